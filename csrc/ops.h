// The operations exported by byteps_like._core, on raw memory. Callers have already
// checked lengths and dtypes (module.cc); these never touch Python and may run without the
// GIL.
#pragma once

#include <cstddef>
#include <cstdint>

#include "dtype.h"

namespace bps {

// dst += src, n elements of dt. Overlapping buffers are fine.
void add_into(DType dt, void* dst, const void* src, std::size_t n, int nthreads);

// memmove of `bytes` bytes, split over threads when the ranges do not overlap.
void copy_into(void* dst, const void* src, std::size_t bytes, int nthreads);

// buf /= divisor in place, n elements of dt; divisor >= 1 (floats: true division, in float32
// for float16/bfloat16; ints: floor division).
void scale_into(DType dt, void* buf, std::size_t n, std::int64_t divisor, int nthreads);

// Whether convert() supports src -> dst.
bool can_convert(DType dst_dt, DType src_dt);
// dst[i] = src[i] converted from src_dt to dst_dt (round to nearest even), n elements.
// Overlapping buffers are fine. Requires can_convert(dst_dt, src_dt).
void convert(DType dst_dt, void* dst, DType src_dt, const void* src, std::size_t n, int nthreads);

}  // namespace bps
