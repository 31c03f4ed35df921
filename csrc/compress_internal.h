// Internal to the compression kernels (compress.cc, compress_onebit.cc, compress_sparse.cc,
// compress_dither.cc): the unaligned little-endian loads and stores and the argument check
// that more than one of them uses. Not part of the public interface, which is compress.h.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "cpu.h"  // the ISA the kernels dispatch on

#if defined(BPS_X86_KERNELS)
#include <immintrin.h>
#endif

namespace bps {
namespace compress {
namespace detail {

using u8 = std::uint8_t;
using u32 = std::uint32_t;
using u64 = std::uint64_t;

constexpr u64 kGolden = 0x9E3779B97F4A7C15ULL;

// The i-th 4-byte value of T at p, which need not be aligned (payloads are byte buffers).
template <class T>
inline T load4(const void* p, std::size_t i) {
  static_assert(sizeof(T) == 4, "4-byte values");
  T v;
  std::memcpy(&v, static_cast<const u8*>(p) + 4 * i, 4);
  return v;
}
template <class T>
inline void store4(void* p, std::size_t i, T v) {
  static_assert(sizeof(T) == 4, "4-byte values");
  std::memcpy(static_cast<u8*>(p) + 4 * i, &v, 4);
}
inline u32 load_u32(const void* p, std::size_t i) { return load4<u32>(p, i); }
inline void store_u32(void* p, std::size_t i, u32 v) { store4(p, i, v); }
inline float load_f32(const void* p, std::size_t i) { return load4<float>(p, i); }
inline void store_f32(void* p, std::size_t i, float v) { store4(p, i, v); }
inline u32 f32_bits(float f) {
  u32 u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_f32(u32 u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline void check_n(std::size_t n, const char* func) {
  if (n > 0xFFFFFFFFULL) {
    throw std::invalid_argument(std::string(func) + ": n = " + std::to_string(n) +
                                " exceeds 2^32 - 1 elements");
  }
}

}  // namespace detail
}  // namespace compress
}  // namespace bps
