// Portable kernel bodies, written so that gcc/clang auto-vectorise them at -O3.
//
// Included by each kernels_*.cc after its `#pragma GCC target`, so every level gets its own
// copy compiled for its instruction set. Internal linkage keeps those copies apart (see
// halfconv.h). Loads and stores go through memcpy so any alignment is fine.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "halfconv.h"
#include "kernels.h"

namespace bps {
namespace {

using u8 = unsigned char;

template <class T>
inline T load(const u8* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <class T>
inline void store(u8* p, T v) {
  std::memcpy(p, &v, sizeof v);
}

// T is the storage type; ints are added as unsigned so overflow wraps (two's complement).
template <class T>
void add_plain(void* dst, const void* src, std::size_t n) {
  u8* __restrict d = static_cast<u8*>(dst);
  const u8* __restrict s = static_cast<const u8*>(src);
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t o = i * sizeof(T);
    store<T>(d + o, static_cast<T>(load<T>(d + o) + load<T>(s + o)));
  }
}

void add_f16_generic(void* dst, const void* src, std::size_t n) {
  u8* __restrict d = static_cast<u8*>(dst);
  const u8* __restrict s = static_cast<const u8*>(src);
  for (std::size_t i = 0; i < n; ++i) {
    const float sum = f16_to_f32(load<std::uint16_t>(d + 2 * i)) +
                      f16_to_f32(load<std::uint16_t>(s + 2 * i));
    store<std::uint16_t>(d + 2 * i, f32_to_f16(sum));
  }
}

void add_bf16_generic(void* dst, const void* src, std::size_t n) {
  u8* __restrict d = static_cast<u8*>(dst);
  const u8* __restrict s = static_cast<const u8*>(src);
  for (std::size_t i = 0; i < n; ++i) {
    const float sum = bf16_to_f32(load<std::uint16_t>(d + 2 * i)) +
                      bf16_to_f32(load<std::uint16_t>(s + 2 * i));
    store<std::uint16_t>(d + 2 * i, f32_to_bf16(sum));
  }
}

template <class T>
void scale_float(void* buf, std::size_t n, std::int64_t divisor) {
  u8* __restrict b = static_cast<u8*>(buf);
  const T div = static_cast<T>(divisor);
  for (std::size_t i = 0; i < n; ++i) store<T>(b + i * sizeof(T), load<T>(b + i * sizeof(T)) / div);
}

void scale_f16_generic(void* buf, std::size_t n, std::int64_t divisor) {
  u8* __restrict b = static_cast<u8*>(buf);
  const float div = static_cast<float>(divisor);
  for (std::size_t i = 0; i < n; ++i)
    store<std::uint16_t>(b + 2 * i, f32_to_f16(f16_to_f32(load<std::uint16_t>(b + 2 * i)) / div));
}

void scale_bf16_generic(void* buf, std::size_t n, std::int64_t divisor) {
  u8* __restrict b = static_cast<u8*>(buf);
  const float div = static_cast<float>(divisor);
  for (std::size_t i = 0; i < n; ++i)
    store<std::uint16_t>(b + 2 * i, f32_to_bf16(bf16_to_f32(load<std::uint16_t>(b + 2 * i)) / div));
}

// Floor division (numpy's floor_divide) of signed T by divisor >= 1, computed in int64 so
// that divisors beyond T's range work too.
template <class T>
void scale_int(void* buf, std::size_t n, std::int64_t divisor) {
  if (divisor <= 1) return;
  u8* __restrict b = static_cast<u8*>(buf);
  if ((divisor & (divisor - 1)) == 0) {  // power of two: arithmetic shift is floor division
    const int shift = __builtin_ctzll(static_cast<unsigned long long>(divisor));
    for (std::size_t i = 0; i < n; ++i) {
      const std::int64_t x = load<T>(b + i * sizeof(T));
      store<T>(b + i * sizeof(T), static_cast<T>(x >> shift));
    }
    return;
  }
  for (std::size_t i = 0; i < n; ++i) {
    const std::int64_t x = load<T>(b + i * sizeof(T));
    std::int64_t q = x / divisor;
    if (x % divisor != 0 && x < 0) --q;
    store<T>(b + i * sizeof(T), static_cast<T>(q));
  }
}

// dst[i] = conv(src[i]) for n elements of From into To.
template <class To, class From, class Conv>
inline void convert_each(void* dst, const void* src, std::size_t n, Conv conv) {
  u8* __restrict d = static_cast<u8*>(dst);
  const u8* __restrict s = static_cast<const u8*>(src);
  for (std::size_t i = 0; i < n; ++i)
    store<To>(d + sizeof(To) * i, conv(load<From>(s + sizeof(From) * i)));
}

void f32_to_f16_generic(void* dst, const void* src, std::size_t n) {
  convert_each<std::uint16_t, float>(dst, src, n, [](float v) { return f32_to_f16(v); });
}
void f16_to_f32_generic(void* dst, const void* src, std::size_t n) {
  convert_each<float, std::uint16_t>(dst, src, n, [](std::uint16_t v) { return f16_to_f32(v); });
}
void f32_to_bf16_generic(void* dst, const void* src, std::size_t n) {
  convert_each<std::uint16_t, float>(dst, src, n, [](float v) { return f32_to_bf16(v); });
}
void bf16_to_f32_generic(void* dst, const void* src, std::size_t n) {
  convert_each<float, std::uint16_t>(dst, src, n, [](std::uint16_t v) { return bf16_to_f32(v); });
}

// A table filled with this translation unit's copies of the portable kernels.
KernelTable generic_table(const char* name) {
  KernelTable t;
  t.name = name;
  t.add[static_cast<int>(DType::kFloat32)] = add_plain<float>;
  t.add[static_cast<int>(DType::kFloat64)] = add_plain<double>;
  t.add[static_cast<int>(DType::kFloat16)] = add_f16_generic;
  t.add[static_cast<int>(DType::kBFloat16)] = add_bf16_generic;
  t.add[static_cast<int>(DType::kInt32)] = add_plain<std::uint32_t>;
  t.add[static_cast<int>(DType::kInt64)] = add_plain<std::uint64_t>;
  t.scale[static_cast<int>(DType::kFloat32)] = scale_float<float>;
  t.scale[static_cast<int>(DType::kFloat64)] = scale_float<double>;
  t.scale[static_cast<int>(DType::kFloat16)] = scale_f16_generic;
  t.scale[static_cast<int>(DType::kBFloat16)] = scale_bf16_generic;
  t.scale[static_cast<int>(DType::kInt32)] = scale_int<std::int32_t>;
  t.scale[static_cast<int>(DType::kInt64)] = scale_int<std::int64_t>;
  t.f32_to_f16 = f32_to_f16_generic;
  t.f16_to_f32 = f16_to_f32_generic;
  t.f32_to_bf16 = f32_to_bf16_generic;
  t.bf16_to_f32 = bf16_to_f32_generic;
  return t;
}

}  // namespace
}  // namespace bps
