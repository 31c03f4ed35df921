// AVX2 + FMA + F16C kernels. Only called when the CPU has them (see cpu.cc); the rest of the
// extension stays baseline x86-64.
#include "kernels.h"

#if defined(BPS_X86_KERNELS)

#include <immintrin.h>

#pragma GCC target("avx2,fma,f16c")

#include "kernels_generic.h"

namespace bps {
namespace {

constexpr int kRound = _MM_FROUND_TO_NEAREST_INT;

inline __m256 load8_f16(const u8* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline void store8_f16(u8* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, kRound));
}
// float32 -> bfloat16 bits in the low half of each 32-bit lane, round to nearest even.
inline __m256i round_bf16(__m256 v) {
  const __m256i x = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i nan = _mm256_or_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(0x40));
  const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, nan, is_nan);
}
inline void store16_bf16(u8* p, __m256 lo, __m256 hi) {
  // packus works per 128-bit lane: [lo0-3 hi0-3 lo4-7 hi4-7]; the permute restores order.
  const __m256i packed = _mm256_packus_epi32(round_bf16(lo), round_bf16(hi));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permute4x64_epi64(packed, 0xD8));
}

// Runs `body(d, s)` on the last n < block elements through zero-padded stack copies, so the
// vector body handles the tail too.
template <std::size_t kBlock, std::size_t kDstSize, std::size_t kSrcSize, class Body>
inline void tail(u8* d, const u8* s, std::size_t n, Body body) {
  alignas(64) u8 td[kBlock * kDstSize] = {};
  alignas(64) u8 ts[kBlock * (kSrcSize ? kSrcSize : 1)] = {};
  std::memcpy(td, d, n * kDstSize);
  if (kSrcSize) std::memcpy(ts, s, n * kSrcSize);
  body(td, ts);
  std::memcpy(d, td, n * kDstSize);
}

void add_f16(void* dst, const void* src, std::size_t n) {
  u8* d = static_cast<u8*>(dst);
  const u8* s = static_cast<const u8*>(src);
  std::size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const std::size_t o = 2 * i;
    const __m256 a0 = _mm256_add_ps(load8_f16(d + o), load8_f16(s + o));
    const __m256 a1 = _mm256_add_ps(load8_f16(d + o + 16), load8_f16(s + o + 16));
    const __m256 a2 = _mm256_add_ps(load8_f16(d + o + 32), load8_f16(s + o + 32));
    const __m256 a3 = _mm256_add_ps(load8_f16(d + o + 48), load8_f16(s + o + 48));
    store8_f16(d + o, a0);
    store8_f16(d + o + 16, a1);
    store8_f16(d + o + 32, a2);
    store8_f16(d + o + 48, a3);
  }
  auto body = [](u8* dd, const u8* ss) { store8_f16(dd, _mm256_add_ps(load8_f16(dd), load8_f16(ss))); };
  for (; i + 8 <= n; i += 8) body(d + 2 * i, s + 2 * i);
  if (i < n) tail<8, 2, 2>(d + 2 * i, s + 2 * i, n - i, body);
}

// bfloat16 add/scale work on 16 values per register without widening: the even values
// (low halves of the 32-bit lanes) shifted up and the odd values (high halves) masked are
// both exact float32s; each result is rounded in the high half of its lane and the two
// halves are merged back.
inline __m256i loadu256(const u8* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline void storeu256(u8* p, __m256i v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
inline __m256 even_bf16(__m256i w) { return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)); }
inline __m256 odd_bf16(__m256i w) {
  return _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}
inline __m256i round_hi_bf16(__m256 v) {
  const __m256i x = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7fff)), lsb);
  const __m256i nan = _mm256_or_si256(x, _mm256_set1_epi32(0x00400000));
  return _mm256_blendv_epi8(rounded, nan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}
inline __m256i merge_bf16(__m256 even, __m256 odd) {
  return _mm256_blend_epi16(_mm256_srli_epi32(round_hi_bf16(even), 16), round_hi_bf16(odd), 0xAA);
}

void add_bf16(void* dst, const void* src, std::size_t n) {
  u8* d = static_cast<u8*>(dst);
  const u8* s = static_cast<const u8*>(src);
  auto body = [](u8* dd, const u8* ss) {
    const __m256i a = loadu256(dd), b = loadu256(ss);
    storeu256(dd, merge_bf16(_mm256_add_ps(even_bf16(a), even_bf16(b)),
                             _mm256_add_ps(odd_bf16(a), odd_bf16(b))));
  };
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) body(d + 2 * i, s + 2 * i);
  if (i < n) tail<16, 2, 2>(d + 2 * i, s + 2 * i, n - i, body);
}

void scale_f16(void* buf, std::size_t n, std::int64_t divisor) {
  u8* b = static_cast<u8*>(buf);
  const __m256 div = _mm256_set1_ps(static_cast<float>(divisor));
  auto body = [div](u8* bb, const u8*) { store8_f16(bb, _mm256_div_ps(load8_f16(bb), div)); };
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) body(b + 2 * i, nullptr);
  if (i < n) tail<8, 2, 0>(b + 2 * i, nullptr, n - i, body);
}

void scale_bf16(void* buf, std::size_t n, std::int64_t divisor) {
  u8* b = static_cast<u8*>(buf);
  const __m256 div = _mm256_set1_ps(static_cast<float>(divisor));
  auto body = [div](u8* bb, const u8*) {
    const __m256i a = loadu256(bb);
    storeu256(bb, merge_bf16(_mm256_div_ps(even_bf16(a), div), _mm256_div_ps(odd_bf16(a), div)));
  };
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) body(b + 2 * i, nullptr);
  if (i < n) tail<16, 2, 0>(b + 2 * i, nullptr, n - i, body);
}

void f32_to_f16(void* dst, const void* src, std::size_t n) {
  u8* d = static_cast<u8*>(dst);
  const u8* s = static_cast<const u8*>(src);
  auto body = [](u8* dd, const u8* ss) {
    store8_f16(dd, _mm256_loadu_ps(reinterpret_cast<const float*>(ss)));
  };
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) body(d + 2 * i, s + 4 * i);
  if (i < n) tail<8, 2, 4>(d + 2 * i, s + 4 * i, n - i, body);
}

void f16_to_f32(void* dst, const void* src, std::size_t n) {
  u8* d = static_cast<u8*>(dst);
  const u8* s = static_cast<const u8*>(src);
  auto body = [](u8* dd, const u8* ss) {
    _mm256_storeu_ps(reinterpret_cast<float*>(dd), load8_f16(ss));
  };
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) body(d + 4 * i, s + 2 * i);
  if (i < n) tail<8, 4, 2>(d + 4 * i, s + 2 * i, n - i, body);
}

void f32_to_bf16(void* dst, const void* src, std::size_t n) {
  u8* d = static_cast<u8*>(dst);
  const u8* s = static_cast<const u8*>(src);
  auto body = [](u8* dd, const u8* ss) {
    store16_bf16(dd, _mm256_loadu_ps(reinterpret_cast<const float*>(ss)),
                 _mm256_loadu_ps(reinterpret_cast<const float*>(ss + 32)));
  };
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) body(d + 2 * i, s + 4 * i);
  if (i < n) tail<16, 2, 4>(d + 2 * i, s + 4 * i, n - i, body);
}

}  // namespace

const KernelTable* avx2_kernels() {
  static const KernelTable table = [] {
    KernelTable t = generic_table("avx2");
    t.add[static_cast<int>(DType::kFloat16)] = add_f16;
    t.add[static_cast<int>(DType::kBFloat16)] = add_bf16;
    t.scale[static_cast<int>(DType::kFloat16)] = scale_f16;
    t.scale[static_cast<int>(DType::kBFloat16)] = scale_bf16;
    t.f32_to_f16 = f32_to_f16;
    t.f16_to_f32 = f16_to_f32;
    t.f32_to_bf16 = f32_to_bf16;
    return t;  // bf16_to_f32 (a shift) auto-vectorises well
  }();
  return &table;
}

}  // namespace bps

#else  // no x86-64 kernels

namespace bps {
const KernelTable* avx2_kernels() { return nullptr; }
}  // namespace bps

#endif
