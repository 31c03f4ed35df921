// Portable kernels (baseline instruction set) and the per-level table lookup.
#include "kernels.h"
#include "kernels_generic.h"

namespace bps {

const KernelTable& scalar_kernels() {
  static const KernelTable table = generic_table("scalar");
  return table;
}

namespace {

// Entries missing from `t` are taken from `fallback`.
KernelTable merged(const KernelTable& t, const KernelTable& fallback) {
  KernelTable m = t;
  for (int i = 0; i < kNumDTypes; ++i) {
    if (!m.add[i]) m.add[i] = fallback.add[i];
    if (!m.scale[i]) m.scale[i] = fallback.scale[i];
  }
  if (!m.f32_to_f16) m.f32_to_f16 = fallback.f32_to_f16;
  if (!m.f16_to_f32) m.f16_to_f32 = fallback.f16_to_f32;
  if (!m.f32_to_bf16) m.f32_to_bf16 = fallback.f32_to_bf16;
  if (!m.bf16_to_f32) m.bf16_to_f32 = fallback.bf16_to_f32;
  return m;
}

}  // namespace

const KernelTable& kernels_for(Isa isa) {
  // avx*_kernels() run code compiled for their level, so only call them on CPUs that have it.
  static const int detected = static_cast<int>(detected_isa());
  static const KernelTable avx2 = detected >= static_cast<int>(Isa::kAvx2) && avx2_kernels()
                                      ? merged(*avx2_kernels(), scalar_kernels())
                                      : scalar_kernels();
  static const KernelTable avx512 =
      detected >= static_cast<int>(Isa::kAvx512) && avx512_kernels()
          ? merged(*avx512_kernels(), avx2)
          : avx2;
  switch (isa) {
    case Isa::kAvx512: return avx512;
    case Isa::kAvx2: return avx2;
    default: return scalar_kernels();
  }
}

}  // namespace bps
