// Scalar IEEE half (float16) and bfloat16 <-> float32 conversions, round to nearest even.
//
// Everything here has internal linkage on purpose: the header is also included by the
// translation units compiled for AVX2/AVX-512 (#pragma GCC target), and an inline function
// with external linkage would let the linker pick an AVX copy for baseline callers.
#pragma once

#include <cstdint>
#include <cstring>

namespace bps {
namespace {

inline std::uint32_t f32_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float bits_f32(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Exact; NaNs come back quiet with their payload (as F16C's vcvtph2ps does).
inline float f16_to_f32(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t em = h & 0x7fffu;
  if (em >= 0x7c00u) {  // inf / nan
    const std::uint32_t mant = (em & 0x3ffu) << 13;
    return bits_f32(sign | 0x7f800000u | mant | (mant ? 0x00400000u : 0u));
  }
  if (em >= 0x0400u) return bits_f32(sign | ((em << 13) + 0x38000000u));  // normal
  // Zero or subnormal: em * 2^-24, exact and a normal float32.
  return bits_f32(sign | f32_bits(static_cast<float>(em) * 5.9604644775390625e-08f));
}

// Round to nearest even; overflow gives inf; NaNs stay NaN (quiet, top payload bits kept,
// as F16C's vcvtps2ph does).
inline std::uint16_t f32_to_f16(float f) {
  std::uint32_t x = f32_bits(f);
  const std::uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7fffffffu;
  std::uint32_t o;
  if (x >= 0x47800000u) {  // |f| >= 65536: inf or nan (65520..65536 is handled below)
    o = x > 0x7f800000u ? (0x7e00u | ((x >> 13) & 0x3ffu)) : 0x7c00u;
  } else if (x < 0x38800000u) {
    // Result is subnormal or zero: let the FPU round by adding 0.5, whose ulp is 2^-24 (the
    // half subnormal step); the low mantissa bits of the sum are then the half bits.
    const float sum = bits_f32(x) + 0.5f;
    o = f32_bits(sum) - 0x3f000000u;
  } else {
    // Normal: rebias the exponent and round the 13 dropped bits to nearest even; a carry
    // out of the mantissa correctly bumps the exponent (up to inf for 65520 and above).
    const std::uint32_t mant_odd = (x >> 13) & 1u;
    x += 0xc8000fffu + mant_odd;  // (15 - 127) << 23, plus the rounding bias
    o = x >> 13;
  }
  return static_cast<std::uint16_t>(o | sign);
}

inline float bf16_to_f32(std::uint16_t h) { return bits_f32(static_cast<std::uint32_t>(h) << 16); }

// Round to nearest even; NaNs stay NaN (quietened). Branch-free so loops vectorise.
inline std::uint16_t f32_to_bf16(float f) {
  const std::uint32_t x = f32_bits(f);
  const std::uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
  const std::uint32_t nan = (x >> 16) | 0x40u;
  return static_cast<std::uint16_t>((x & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

}  // namespace
}  // namespace bps
