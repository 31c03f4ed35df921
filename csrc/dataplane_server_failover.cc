// Losing a server (docs/reliability.md, "Losing a server"): what a key's NEW server does when
// the workers move the keys of a lost server to it.
//
// A synchronous round holds nothing the workers cannot give again, except the sum of a round
// that completed on the lost server and reached some workers but not others (its replies were
// cut off). So each worker keeps the answer of its last completed round of every key (the
// client's shadow), and after a loss, before anyone pushes a moved key again, sends it to the
// key's new server as a SEED (FLAG_SEED: a PUSH carrying round r's sum, and the contributors
// in the flags as a PULL_RESP carries them). The new server takes the newest seed of a key as
// that round's result: round r completed, round r + 1 open. Then the workers re-send what was
// in flight (FLAG_RETRY): a retried push of the round a seed completed is answered from it (the
// worker that missed the answer gets the sum everyone else has), a retried push of the open
// round is summed as usual, and a key that no seed made starts at the retried push's round.
#include <cstring>

#include "dataplane_server_impl.h"

namespace bps {
namespace dp {

// A seed's header (and declaration) arrived: the store it completes, or null when there is
// nothing to do (a round already completed: acknowledged) or after an error reply. The
// payload is received whole (charged to the budget, *staged) and applied by finish_seed.
std::shared_ptr<Store> ServerImpl::begin_seed(const std::shared_ptr<Conn>& conn, const Header& h,
                                              const std::string& meta, std::uint64_t* gen,
                                              std::uint64_t* staged) {
  const bool compressed = h.flags & kFlagCompressed;
  const int kdt = compressed ? static_cast<int>(DType::kFloat32) : wire_to_kernel_dtype(h.dtype);
  if (async_) {  // nothing to seed: a moved key's value comes from its lost server's
    ack_locked(conn, h);  // snapshot (adopt_async); the payload is read and dropped
    return nullptr;
  }
  if (kdt < 0 || h.round < 0 || (compressed && h.dtype != kWireUint8Code)) {
    reject("malformed seed");
    send_error(conn, h, "protocol", "server " + std::to_string(rank_.load()) + ": key " +
               std::to_string(h.key) + ": a seed is a completed synchronous round's sum");
    return nullptr;
  }
  std::shared_ptr<Store> st = store_for_push(conn, h, meta, kdt);
  if (!st) return nullptr;
  {
    std::lock_guard<std::mutex> g(st->mu);
    if ((h.flags & kFlagDeclare) && meta != st->decl) {
      reject("seed of another tensor");
      send_error(conn, h, "mismatch", "key " + std::to_string(h.key) + ": worker rank " +
                 std::to_string(h.rank) + " seeded " + describe_decl(meta) + " but the key "
                 "holds " + describe_decl(st->decl));
      return nullptr;
    }
    if (h.dtype != st->wire_dtype || !payload_fits(*st, h)) {
      reject("wrong dtype or size for a declared key");
      send_error(conn, h, "protocol", "seed of key " + std::to_string(h.key) + " from worker "
                 "rank " + std::to_string(h.rank) + ": " + std::to_string(h.nbytes) +
                 " bytes, the key holds " + std::to_string(st->nbytes));
      return nullptr;
    }
    *gen = st->gen.load();
    if (h.round <= st->completed) {  // another worker's seed of this round came first
      ack_locked(conn, h);
      return nullptr;
    }
  }
  if (!reserve(static_cast<std::int64_t>(h.nbytes))) {
    reject("server memory budget exhausted");
    send_error(conn, h, "protocol", "server " + std::to_string(rank_.load()) + ": key " +
               std::to_string(h.key) + ": no room in the memory budget "
               "(BYTEPS_SERVER_MAX_BYTES) to receive a seed of " + std::to_string(h.nbytes) +
               " bytes");
    return nullptr;
  }
  *staged = h.nbytes;
  return st;
}

void ServerImpl::ack_locked(const std::shared_ptr<Conn>& conn, const Header& h) {
  Out ack;
  ack.hdr = make_header(kPushAck, kRoleServer, rank_.load(), 0, job_, h.key, h.round);
  conn->send(std::move(ack));
}

// A seed received whole: round h.round of the key completes with its payload as the sum
// (unless a newer round completed meanwhile), the next round opens, and pulls that waited
// for the seeded round are answered.
void ServerImpl::finish_seed(const std::shared_ptr<Conn>& conn, const std::shared_ptr<Store>& st,
                             const Header& h, std::uint64_t gen, const std::uint8_t* payload) {
  std::vector<Store::Pending> answer;
  const std::int64_t r = h.round;
  {
    std::lock_guard<std::mutex> g(st->mu);
    ack_locked(conn, h);  // taken, or superseded: another worker's seed of it came first
    (void)gen;            // (a seed bumps the generation, so a concurrent one sees it moved)
    if (r <= st->completed || !st->failed.empty()) return;
    for (std::size_t c = 0; c < st->nchunks; ++c) {  // a push begun here sums nothing more
      std::lock_guard<std::mutex> cg(st->chunk_mu[c]);
      st->fill[0][c] = st->fill[1][c] = 0;
    }
    st->gen.fetch_add(1);
    std::memcpy(st->buf[r & 1].get(), payload, h.nbytes);
    if (st->codec) st->rlen[r & 1] = h.nbytes;
    const int n = (h.flags & kFlagContrib) ? static_cast<int>(h.flags >> kContribShift) : 0;
    st->contrib[r & 1] = n > 0 && n < num_workers_ ? n : num_workers_;
    st->completed = r;
    st->round = r + 1;
    st->started = st->finished = 0;
    std::fill(st->pushed.begin(), st->pushed.end(), 0);
    for (auto& p : st->pending)
      if (p.round == r) answer.push_back(p);
    st->pending.erase(std::remove_if(st->pending.begin(), st->pending.end(),
                                     [r](const Store::Pending& p) { return p.round <= r; }),
                      st->pending.end());
    c_.seeds++;
  }
  for (auto& p : answer)
    if (auto c = p.conn.lock()) send_resp(c, st, r);
}

// A retried push (st->mu held) of the round a seed completed: the worker missed that round's
// answer; it gets it now (its payload is discarded). True when it was answered so.
bool ServerImpl::answer_retry_locked(const std::shared_ptr<Conn>& conn,
                                     const std::shared_ptr<Store>& st, const Header& h) {
  if (!(h.flags & kFlagRetry) || async_ || h.round != st->completed || h.round < 0)
    return false;
  ack_locked(conn, h);
  if (h.flags & kFlagPull) send_resp(conn, st, h.round);
  c_.retries_answered++;
  return true;
}

}  // namespace dp
}  // namespace bps
