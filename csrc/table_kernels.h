// Kernels of a server-held embedding table's shard (byteps_like/embedding.py holds the numpy
// reference they match bit for bit): summing one round's pushes per row, making rows from their
// initial values, gathering rows for a pull and the lazy optimizer step (SGD, Adagrad, Adam).
// Plain C++ on raw arrays the caller checked (module_tables.cc); no Python, no allocation but
// the summing's index of the round's ids. Compiled without FMA contraction (table_kernels.cc).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace bps {
namespace table {

enum class Init : int { kZeros = 0, kUniform = 1, kNormal = 2 };
enum class Opt : int { kSgd = 0, kAdagrad = 1, kAdam = 2 };

// A table's initializer: uniform(a = low, b = high) or normal(a = mean, b = std), as float64.
struct InitSpec {
  Init kind = Init::kZeros;
  double a = 0.0, b = 0.0;
  std::uint64_t seed = 0;
  std::int64_t dim = 1;
};

// The initial values of global rows ids[0..n) into out (n x dim float32): a function of
// (seed, row, column) only, the same bits as embedding.initial_rows' numpy reference.
void initial_rows(const InitSpec& spec, const std::int64_t* ids, std::int64_t n, float* out);

// A table's server-side optimizer: float32 parameters as numpy holds them, and Adam's betas
// as float64 (its bias corrections 1 - beta^t are computed in float64, then rounded).
struct OptSpec {
  Opt kind = Opt::kSgd;
  float lr = 0.0f, eps = 0.0f;
  float b1 = 0.0f, b2 = 0.0f, c1 = 0.0f, c2 = 0.0f;  // beta1, beta2, 1 - beta1, 1 - beta2
  double beta1 = 0.0, beta2 = 0.0;
  float acc0 = 0.0f;  // Adagrad's initial accumulator value
};

// One shard's arrays (owned by its TableShard; checked once by the binding): nrows x dim
// weights, a made and a changed byte per row, the optimizer's state (null where unused).
struct Shard {
  float* w = nullptr;
  std::uint8_t* made = nullptr;
  std::uint8_t* changed = nullptr;
  float* acc = nullptr;
  float* m = nullptr;
  float* v = nullptr;
  std::int32_t* t = nullptr;
  std::int64_t nrows = 0, dim = 1, shard = 0, shards = 1;
  int threads = 1;  // threads that make new rows (the caller's included; parallel.h)
  InitSpec init;
  OptSpec opt;
};

// Local rows of global ids[0..n) into local; -1 and the index of the first id the shard does
// not hold (negative, of another shard, past its rows), else the number of ids.
std::int64_t to_local(const Shard& s, const std::int64_t* ids, std::int64_t n,
                      std::int64_t* local);

// Rows never made (or forgotten by a restore) get their initial values and fresh state, on up
// to s.threads threads (each row by one of them: the same bits whatever the number).
void make_rows(Shard& s, const std::int64_t* local, std::int64_t n);

// out (n x dim) = the current rows local[0..n), made first where needed.
void gather(Shard& s, const std::int64_t* local, std::int64_t n, float* out);

// One optimizer step on the unique local rows local[0..n) with their summed gradients grad
// (n x dim), made first where needed and marked changed.
void apply(Shard& s, const std::int64_t* local, std::int64_t n, const float* grad);

// Index of a round's pushes: the unique ids (ascending) and, per id in push order, its unique
// row. build() sorts; sum() adds the pushes' rows per unique id in push order.
class RoundIndex {
 public:
  // ids of every push, concatenated in list order (the caller's pointers, len total).
  void build(const std::vector<const std::int64_t*>& ids, const std::vector<std::int64_t>& len);
  std::int64_t unique() const { return static_cast<std::int64_t>(uniq_.size()); }
  // uniq (unique() ids) and sums (unique() x dim, overwritten) from the pushes' gradients.
  void sum(const std::vector<const float*>& grads, std::int64_t dim, std::int64_t* uniq,
           float* sums) const;

 private:
  std::vector<std::int64_t> uniq_;
  std::vector<std::int64_t> inv_;  // per id in push order: its index in uniq_
  std::vector<std::int64_t> len_;
};

// A worker's request split by shard (id % shards): order (n) lists the ids' positions shard by
// shard, in their order within each shard (a stable counting sort), and counts (shards) how
// many each shard has. The ids are non-negative (the caller checked them).
void split_by_shard(const std::int64_t* ids, std::int64_t n, std::int64_t shards,
                    std::int64_t* order, std::int64_t* counts);

// A push's records for one shard, in one pass: out = its ids (int64, ids[order[i]]) then their
// gradient rows (float32, grads[order[i]] of dim values), i over [0, n) (n = the shard's count).
void push_records(const std::int64_t* ids, const float* grads, std::int64_t dim,
                  const std::int64_t* order, std::int64_t n, std::uint8_t* out);

// Whether the n ids repeat one (sorted ids are checked in one pass; others are sorted first).
bool has_repeats(const std::int64_t* ids, std::int64_t n);

}  // namespace table
}  // namespace bps
