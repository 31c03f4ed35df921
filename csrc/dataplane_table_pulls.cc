// Table pulls answered on the plane's own threads (dataplane_table_pulls.h).
#include "dataplane_table_pulls.h"

#include <cstring>
#include <utility>

#include "dataplane_io.h"
#include "payload_pool.h"

namespace bps {
namespace dp {

namespace {

constexpr std::uint8_t kWireFloat32 = 1, kWireInt64 = 6;
static_assert(kWireDTypes[kWireFloat32].itemsize == 4 && kWireDTypes[kWireInt64].itemsize == 8,
              "the wire's float32 and int64 codes");

}  // namespace

void ServedShard::retire() {
  std::lock_guard<std::mutex> g(mu_);
  alive_ = false;
  rules_.open = false;
  for (ParkedPull& p : parked_)
    if (auto c = p.conn.lock()) c->charge_held(-p.cost);
  parked_.clear();
}

// The request as the tables' thread would take it: its ids' count, bytes and rows, its rank
// and generation, the reply's size (any doubt: false, and the tables' thread says what is
// wrong).
bool ServedShard::fits_locked(const Header& h, const std::string& ids) const {
  const ServeRules& r = rules_;
  if (!alive_ || !r.open || h.dtype != kWireInt64 || h.rank < 0 || h.rank >= r.rank_limit ||
      (h.flags >> kContribShift) < r.generation)
    return false;
  const std::uint64_t n = h.count;
  if (n > static_cast<std::uint64_t>(r.max_ids) || ids.size() != n * 8 || h.nbytes != n * 8 ||
      n * static_cast<std::uint64_t>(s.dim) * sizeof(float) > r.max_message)
    return false;
  const auto* p = reinterpret_cast<const std::int64_t*>(ids.data());
  for (std::uint64_t i = 0; i < n; ++i) {
    std::int64_t id;
    std::memcpy(&id, p + i, sizeof id);  // the payload's alignment is the stream's
    if (id < 0 || id >= r.rows || (s.shards > 1 && id % s.shards != s.shard)) return false;
  }
  return true;
}

void ServedShard::answer_locked(Conn& c, const Header& h, const std::string& ids) {
  const auto n = static_cast<std::int64_t>(h.count);
  std::vector<std::int64_t> global(static_cast<std::size_t>(n)), local(global.size());
  if (n) std::memcpy(global.data(), ids.data(), static_cast<std::size_t>(n) * 8);
  table::to_local(s, global.data(), n, local.data());  // checked by fits_locked
  auto rows = pooled_shared(pooled(static_cast<std::size_t>(n * s.dim) * sizeof(float)));
  table::gather(s, local.data(), n, reinterpret_cast<float*>(&(*rows)[0]));
  Out o;
  o.hdr = make_header(kSparseRows, kRoleServer, server_rank_,
                      (h.flags >> kContribShift) << kContribShift, job_, h.key, h.round,
                      kWireFloat32, static_cast<std::uint64_t>(n * s.dim), rows->size());
  o.payload = rows->data();
  o.plen = o.owned = rows->size();
  o.keep = std::move(rows);
  c.post(std::move(o));
  ++answered_;
}

bool ServedShard::take(const std::shared_ptr<Conn>& c, std::uint64_t stream, const Header& h,
                       const std::string& meta, std::string& ids, int server_rank,
                       std::uint32_t job) {
  if (h.type != kSparsePull || !meta.empty() || c->replies_over_share()) return false;
  std::lock_guard<std::mutex> g(mu_);
  if (!fits_locked(h, ids)) return false;
  server_rank_ = server_rank;
  job_ = job;
  if (h.round == rules_.applied) {
    answer_locked(*c, h, ids);
    return true;
  }
  if (h.round != rules_.applied + 1 ||
      static_cast<std::int64_t>(parked_.size()) >= rules_.park_limit)
    return false;
  ParkedPull p{stream, c, h, std::move(ids), 0};
  p.cost = static_cast<std::int64_t>(p.ids.size()) + 256;
  c->charge_held(p.cost);  // its stream reads no faster than its pulls are answered
  parked_.push_back(std::move(p));
  ++parked_total_;
  return true;
}

void ServedShard::applied_locked(std::int64_t applied) {
  rules_.applied = applied;
  std::vector<ParkedPull> keep;
  for (ParkedPull& p : parked_) {
    auto c = p.conn.lock();
    if (!c) continue;  // its stream closed: nobody to answer
    if (p.h.round != applied || !alive_) {
      keep.push_back(std::move(p));
      continue;
    }
    c->charge_held(-p.cost);
    answer_locked(*c, p.h, p.ids);
  }
  parked_.swap(keep);
}

std::vector<ReturnedPull> ServedShard::serve(const ServeRules& rules) {
  std::lock_guard<std::mutex> g(mu_);
  rules_ = rules;
  if (rules_.open) applied_locked(rules_.applied);
  std::vector<ReturnedPull> back;
  std::vector<ParkedPull> keep;
  for (ParkedPull& p : parked_) {
    auto c = p.conn.lock();
    if (!c) continue;
    if (alive_ && fits_locked(p.h, p.ids) && p.h.round == rules_.applied + 1 &&
        static_cast<std::int64_t>(keep.size()) < rules_.park_limit) {
      keep.push_back(std::move(p));
      continue;
    }
    c->charge_held(-p.cost);
    back.push_back(ReturnedPull{p.stream, p.h, std::move(p.ids)});
  }
  parked_.swap(keep);
  return back;
}

}  // namespace dp
}  // namespace bps
