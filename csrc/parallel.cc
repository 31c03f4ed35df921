#include "parallel.h"

#include <pthread.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>

namespace bps {
namespace {

// One parallel_for call. Whoever runs it (the caller or pool helpers) claims chunk indices
// until none are left, so the caller never waits for a chunk nobody has started.
struct Job {
  std::function<void(std::size_t)> run_chunk;
  std::size_t nchunks = 0;
  std::atomic<std::size_t> next{0};
  std::atomic<std::size_t> done{0};
  std::mutex mu;
  std::condition_variable all_done;

  void work() {
    for (;;) {
      const std::size_t i = next.fetch_add(1, std::memory_order_relaxed);
      if (i >= nchunks) return;
      run_chunk(i);
      if (done.fetch_add(1, std::memory_order_acq_rel) + 1 == nchunks) {
        std::lock_guard<std::mutex> lock(mu);
        all_done.notify_all();
      }
    }
  }

  void wait() {
    std::unique_lock<std::mutex> lock(mu);
    all_done.wait(lock, [this] { return done.load(std::memory_order_acquire) == nchunks; });
  }
};

// Detached helper threads fed from a queue. Never destroyed: threads blocked on the queue
// at interpreter exit simply end with the process.
class Pool {
 public:
  void submit(const std::shared_ptr<Job>& job, int helpers) {
    std::lock_guard<std::mutex> lock(mu_);
    while (nthreads_ < helpers && nthreads_ < kMaxThreads - 1) {
      std::thread([this] { loop(); }).detach();
      ++nthreads_;
    }
    for (int i = 0; i < helpers; ++i) queue_.push_back(job);
    if (helpers == 1) {
      ready_.notify_one();
    } else {
      ready_.notify_all();
    }
  }

 private:
  void loop() {
    for (;;) {
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        ready_.wait(lock, [this] { return !queue_.empty(); });
        job = std::move(queue_.front());
        queue_.pop_front();
      }
      job->work();
    }
  }

  std::mutex mu_;
  std::condition_variable ready_;
  std::deque<std::shared_ptr<Job>> queue_;
  int nthreads_ = 0;
};

std::atomic<Pool*> g_pool{nullptr};

// In a forked child the pool's threads are gone (and its mutex may be held forever): forget
// it, leaking it on purpose, and let the child build a fresh one on first use.
void forget_pool_in_child() { g_pool.store(nullptr, std::memory_order_relaxed); }

Pool& pool() {
  Pool* p = g_pool.load(std::memory_order_acquire);
  if (p) return *p;
  static const bool registered = [] {
    pthread_atfork(nullptr, nullptr, forget_pool_in_child);
    return true;
  }();
  (void)registered;
  Pool* fresh = new Pool();
  if (g_pool.compare_exchange_strong(p, fresh, std::memory_order_acq_rel)) return *fresh;
  delete fresh;
  return *p;
}

}  // namespace

void parallel_for(std::size_t n, std::size_t bytes_per_elem, int nthreads,
                  const std::function<void(std::size_t, std::size_t)>& fn) {
  constexpr std::size_t kGrain = 64;  // elements; keeps chunk edges cache-line aligned
  if (nthreads > kMaxThreads) nthreads = kMaxThreads;
  std::size_t by_size = n * bytes_per_elem / kMinBytesPerThread;
  std::size_t k = nthreads > 1 ? static_cast<std::size_t>(nthreads) : 1;
  if (by_size < k) k = by_size;
  if (k <= 1) {
    if (n) fn(0, n);
    return;
  }
  std::size_t chunk = (n + k - 1) / k;
  chunk = (chunk + kGrain - 1) / kGrain * kGrain;
  auto job = std::make_shared<Job>();
  job->nchunks = (n + chunk - 1) / chunk;
  job->run_chunk = [&fn, chunk, n](std::size_t i) {
    const std::size_t begin = i * chunk;
    const std::size_t end = begin + chunk < n ? begin + chunk : n;
    fn(begin, end);
  };
  pool().submit(job, static_cast<int>(job->nchunks) - 1);
  job->work();
  job->wait();
}

}  // namespace bps
