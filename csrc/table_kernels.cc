// Kernels of an embedding table's shard (table_kernels.h). Every float operation is the one
// numpy's reference does, in its order: a float32 product or sum is rounded before the next
// operation, never fused. FMA contraction is turned off for this file below (GCC contracts
// across statements by default where the target has FMA, aarch64 for one); no -ffast-math.
#include "table_kernels.h"

#include "parallel.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <utility>

#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace bps {
namespace table {
namespace {

constexpr std::uint64_t kGolden = 0x9E3779B97F4A7C15ULL;
constexpr double kTwo24 = 1.0 / 16777216.0;  // 2^-24
constexpr double kTwoPi = 2.0 * 3.141592653589793;  // numpy: 2.0 * np.pi, then * u2

inline std::uint64_t splitmix(std::uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ULL;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBULL;
  x ^= x >> 31;
  return x;
}

// One row's initial values: hash of (row * dim + column) * golden + base, as the reference.
void init_row(const InitSpec& spec, std::uint64_t base, std::int64_t id, float* out) {
  const std::uint64_t dim = static_cast<std::uint64_t>(spec.dim);
  const std::uint64_t first = static_cast<std::uint64_t>(id) * dim;
  if (spec.kind == Init::kUniform) {
    const double lo = spec.a, span = spec.b - spec.a;
    for (std::uint64_t j = 0; j < dim; ++j) {
      const std::uint64_t x = splitmix((first + j) * kGolden + base);
      const double hi = static_cast<double>(x >> 40);
      out[j] = static_cast<float>(lo + span * (hi * kTwo24));
    }
    return;
  }
  for (std::uint64_t j = 0; j < dim; ++j) {  // normal: Box-Muller on two 24-bit uniforms
    const std::uint64_t x = splitmix((first + j) * kGolden + base);
    const double u1 = (static_cast<double>(x >> 40) + 1.0) * kTwo24;
    const double u2 = static_cast<double>((x >> 8) & 0xFFFFFFULL) * kTwo24;
    const double z = std::sqrt(-2.0 * std::log(u1)) * std::cos(kTwoPi * u2);
    out[j] = static_cast<float>(spec.a + spec.b * z);
  }
}

std::uint64_t init_base(const InitSpec& spec) {
  return spec.seed * kGolden + 0x632BE59BD9B4E019ULL;  // wraps, as the reference's & (2^64-1)
}

// Local row r: initial weights and fresh optimizer state.
void make_row(Shard& s, std::uint64_t base, std::int64_t r) {
  const std::int64_t d = s.dim;
  float* w = s.w + r * d;
  if (s.init.kind == Init::kZeros) {
    std::fill(w, w + d, 0.0f);
  } else {
    init_row(s.init, base, r * s.shards + s.shard, w);
  }
  if (s.acc) std::fill(s.acc + r * d, s.acc + (r + 1) * d, s.opt.acc0);
  if (s.m) std::fill(s.m + r * d, s.m + (r + 1) * d, 0.0f);
  if (s.v) std::fill(s.v + r * d, s.v + (r + 1) * d, 0.0f);
  if (s.t) s.t[r] = 0;
  s.made[r] = 1;
}

void sgd_row(const OptSpec& o, std::int64_t d, float* w, const float* g) {
  for (std::int64_t j = 0; j < d; ++j) {
    const float step = o.lr * g[j];
    w[j] = w[j] - step;
  }
}

void adagrad_row(const OptSpec& o, std::int64_t d, float* w, float* acc, const float* g) {
  for (std::int64_t j = 0; j < d; ++j) {
    const float sq = g[j] * g[j];
    const float a = acc[j] + sq;
    acc[j] = a;
    const float num = o.lr * g[j];
    const float den = std::sqrt(a) + o.eps;
    const float step = num / den;
    w[j] = w[j] - step;
  }
}

// Adam on one row, t its new step count: m = b1 m + c1 g; v = b2 v + (c2 g) g;
// w -= (lr (m / bc1)) / (sqrt(v / bc2) + eps), bc = float32(1 - beta^t) in float64.
void adam_row(const OptSpec& o, std::int64_t d, std::int32_t t, float* w, float* m, float* v,
              const float* g) {
  const double tt = static_cast<double>(t);
  const float bc1 = static_cast<float>(1.0 - std::pow(o.beta1, tt));
  const float bc2 = static_cast<float>(1.0 - std::pow(o.beta2, tt));
  for (std::int64_t j = 0; j < d; ++j) {
    const float m1 = o.b1 * m[j], m2 = o.c1 * g[j];
    const float mn = m1 + m2;
    const float v1 = o.b2 * v[j], v2 = (o.c2 * g[j]) * g[j];
    const float vn = v1 + v2;
    m[j] = mn;
    v[j] = vn;
    const float num = o.lr * (mn / bc1);
    const float den = std::sqrt(vn / bc2) + o.eps;
    const float step = num / den;
    w[j] = w[j] - step;
  }
}

}  // namespace

void initial_rows(const InitSpec& spec, const std::int64_t* ids, std::int64_t n, float* out) {
  if (spec.kind == Init::kZeros) {
    std::fill(out, out + n * spec.dim, 0.0f);
    return;
  }
  const std::uint64_t base = init_base(spec);
  for (std::int64_t i = 0; i < n; ++i) init_row(spec, base, ids[i], out + i * spec.dim);
}

std::int64_t to_local(const Shard& s, const std::int64_t* ids, std::int64_t n,
                      std::int64_t* local) {
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t id = ids[i];
    if (id < 0) return i;
    const std::int64_t r = s.shards > 1 ? id / s.shards : id;
    if ((s.shards > 1 && id % s.shards != s.shard) || r >= s.nrows) return i;
    local[i] = r;
  }
  return n;
}

void make_rows(Shard& s, const std::int64_t* local, std::int64_t n) {
  std::vector<std::int64_t> fresh;  // each row never made once (a pull may repeat one)
  for (std::int64_t i = 0; i < n; ++i) {
    if (!s.made[local[i]]) {
      s.made[local[i]] = 1;
      fresh.push_back(local[i]);
    }
  }
  if (fresh.empty()) return;
  const std::uint64_t base = init_base(s.init);
  // a value of the normal initializer costs about as much as summing 256 bytes, a uniform one
  // 32: what parallel_for weighs against its threads' cost
  const std::size_t weight = s.init.kind == Init::kNormal    ? 256
                             : s.init.kind == Init::kUniform ? 32
                                                             : 4;
  parallel_for(fresh.size(), static_cast<std::size_t>(s.dim) * weight, s.threads,
               [&](std::size_t begin, std::size_t end) {
                 for (std::size_t k = begin; k < end; ++k) make_row(s, base, fresh[k]);
               });
}

void gather(Shard& s, const std::int64_t* local, std::int64_t n, float* out) {
  make_rows(s, local, n);
  const std::int64_t d = s.dim;
  for (std::int64_t i = 0; i < n; ++i) {
    std::memcpy(out + i * d, s.w + local[i] * d, static_cast<std::size_t>(d) * sizeof(float));
  }
}

void apply(Shard& s, const std::int64_t* local, std::int64_t n, const float* grad) {
  make_rows(s, local, n);
  const std::int64_t d = s.dim;
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t r = local[i];
    s.changed[r] = 1;
    float* w = s.w + r * d;
    const float* g = grad + i * d;
    switch (s.opt.kind) {
      case Opt::kSgd:
        sgd_row(s.opt, d, w, g);
        break;
      case Opt::kAdagrad:
        adagrad_row(s.opt, d, w, s.acc + r * d, g);
        break;
      case Opt::kAdam: {
        // int32 as numpy's: wraps (in unsigned arithmetic, where wrapping is defined)
        const auto t = static_cast<std::int32_t>(static_cast<std::uint32_t>(s.t[r]) + 1u);
        s.t[r] = t;
        adam_row(s.opt, d, t, w, s.m + r * d, s.v + r * d, g);
        break;
      }
    }
  }
}

void split_by_shard(const std::int64_t* ids, std::int64_t n, std::int64_t shards,
                    std::int64_t* order, std::int64_t* counts) {
  std::fill(counts, counts + shards, 0);
  for (std::int64_t i = 0; i < n; ++i) ++counts[ids[i] % shards];
  std::vector<std::int64_t> at(static_cast<std::size_t>(shards), 0);
  for (std::int64_t s = 1; s < shards; ++s) at[s] = at[s - 1] + counts[s - 1];
  for (std::int64_t i = 0; i < n; ++i) order[at[ids[i] % shards]++] = i;
}

void push_records(const std::int64_t* ids, const float* grads, std::int64_t dim,
                  const std::int64_t* order, std::int64_t n, std::uint8_t* out) {
  auto* out_ids = reinterpret_cast<std::int64_t*>(out);  // (the caller's buffer is aligned)
  float* out_rows = reinterpret_cast<float*>(out + n * 8);
  const std::size_t row = static_cast<std::size_t>(dim) * sizeof(float);
  for (std::int64_t i = 0; i < n; ++i) {
    out_ids[i] = ids[order[i]];
    std::memcpy(out_rows + i * dim, grads + order[i] * dim, row);
  }
}

void RoundIndex::build(const std::vector<const std::int64_t*>& ids,
                       const std::vector<std::int64_t>& len) {
  len_ = len;
  const std::int64_t total = std::accumulate(len.begin(), len.end(), std::int64_t{0});
  std::vector<std::pair<std::int64_t, std::int64_t>> order;  // (id, position in push order)
  order.reserve(static_cast<std::size_t>(total));
  std::int64_t pos = 0;
  for (std::size_t p = 0; p < ids.size(); ++p) {
    for (std::int64_t i = 0; i < len[p]; ++i) order.emplace_back(ids[p][i], pos++);
  }
  std::sort(order.begin(), order.end());
  uniq_.clear();
  inv_.assign(static_cast<std::size_t>(total), 0);
  for (const auto& [id, where] : order) {
    if (uniq_.empty() || uniq_.back() != id) uniq_.push_back(id);
    inv_[static_cast<std::size_t>(where)] = static_cast<std::int64_t>(uniq_.size()) - 1;
  }
}

void RoundIndex::sum(const std::vector<const float*>& grads, std::int64_t dim,
                     std::int64_t* uniq, float* sums) const {
  std::copy(uniq_.begin(), uniq_.end(), uniq);
  std::fill(sums, sums + unique() * dim, 0.0f);
  std::size_t pos = 0;
  for (std::size_t p = 0; p < grads.size(); ++p) {  // push order, then each push's row order
    const float* g = grads[p];
    for (std::int64_t i = 0; i < len_[p]; ++i, g += dim) {
      float* row = sums + inv_[pos++] * dim;
      for (std::int64_t j = 0; j < dim; ++j) row[j] = row[j] + g[j];
    }
  }
}

bool has_repeats(const std::int64_t* ids, std::int64_t n) {
  bool sorted = true;
  for (std::int64_t i = 1; i < n && sorted; ++i) sorted = ids[i - 1] < ids[i];
  if (sorted) return false;
  std::vector<std::int64_t> copy(ids, ids + n);
  std::sort(copy.begin(), copy.end());
  return std::adjacent_find(copy.begin(), copy.end()) != copy.end();
}

}  // namespace table
}  // namespace bps
