// The sparse kernels (compress.h): gather and scatter of (index, value) pairs, and random-k's
// index draw (xoshiro256** seeded from stream_base). Top-k's selection is compress_topk.cc.
#include "compress.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "compress_internal.h"

namespace bps {
namespace compress {
using namespace detail;  // NOLINT(build/namespaces): compress_internal.h's helpers
namespace {

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

}  // namespace

// ---- sparse (top-k is compress_topk.cc) ------------------------------------------------
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

}  // namespace compress
}  // namespace bps
