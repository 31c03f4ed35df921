// Exact top-k selection (compress.h: topk_select, topk_ef_encode). The keys are the float bits
// without the sign (so NaN ranks above inf); ties at the k-th key go to the lower indices;
// output in increasing index order.
//
// How: a threshold `lo` below the k-th largest key is guessed from a sample, one streaming pass
// (fused with error feedback's y = x + r) collects the indices whose key is >= lo, and the
// exact k-th key is found among those candidates alone. The guess only decides the speed: when
// it leaves fewer than k candidates or more than a bound, a histogram of the top 11 key bits
// over all n gives a lo that is right by construction (the path of every input, before). The
// set and order are the same either way: every entry of key >= the k-th key is a candidate.
// A guess of 0 (mostly zeros: a server's sum of sparse pushes) collects the nonzero keys; when
// fewer than k, the lowest-index zeros fill up (emit_with_zeros).
#include "compress.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "compress_internal.h"  // with cpu.h and, on x86, immintrin.h

namespace bps {
namespace compress {
using namespace detail;  // NOLINT(build/namespaces): compress_internal.h's helpers
namespace {

constexpr u32 kKeyMask = 0x7fffffffu;
constexpr std::size_t kSample = 8192;      // sample size of the threshold guess
constexpr std::size_t kRun = 8;            // taken in runs of neighbours
constexpr std::size_t kMinSampled = 65536;  // below this n, the histogram path alone
constexpr std::size_t kNone = ~std::size_t{0};

inline u32 key_at(const float* y, std::size_t i) { return load_u32(y, i) & kKeyMask; }

// The candidates: their indices (increasing) and the bits of y there, so the selection reads
// y no more (each would be a cache miss: the candidates are spread over all of y).
struct Cands {
  std::vector<u32> idx, bits;
  void resize(std::size_t c) {
    idx.resize(c);
    bits.resize(c);
  }
};

// Entries i (increasing) with key(y[i]) >= lo into c.idx/c.bits from position `at`, at most cap
// in all; returns their count, or kNone once more than cap qualify. With kAdd, y = x + r is
// formed in r first (element by element, all n of them even past cap); else y is x. Scalar.
template <bool kAdd>
std::size_t collect_scalar(const float* x, float* r, std::size_t n, std::size_t from, u32 lo,
                           Cands* c, std::size_t at, std::size_t cap) {
  std::size_t o = at;
  for (std::size_t i = from; i < n; ++i) {
    float y = load_f32(x, i);
    if (kAdd) {
      y = y + load_f32(r, i);
      store_f32(r, i, y);
    }
    if ((f32_bits(y) & kKeyMask) >= lo && o != kNone) {
      if (o == cap) {
        o = kNone;
        if (!kAdd) return kNone;
      } else {
        c->idx[o] = static_cast<u32>(i);
        c->bits[o++] = f32_bits(y);
      }
    }
  }
  return o;
}

#if defined(BPS_X86_KERNELS)
// collect_scalar, 32 elements a step: a key compare per lane, and the rare hits from the mask.
template <bool kAdd>
__attribute__((target("avx2"))) std::size_t collect_avx2(const float* x, float* r,
                                                         std::size_t n, u32 lo, Cands* c,
                                                         std::size_t cap) {
  const __m256i mask = _mm256_set1_epi32(static_cast<int>(kKeyMask));
  const __m256i below = _mm256_set1_epi32(static_cast<int>(lo) - 1);  // keys < 2^31
  alignas(32) u32 lanes[32];
  std::size_t o = 0, i = 0;
  for (; i + 32 <= n; i += 32) {
    __m256 y[4];
    u32 hits = 0;
    for (int v = 0; v < 4; ++v) {
      y[v] = _mm256_loadu_ps(x + i + 8 * v);
      if (kAdd) {
        y[v] = _mm256_add_ps(y[v], _mm256_loadu_ps(r + i + 8 * v));
        _mm256_storeu_ps(r + i + 8 * v, y[v]);
      }
      const __m256i key = _mm256_and_si256(_mm256_castps_si256(y[v]), mask);
      const __m256i ge = _mm256_cmpgt_epi32(key, below);
      hits |= static_cast<u32>(_mm256_movemask_ps(_mm256_castsi256_ps(ge))) << (8 * v);
    }
    if (!hits || o == kNone) continue;
    for (int v = 0; v < 4; ++v) _mm256_store_ps(reinterpret_cast<float*>(lanes) + 8 * v, y[v]);
    for (; hits; hits &= hits - 1) {
      if (o == cap) {
        o = kNone;
        if (!kAdd) return kNone;
        break;
      }
      const int lane = __builtin_ctz(hits);
      c->idx[o] = static_cast<u32>(i + lane);
      c->bits[o++] = lanes[lane];
    }
  }
  if (o == kNone) {
    for (; i < n; ++i) if (kAdd) store_f32(r, i, load_f32(x, i) + load_f32(r, i));
    return kNone;
  }
  return collect_scalar<kAdd>(x, r, n, i, lo, c, o, cap);
}
#endif

template <bool kAdd>
std::size_t collect(const float* x, float* r, std::size_t n, u32 lo, Cands* c,
                    std::size_t cap) {
#if defined(BPS_X86_KERNELS)
  if (active_isa() >= Isa::kAvx2) return collect_avx2<kAdd>(x, r, n, lo, c, cap);
#endif
  return collect_scalar<kAdd>(x, r, n, 0, lo, c, 0, cap);
}

// A guess of lo from kSample keys in runs at jittered strided positions (y = x + r there when
// r), meant to leave about k + 3 sigma candidates, and the bound on them past which the guess
// is given up (*cap). False when there is no useful guess (small n, k a large share of n).
bool sample_threshold(const float* x, const float* r, std::size_t n, std::size_t k, u32* lo,
                      std::size_t* cap) {
  if (n < kMinSampled) return false;
  const double expect = static_cast<double>(k) * kSample / static_cast<double>(n);
  const std::size_t rank = static_cast<std::size_t>(std::ceil(expect + 3.0 * std::sqrt(expect)
                                                              + 4.0));
  if (rank > kSample / 8) return false;
  // runs of kRun neighbours at jittered places: a miss brings in a run, not one key
  const std::size_t runs = kSample / kRun, stride = n / runs;
  std::vector<u32> keys(kSample);
  for (std::size_t j = 0; j < runs; ++j) {
    const std::size_t at = j * stride + mix64(j) % (stride - kRun + 1);
    for (std::size_t q = 0; q < kRun; ++q) {
      const std::size_t i = at + q;
      const float y = r ? load_f32(x, i) + load_f32(r, i) : load_f32(x, i);
      keys[j * kRun + q] = f32_bits(y) & kKeyMask;
    }
  }
  std::nth_element(keys.begin(), keys.begin() + static_cast<std::ptrdiff_t>(rank - 1),
                   keys.end(), [](u32 a, u32 b) { return a > b; });
  *lo = keys[rank - 1];
  *cap = std::min(n, 2 * (rank * (n / kSample)) + 4096);
  if (*lo == 0) *lo = 1;  // mostly zeros (a sum of sparse pushes): the nonzero keys, then zeros
  return true;
}

// The exact lo from a histogram of the top 11 key bits: the lower bound of the bucket that
// holds the k-th largest key; *count is how many keys are >= it.
u32 histogram_threshold(const float* y, std::size_t n, std::size_t k, std::size_t* count) {
  constexpr int kShift = 20;
  std::vector<u32> hist(4u << (31 - kShift), 0);  // four interleaved copies: fewer stalls
  u32* h = hist.data();
  const std::size_t buckets = 1u << (31 - kShift);
  std::size_t i = 0;
  for (; i + 4 <= n; i += 4)
    for (std::size_t q = 0; q < 4; ++q) ++h[q * buckets + (key_at(y, i + q) >> kShift)];
  for (; i < n; ++i) ++h[key_at(y, i) >> kShift];
  std::size_t bucket = buckets, above = 0;
  while (bucket > 0) {
    --bucket;
    const std::size_t here = static_cast<std::size_t>(h[bucket]) + h[buckets + bucket] +
                             h[2 * buckets + bucket] + h[3 * buckets + bucket];
    if (above + here >= k) {
      *count = above + here;
      break;
    }
    above += here;
  }
  return static_cast<u32>(bucket) << kShift;
}

// Error feedback's residual at the k chosen entries (y is r): y - decode(payload) there is
// y[i] - y[i], 0 (NaN for inf and NaN), as the subtraction of the three steps apart gives.
void settle(const void* idx, const void* val, std::size_t k, float* r) {
  for (std::size_t j = 0; j < k; ++j) {
    const float v = load_f32(val, j);
    store_f32(r, load_u32(idx, j), v - v);
  }
}

// The k-th largest key among the c > k candidates, and how many keys are above it (*greater):
// a histogram of (key - min) >> shift in 2048 buckets over the candidates, then nth_element
// within the bucket that holds it.
u32 kth_key(const Cands& cand, std::size_t c, std::size_t k, std::size_t* greater) {
  u32 lo = kKeyMask, hi = 0;
  for (std::size_t j = 0; j < c; ++j) {
    const u32 key = cand.bits[j] & kKeyMask;
    lo = std::min(lo, key);
    hi = std::max(hi, key);
  }
  constexpr std::size_t kBuckets = 2048;
  int shift = 0;
  while (((hi - lo) >> shift) >= kBuckets) ++shift;
  std::vector<u32> hist(kBuckets, 0);
  for (std::size_t j = 0; j < c; ++j) ++hist[((cand.bits[j] & kKeyMask) - lo) >> shift];
  std::size_t bucket = kBuckets, above = 0;
  while (bucket > 0 && above + hist[bucket - 1] < k) above += hist[--bucket];
  --bucket;  // holds the k-th: above < k <= above + hist[bucket]
  std::vector<u32> in;
  in.reserve(hist[bucket]);
  for (std::size_t j = 0; j < c; ++j) {
    const u32 key = cand.bits[j] & kKeyMask;
    if (((key - lo) >> shift) == bucket) in.push_back(key);
  }
  const std::size_t need = k - above;
  std::nth_element(in.begin(), in.begin() + static_cast<std::ptrdiff_t>(need - 1), in.end(),
                   [](u32 a, u32 b) { return a > b; });
  const u32 t = in[need - 1];
  *greater = above;
  for (std::size_t j = 0; j < need; ++j) *greater += in[j] > t;  // in[need..) are <= t
  return t;
}

// From the c candidates (every entry of key >= the k-th largest among them, c >= k): the k of
// largest key, ties to the lower index, written in index order; with r (error feedback, y is
// r), r[i] = y[i] - val there, as the residual's subtraction does.
void emit(const Cands& cand, std::size_t c, std::size_t k, void* idx, void* val, float* r) {
  u32 t = 0;
  std::size_t ties = 0, o = 0;
  if (c > k) {
    std::size_t greater = 0;
    t = kth_key(cand, c, k, &greater);
    ties = k - greater;
  }
  for (std::size_t j = 0; j < c && o < k; ++j) {  // branch-free: most candidates are taken
    const u32 key = cand.bits[j] & kKeyMask;
    const bool tie = key == t && ties > 0;
    const bool take = c == k || key > t || tie;
    ties -= tie;
    store_u32(idx, o, cand.idx[j]);
    store_u32(val, o, cand.bits[j]);
    o += take;
  }
  if (r) settle(idx, val, k, r);
}

// When fewer than k keys are nonzero, the c < k candidates hold all of them: those, and the
// k - c lowest-index entries of key 0 (+-0.0) of y, in index order.
void emit_with_zeros(const float* y, const Cands& cand, std::size_t c, std::size_t k, void* idx,
                     void* val, float* r) {
  std::size_t zeros = k - c, j = 0, o = 0;
  for (std::size_t i = 0; o < k; ++i) {
    u32 bits;
    if (j < c && cand.idx[j] == i) {
      bits = cand.bits[j++];
    } else if (zeros > 0) {
      bits = load_u32(y, i);
      --zeros;
    } else {
      for (; j < c; ++j, ++o) {  // no zero more: the candidates left
        store_u32(idx, o, cand.idx[j]);
        store_u32(val, o, cand.bits[j]);
      }
      break;
    }
    store_u32(idx, o, static_cast<u32>(i));
    store_u32(val, o, bits);
    ++o;
  }
  if (r) settle(idx, val, k, r);
}

// topk_select (kAdd false: y is x) or topk_ef_encode's select (kAdd: y = x + r formed in r),
// 0 < k < n.
template <bool kAdd>
void select(const float* x, float* r, std::size_t n, std::size_t k, void* idx, void* val) {
  const float* y = kAdd ? r : x;
  u32 lo = 0;
  std::size_t cap = 0, c = kNone;
  Cands cand;
  if (sample_threshold(x, kAdd ? r : nullptr, n, k, &lo, &cap)) {
    cand.resize(cap);
    c = collect<kAdd>(x, r, n, lo, &cand, cap);
    if (c != kNone && c < k && lo == 1) {  // every nonzero key is a candidate
      emit_with_zeros(y, cand, c, k, idx, val, kAdd ? r : nullptr);
      return;
    }
    if (c != kNone && c < k) c = kNone;  // the guess was above the k-th key
  } else if (kAdd) {
    for (std::size_t i = 0; i < n; ++i) store_f32(r, i, load_f32(x, i) + load_f32(r, i));
  }
  if (c == kNone) {  // y is whole by now
    lo = histogram_threshold(y, n, k, &c);
    cand.resize(c);
    collect<false>(y, nullptr, n, lo, &cand, c);
  }
  emit(cand, c, k, idx, val, kAdd ? r : nullptr);
}

void check_k(std::size_t n, std::size_t k, const char* func) {
  check_n(n, func);
  if (k > n) {
    throw std::invalid_argument(std::string(func) + ": k = " + std::to_string(k) +
                                " exceeds n = " + std::to_string(n));
  }
}

}  // namespace

void topk_select(const float* x, std::size_t n, std::size_t k, void* idx, void* val) {
  check_k(n, k, "topk_select");
  if (k == 0) return;
  if (k == n) {
    for (std::size_t i = 0; i < n; ++i) {
      store_u32(idx, i, static_cast<u32>(i));
      store_f32(val, i, load_f32(x, i));
    }
    return;
  }
  select<false>(x, nullptr, n, k, idx, val);
}

void topk_ef_encode(const float* x, float* r, std::size_t n, std::size_t k, void* idx,
                    void* val) {
  check_k(n, k, "topk_ef_encode");
  if (k == 0 || k == n) {
    for (std::size_t i = 0; i < n; ++i) store_f32(r, i, load_f32(x, i) + load_f32(r, i));
    for (std::size_t i = 0; i < k; ++i) {
      const float v = load_f32(r, i);
      store_u32(idx, i, static_cast<u32>(i));
      store_f32(val, i, v);
      store_f32(r, i, v - v);
    }
    return;
  }
  select<true>(x, r, n, k, idx, val);
}

}  // namespace compress
}  // namespace bps
