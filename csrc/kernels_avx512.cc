// AVX-512 (F/BW/VL) kernels. Only called when the CPU has them (see cpu.cc).
#include "kernels.h"

#if defined(BPS_X86_KERNELS)

#include <immintrin.h>

#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
// gcc 12 warns about the deliberately undefined pass-through operands inside the AVX-512
// intrinsics (_mm512_undefined_*); they are not real uses.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include "kernels_generic.h"

namespace bps {
namespace {

constexpr int kRound = _MM_FROUND_TO_NEAREST_INT;

// Mask of the first n (< 16) lanes.
inline __mmask16 first(std::size_t n) { return static_cast<__mmask16>((1u << n) - 1u); }

inline __m512 load16_f16(const u8* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16_f16(const u8* p, __mmask16 m) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}
inline void store16_f16(u8* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, kRound));
}
inline void store16_f16(u8* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtps_ph(v, kRound));
}
inline __m512 widen_bf16(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16_bf16(const u8* p) {
  return widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16_bf16(const u8* p, __mmask16 m) { return widen_bf16(_mm256_maskz_loadu_epi16(m, p)); }
// float32 -> bfloat16, round to nearest even, NaN stays NaN.
inline __m256i narrow_bf16(__m512 v) {
  const __m512i x = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(x, _mm512_set1_epi32(0x7fff)), lsb), 16);
  const __m512i nan = _mm512_or_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(0x40));
  const __mmask16 is_nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(is_nan, rounded, nan));
}
inline void store16_bf16(u8* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), narrow_bf16(v));
}
inline void store16_bf16(u8* p, __m512 v, __mmask16 m) { _mm256_mask_storeu_epi16(p, m, narrow_bf16(v)); }

void add_f16(void* dst, const void* src, std::size_t n) {
  u8* d = static_cast<u8*>(dst);
  const u8* s = static_cast<const u8*>(src);
  std::size_t i = 0;
  for (; i + 64 <= n; i += 64) {
    const std::size_t o = 2 * i;
    const __m512 a0 = _mm512_add_ps(load16_f16(d + o), load16_f16(s + o));
    const __m512 a1 = _mm512_add_ps(load16_f16(d + o + 32), load16_f16(s + o + 32));
    const __m512 a2 = _mm512_add_ps(load16_f16(d + o + 64), load16_f16(s + o + 64));
    const __m512 a3 = _mm512_add_ps(load16_f16(d + o + 96), load16_f16(s + o + 96));
    store16_f16(d + o, a0);
    store16_f16(d + o + 32, a1);
    store16_f16(d + o + 64, a2);
    store16_f16(d + o + 96, a3);
  }
  for (; i + 16 <= n; i += 16)
    store16_f16(d + 2 * i, _mm512_add_ps(load16_f16(d + 2 * i), load16_f16(s + 2 * i)));
  if (i < n) {
    const __mmask16 m = first(n - i);
    store16_f16(d + 2 * i, _mm512_add_ps(load16_f16(d + 2 * i, m), load16_f16(s + 2 * i, m)), m);
  }
}

// bfloat16 add/scale work on 32 values per register without widening: the even values
// (low halves of the 32-bit lanes) shifted up and the odd values (high halves) masked are
// both exact float32s; each result is rounded in the high half of its lane and the two
// halves are merged back.
inline __m512 even_bf16(__m512i w) { return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)); }
inline __m512 odd_bf16(__m512i w) {
  return _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}
// float32 -> bfloat16 in the high half of each lane: round to nearest even, NaN stays NaN.
inline __m512i round_hi_bf16(__m512 v) {
  const __m512i x = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(x, _mm512_set1_epi32(0x7fff)), lsb);
  const __mmask16 is_nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_or_epi32(rounded, is_nan, x, _mm512_set1_epi32(0x00400000));
}
inline __m512i merge_bf16(__m512 even, __m512 odd) {
  return _mm512_mask_blend_epi16(0xAAAAAAAAu, _mm512_srli_epi32(round_hi_bf16(even), 16),
                                 round_hi_bf16(odd));
}
inline __mmask32 first32(std::size_t n) { return static_cast<__mmask32>((1ull << n) - 1u); }

inline __m512i sum_bf16(__m512i a, __m512i b) {
  return merge_bf16(_mm512_add_ps(even_bf16(a), even_bf16(b)), _mm512_add_ps(odd_bf16(a), odd_bf16(b)));
}
inline __m512i quot_bf16(__m512i a, __m512 div) {
  return merge_bf16(_mm512_div_ps(even_bf16(a), div), _mm512_div_ps(odd_bf16(a), div));
}

void add_bf16(void* dst, const void* src, std::size_t n) {
  u8* d = static_cast<u8*>(dst);
  const u8* s = static_cast<const u8*>(src);
  std::size_t i = 0;
  for (; i + 64 <= n; i += 64) {
    const std::size_t o = 2 * i;
    const __m512i r0 = sum_bf16(_mm512_loadu_si512(d + o), _mm512_loadu_si512(s + o));
    const __m512i r1 = sum_bf16(_mm512_loadu_si512(d + o + 64), _mm512_loadu_si512(s + o + 64));
    _mm512_storeu_si512(d + o, r0);
    _mm512_storeu_si512(d + o + 64, r1);
  }
  for (; i + 32 <= n; i += 32)
    _mm512_storeu_si512(d + 2 * i, sum_bf16(_mm512_loadu_si512(d + 2 * i), _mm512_loadu_si512(s + 2 * i)));
  if (i < n) {
    const __mmask32 m = first32(n - i);
    _mm512_mask_storeu_epi16(d + 2 * i, m,
                             sum_bf16(_mm512_maskz_loadu_epi16(m, d + 2 * i), _mm512_maskz_loadu_epi16(m, s + 2 * i)));
  }
}

void scale_f16(void* buf, std::size_t n, std::int64_t divisor) {
  u8* b = static_cast<u8*>(buf);
  const __m512 div = _mm512_set1_ps(static_cast<float>(divisor));
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) store16_f16(b + 2 * i, _mm512_div_ps(load16_f16(b + 2 * i), div));
  if (i < n) {
    const __mmask16 m = first(n - i);
    store16_f16(b + 2 * i, _mm512_div_ps(load16_f16(b + 2 * i, m), div), m);
  }
}

void scale_bf16(void* buf, std::size_t n, std::int64_t divisor) {
  u8* b = static_cast<u8*>(buf);
  const __m512 div = _mm512_set1_ps(static_cast<float>(divisor));
  std::size_t i = 0;
  for (; i + 32 <= n; i += 32) _mm512_storeu_si512(b + 2 * i, quot_bf16(_mm512_loadu_si512(b + 2 * i), div));
  if (i < n) {
    const __mmask32 m = first32(n - i);
    _mm512_mask_storeu_epi16(b + 2 * i, m, quot_bf16(_mm512_maskz_loadu_epi16(m, b + 2 * i), div));
  }
}

void f32_to_f16(void* dst, const void* src, std::size_t n) {
  u8* d = static_cast<u8*>(dst);
  const u8* s = static_cast<const u8*>(src);
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) store16_f16(d + 2 * i, _mm512_loadu_ps(s + 4 * i));
  if (i < n) {
    const __mmask16 m = first(n - i);
    store16_f16(d + 2 * i, _mm512_maskz_loadu_ps(m, s + 4 * i), m);
  }
}

void f16_to_f32(void* dst, const void* src, std::size_t n) {
  u8* d = static_cast<u8*>(dst);
  const u8* s = static_cast<const u8*>(src);
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(d + 4 * i, load16_f16(s + 2 * i));
  if (i < n) {
    const __mmask16 m = first(n - i);
    _mm512_mask_storeu_ps(d + 4 * i, m, load16_f16(s + 2 * i, m));
  }
}

void f32_to_bf16(void* dst, const void* src, std::size_t n) {
  u8* d = static_cast<u8*>(dst);
  const u8* s = static_cast<const u8*>(src);
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) store16_bf16(d + 2 * i, _mm512_loadu_ps(s + 4 * i));
  if (i < n) {
    const __mmask16 m = first(n - i);
    store16_bf16(d + 2 * i, _mm512_maskz_loadu_ps(m, s + 4 * i), m);
  }
}

void bf16_to_f32(void* dst, const void* src, std::size_t n) {
  u8* d = static_cast<u8*>(dst);
  const u8* s = static_cast<const u8*>(src);
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(d + 4 * i, load16_bf16(s + 2 * i));
  if (i < n) {
    const __mmask16 m = first(n - i);
    _mm512_mask_storeu_ps(d + 4 * i, m, load16_bf16(s + 2 * i, m));
  }
}

}  // namespace

const KernelTable* avx512_kernels() {
  static const KernelTable table = [] {
    KernelTable t = generic_table("avx512");
    t.add[static_cast<int>(DType::kFloat16)] = add_f16;
    t.add[static_cast<int>(DType::kBFloat16)] = add_bf16;
    t.scale[static_cast<int>(DType::kFloat16)] = scale_f16;
    t.scale[static_cast<int>(DType::kBFloat16)] = scale_bf16;
    t.f32_to_f16 = f32_to_f16;
    t.f16_to_f32 = f16_to_f32;
    t.f32_to_bf16 = f32_to_bf16;
    t.bf16_to_f32 = bf16_to_f32;
    return t;
  }();
  return &table;
}

}  // namespace bps

#else  // no x86-64 kernels

namespace bps {
const KernelTable* avx512_kernels() { return nullptr; }
}  // namespace bps

#endif
