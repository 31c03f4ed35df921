#include "compress.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu.h"

#if defined(BPS_X86_KERNELS)
#include <immintrin.h>
#endif

namespace bps {
namespace compress {
namespace {

using u8 = std::uint8_t;
using u32 = std::uint32_t;
using u64 = std::uint64_t;

constexpr u64 kGolden = 0x9E3779B97F4A7C15ULL;

inline u32 load_u32(const void* p, std::size_t i) {
  u32 v;
  std::memcpy(&v, static_cast<const u8*>(p) + 4 * i, 4);
  return v;
}
inline void store_u32(void* p, std::size_t i, u32 v) {
  std::memcpy(static_cast<u8*>(p) + 4 * i, &v, 4);
}
inline float load_f32(const void* p, std::size_t i) {
  float v;
  std::memcpy(&v, static_cast<const u8*>(p) + 4 * i, 4);
  return v;
}
inline void store_f32(void* p, std::size_t i, float v) {
  std::memcpy(static_cast<u8*>(p) + 4 * i, &v, 4);
}
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

inline u64 rotl(u64 x, int k) { return (x << k) | (x >> (64 - k)); }

// xoshiro256** (Blackman & Vigna), state from four splitmix64 outputs.
struct Xoshiro {
  u64 s[4];
  explicit Xoshiro(u64 seed) {
    for (u64& w : s) {
      seed += kGolden;
      w = mix64(seed);
    }
  }
  u64 next() {
    const u64 result = rotl(s[1] * 5, 7) * 9;
    const u64 t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
  }
  // Uniform in [0, range), 0 < range <= 2^32: Lemire's multiply-shift with rejection, drawing
  // the high 32 bits of next() each time.
  u32 below(u64 range) {
    u64 m = (next() >> 32) * range;
    u32 low = static_cast<u32>(m);
    if (low < range) {
      const u32 threshold = static_cast<u32>((0x100000000ULL - range) % range);
      while (low < threshold) {
        m = (next() >> 32) * range;
        low = static_cast<u32>(m);
      }
    }
    return static_cast<u32>(m >> 32);
  }
};

void check_n(std::size_t n, const char* func) {
  if (n > 0xFFFFFFFFULL) {
    throw std::invalid_argument(std::string(func) + ": n = " + std::to_string(n) +
                                " exceeds 2^32 - 1 elements");
  }
}

void check_levels(int levels, bool natural, const char* func) {
  const int hi = natural ? 127 : 65535;
  if (levels < 1 || levels > hi) {
    throw std::invalid_argument(std::string(func) + ": levels must be in [1, " +
                                std::to_string(hi) + "] for " +
                                (natural ? "natural" : "linear") + " dithering, got " +
                                std::to_string(levels));
  }
}

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

// out[i] = scale with the sign bit flipped where the bit is set, 8 at a time.
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
    _mm256_storeu_ps(o, add ? _mm256_add_ps(_mm256_loadu_ps(o), v) : v);
  }
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

// ---- dithering helpers ----------------------------------------------------------------
inline float uniform24(u64 base, std::size_t i) {
  return static_cast<float>(mix64(base + (static_cast<u64>(i) + 1) * kGolden) >> 40) *
         (1.0f / 16777216.0f);
}

}  // namespace

u64 mix64(u64 z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

u64 stream_base(u64 seed, u64 key, u64 step, u64 domain) {
  u64 h = mix64(seed + kGolden);
  h = mix64(h ^ (key + 2 * kGolden));
  h = mix64(h ^ (step + 3 * kGolden));
  return mix64(h ^ (domain * kGolden));
}

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

void onebit_decode(const u8* bits, std::size_t n, float scale, float* out, bool add) {
#if defined(BPS_X86_KERNELS)
  if (use_avx2()) {
    onebit_unpack_avx2(bits, n, scale, out, add);
    return;
  }
#endif
  const u32 sb = f32_bits(scale);
  for (std::size_t i = 0; i < n; ++i) {
    const float v = bits_f32(sb ^ (static_cast<u32>((bits[i / 8] >> (i % 8)) & 1) << 31));
    store_f32(out, i, add ? load_f32(out, i) + v : v);
  }
}

// ---- sparse -------------------------------------------------------------------------------
void topk_select(const float* x, std::size_t n, std::size_t k, void* idx, void* val) {
  check_n(n, "topk_select");
  if (k > n) {
    throw std::invalid_argument("topk_select: k = " + std::to_string(k) + " exceeds n = " +
                                std::to_string(n));
  }
  if (k == 0) return;
  if (k == n) {
    for (std::size_t i = 0; i < n; ++i) {
      store_u32(idx, i, static_cast<u32>(i));
      store_f32(val, i, load_f32(x, i));
    }
    return;
  }
  // Radix select on the magnitude bits: a histogram of the top 11 bits finds the bucket that
  // holds the k-th largest key; only that bucket's entries need an nth_element.
  constexpr int kShift = 20;
  std::vector<std::size_t> hist(1u << (31 - kShift), 0);
  for (std::size_t i = 0; i < n; ++i) ++hist[(load_u32(x, i) & 0x7fffffffu) >> kShift];
  std::size_t bucket = hist.size(), above = 0;
  while (bucket > 0) {
    --bucket;
    if (above + hist[bucket] >= k) break;
    above += hist[bucket];
  }
  const std::size_t need = k - above;
  std::vector<u32> hi;
  hi.reserve(above);
  std::vector<u32> cand_idx;
  cand_idx.reserve(hist[bucket]);
  for (std::size_t i = 0; i < n; ++i) {
    const u32 b = (load_u32(x, i) & 0x7fffffffu) >> kShift;
    if (b > bucket) hi.push_back(static_cast<u32>(i));
    else if (b == bucket) cand_idx.push_back(static_cast<u32>(i));
  }
  std::vector<u32> chosen;
  if (need == cand_idx.size()) {
    chosen.swap(cand_idx);
  } else {
    std::vector<u32> keys(cand_idx.size());
    for (std::size_t j = 0; j < cand_idx.size(); ++j) keys[j] = load_u32(x, cand_idx[j]) & 0x7fffffffu;
    std::vector<u32> sorted = keys;
    std::nth_element(sorted.begin(), sorted.begin() + (need - 1), sorted.end(),
                     [](u32 a, u32 b) { return a > b; });
    const u32 t = sorted[need - 1];
    std::size_t greater = 0;
    for (u32 key : keys) greater += key > t;
    std::size_t ties = need - greater;
    chosen.reserve(need);
    for (std::size_t j = 0; j < cand_idx.size(); ++j) {
      if (keys[j] > t || (keys[j] == t && ties > 0 && ties--)) chosen.push_back(cand_idx[j]);
    }
  }
  // Merge the two increasing lists straight into the output.
  std::size_t a = 0, c = 0, o = 0;
  while (a < hi.size() || c < chosen.size()) {
    const u32 i = (c == chosen.size() || (a < hi.size() && hi[a] < chosen[c])) ? hi[a++]
                                                                             : chosen[c++];
    store_u32(idx, o, i);
    store_f32(val, o, load_f32(x, i));
    ++o;
  }
}

namespace {
void check_indices(const void* idx, std::size_t k, std::size_t n, const char* func) {
  u32 worst = 0;
  for (std::size_t j = 0; j < k; ++j) worst = std::max(worst, load_u32(idx, j));
  if (k > 0 && worst >= n) {
    std::size_t j = 0;
    while (load_u32(idx, j) < n) ++j;
    throw std::out_of_range(std::string(func) + ": index " + std::to_string(load_u32(idx, j)) +
                            " at position " + std::to_string(j) + " is out of range for " +
                            std::to_string(n) + " elements");
  }
}
}  // namespace

void gather(const float* x, std::size_t n, const void* idx, std::size_t k, void* val) {
  check_indices(idx, k, n, "gather");
  for (std::size_t j = 0; j < k; ++j) store_f32(val, j, load_f32(x, load_u32(idx, j)));
}

void scatter(const void* idx, const void* val, std::size_t k, float* out, std::size_t n,
             bool add) {
  check_indices(idx, k, n, "scatter");
  if (add) {
    for (std::size_t j = 0; j < k; ++j) {
      const u32 i = load_u32(idx, j);
      store_f32(out, i, load_f32(out, i) + load_f32(val, j));
    }
  } else {
    std::memset(static_cast<void*>(out), 0, n * sizeof(float));
    for (std::size_t j = 0; j < k; ++j) store_f32(out, load_u32(idx, j), load_f32(val, j));
  }
}

void randomk_indices(std::size_t n, std::size_t k, u64 seed, u64 key, u64 step, void* idx) {
  check_n(n, "randomk_indices");
  if (k > n) {
    throw std::invalid_argument("randomk_indices: k = " + std::to_string(k) + " exceeds n = " +
                                std::to_string(n));
  }
  const bool complement = k > n / 2;
  const std::size_t m = complement ? n - k : k;
  std::vector<u64> bitmap((n + 63) / 64, 0);
  Xoshiro rng(stream_base(seed, key, step, kDomainRandomK));
  // Floyd: for j = n-m .. n-1 draw t in [0, j]; take t unless taken already, else take j.
  for (std::size_t j = n - m; j < n; ++j) {
    const u32 t = rng.below(static_cast<u64>(j) + 1);
    u64& w = bitmap[t >> 6];
    const u64 bit = 1ULL << (t & 63);
    if (w & bit) bitmap[j >> 6] |= 1ULL << (j & 63);
    else w |= bit;
  }
  std::size_t o = 0;
  for (std::size_t w = 0; w < bitmap.size(); ++w) {
    u64 word = complement ? ~bitmap[w] : bitmap[w];
    if (w == bitmap.size() - 1 && n % 64) word &= (1ULL << (n % 64)) - 1;
    while (word) {
      store_u32(idx, o++, static_cast<u32>(w * 64 + __builtin_ctzll(word)));
      word &= word - 1;
    }
  }
}

// ---- dithering --------------------------------------------------------------------------
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
  float norm;
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
    norm = static_cast<float>(std::sqrt((acc[0] + acc[1]) + (acc[2] + acc[3])));
  } else {
    u32 worst = 0;  // NaN magnitudes rank above inf, so a NaN input gives a NaN norm
    for (std::size_t i = 0; i < n; ++i) worst = std::max(worst, load_u32(x, i) & 0x7fffffffu);
    norm = bits_f32(worst);
  }
  std::memset(out, 0, nbytes);
  if (!(norm > 0.0f) || !std::isfinite(norm)) return norm;
  const int bits = dither_bits(levels);
  const u64 base = stream_base(seed, key, step, kDomainDither);
  const float s = static_cast<float>(levels);
  u64 acc = 0;
  int nacc = 0;
  std::size_t o = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const u32 xb = load_u32(x, i);
    const float a = std::min(bits_f32(xb & 0x7fffffffu) / norm, 1.0f);
    const float u = uniform24(base, i);
    u32 q;
    if (!natural) {
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
    const u64 code = q ? (static_cast<u64>(q) << 1) | (xb >> 31) : 0;
    acc |= code << nacc;
    nacc += bits;
    if (nacc >= 32) {
      const u32 word = static_cast<u32>(acc);
      std::memcpy(out + o, &word, 4);
      o += 4;
      acc >>= 32;
      nacc -= 32;
    }
  }
  while (nacc > 0) {
    out[o++] = static_cast<u8>(acc);
    acc >>= 8;
    nacc -= 8;
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
  const u32 mask = (1u << bits) - 1;
  auto code_at = [&](std::size_t i) -> u32 {
    const std::size_t bit = i * static_cast<std::size_t>(bits);
    const std::size_t byte = bit / 8;
    u32 w = 0;
    if (byte + 4 <= nbytes) std::memcpy(&w, in + byte, 4);
    else for (std::size_t j = 0; byte + j < nbytes; ++j) w |= static_cast<u32>(in[byte + j]) << (8 * j);
    return (w >> (bit % 8)) & mask;
  };
  // Validate everything first so a bad body never half-updates an accumulator.
  for (std::size_t i = 0; i < n; ++i) {
    const u32 q = code_at(i) >> 1;
    if (q > static_cast<u32>(levels)) {
      throw std::invalid_argument("dither_decode: level " + std::to_string(q) + " of element " +
                                  std::to_string(i) + " exceeds levels = " +
                                  std::to_string(levels));
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
  for (std::size_t i = 0; i < n; ++i) {
    const u32 c = code_at(i);
    const float v = bits_f32(f32_bits(table[c >> 1]) ^ ((c & 1u) << 31));
    store_f32(out, i, add ? load_f32(out, i) + v : v);
  }
}

}  // namespace compress
}  // namespace bps
