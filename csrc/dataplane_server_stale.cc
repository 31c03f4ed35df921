// Bounded staleness in asynchronous mode (BYTEPS_ASYNC_STALENESS; stale synchronous parallel,
// Ho et al., NIPS 2013; docs/architecture.md, "Asynchronous mode"). Asynchronous mode applies
// every push at once and answers its pull at once, so a fast worker may run any number of
// rounds ahead of a slow one. With a staleness s > 0 the server keeps, per key, the newest
// round each worker rank has pushed (Store::last_push) and holds the answer of a pull of round
// r until every rank that still takes part has pushed round r - s: a worker that completed
// round r is at most s rounds ahead of the slowest one's pushes. Ranks in join() and ranks that
// left the job (finished or lost: the scheduler's set_members) are not waited for, so a worker
// that is gone never blocks the others. 0: unbounded, exactly as before (nothing is recorded).
//
// Cost with s > 0: one store per push of the rank's round, and per answered pull one pass over
// the worker ranks under mem_mu_ (taken inside a store's mu, as everywhere).
#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "dataplane_server_impl.h"

namespace bps {
namespace dp {

void ServerImpl::set_staleness(std::int64_t s) {
  if (s < 0 || s > (std::int64_t{1} << 40))
    throw std::invalid_argument("staleness " + std::to_string(s) +
                                ": must be 0 (unbounded) or a number of rounds >= 1");
  if (s > 0 && !async_)
    throw std::invalid_argument("a staleness bound applies to asynchronous mode only");
  staleness_.store(s);
  release_stale();  // a bound lifted or widened: what waited may go now
}

// An asynchronous push of round h.round by h.rank was summed (st.mu held).
void ServerImpl::note_async_push_locked(Store& st, const Header& h) {
  if (staleness_.load() <= 0 || h.rank < 0 || h.rank >= num_workers_) return;
  if (st.last_push.empty()) st.last_push.assign(num_workers_, -1);
  st.last_push[h.rank] = std::max(st.last_push[h.rank], h.round);
}

// Whether a pull of `round` may be answered now (st.mu held): every rank not joined and not
// left has pushed round - staleness of this key.
bool ServerImpl::stale_ok_locked(const Store& st, std::int64_t round) {
  const std::int64_t s = staleness_.load();
  if (s <= 0 || round - s < 0) return true;
  const std::int64_t need = round - s;
  std::lock_guard<std::mutex> m(mem_mu_);
  for (int r = 0; r < num_workers_; ++r) {
    if (joined_[r] || left_.count(r)) continue;
    const std::int64_t pushed = st.last_push.empty() ? -1 : st.last_push[r];
    if (pushed < need) return false;
  }
  return true;
}

// The waiting pulls that may be answered now move to *answer (st.mu held, no push in
// flight); the others stay, counted once as held.
void ServerImpl::take_due_locked(Store& st, std::vector<Store::Pending>* answer) {
  if (staleness_.load() <= 0) {
    answer->swap(st.pending);
    return;
  }
  std::vector<Store::Pending> keep;
  for (auto& p : st.pending) {
    if (stale_ok_locked(st, p.round)) {
      answer->push_back(std::move(p));
    } else {
      if (!p.held) stale_holds_++;
      p.held = true;
      keep.push_back(std::move(p));
    }
  }
  st.pending.swap(keep);
}

// Membership changed (or the bound did): answer the pulls no longer held back.
void ServerImpl::release_stale() {
  if (!async_) return;
  std::vector<std::shared_ptr<Store>> all;
  {
    std::lock_guard<std::mutex> g(map_mu_);
    for (auto& kv : stores_) all.push_back(kv.second);
  }
  for (auto& st : all) {
    std::vector<Store::Pending> answer;
    std::shared_ptr<char> value;
    {
      std::lock_guard<std::mutex> g(st->mu);
      if (!st->failed.empty() || st->pending.empty()) continue;
      value = settled_value_locked(*st, &answer);
    }
    for (auto& p : answer) {
      if (auto c = p.conn.lock()) send_value(c, *st, value, p.round);
    }
  }
}

void DataServer::set_staleness(std::int64_t rounds) { impl_->set_staleness(rounds); }

}  // namespace dp
}  // namespace bps
