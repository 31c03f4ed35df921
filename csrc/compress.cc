// The kernels' randomness (compress.h): splitmix64's mixer and the base of one (seed, key, step)
// stream, which random-k (compress_sparse.cc) and dithering (compress_dither.cc) draw from.
// The kernels themselves: compress_onebit.cc, compress_sparse.cc, compress_dither.cc.
#include "compress.h"

#include "compress_internal.h"

namespace bps {
namespace compress {
using namespace detail;  // NOLINT(build/namespaces): compress_internal.h's helpers

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

}  // namespace compress
}  // namespace bps
