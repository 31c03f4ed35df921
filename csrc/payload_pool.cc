// Payload buffers of table messages, recycled (payload_pool.h).
#include "payload_pool.h"

#include <mutex>
#include <utility>
#include <vector>

namespace bps {
namespace dp {

namespace {

struct Pool {
  std::mutex mu;
  std::vector<std::string> free;  // each of capacity within [kPoolMinBuffer, kPoolMaxBuffer]
  std::size_t bytes = 0;
};

Pool& pool() {
  static Pool* p = new Pool();  // never destroyed: threads may recycle while the process exits
  return *p;
}

}  // namespace

std::string pooled(std::size_t n) {
  std::string s;
  if (n >= kPoolMinBuffer / 2 && n <= kPoolMaxBuffer) {
    Pool& p = pool();
    std::lock_guard<std::mutex> g(p.mu);
    std::size_t best = p.free.size();
    for (std::size_t i = 0; i < p.free.size(); ++i)  // the smallest that holds n
      if (p.free[i].capacity() >= n &&
          (best == p.free.size() || p.free[i].capacity() < p.free[best].capacity()))
        best = i;
    if (best != p.free.size()) {
      s = std::move(p.free[best]);
      p.free[best] = std::move(p.free.back());
      p.free.pop_back();
      p.bytes -= s.capacity();
    }
  }
  s.resize(n);  // within its capacity: no allocation, and the kernel's pages stay
  return s;
}

void recycle(std::string&& s) {
  const std::size_t cap = s.capacity();
  if (cap < kPoolMinBuffer || cap > kPoolMaxBuffer) return;
  Pool& p = pool();
  std::lock_guard<std::mutex> g(p.mu);
  if (p.free.size() >= kPoolBuffers || p.bytes + cap > kPoolBytes) return;
  p.bytes += cap;
  p.free.push_back(std::move(s));
}

std::shared_ptr<std::string> pooled_shared(std::string&& s) {
  return std::shared_ptr<std::string>(new std::string(std::move(s)), [](std::string* b) {
    recycle(std::move(*b));
    delete b;
  });
}

void drain_pool() {
  std::vector<std::string> gone;
  Pool& p = pool();
  {
    std::lock_guard<std::mutex> g(p.mu);
    gone.swap(p.free);
    p.bytes = 0;
  }
}

}  // namespace dp
}  // namespace bps
