// Tables of element kernels, one table per instruction-set level.
//
// Kernels take raw pointers with no alignment requirement and element counts; they never
// fail. Callers (ops.cc) check lengths and pick the table for active_isa().
#pragma once

#include <cstddef>
#include <cstdint>

#include "cpu.h"
#include "dtype.h"

namespace bps {

// dst[i] += src[i] for i < n. dst and src do not overlap, or are the same pointer.
using AddFn = void (*)(void* dst, const void* src, std::size_t n);
// buf[i] = buf[i] / divisor (floats: true division; ints: floor division); divisor >= 1.
using ScaleFn = void (*)(void* buf, std::size_t n, std::int64_t divisor);
// dst[i] = convert(src[i]) for i < n; dst and src do not overlap.
using ConvertFn = void (*)(void* dst, const void* src, std::size_t n);

struct KernelTable {
  const char* name = nullptr;
  AddFn add[kNumDTypes] = {};
  ScaleFn scale[kNumDTypes] = {};
  ConvertFn f32_to_f16 = nullptr;
  ConvertFn f16_to_f32 = nullptr;
  ConvertFn f32_to_bf16 = nullptr;
  ConvertFn bf16_to_f32 = nullptr;
};

// Portable kernels; every entry is set.
const KernelTable& scalar_kernels();
// AVX2/F16C and AVX-512 kernels; nullptr when not compiled in (non-x86 builds). Only call
// their entries when detected_isa() is at least that level.
const KernelTable* avx2_kernels();
const KernelTable* avx512_kernels();

// The table for `isa`, entries always set (falls back level by level).
const KernelTable& kernels_for(Isa isa);

}  // namespace bps
