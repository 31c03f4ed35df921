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
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "codec.h"
#include "dtype.h"
#include "ops.h"

namespace bps {
namespace dp {

// One partition's encode before its push and decode after its pull, on the codec threads. The
// partition is float32 in the caller's src and dst; on the wire it is what the coder makes.
// A coder serves one operation at a time (a tensor's rounds are sequential).
class PartCoder {
 public:
  virtual ~PartCoder() = default;
  virtual std::size_t count() const = 0;       // float32 elements of the partition
  virtual std::size_t wire_bytes() const = 0;  // the push's and the answer's bytes
  // Buffers of wire_bytes() (0: the push, 1: the answer), the coder's own, kept round to round.
  virtual std::uint8_t* wire_buffer(int which) = 0;
  virtual void encode(const float* src, std::uint64_t step, std::uint8_t* out) = 0;
  // The answer into dst[count()], divided by divisor (>= 1); throws std::invalid_argument
  // saying what is wrong with it (dst untouched).
  virtual void decode(const std::uint8_t* in, std::size_t len, float* dst, std::int64_t divisor,
                      std::uint64_t step) = 0;
};

// A built-in codec (codec.h): its payloads travel compressed, the server sums the decoded
// pushes and answers its encoded sum.
class FramedCoder : public PartCoder {
 public:
  explicit FramedCoder(std::shared_ptr<compress::FramedCodec> c) : c_(std::move(c)) {}
  std::size_t count() const override { return c_->n(); }
  std::size_t wire_bytes() const override { return c_->max_bytes(); }
  std::uint8_t* wire_buffer(int which) override { return c_->wire_buffer(which); }
  void encode(const float* src, std::uint64_t step, std::uint8_t* out) override {
    c_->encode(src, step, out);
  }
  void decode(const std::uint8_t* in, std::size_t len, float* dst, std::int64_t divisor,
              std::uint64_t step) override {
    const std::uint64_t got = c_->decode_divided(in, len, dst, divisor);
    if (got != step)
      throw std::invalid_argument("is of step " + std::to_string(got) + ", expected " +
                                  std::to_string(step));
  }

 private:
  std::shared_ptr<compress::FramedCodec> c_;
};

// A cast compressor (fp16, bf16): the partition travels, and the servers sum it, in the
// narrower dtype; the answer is averaged there and widened into dst, bit for bit what
// converting the whole tensor before and after a push_pull of the narrow one gives.
class CastCoder : public PartCoder {
 public:
  CastCoder(std::size_t n, DType wire) : n_(n), wire_(wire) {
    if (wire != DType::kFloat16 && wire != DType::kBFloat16)
      throw std::invalid_argument("a cast travels as float16 or bfloat16");
    if (n == 0) throw std::invalid_argument("a cast partition has at least one element");
  }
  DType wire() const { return wire_; }
  std::size_t count() const override { return n_; }
  std::size_t wire_bytes() const override { return 2 * n_; }
  std::uint8_t* wire_buffer(int which) override {
    std::vector<std::uint8_t>& b = buf_[which & 1];
    if (b.size() != 2 * n_) b.assign(2 * n_, 0);
    return b.data();
  }
  void encode(const float* src, std::uint64_t, std::uint8_t* out) override {
    convert(wire_, out, DType::kFloat32, src, n_, 1);
  }
  void decode(const std::uint8_t* in, std::size_t len, float* dst, std::int64_t divisor,
              std::uint64_t) override {
    if (len != 2 * n_) throw std::invalid_argument("an answer of the wrong size");
    auto* w = const_cast<std::uint8_t*>(in);  // the coder's own answer buffer
    if (divisor > 1) scale_into(wire_, w, n_, divisor, 1);
    convert(DType::kFloat32, dst, wire_, w, n_, 1);
  }

 private:
  std::size_t n_;
  DType wire_;
  std::vector<std::uint8_t> buf_[2];
};

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
