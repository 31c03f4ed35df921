#include "cpu.h"

#include <atomic>
#include <cstring>

namespace bps {
namespace {

CpuFeatures detect() {
  CpuFeatures f;
#if defined(BPS_X86_KERNELS)
  // libgcc's cpu model also checks XGETBV, so AVX/AVX-512 features are only reported
  // when the OS saves the wider register state.
  __builtin_cpu_init();
  f.x86_64 = true;
  f.sse2 = __builtin_cpu_supports("sse2");
  f.avx = __builtin_cpu_supports("avx");
  f.avx2 = __builtin_cpu_supports("avx2");
  f.fma = __builtin_cpu_supports("fma");
  // Older compilers do not know "f16c"; fall back to CPUID leaf 1, ECX bit 29.
  {
    unsigned eax = 1, ebx = 0, ecx = 0, edx = 0;
    __asm__ volatile("cpuid" : "+a"(eax), "=b"(ebx), "+c"(ecx), "=d"(edx));
    f.f16c = f.avx && ((ecx >> 29) & 1u);
  }
  f.avx512f = __builtin_cpu_supports("avx512f");
  f.avx512bw = __builtin_cpu_supports("avx512bw");
  f.avx512vl = __builtin_cpu_supports("avx512vl");
#endif
  return f;
}

Isa detect_isa(const CpuFeatures& f) {
  const bool avx2 = f.avx2 && f.fma && f.f16c;
  if (avx2 && f.avx512f && f.avx512bw && f.avx512vl) return Isa::kAvx512;
  if (avx2) return Isa::kAvx2;
  return Isa::kScalar;
}

std::atomic<int> g_limit{static_cast<int>(Isa::kAvx512)};

constexpr const char* kIsaNames[] = {"scalar", "avx2", "avx512"};

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures f = detect();
  return f;
}

Isa detected_isa() {
  static const Isa isa = detect_isa(cpu_features());
  return isa;
}

Isa active_isa() {
  const int limit = g_limit.load(std::memory_order_relaxed);
  const int detected = static_cast<int>(detected_isa());
  return static_cast<Isa>(limit < detected ? limit : detected);
}

bool set_isa_limit(Isa limit) {
  if (static_cast<int>(limit) > static_cast<int>(detected_isa())) return false;
  g_limit.store(static_cast<int>(limit), std::memory_order_relaxed);
  return true;
}

void reset_isa_limit() {
  g_limit.store(static_cast<int>(Isa::kAvx512), std::memory_order_relaxed);
}

const char* isa_name(Isa isa) { return kIsaNames[static_cast<int>(isa)]; }

bool parse_isa(const char* name, Isa* out) {
  for (int i = 0; i < 3; ++i) {
    if (std::strcmp(name, kIsaNames[i]) == 0) {
      *out = static_cast<Isa>(i);
      return true;
    }
  }
  return false;
}

}  // namespace bps
