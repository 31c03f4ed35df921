// Runtime CPU feature detection and the instruction-set level the kernels dispatch on.
#pragma once

// x86-64 SIMD kernels and CPUID detection are compiled in only here; every other target gets
// the portable kernels. -DBPS_DISABLE_X86_KERNELS forces the portable build on x86-64 too.
#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__)) && \
    !defined(BPS_DISABLE_X86_KERNELS)
#define BPS_X86_KERNELS 1
#endif

namespace bps {

// Kernel instruction-set levels, lowest first. Every level above kScalar is x86-64 only.
enum class Isa : int {
  kScalar = 0,  // portable C++ (on x86-64 the compiler still uses SSE2)
  kAvx2 = 1,    // AVX2 + FMA + F16C
  kAvx512 = 2,  // AVX-512 F/BW/VL + the above
};

struct CpuFeatures {
  bool x86_64 = false;
  bool sse2 = false;
  bool avx = false;
  bool avx2 = false;
  bool fma = false;
  bool f16c = false;
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512vl = false;
};

// Features of the running CPU (with OS support for the register state), detected once.
const CpuFeatures& cpu_features();

// Highest level the running CPU supports.
Isa detected_isa();

// Level the kernels use now: the detected level, or lower after set_isa_limit().
Isa active_isa();

// Caps the level the kernels use (tests use it to exercise the fallbacks).
// Returns false, changing nothing, when `limit` is above detected_isa().
bool set_isa_limit(Isa limit);
// Removes the cap set by set_isa_limit().
void reset_isa_limit();

const char* isa_name(Isa isa);
bool parse_isa(const char* name, Isa* out);

}  // namespace bps
