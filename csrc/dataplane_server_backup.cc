// Backup workers (BYTEPS_BACKUP_WORKERS=b; docs/reliability.md, "Backup workers"): a key
// whose declaration says "backup" (the workers declare the tensors they average so) completes
// a synchronous round once all but b worker ranks have pushed it (and every push begun has
// been summed). Its answer carries the pushes summed (FLAG_CONTRIB), so every worker divides
// the same sum by the same count.
//
// The ranks whose pushes came too late are not skipped: every completed round's answer is
// kept (a copy, charged to BYTEPS_SERVER_MAX_BYTES) until every worker rank has had it. A
// late push of a completed round is dropped (counted: late_pushes_dropped) and answered at
// once with that round's kept sum, so a rank that fell behind applies the same sums in the
// same order as the others and its model stays theirs. A key keeps at most
// BYTEPS_BACKUP_MAX_LAG completed rounds besides the newest (fewer when the budget is full):
// a rank that asks for an older one gets a "behind" error that names it and says how far
// behind it is, never a silently different model.
#include <algorithm>
#include <cstring>

#include "dataplane_server_impl.h"
#include "decl.h"

namespace bps {
namespace dp {

// The backup workers b a declaration asks for: 0 when it does not (or in asynchronous mode,
// where no round waits for anyone), -1 when b is not an integer in 1..num_workers - 1.
int ServerImpl::backup_decl(const std::string& meta) const {
  std::uint16_t b = 0;
  try {
    b = parse_decl(meta).backup;
  } catch (const std::invalid_argument&) {
    return 0;  // refused as a malformed declaration (may_declare_locked)
  }
  if (b == 0 || async_) return 0;
  return b < num_workers_ ? b : -1;
}

// The pushes that complete a round of the key: every worker rank not joined, less b for a
// backup key (at least one).
int ServerImpl::pushes_needed(const Store& st) const {
  const int req = required_.load();
  return st.backup ? std::max(1, req - st.backup) : req;
}

// Round `round` of a backup key completed (st.mu held): its sum (buf[round % 2], which round
// + 2 overwrites) is kept for every rank until each has had it. The oldest kept rounds go when
// the key keeps more than the bound or the budget has no room; false (the key failed, naming
// the budget) when even the newest has none.
bool ServerImpl::keep_round_locked(Store& st, std::int64_t round) {
  const std::size_t len = st.nbytes;
  while (!st.kept.empty() && st.kept.size() > static_cast<std::size_t>(max_lag_.load())) {
    reserve(-static_cast<std::int64_t>(len));
    st.kept_from = st.kept.front().round + 1;
    st.kept.pop_front();
  }
  while (!reserve(static_cast<std::int64_t>(len))) {
    if (st.kept.empty()) {
      reject("server memory budget exhausted");
      st.failed_kind = "protocol";
      fail_key_locked(st, "server " + std::to_string(rank_.load()) + ": key " +
                      std::to_string(st.key) + " (" + describe_decl(st.decl) + "): no room "
                      "in the memory budget (BYTEPS_SERVER_MAX_BYTES=" +
                      std::to_string(max_store_) + ") to keep round " + std::to_string(round) +
                      "'s sum of " + std::to_string(len) + " bytes for the ranks that "
                      "pushed too late (BYTEPS_BACKUP_WORKERS); raise the budget");
      return false;
    }
    reserve(-static_cast<std::int64_t>(len));
    st.kept_from = st.kept.front().round + 1;
    st.kept.pop_front();
  }
  std::shared_ptr<char> data(new char[len], std::default_delete<char[]>());
  std::memcpy(data.get(), st.buf[round & 1].get(), len);
  if (st.kept.empty()) st.kept_from = round;
  Store::Kept k;
  k.round = round;
  k.contrib = st.contrib[round & 1];
  k.data = std::move(data);
  st.kept.push_back(std::move(k));
  if (k.contrib < required_.load()) backup_rounds_++;
  return true;
}

// A kept round's answer to `rank` (st.mu held), or the "behind" error when the round is no
// longer kept. The kept rounds every rank has had are given back.
void ServerImpl::send_kept_locked(const std::shared_ptr<Conn>& conn, Store& st,
                                  std::int64_t round, int rank) {
  const Store::Kept* k = nullptr;
  if (!st.kept.empty() && round >= st.kept.front().round && round <= st.kept.back().round)
    k = &st.kept[static_cast<std::size_t>(round - st.kept.front().round)];
  if (k == nullptr || k->round != round) {
    const std::int64_t newest = st.round - 1, behind = newest - round;
    lag_errors_++;
    reject("worker fell behind the kept rounds");
    const Header h = make_header(kPull, 0, rank, 0, 0, st.key, round);
    send_error(conn, h, "behind", "server " + std::to_string(rank_.load()) + ": key " +
               std::to_string(st.key) + " (" + describe_decl(st.decl) + "): worker rank " +
               std::to_string(rank) + " asked for round " + std::to_string(round) + ", " +
               std::to_string(behind) + " rounds behind the newest completed round (" +
               std::to_string(newest) + "); the servers keep the newest and at most " +
               std::to_string(max_lag_.load()) + " rounds before it for a worker that falls "
               "behind (BYTEPS_BACKUP_MAX_LAG, fewer when BYTEPS_SERVER_MAX_BYTES is full) and "
               "no longer hold this one. This worker is too slow for the job: give it a faster machine, "
               "raise BYTEPS_BACKUP_MAX_LAG, or run without BYTEPS_BACKUP_WORKERS",
               ",\"rank\":" + std::to_string(rank) + ",\"behind\":" + std::to_string(behind));
    return;
  }
  const int n = k->contrib;
  const std::uint32_t flags =
      n < num_workers_ ? kFlagContrib | (static_cast<std::uint32_t>(n) << kContribShift) : 0;
  Out o;
  o.hdr = make_header(kPullResp, kRoleServer, rank_.load(), flags, job_, st.key, round,
                      static_cast<std::uint8_t>(st.wire_dtype), st.count, st.nbytes);
  o.payload = k->data.get();
  o.plen = st.nbytes;
  o.keep = k->data;
  conn->send(std::move(o));
  if (rank >= 0 && rank < num_workers_ && st.served[rank] < round) {
    st.served[rank] = round;
    trim_kept_locked(st);
  }
}

void ServerImpl::send_kept(const std::shared_ptr<Conn>& conn, const std::shared_ptr<Store>& st,
                           std::int64_t round, int rank) {
  std::lock_guard<std::mutex> g(st->mu);
  send_kept_locked(conn, *st, round, rank);
}

// A push of a round the key completed without it (st.mu held): dropped (its payload is
// discarded by the stream), acknowledged, and, when it asks, answered with that round's sum.
bool ServerImpl::late_push_locked(const std::shared_ptr<Conn>& conn,
                                  const std::shared_ptr<Store>& st, const Header& h) {
  late_dropped_++;
  ack_locked(conn, h);
  if (h.flags & kFlagPull) send_kept_locked(conn, *st, h.round, h.rank);
  return true;
}

// Gives back the kept rounds that every worker rank has had (st.mu held).
void ServerImpl::trim_kept_locked(Store& st) {
  const std::int64_t all = *std::min_element(st.served.begin(), st.served.end());
  while (!st.kept.empty() && st.kept.front().round <= all) {
    reserve(-static_cast<std::int64_t>(st.nbytes));
    st.kept_from = st.kept.front().round + 1;
    st.kept.pop_front();
  }
}

// Forgets every kept round (an elastic epoch's reset; st.mu held).
void ServerImpl::drop_kept_locked(Store& st) {
  reserve(-static_cast<std::int64_t>(st.nbytes * st.kept.size()));
  st.kept.clear();
  st.kept_from = 0;
  std::fill(st.served.begin(), st.served.end(), -1);
}

}  // namespace dp
}  // namespace bps
