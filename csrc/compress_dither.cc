// Dithering (compress.h): stochastic quantisation to linear or natural levels, the codes'
// bit packing and unpacking; scalar paths and AVX-512 ones, chosen at run time (cpu.h).
#include "compress.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "compress_internal.h"  // with cpu.h and, on x86, immintrin.h

namespace bps {
namespace compress {
using namespace detail;  // NOLINT(build/namespaces): compress_internal.h's helpers

// ---- dithering --------------------------------------------------------------------------
// Encode runs in two passes per chunk: the level codes of the elements (a loop free of the bit
// packing, SIMD on AVX-512), then the packing; decode validates every code of the body first
// and then decodes. Every path computes exactly the float ops documented in compress.h, so all
// of them give the same bits as the element-at-a-time definition:
//   a = min(|x| / norm, 1), u = uniform24(base, i)
//   linear:  t = a * s, l = floor(t), q = l + (u < t - l)
//   natural: a >= 1: q = s; a == 0: q = 0; else m, e = frexp(a), ql = e - 1 + s,
//            q = ql >= 1 ? ql + (u < 2m - 1) : (u < ldexp(a, s - 1))
//   code = q ? q << 1 | sign(x) : 0, dither_bits(s) bits each, LSB first.
namespace {

void check_levels(int levels, bool natural, const char* func) {
  const int hi = natural ? 127 : 65535;
  if (levels < 1 || levels > hi) {
    throw std::invalid_argument(std::string(func) + ": levels must be in [1, " +
                                std::to_string(hi) + "] for " +
                                (natural ? "natural" : "linear") + " dithering, got " +
                                std::to_string(levels));
  }
}

inline float uniform24(u64 base, std::size_t i) {
  return static_cast<float>(mix64(base + (static_cast<u64>(i) + 1) * kGolden) >> 40) *
         (1.0f / 16777216.0f);
}


// Elements per chunk of the chunked loops (a multiple of 16, so every chunk starts on a byte).
constexpr std::size_t kDitherChunk = 512;

// Level codes of x[i0 .. i0 + cnt) (scalar definition).
template <bool kNatural>
void dither_codes_scalar(const float* x, std::size_t i0, std::size_t cnt, float norm, int levels,
                         u64 base, u32* codes) {
  const float s = static_cast<float>(levels);
  for (std::size_t j = 0; j < cnt; ++j) {
    const std::size_t i = i0 + j;
    const u32 xb = load_u32(x, i);
    const float a = std::min(bits_f32(xb & 0x7fffffffu) / norm, 1.0f);
    const float u = uniform24(base, i);
    u32 q;
    if (!kNatural) {
      const float t = a * s;
      const float l = std::floor(t);
      q = static_cast<u32>(l) + (u < t - l ? 1u : 0u);
    } else if (a >= 1.0f) {
      q = static_cast<u32>(levels);
    } else if (a == 0.0f) {
      q = 0;
    } else {
      int e;
      const float m = std::frexp(a, &e);
      const int ql = e - 1 + levels;
      if (ql >= 1) q = static_cast<u32>(ql) + (u < 2.0f * m - 1.0f ? 1u : 0u);
      else q = (u < std::ldexp(a, levels - 1)) ? 1u : 0u;
    }
    codes[j] = q ? (q << 1) | (xb >> 31) : 0u;
  }
}

void dither_codes(const float* x, std::size_t i0, std::size_t cnt, float norm, int levels,
                  bool natural, u64 base, u32* codes) {
  if (natural) dither_codes_scalar<true>(x, i0, cnt, norm, levels, base, codes);
  else dither_codes_scalar<false>(x, i0, cnt, norm, levels, base, codes);
}

// Packs cnt codes of `bits` bits LSB first into out (bit 0 of out[0] first), writing all
// ceil(cnt * bits / 8) bytes.
void pack_codes_generic(const u32* c, std::size_t cnt, int bits, u8* out) {
  u64 acc = 0;
  int nacc = 0;
  std::size_t o = 0;
  for (std::size_t j = 0; j < cnt; ++j) {
    acc |= static_cast<u64>(c[j]) << nacc;
    nacc += bits;
    if (nacc >= 32) {
      const u32 word = static_cast<u32>(acc);
      std::memcpy(out + o, &word, 4);
      o += 4;
      acc >>= 32;
      nacc -= 32;
    }
  }
  for (; nacc > 0; nacc -= 8, acc >>= 8) out[o++] = static_cast<u8>(acc);
}

// The same, 8 codes -> kBits bytes at a time through one word W (u64 up to 8 bits, a
// 128-bit word up to 16), the last codes as above.
template <int kBits, class W>
void pack_codes_words(const u32* c, std::size_t cnt, u8* out) {
  static_assert(kBits >= 1 && kBits <= static_cast<int>(sizeof(W)), "8 codes per word");
  std::size_t j = 0;
  u8* o = out;
  for (; j + 8 <= cnt; j += 8, o += kBits) {
    W w = 0;
    for (int k = 0; k < 8; ++k) w |= static_cast<W>(c[j + k]) << (k * kBits);
    std::memcpy(o, &w, kBits);
  }
  pack_codes_generic(c + j, cnt - j, kBits, o);
}

// f(std::integral_constant<int, B>()) for the B in kLo..kHi that equals bits: the kernels
// specialised per code width; false (f not called) when bits is out of that range.
template <int kLo, int kHi, class F>
bool with_bits(int bits, F&& f) {
  if constexpr (kLo > kHi) {
    return false;
  } else {
    if (bits != kLo) return with_bits<kLo + 1, kHi>(bits, std::forward<F>(f));
    f(std::integral_constant<int, kLo>());
    return true;
  }
}

void pack_codes(const u32* c, std::size_t cnt, int bits, u8* out) {
  auto narrow = [&](auto b) { pack_codes_words<decltype(b)::value, u64>(c, cnt, out); };
  if (with_bits<2, 8>(bits, narrow)) return;
#if defined(__SIZEOF_INT128__)
  using u128 = unsigned __int128;
  auto wide = [&](auto b) { pack_codes_words<decltype(b)::value, u128>(c, cnt, out); };
  if (with_bits<9, 16>(bits, wide)) return;
#endif
  pack_codes_generic(c, cnt, bits, out);
}

// Codes i0 .. i0 + cnt of a body (i0 a multiple of 8, so element i0 starts on byte
// i0 * bits / 8); reads no byte at or past nbytes.
template <int kBits>
void unpack_codes_fixed(const u8* in, std::size_t nbytes, std::size_t i0, std::size_t cnt,
                        u32* c) {
  static_assert(kBits >= 1 && kBits <= 8, "8 codes per u64");
  constexpr u64 mask = (u64{1} << kBits) - 1;
  std::size_t byte = i0 / 8 * kBits;
  std::size_t j = 0;
  for (; j + 8 <= cnt; j += 8, byte += kBits) {
    u64 w = 0;
    std::memcpy(&w, in + byte, kBits);
    for (int k = 0; k < 8; ++k) c[j + k] = static_cast<u32>((w >> (k * kBits)) & mask);
  }
  if (j < cnt) {
    u64 w = 0;
    for (std::size_t b = 0; b < kBits && byte + b < nbytes; ++b) {
      w |= static_cast<u64>(in[byte + b]) << (8 * b);
    }
    for (int k = 0; j < cnt; ++j, ++k) c[j] = static_cast<u32>((w >> (k * kBits)) & mask);
  }
}

void unpack_codes_generic(const u8* in, std::size_t nbytes, std::size_t i0, std::size_t cnt,
                          int bits, u32* c) {
  const u32 mask = (1u << bits) - 1;
  for (std::size_t j = 0; j < cnt; ++j) {
    const std::size_t bit = (i0 + j) * static_cast<std::size_t>(bits);
    const std::size_t byte = bit / 8;
    u32 w = 0;
    if (byte + 4 <= nbytes) std::memcpy(&w, in + byte, 4);
    else for (std::size_t k = 0; byte + k < nbytes; ++k) w |= static_cast<u32>(in[byte + k]) << (8 * k);
    c[j] = (w >> (bit % 8)) & mask;
  }
}

// 9..17 bits: each code read from an 8-byte load at its first byte, while 8 bytes remain.
template <int kBits>
void unpack_codes_wide(const u8* in, std::size_t nbytes, std::size_t i0, std::size_t cnt,
                       u32* c) {
  static_assert(kBits > 8 && kBits <= 24, "a code and its bit offset fit a u32 window");
  constexpr u64 mask = (u64{1} << kBits) - 1;
  std::size_t byte = i0 / 8 * kBits;
  std::size_t j = 0;
  for (; j + 8 <= cnt && byte + kBits + 8 <= nbytes; j += 8, byte += kBits) {
    for (int k = 0; k < 8; ++k) {
      u64 w;
      std::memcpy(&w, in + byte + k * kBits / 8, 8);
      c[j + k] = static_cast<u32>((w >> (k * kBits % 8)) & mask);
    }
  }
  unpack_codes_generic(in, nbytes, i0 + j, cnt - j, kBits, c + j);
}

void unpack_codes(const u8* in, std::size_t nbytes, std::size_t i0, std::size_t cnt, int bits,
                  u32* c) {
  auto fixed = [&](auto b) { unpack_codes_fixed<decltype(b)::value>(in, nbytes, i0, cnt, c); };
  auto wide = [&](auto b) { unpack_codes_wide<decltype(b)::value>(in, nbytes, i0, cnt, c); };
  if (!with_bits<2, 8>(bits, fixed) && !with_bits<9, 17>(bits, wide))
    unpack_codes_generic(in, nbytes, i0, cnt, bits, c);
}

float dither_norm_scalar(const float* x, std::size_t n, bool l2) {
  if (l2) {
    double acc[4] = {0, 0, 0, 0};
    std::size_t i = 0;
    for (; i + 4 <= n; i += 4) {
      for (int j = 0; j < 4; ++j) {
        const double v = load_f32(x, i + j);
        acc[j] += v * v;
      }
    }
    for (; i < n; ++i) {
      const double v = load_f32(x, i);
      acc[0] += v * v;
    }
    return static_cast<float>(std::sqrt((acc[0] + acc[1]) + (acc[2] + acc[3])));
  }
  u32 worst = 0;  // NaN magnitudes rank above inf, so a NaN input gives a NaN norm
  for (std::size_t i = 0; i < n; ++i) worst = std::max(worst, load_u32(x, i) & 0x7fffffffu);
  return bits_f32(worst);
}

#if defined(BPS_X86_KERNELS)
// AVX-512 (F/BW/VL/DQ: vpmullq for mix64) variants, 16 elements per step. The float ops use
// the _round_ intrinsics with the current rounding mode: the same instructions, but builtins the
// compiler never contracts into an FMA (which would change bits).
// gcc 12 warns about the deliberately undefined pass-through operands inside the AVX-512
// intrinsics (_mm512_undefined_*); they are not real uses.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#define BPS_DITHER_AVX512 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,bmi2")))
constexpr int kCur = _MM_FROUND_CUR_DIRECTION;

bool use_dither_avx512() {
  static const bool dq = __builtin_cpu_supports("avx512dq");
  return dq && active_isa() >= Isa::kAvx512;
}

BPS_DITHER_AVX512 float dither_norm_avx512(const float* x, std::size_t n, bool l2) {
  std::size_t i = 0;
  if (l2) {
    // The 4 lanes are the scalar loop's acc[0..3], in the same order.
    __m256d acc = _mm256_setzero_pd();
    for (; i + 4 <= n; i += 4) {
      const __m256d v = _mm256_cvtps_pd(_mm_loadu_ps(x + i));
      acc = _mm256_add_pd(acc, _mm256_mul_pd(v, v));
    }
    alignas(32) double a[4];
    _mm256_store_pd(a, acc);
    for (; i < n; ++i) {
      const double v = load_f32(x, i);
      a[0] += v * v;
    }
    return static_cast<float>(std::sqrt((a[0] + a[1]) + (a[2] + a[3])));
  }
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  __m512i m0 = _mm512_setzero_si512(), m1 = _mm512_setzero_si512();
  for (; i + 32 <= n; i += 32) {
    m0 = _mm512_max_epu32(m0, _mm512_and_si512(_mm512_loadu_si512(x + i), abs_mask));
    m1 = _mm512_max_epu32(m1, _mm512_and_si512(_mm512_loadu_si512(x + i + 16), abs_mask));
  }
  u32 worst = _mm512_reduce_max_epu32(_mm512_max_epu32(m0, m1));
  for (; i < n; ++i) worst = std::max(worst, load_u32(x, i) & 0x7fffffffu);
  return bits_f32(worst);
}

// Top 24 bits of mix64(z) for the 8 counters z: the last step of mix64 (z ^ z >> 31) leaves
// bits 40..63 unchanged, so it is skipped.
BPS_DITHER_AVX512 inline __m512i mix64_top24_x8(__m512i z) {
  z = _mm512_xor_si512(z, _mm512_srli_epi64(z, 30));
  z = _mm512_mullo_epi64(z, _mm512_set1_epi64(static_cast<long long>(0xBF58476D1CE4E5B9ULL)));
  z = _mm512_xor_si512(z, _mm512_srli_epi64(z, 27));
  z = _mm512_mullo_epi64(z, _mm512_set1_epi64(static_cast<long long>(0x94D049BB133111EBULL)));
  return z;  // top 24 bits valid
}

struct DitherAvx512State {
  __m512i z0, z1;    // counters base + (i + 1 + j) * G of elements i + 0..7, i + 8..15
  __m512i zstep;     // 16 * G
  __m512i odd;       // permutex2var index of the high halves of the 16 u64 lanes
  __m512 norm, one, sv, p2;
  __m512i levels_v;
};

BPS_DITHER_AVX512 inline void dither_state_init(DitherAvx512State& st, u64 base, std::size_t i0,
                                                float norm, int levels) {
  alignas(64) u64 z[16];
  for (int j = 0; j < 16; ++j) z[j] = base + (static_cast<u64>(i0) + 1 + j) * kGolden;
  st.z0 = _mm512_load_si512(z);
  st.z1 = _mm512_load_si512(z + 8);
  st.zstep = _mm512_set1_epi64(static_cast<long long>(16 * kGolden));
  st.odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  st.norm = _mm512_set1_ps(norm);
  st.one = _mm512_set1_ps(1.0f);
  st.sv = _mm512_set1_ps(static_cast<float>(levels));
  st.p2 = _mm512_set1_ps(std::ldexp(1.0f, levels - 1 < 127 ? levels - 1 : 127));
  st.levels_v = _mm512_set1_epi32(levels);
}

// Codes of the 16 elements at p (the next 16 of the stream), advancing the counters.
template <bool kNatural>
BPS_DITHER_AVX512 inline __m512i dither_codes16(DitherAvx512State& st, const float* p,
                                                int levels) {
  const __m512i h0 = mix64_top24_x8(st.z0);
  const __m512i h1 = mix64_top24_x8(st.z1);
  st.z0 = _mm512_add_epi64(st.z0, st.zstep);
  st.z1 = _mm512_add_epi64(st.z1, st.zstep);
  const __m512i r24 = _mm512_srli_epi32(_mm512_permutex2var_epi32(h0, st.odd, h1), 8);
  const __m512 u = _mm512_mul_round_ps(_mm512_cvtepi32_ps(r24), _mm512_set1_ps(1.0f / 16777216.0f),
                                       kCur);
  const __m512i xb = _mm512_loadu_si512(p);
  const __m512 ax = _mm512_castsi512_ps(_mm512_and_si512(xb, _mm512_set1_epi32(0x7fffffff)));
  const __m512 a = _mm512_min_ps(_mm512_div_round_ps(ax, st.norm, kCur), st.one);
  const __m512i one_i = _mm512_set1_epi32(1);
  __m512i q;
  if (!kNatural) {
    const __m512 t = _mm512_mul_round_ps(a, st.sv, kCur);
    const __m512 l = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 frac = _mm512_sub_round_ps(t, l, kCur);
    q = _mm512_cvttps_epi32(l);
    q = _mm512_mask_add_epi32(q, _mm512_cmp_ps_mask(u, frac, _CMP_LT_OQ), q, one_i);
  } else {
    // a in [0, 1]: its biased exponent E gives frexp's e = E - 126 for a normal a; a zero or
    // subnormal a (E = 0) has ql <= levels - 127 <= 0 either way, so it takes the ldexp branch
    // (a * 2^(s-1) is exact, as ldexp is).
    // The a >= 1 and a == 0 cases need no lanes of their own: a = 1 (E = 127) gives ql = s and
    // 2m - 1 = 0, so q = s; a = 0 gives ql <= 0 and u < 0 * 2^(s-1) is false, so q = 0.
    // u < 2m - 1 compares r24 / 2^24 with mantissa / 2^23, i.e. r24 < 2 * mantissa (exact).
    const __m512i ab = _mm512_castps_si512(a);
    const __m512i ql = _mm512_add_epi32(_mm512_srli_epi32(ab, 23), _mm512_set1_epi32(levels - 127));
    const __m512i mant = _mm512_and_si512(ab, _mm512_set1_epi32(0x007fffff));
    const __mmask16 hi_up = _mm512_cmplt_epi32_mask(r24, _mm512_add_epi32(mant, mant));
    const __mmask16 lo_up =
        _mm512_cmp_ps_mask(u, _mm512_mul_round_ps(a, st.p2, kCur), _CMP_LT_OQ);
    const __mmask16 hi = _mm512_cmpgt_epi32_mask(ql, _mm512_setzero_si512());
    // hi lanes: ql + hi_up; other lanes: lo_up
    q = _mm512_maskz_mov_epi32(hi, ql);
    q = _mm512_mask_add_epi32(q, (hi & hi_up) | (~hi & lo_up), q, one_i);
  }
  const __m512i code = _mm512_or_si512(_mm512_slli_epi32(q, 1), _mm512_srli_epi32(xb, 31));
  return _mm512_maskz_mov_epi32(_mm512_test_epi32_mask(q, q), code);
}

// Encodes the first n - n % 16 elements; returns how many.
template <bool kNatural>
BPS_DITHER_AVX512 std::size_t dither_encode_avx512(const float* x, std::size_t n, float norm,
                                                   int levels, int bits, u64 base, u8* out,
                                                   std::size_t nbytes) {
  const std::size_t full = n - n % 16;
  DitherAvx512State st;
  dither_state_init(st, base, 0, norm, levels);
  if (bits > 8) {
    alignas(64) u32 codes[kDitherChunk];
    for (std::size_t i = 0; i < full; i += kDitherChunk) {
      const std::size_t cnt = std::min(kDitherChunk, full - i);
      for (std::size_t j = 0; j < cnt; j += 16) {
        _mm512_store_si512(codes + j, dither_codes16<kNatural>(st, x + i + j, levels));
      }
      pack_codes(codes, cnt, bits, out + i / 8 * static_cast<std::size_t>(bits));
    }
    return full;
  }
  // 16 codes of b <= 8 bits -> 2b bytes: pairs into 64-bit lanes (2b bits), pairs of those in
  // each 128-bit lane (4b bits), then two u64 words of 8 codes (8b bits) compacted to 2b bytes.
  const __m512i lo32 = _mm512_set1_epi64(0xffffffffLL);
  const __m512i sel_lo = _mm512_setr_epi64(0, 4, 0, 0, 0, 0, 0, 0);
  const __m512i sel_hi = _mm512_setr_epi64(2, 6, 0, 0, 0, 0, 0, 0);
  alignas(16) u8 cidx[16];
  for (int k = 0; k < 16; ++k) {
    cidx[k] = k < bits ? static_cast<u8>(k) : k < 2 * bits ? static_cast<u8>(8 + k - bits) : 0x80;
  }
  const __m128i compact = _mm_load_si128(reinterpret_cast<const __m128i*>(cidx));
  const __mmask16 store_mask = static_cast<__mmask16>((1u << (2 * bits)) - 1u);
  const int step = 2 * bits;
  std::size_t o = 0;
  for (std::size_t i = 0; i < full; i += 16, o += step) {
    const __m512i c = dither_codes16<kNatural>(st, x + i, levels);
    const __m512i p = _mm512_or_si512(_mm512_and_si512(c, lo32), _mm512_srli_epi64(c, 32 - bits));
    const __m512i q = _mm512_or_si512(p, _mm512_slli_epi64(_mm512_unpackhi_epi64(p, p), 2 * bits));
    const __m512i w = _mm512_or_si512(_mm512_permutexvar_epi64(sel_lo, q),
                                      _mm512_slli_epi64(_mm512_permutexvar_epi64(sel_hi, q), 4 * bits));
    const __m128i bytes = _mm_shuffle_epi8(_mm512_castsi512_si128(w), compact);
    if (o + 16 <= nbytes) _mm_storeu_si128(reinterpret_cast<__m128i*>(out + o), bytes);
    else _mm_mask_storeu_epi8(out + o, store_mask, bytes);
  }
  return full;
}

// Unpacks the 16 codes of b <= 8 bits at `in` (2b bytes).
struct Unpack16 {
  __m512i shuf, shift, mask;
  __mmask16 load_mask;
};

BPS_DITHER_AVX512 inline Unpack16 unpack16_init(int bits) {
  alignas(64) u8 sb[64];
  alignas(64) u32 sh[16];
  for (int j = 0; j < 16; ++j) {
    const int fb = j * bits / 8;
    sb[4 * j] = static_cast<u8>(fb);
    sb[4 * j + 1] = static_cast<u8>(fb + 1 < 16 ? fb + 1 : 15);
    sb[4 * j + 2] = 0x80;
    sb[4 * j + 3] = 0x80;
    sh[j] = static_cast<u32>(j * bits % 8);
  }
  Unpack16 u;
  u.shuf = _mm512_load_si512(sb);
  u.shift = _mm512_load_si512(sh);
  u.mask = _mm512_set1_epi32((1 << bits) - 1);
  u.load_mask = static_cast<__mmask16>((1u << (2 * bits)) - 1u);
  return u;
}

BPS_DITHER_AVX512 inline __m512i unpack16(const Unpack16& u, const u8* p, bool room) {
  const __m128i raw = room ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(p))
                           : _mm_maskz_loadu_epi8(u.load_mask, p);
  const __m512i b = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(raw), u.shuf);
  return _mm512_and_si512(_mm512_srlv_epi32(b, u.shift), u.mask);
}

// First full 16-block (of n / 16) holding a level above `levels`, or n / 16 when none.
BPS_DITHER_AVX512 std::size_t dither_first_bad_block_avx512(const u8* in, std::size_t nbytes,
                                                            std::size_t n, int bits,
                                                            int levels) {
  const Unpack16 u = unpack16_init(bits);
  const __m512i lv = _mm512_set1_epi32(levels);
  const std::size_t blocks = n / 16;
  const std::size_t step = 2 * static_cast<std::size_t>(bits);
  std::size_t k = 0;
  for (; k + 4 <= blocks; k += 4) {
    const u8* p = in + k * step;
    const bool room = (k + 3) * step + 16 <= nbytes;
    const __m512i m = _mm512_max_epu32(
        _mm512_max_epu32(unpack16(u, p, room), unpack16(u, p + step, room)),
        _mm512_max_epu32(unpack16(u, p + 2 * step, room), unpack16(u, p + 3 * step, room)));
    if (_mm512_cmpgt_epu32_mask(_mm512_srli_epi32(m, 1), lv)) break;
  }
  for (; k < blocks; ++k) {
    const __m512i c = unpack16(u, in + k * step, k * step + 16 <= nbytes);
    if (_mm512_cmpgt_epu32_mask(_mm512_srli_epi32(c, 1), lv)) return k;
  }
  return blocks;
}

// Decodes the first n - n % 16 elements (codes already validated); returns how many.
BPS_DITHER_AVX512 std::size_t dither_decode_avx512(const u8* in, std::size_t nbytes,
                                                   std::size_t n, int bits, int levels,
                                                   const float* table, float* out, bool add) {
  const Unpack16 u = unpack16_init(bits);
  const std::size_t blocks = n / 16;
  const std::size_t step = 2 * static_cast<std::size_t>(bits);
  alignas(64) float tab[32] = {};
  const bool small = levels < 32;
  if (small) std::memcpy(tab, table, (static_cast<std::size_t>(levels) + 1) * sizeof(float));
  const __m512 t0 = _mm512_load_ps(tab), t1 = _mm512_load_ps(tab + 16);
  for (std::size_t k = 0; k < blocks; ++k) {
    const __m512i c = unpack16(u, in + k * step, k * step + 16 <= nbytes);
    const __m512i q = _mm512_srli_epi32(c, 1);
    __m512 v = small ? _mm512_permutex2var_ps(t0, q, t1) : _mm512_i32gather_ps(q, table, 4);
    v = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), _mm512_slli_epi32(c, 31)));
    float* o = out + 16 * k;
    _mm512_storeu_ps(o, add ? _mm512_add_ps(_mm512_loadu_ps(o), v) : v);
  }
  return 16 * blocks;
}
#pragma GCC diagnostic pop
#endif

[[noreturn]] void throw_bad_level(u32 q, std::size_t i, int levels) {
  throw std::invalid_argument("dither_decode: level " + std::to_string(q) + " of element " +
                              std::to_string(i) + " exceeds levels = " + std::to_string(levels));
}

}  // namespace

int dither_bits(int levels) {
  int b = 0;
  while ((levels >> b) != 0) ++b;
  return 1 + b;
}

std::size_t dither_bytes(std::size_t n, int levels) {
  return (n * static_cast<std::size_t>(dither_bits(levels)) + 7) / 8;
}

float dither_encode(const float* x, std::size_t n, int levels, bool natural, bool l2, u64 seed,
                    u64 key, u64 step, u8* out) {
  check_levels(levels, natural, "dither_encode");
  check_n(n, "dither_encode");
  const std::size_t nbytes = dither_bytes(n, levels);
#if defined(BPS_X86_KERNELS)
  const bool avx512 = use_dither_avx512();
  const float norm = avx512 ? dither_norm_avx512(x, n, l2) : dither_norm_scalar(x, n, l2);
#else
  const float norm = dither_norm_scalar(x, n, l2);
#endif
  if (!(norm > 0.0f) || !std::isfinite(norm)) {
    std::memset(out, 0, nbytes);
    return norm;
  }
  const int bits = dither_bits(levels);
  const u64 base = stream_base(seed, key, step, kDomainDither);
  std::size_t i = 0;
#if defined(BPS_X86_KERNELS)
  if (avx512) {
    i = natural ? dither_encode_avx512<true>(x, n, norm, levels, bits, base, out, nbytes)
                : dither_encode_avx512<false>(x, n, norm, levels, bits, base, out, nbytes);
  }
#endif
  // Chunks start at multiples of 16 elements, so on whole bytes, and together write every byte.
  u32 codes[kDitherChunk];
  for (; i < n; i += kDitherChunk) {
    const std::size_t cnt = std::min(kDitherChunk, n - i);
    dither_codes(x, i, cnt, norm, levels, natural, base, codes);
    pack_codes(codes, cnt, bits, out + i / 8 * static_cast<std::size_t>(bits));
  }
  return norm;
}

void dither_decode(const u8* in, std::size_t nbytes, std::size_t n, int levels, bool natural,
                   float norm, float* out, bool add) {
  check_levels(levels, natural, "dither_decode");
  check_n(n, "dither_decode");
  if (nbytes != dither_bytes(n, levels)) {
    throw std::invalid_argument("dither_decode: body has " + std::to_string(nbytes) +
                                " bytes; " + std::to_string(n) + " elements at " +
                                std::to_string(dither_bits(levels)) + " bits need " +
                                std::to_string(dither_bytes(n, levels)));
  }
  const int bits = dither_bits(levels);
#if defined(BPS_X86_KERNELS)
  const bool avx512 = bits <= 8 && use_dither_avx512();
#else
  const bool avx512 = false;
#endif
  u32 codes[kDitherChunk];
  // Validate everything first so a bad body never half-updates an accumulator. Every code is
  // valid when levels = 2^(bits-1) - 1.
  if (static_cast<u32>(levels) < (1u << (bits - 1)) - 1) {
    std::size_t i = 0;
#if defined(BPS_X86_KERNELS)
    if (avx512) i = 16 * dither_first_bad_block_avx512(in, nbytes, n, bits, levels);
#endif
    for (; i < n; i += kDitherChunk) {
      const std::size_t cnt = std::min(kDitherChunk, n - i);
      unpack_codes(in, nbytes, i, cnt, bits, codes);
      u32 worst = 0;
      for (std::size_t j = 0; j < cnt; ++j) worst = std::max(worst, codes[j]);
      if ((worst >> 1) <= static_cast<u32>(levels)) continue;
      for (std::size_t j = 0; j < cnt; ++j) {
        if ((codes[j] >> 1) > static_cast<u32>(levels)) throw_bad_level(codes[j] >> 1, i + j, levels);
      }
    }
  }
  const std::size_t used = n * static_cast<std::size_t>(bits);
  if (used % 8 && (in[nbytes - 1] >> (used % 8)) != 0) {
    throw std::invalid_argument("dither_decode: nonzero padding bits");
  }
  std::vector<float> table(static_cast<std::size_t>(levels) + 1);
  for (int q = 0; q <= levels; ++q) {
    if (!natural) table[q] = static_cast<float>(static_cast<double>(norm) * q / levels);
    else table[q] = q == 0 ? norm * 0.0f : std::ldexp(norm, q - levels);
  }
  std::size_t i = 0;
#if defined(BPS_X86_KERNELS)
  if (avx512) i = dither_decode_avx512(in, nbytes, n, bits, levels, table.data(), out, add);
#endif
  for (; i < n; i += kDitherChunk) {
    const std::size_t cnt = std::min(kDitherChunk, n - i);
    unpack_codes(in, nbytes, i, cnt, bits, codes);
    if (add) {
      for (std::size_t j = 0; j < cnt; ++j) {
        const float v = bits_f32(f32_bits(table[codes[j] >> 1]) ^ (codes[j] << 31));
        store_f32(out, i + j, load_f32(out, i + j) + v);
      }
    } else {
      for (std::size_t j = 0; j < cnt; ++j) {
        store_f32(out, i + j, bits_f32(f32_bits(table[codes[j] >> 1]) ^ (codes[j] << 31)));
      }
    }
  }
}

}  // namespace compress
}  // namespace bps
