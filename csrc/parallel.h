// Splitting a kernel call over a few threads.
#pragma once

#include <cstddef>
#include <functional>

namespace bps {

// Below this many bytes per thread, extra threads cost more than they bring.
constexpr std::size_t kMinBytesPerThread = 256 * 1024;
// nthreads is clamped to this.
constexpr int kMaxThreads = 64;

// Calls fn(begin, end) on disjoint element ranges covering [0, n), using up to `nthreads`
// threads (the caller's included) but only as many as give each at least
// kMinBytesPerThread of `bytes_per_elem * n`. Range boundaries are multiples of 64 elements.
// nthreads <= 1, or a small n, runs fn(0, n) inline. Helper threads come from a small
// persistent pool (recreated in a forked child). Returns once every range is done. fn must
// not throw.
void parallel_for(std::size_t n, std::size_t bytes_per_elem, int nthreads,
                  const std::function<void(std::size_t, std::size_t)>& fn);

}  // namespace bps
