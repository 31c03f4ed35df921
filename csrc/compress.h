// Gradient-compression kernels: onebit, top-k, random-k, dithering (bodies of the payloads that
// byteps_like/compression.py frames with a header). Raw memory, no alignment requirement,
// little-endian wire layouts; no Python. Functions throw std::invalid_argument or
// std::out_of_range on a bad argument or a malformed wire body *before* writing anything, so a
// rejected payload never half-updates an accumulator. Documented for Python users in
// byteps_like/_core.pyi. The kernels by concern: compress_onebit.cc, compress_topk.cc,
// compress_sparse.cc (random-k, gather, scatter), compress_dither.cc; the randomness in
// compress.cc; their shared helpers in compress_internal.h.
#pragma once

#include <cstddef>
#include <cstdint>

namespace bps {
namespace compress {

// ---- randomness -------------------------------------------------------------------------
// splitmix64's output function (a bijective 64-bit mixer).
std::uint64_t mix64(std::uint64_t z);
// Base of the random stream of one (seed, key, step) in one domain (kDomainRandomK,
// kDomainDither): mix64(mix64(mix64(mix64(seed + G) ^ (key + 2G)) ^ (step + 3G)) ^ domain*G)
// with G = 0x9E3779B97F4A7C15.
constexpr std::uint64_t kDomainRandomK = 1;
constexpr std::uint64_t kDomainDither = 2;
std::uint64_t stream_base(std::uint64_t seed, std::uint64_t key, std::uint64_t step,
                          std::uint64_t domain);

// ---- onebit -----------------------------------------------------------------------------
// bits[(i/8)] bit (i%8) = sign bit of x[i] (so -0.0 and negative NaNs count as negative);
// (n+7)/8 bytes, padding bits zero. Returns mean |x| accumulated in double (NaN/inf propagate)
// when `scaling`, else 1.
float onebit_encode(const float* x, std::size_t n, std::uint8_t* bits, bool scaling);
// out[i] (+)= bit ? -scale : +scale (the sign flip is on the bit pattern, so NaN stays NaN).
// stream (without add): out is not read back soon (a worker's result), so it may be written
// with non-temporal stores; the same values.
void onebit_decode(const std::uint8_t* bits, std::size_t n, float scale, float* out, bool add,
                   bool stream = false);
// Error feedback's first pass of onebit: r = x + r (y, formed in r), packed as onebit_encode
// packs y, in one pass over x and r; returns what onebit_encode(y) returns, bit for bit (the
// same order of the double sum). With `settle`, r holds the last step's y whose residual was
// not taken yet: each r[i] is first settled as onebit_residual(r, *settle) would, in the same
// pass (so a step streams r once instead of twice, with the same bits).
float onebit_ef_encode(const float* x, float* r, std::size_t n, std::uint8_t* bits,
                       bool scaling, const float* settle = nullptr);
// Error feedback's residual of onebit in one pass: y[i] -= d[i] where d is what onebit_decode
// gives for the bits onebit_encode packed from y (scale with y[i]'s sign bit), bit for bit.
void onebit_residual(float* y, std::size_t n, float scale);

// ---- sparse (top-k, random-k) -------------------------------------------------------------
// The k entries of largest |x| (keys: the float bits without the sign, so NaN ranks above inf);
// ties go to the lower index. idx (u32, increasing) and val = x[idx]. Requires k <= n.
// Exact whatever the input; fast when a sample's guess of the threshold holds (compress_topk.cc).
void topk_select(const float* x, std::size_t n, std::size_t k, void* idx, void* val);
// Error feedback around top-k in two streaming passes: r = x + r (y, formed in r), idx/val =
// topk_select(y), then r[idx] = y[idx] - val (y - decode(payload): 0, or NaN for inf/NaN); the
// same payload and residual, bit for bit, as those three steps apart. Requires k <= n.
void topk_ef_encode(const float* x, float* r, std::size_t n, std::size_t k, void* idx,
                    void* val);
// val[j] = x[idx[j]]; throws std::out_of_range when an index is >= n.
void gather(const float* x, std::size_t n, const void* idx, std::size_t k, void* val);
// add: out[idx[j]] += val[j]; else out is zeroed and out[idx[j]] = val[j] (last write wins).
// Every index is checked (< n) first; throws std::out_of_range.
void scatter(const void* idx, const void* val, std::size_t k, float* out, std::size_t n,
             bool add);
// k distinct indices of [0, n), increasing, from (seed, key, step): Floyd's algorithm over an
// n-bit bitmap (for k > n/2 the n-k complement is drawn and the bitmap inverted), xoshiro256**
// seeded by four splitmix64 outputs from stream_base(.., kDomainRandomK), bounded draws by
// Lemire's multiply-shift with rejection (unbiased). Requires k <= n < 2^32.
void randomk_indices(std::size_t n, std::size_t k, std::uint64_t seed, std::uint64_t key,
                     std::uint64_t step, void* idx);

// ---- dithering --------------------------------------------------------------------------
// Bits per element: 1 (sign) + bit_length(levels).
int dither_bits(int levels);
std::size_t dither_bytes(std::size_t n, int levels);
// Stochastic quantisation of x / norm (norm = max |x| or the L2 norm) to levels 0..s: linear
// (q/s) or natural (0 and 2^(q-s)), rounding up with probability equal to the distance from the
// lower level (uniforms from splitmix64 counters of stream_base(.., kDomainDither)). Each
// element packs as (q << 1 | sign) in dither_bits(s) bits, LSB first. Returns norm; when it is
// zero or not finite every code is 0. linear: 1 <= s <= 65535; natural: 1 <= s <= 127.
float dither_encode(const float* x, std::size_t n, int levels, bool natural, bool l2,
                    std::uint64_t seed, std::uint64_t key, std::uint64_t step, std::uint8_t* out);
// out[i] (+)= ±table[q]: linear table[q] = float(double(norm) * q / s), natural table[0] =
// norm * 0, table[q] = ldexp(norm, q - s). nbytes must equal dither_bytes(n, s); throws
// std::invalid_argument for a level code above s or nonzero padding bits.
void dither_decode(const std::uint8_t* in, std::size_t nbytes, std::size_t n, int levels,
                   bool natural, float norm, float* out, bool add);

}  // namespace compress
}  // namespace bps
