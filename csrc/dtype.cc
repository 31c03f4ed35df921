#include "dtype.h"

namespace bps {
namespace {

struct DTypeInfo {
  const char* name;
  std::size_t size;
};

// Indexed by DType.
constexpr DTypeInfo kInfo[kNumDTypes] = {
    {"float32", 4}, {"float64", 8}, {"float16", 2},
    {"bfloat16", 2}, {"int32", 4}, {"int64", 8},
};

}  // namespace

std::size_t itemsize(DType dt) { return kInfo[static_cast<int>(dt)].size; }

const char* dtype_name(DType dt) { return kInfo[static_cast<int>(dt)].name; }

bool parse_dtype(const std::string& name, DType* out) {
  for (int i = 0; i < kNumDTypes; ++i) {
    if (name == kInfo[i].name) {
      *out = static_cast<DType>(i);
      return true;
    }
  }
  return false;
}

std::string valid_dtype_names() {
  std::string s;
  for (int i = 0; i < kNumDTypes; ++i) {
    if (i) s += ", ";
    s += kInfo[i].name;
  }
  return s;
}

}  // namespace bps
