// Element types understood by the kernels of byteps_like._core.
#pragma once

#include <cstddef>
#include <string>

namespace bps {

enum class DType : int {
  kFloat32 = 0,
  kFloat64 = 1,
  kFloat16 = 2,
  kBFloat16 = 3,
  kInt32 = 4,
  kInt64 = 5,
};
constexpr int kNumDTypes = 6;

// Bytes per element.
std::size_t itemsize(DType dt);
// Canonical name ("float32", ...).
const char* dtype_name(DType dt);
// Parses a canonical name; returns false for anything else.
bool parse_dtype(const std::string& name, DType* out);
// "float32, float64, float16, bfloat16, int32, int64", for error messages.
std::string valid_dtype_names();

}  // namespace bps
