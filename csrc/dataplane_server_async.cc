// Asynchronous mode's parameters surviving a lost server (server/async_snapshots.py): the
// server's values copied for a snapshot, and a lost server's values taken by the stores its
// moved keys make here.

#include <chrono>
#include <cstring>
#include <thread>

#include "dataplane_server_impl.h"

namespace bps {
namespace dp {

namespace {
// How long a snapshot waits for a key's pushes in flight to end, in tries of kTryWait.
constexpr int kTries = 2000;
constexpr auto kTryWait = std::chrono::microseconds(500);
}  // namespace

// Every asynchronous key's value as it stands between two pushes (each copied under its
// store's lock once no push of it is in flight: a snapshot holds whole pushes). A key whose
// pushes never pause for kTries x kTryWait is copied as it is, with the part of a push in
// flight that has been summed.
std::vector<AsyncValue> ServerImpl::async_values() {
  std::vector<std::shared_ptr<Store>> all;
  {
    std::lock_guard<std::mutex> g(map_mu_);
    if (!async_) return {};
    all.reserve(stores_.size());
    for (auto& kv : stores_) all.push_back(kv.second);
  }
  std::vector<AsyncValue> out;
  out.reserve(all.size());
  for (auto& st : all) {
    for (int t = 0;; ++t) {
      std::unique_lock<std::mutex> g(st->mu);
      if (!st->failed.empty() || !st->value) break;
      if (st->started == st->finished || t >= kTries) {
        out.push_back({st->key, st->wire_dtype, std::string(st->value.get(), st->nbytes)});
        break;
      }
      g.unlock();
      std::this_thread::sleep_for(kTryWait);
    }
  }
  return out;
}

bool ServerImpl::adopt_async(std::uint64_t key, std::string value) {
  std::lock_guard<std::mutex> g(map_mu_);
  auto it = adopt_.find(key);
  const std::uint64_t before = it == adopt_.end() ? 0 : it->second.size();
  store_bytes_ -= std::min<std::uint64_t>(before, store_bytes_);
  if (store_bytes_ + value.size() > max_store_) {
    if (it != adopt_.end()) adopt_.erase(it);
    return false;
  }
  store_bytes_ += value.size();
  adopt_[key] = std::move(value);
  return true;
}

// A new asynchronous store (map_mu_ held): a moved key's (a retried push) starts from the
// value its lost server's snapshot held, when there is one of its size.
void ServerImpl::adopt_locked(Store& st, const Header& h) {
  if (!(h.flags & kFlagRetry)) return;
  auto it = adopt_.find(h.key);
  if (it == adopt_.end()) return;
  if (it->second.size() == st.nbytes) {
    std::memcpy(st.value.get(), it->second.data(), st.nbytes);
    c_.async_adopted++;
  }
  store_bytes_ -= std::min<std::uint64_t>(it->second.size(), store_bytes_);  // the store's own
  adopt_.erase(it);                                                          // charge holds it
}

}  // namespace dp
}  // namespace bps
