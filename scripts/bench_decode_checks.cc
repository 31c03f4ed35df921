// Microbenchmark of the built-in codecs' decode (add), the server's per-push work: the cost of
// the checks of a peer's payload (codec.cc: finite scale / norm, finite values, distinct top-k
// indices; issue 41, item 5). Build and run from the repository root (the flags of setup.py):
//   g++ -std=c++17 -O3 -fno-math-errno -pthread -Icsrc scripts/bench_decode_checks.cc \
//       csrc/codec.cc csrc/compress*.cc csrc/cpu.cc -o /tmp/bench_decode && /tmp/bench_decode
// Build it from the commit before the checks the same way to compare (docs/compression.md).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>
#include "codec.h"
using namespace bps::compress;
int main() {
  struct C { const char* name; CodecParams p; double kfrac; };
  std::vector<C> cs;
  CodecParams ob; ob.id = kOneBit; cs.push_back({"onebit", ob, 0});
  CodecParams t1; t1.id = kTopK; cs.push_back({"topk 1%", t1, 0.01});
  CodecParams t10; t10.id = kTopK; cs.push_back({"topk 10%", t10, 0.10});
  CodecParams rk; rk.id = kRandomK; rk.seed = 3; cs.push_back({"randomk 1%", rk, 0.01});
  CodecParams di; di.id = kDithering; di.levels = 16; cs.push_back({"dither lin16", di, 0});
  for (std::size_t n : {std::size_t(1) << 14, std::size_t(1) << 20, std::size_t(1) << 24}) {
    std::vector<float> x(n), acc(n, 0.f);
    std::mt19937 g(1); std::normal_distribution<float> d;
    for (auto& v : x) v = d(g);
    for (auto& c : cs) {
      CodecParams p = c.p;
      if (c.kfrac > 0) p.k = std::max<std::size_t>(1, std::size_t(n * c.kfrac));
      FramedCodec codec(p, 1, n);
      std::vector<std::uint8_t> pay(codec.max_bytes());
      codec.encode(x.data(), 5, pay.data());
      const int reps = n < (1u << 20) ? 4001 : (n == (1u << 20) ? 301 : 31);
      std::vector<double> ts;
      for (int r = 0; r < reps; ++r) {
        auto t0 = std::chrono::steady_clock::now();
        codec.decode(pay.data(), pay.size(), acc.data(), true);
        ts.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
      std::sort(ts.begin(), ts.end());
      std::printf("n=%9zu %13s: decode_add median %9.2f us  min %9.2f us\n", n, c.name,
                  ts[ts.size() / 2] * 1e6, ts[0] * 1e6);
    }
  }
}
