// The codec threads of the native data plane's worker side (dataplane_client.cc): a tensor
// compressed with a built-in codec (codec.h) is one native operation, like a plain one, and
// its partitions are encoded here before their push and decoded here after their pull, in
// parallel and without the GIL, instead of one Python pipeline task per partition.
//
// The I/O threads only move bytes: an encode or decode never runs on them, so a slow codec
// delays no other stream. Jobs run in the order they were posted (a partition's priority is
// applied when its encoded payload joins the client's send queue).
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace bps {
namespace dp {

class CoderPool {
 public:
  // threads: how many threads run jobs (>= 1); they start at the first post().
  explicit CoderPool(int threads) : want_(threads < 1 ? 1 : threads) {}
  ~CoderPool() { stop(); }
  CoderPool(const CoderPool&) = delete;
  CoderPool& operator=(const CoderPool&) = delete;

  // Runs job on a pool thread; false (job dropped) once stop() was called.
  bool post(std::function<void()> job) {
    {
      std::lock_guard<std::mutex> g(mu_);
      if (stopped_) return false;
      if (threads_.empty())
        for (int i = 0; i < want_; ++i) threads_.emplace_back([this] { run(); });
      jobs_.push_back(std::move(job));
    }
    cv_.notify_one();
    return true;
  }

  // Waits for the running jobs, drops the queued ones and joins the threads. The caller
  // fails what the dropped jobs would have completed.
  void stop() {
    std::vector<std::thread> threads;
    {
      std::lock_guard<std::mutex> g(mu_);
      stopped_ = true;
      jobs_.clear();
      threads.swap(threads_);
    }
    cv_.notify_all();
    for (auto& t : threads) t.join();
  }

  int threads() const { return want_; }

 private:
  void run() {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock<std::mutex> g(mu_);
        cv_.wait(g, [&] { return stopped_ || !jobs_.empty(); });
        if (stopped_) return;
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      job();
    }
  }

  const int want_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopped_ = false;
  std::deque<std::function<void()>> jobs_;
  std::vector<std::thread> threads_;
};

}  // namespace dp
}  // namespace bps
