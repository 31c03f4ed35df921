// onebit (compress.h): the sign bits of x packed eight to a byte, with the mean magnitude as
// scale; its error-feedback passes. Scalar and AVX2 paths, chosen at run time (cpu.h).
#include "compress.h"

#include <cmath>
#include <cstring>

#include "compress_internal.h"  // with cpu.h and, on x86, immintrin.h

namespace bps {
namespace compress {
using namespace detail;  // NOLINT(build/namespaces): compress_internal.h's helpers
namespace {

// ---- onebit pack --------------------------------------------------------------------------
void onebit_pack_scalar(const float* x, std::size_t n, u8* bits) {
  const std::size_t full = n / 8;
  for (std::size_t b = 0; b < full; ++b) {
    unsigned byte = 0;
    for (int j = 0; j < 8; ++j) byte |= (load_u32(x, 8 * b + j) >> 31) << j;
    bits[b] = static_cast<u8>(byte);
  }
  if (n % 8) {
    unsigned byte = 0;
    for (std::size_t j = 0; j < n % 8; ++j) byte |= (load_u32(x, 8 * full + j) >> 31) << j;
    bits[full] = static_cast<u8>(byte);
  }
}

double sum_abs_scalar(const float* x, std::size_t n) {
  double acc[4] = {0, 0, 0, 0};
  std::size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    for (int j = 0; j < 4; ++j) acc[j] += std::fabs(static_cast<double>(load_f32(x, i + j)));
  }
  for (; i < n; ++i) acc[0] += std::fabs(static_cast<double>(load_f32(x, i)));
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

// The residual of the last step's y (r) at element i: onebit_residual's arithmetic.
inline float settled(const float* r, std::size_t i, u32 sb) {
  const float v = load_f32(r, i);
  return v - bits_f32(sb ^ (f32_bits(v) & 0x80000000u));
}

#if defined(BPS_X86_KERNELS)
__attribute__((target("avx2"))) void onebit_pack_avx2(const float* x, std::size_t n, u8* bits) {
  std::size_t b = 0;
  for (; 8 * b + 32 <= n; b += 4) {
    const u32 m0 = _mm256_movemask_ps(_mm256_loadu_ps(x + 8 * b));
    const u32 m1 = _mm256_movemask_ps(_mm256_loadu_ps(x + 8 * b + 8));
    const u32 m2 = _mm256_movemask_ps(_mm256_loadu_ps(x + 8 * b + 16));
    const u32 m3 = _mm256_movemask_ps(_mm256_loadu_ps(x + 8 * b + 24));
    const u32 word = m0 | (m1 << 8) | (m2 << 16) | (m3 << 24);
    std::memcpy(bits + b, &word, 4);
  }
  onebit_pack_scalar(x + 8 * b, n - 8 * b, bits + b);
}

// Sum of |x| in double, 8 lanes at a time (the order differs from the scalar sum only in
// rounding of the double accumulators).
__attribute__((target("avx2"))) double sum_abs_avx2(const float* x, std::size_t n) {
  const __m256 mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
  __m256d a2 = _mm256_setzero_pd(), a3 = _mm256_setzero_pd();
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 v0 = _mm256_and_ps(_mm256_loadu_ps(x + i), mask);
    const __m256 v1 = _mm256_and_ps(_mm256_loadu_ps(x + i + 8), mask);
    a0 = _mm256_add_pd(a0, _mm256_cvtps_pd(_mm256_castps256_ps128(v0)));
    a1 = _mm256_add_pd(a1, _mm256_cvtps_pd(_mm256_extractf128_ps(v0, 1)));
    a2 = _mm256_add_pd(a2, _mm256_cvtps_pd(_mm256_castps256_ps128(v1)));
    a3 = _mm256_add_pd(a3, _mm256_cvtps_pd(_mm256_extractf128_ps(v1, 1)));
  }
  alignas(32) double t[4];
  _mm256_store_pd(t, _mm256_add_pd(_mm256_add_pd(a0, a1), _mm256_add_pd(a2, a3)));
  return (t[0] + t[1]) + (t[2] + t[3]) + sum_abs_scalar(x + i, n - i);
}

// One step of sum_abs_avx2's loop: |y0|, |y1| (16 floats) into its four accumulators.
__attribute__((target("avx2"))) inline void sum16_abs_avx2(__m256 y0, __m256 y1, __m256 mask,
                                                           __m256d& a0, __m256d& a1,
                                                           __m256d& a2, __m256d& a3) {
  const __m256 v0 = _mm256_and_ps(y0, mask), v1 = _mm256_and_ps(y1, mask);
  a0 = _mm256_add_pd(a0, _mm256_cvtps_pd(_mm256_castps256_ps128(v0)));
  a1 = _mm256_add_pd(a1, _mm256_cvtps_pd(_mm256_extractf128_ps(v0, 1)));
  a2 = _mm256_add_pd(a2, _mm256_cvtps_pd(_mm256_castps256_ps128(v1)));
  a3 = _mm256_add_pd(a3, _mm256_cvtps_pd(_mm256_extractf128_ps(v1, 1)));
}

// onebit_pack_avx2 and sum_abs_avx2 of y = x + r (stored into r) in one pass: the same
// 32-element packing steps and the same accumulators, in the same order, 16 elements a step.
// kSettle: r is first settled with scale `prev` (onebit_residual's arithmetic, in the pass).
template <bool kSettle>
__attribute__((target("avx2"))) double onebit_ef_pass_avx2(const float* x, float* r,
                                                           std::size_t n, u8* bits,
                                                           bool scaling, float prev) {
  const __m256 mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(0x80000000u)));
  const __m256 pv = _mm256_set1_ps(prev);
  __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
  __m256d a2 = _mm256_setzero_pd(), a3 = _mm256_setzero_pd();
  std::size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    __m256 y[4];
    for (int j = 0; j < 4; ++j) {
      __m256 rj = _mm256_loadu_ps(r + i + 8 * j);
      if (kSettle) rj = _mm256_sub_ps(rj, _mm256_xor_ps(pv, _mm256_and_ps(rj, sign)));
      y[j] = _mm256_add_ps(_mm256_loadu_ps(x + i + 8 * j), rj);
      _mm256_storeu_ps(r + i + 8 * j, y[j]);
    }
    const u32 word = static_cast<u32>(_mm256_movemask_ps(y[0])) |
                     (static_cast<u32>(_mm256_movemask_ps(y[1])) << 8) |
                     (static_cast<u32>(_mm256_movemask_ps(y[2])) << 16) |
                     (static_cast<u32>(_mm256_movemask_ps(y[3])) << 24);
    std::memcpy(bits + i / 8, &word, 4);
    if (scaling) {
      sum16_abs_avx2(y[0], y[1], mask, a0, a1, a2, a3);
      sum16_abs_avx2(y[2], y[3], mask, a0, a1, a2, a3);
    }
  }
  const u32 sb = f32_bits(prev);
  for (std::size_t k = i; k < n; ++k)
    store_f32(r, k, load_f32(x, k) + (kSettle ? settled(r, k, sb) : load_f32(r, k)));
  onebit_pack_scalar(r + i, n - i, bits + i / 8);
  if (!scaling) return 0.0;
  if (i + 16 <= n) {
    sum16_abs_avx2(_mm256_loadu_ps(r + i), _mm256_loadu_ps(r + i + 8), mask, a0, a1, a2, a3);
    i += 16;
  }
  alignas(32) double t[4];
  _mm256_store_pd(t, _mm256_add_pd(_mm256_add_pd(a0, a1), _mm256_add_pd(a2, a3)));
  return (t[0] + t[1]) + (t[2] + t[3]) + sum_abs_scalar(r + i, n - i);
}

// out[i] = scale with the sign bit flipped where the bit is set, 8 at a time.
// kStream: out is 32-byte aligned and written, not added to, with non-temporal stores (the
// caller does not read it back soon: no read for ownership, no cache evicted for it).
template <bool kStream>
__attribute__((target("avx2"))) void onebit_unpack_avx2(const u8* bits, std::size_t n,
                                                        float scale, float* out, bool add) {
  const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256 s = _mm256_set1_ps(scale);
  const __m256i sign = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  std::size_t b = 0;
  for (; 8 * b + 8 <= n; ++b) {
    const __m256i m = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(bits[b]), sel), sel);
    const __m256 v = _mm256_xor_ps(s, _mm256_castsi256_ps(_mm256_and_si256(m, sign)));
    float* o = out + 8 * b;
    if (kStream)
      _mm256_stream_ps(o, v);
    else
      _mm256_storeu_ps(o, add ? _mm256_add_ps(_mm256_loadu_ps(o), v) : v);
  }
  if (kStream) _mm_sfence();
  const u32 sb = f32_bits(scale);
  for (std::size_t i = 8 * b; i < n; ++i) {
    const float v = bits_f32(sb ^ (static_cast<u32>((bits[i / 8] >> (i % 8)) & 1) << 31));
    store_f32(out, i, add ? load_f32(out, i) + v : v);
  }
}
#endif

bool use_avx2() {
#if defined(BPS_X86_KERNELS)
  return active_isa() >= Isa::kAvx2;
#else
  return false;
#endif
}

}  // namespace

// ---- onebit -----------------------------------------------------------------------------
float onebit_encode(const float* x, std::size_t n, u8* bits, bool scaling) {
#if defined(BPS_X86_KERNELS)
  const bool avx2 = use_avx2();
  if (avx2) onebit_pack_avx2(x, n, bits); else onebit_pack_scalar(x, n, bits);
  if (!scaling) return 1.0f;
  if (n == 0) return 0.0f;
  return static_cast<float>((avx2 ? sum_abs_avx2(x, n) : sum_abs_scalar(x, n)) /
                            static_cast<double>(n));
#else
  onebit_pack_scalar(x, n, bits);
  if (!scaling) return 1.0f;
  if (n == 0) return 0.0f;
  return static_cast<float>(sum_abs_scalar(x, n) / static_cast<double>(n));
#endif
}

void onebit_decode(const u8* bits, std::size_t n, float scale, float* out, bool add,
                   bool stream) {
#if defined(BPS_X86_KERNELS)
  if (use_avx2()) {
    if (stream && !add && reinterpret_cast<std::uintptr_t>(out) % 32 == 0)
      onebit_unpack_avx2<true>(bits, n, scale, out, false);
    else
      onebit_unpack_avx2<false>(bits, n, scale, out, add);
    return;
  }
#endif
  const u32 sb = f32_bits(scale);
  for (std::size_t i = 0; i < n; ++i) {
    const float v = bits_f32(sb ^ (static_cast<u32>((bits[i / 8] >> (i % 8)) & 1) << 31));
    store_f32(out, i, add ? load_f32(out, i) + v : v);
  }
}

float onebit_ef_encode(const float* x, float* r, std::size_t n, u8* bits, bool scaling,
                       const float* settle) {
#if defined(BPS_X86_KERNELS)
  if (use_avx2()) {
    const double s = settle ? onebit_ef_pass_avx2<true>(x, r, n, bits, scaling, *settle)
                            : onebit_ef_pass_avx2<false>(x, r, n, bits, scaling, 0.0f);
    if (!scaling) return 1.0f;
    if (n == 0) return 0.0f;
    return static_cast<float>(s / static_cast<double>(n));
  }
#endif
  const u32 sb = settle ? f32_bits(*settle) : 0;
  for (std::size_t i = 0; i < n; ++i)
    store_f32(r, i, load_f32(x, i) + (settle ? settled(r, i, sb) : load_f32(r, i)));
  return onebit_encode(r, n, bits, scaling);
}

void onebit_residual(float* y, std::size_t n, float scale) {
  const u32 sb = f32_bits(scale);
  for (std::size_t i = 0; i < n; ++i) {
    const float yi = load_f32(y, i);
    store_f32(y, i, yi - bits_f32(sb ^ (f32_bits(yi) & 0x80000000u)));
  }
}

}  // namespace compress
}  // namespace bps
