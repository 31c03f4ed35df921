#include "ops.h"

#include <cstring>
#include <memory>

#include "cpu.h"
#include "kernels.h"
#include "parallel.h"

namespace bps {
namespace {

using u8 = unsigned char;

bool overlap(const void* a, std::size_t a_len, const void* b, std::size_t b_len) {
  const auto pa = reinterpret_cast<std::uintptr_t>(a);
  const auto pb = reinterpret_cast<std::uintptr_t>(b);
  return pa < pb + b_len && pb < pa + a_len;
}

// A private copy of src when it overlaps dst (and is not exactly dst, which the elementwise
// kernels handle), so the kernels can assume disjoint buffers.
std::unique_ptr<u8[]> detach_if_overlapping(const void* dst, std::size_t dst_len,
                                             const void*& src, std::size_t src_len,
                                             bool same_ok) {
  if (src_len == 0 || dst_len == 0 || (same_ok && src == dst)) return nullptr;
  if (!overlap(dst, dst_len, src, src_len)) return nullptr;
  std::unique_ptr<u8[]> copy(new u8[src_len]);
  std::memcpy(copy.get(), src, src_len);
  src = copy.get();
  return copy;
}

}  // namespace

void add_into(DType dt, void* dst, const void* src, std::size_t n, int nthreads) {
  const std::size_t size = itemsize(dt);
  const auto keep = detach_if_overlapping(dst, n * size, src, n * size, /*same_ok=*/true);
  const AddFn add = kernels_for(active_isa()).add[static_cast<int>(dt)];
  u8* d = static_cast<u8*>(dst);
  const u8* s = static_cast<const u8*>(src);
  parallel_for(n, size, nthreads, [=](std::size_t begin, std::size_t end) {
    add(d + begin * size, s + begin * size, end - begin);
  });
}

void copy_into(void* dst, const void* src, std::size_t bytes, int nthreads) {
  if (bytes == 0 || dst == src) return;
  if (overlap(dst, bytes, src, bytes)) {
    std::memmove(dst, src, bytes);
    return;
  }
  u8* d = static_cast<u8*>(dst);
  const u8* s = static_cast<const u8*>(src);
  parallel_for(bytes, 1, nthreads, [=](std::size_t begin, std::size_t end) {
    std::memcpy(d + begin, s + begin, end - begin);
  });
}

void scale_into(DType dt, void* buf, std::size_t n, std::int64_t divisor, int nthreads) {
  if (divisor == 1) return;
  const std::size_t size = itemsize(dt);
  const ScaleFn scale = kernels_for(active_isa()).scale[static_cast<int>(dt)];
  u8* b = static_cast<u8*>(buf);
  parallel_for(n, size, nthreads, [=](std::size_t begin, std::size_t end) {
    scale(b + begin * size, end - begin, divisor);
  });
}

namespace {

ConvertFn converter(DType dst_dt, DType src_dt) {
  const KernelTable& t = kernels_for(active_isa());
  if (src_dt == DType::kFloat32 && dst_dt == DType::kFloat16) return t.f32_to_f16;
  if (src_dt == DType::kFloat16 && dst_dt == DType::kFloat32) return t.f16_to_f32;
  if (src_dt == DType::kFloat32 && dst_dt == DType::kBFloat16) return t.f32_to_bf16;
  if (src_dt == DType::kBFloat16 && dst_dt == DType::kFloat32) return t.bf16_to_f32;
  return nullptr;
}

}  // namespace

bool can_convert(DType dst_dt, DType src_dt) { return converter(dst_dt, src_dt) != nullptr; }

void convert(DType dst_dt, void* dst, DType src_dt, const void* src, std::size_t n, int nthreads) {
  const ConvertFn fn = converter(dst_dt, src_dt);
  const std::size_t dsize = itemsize(dst_dt), ssize = itemsize(src_dt);
  const auto keep = detach_if_overlapping(dst, n * dsize, src, n * ssize, /*same_ok=*/false);
  u8* d = static_cast<u8*>(dst);
  const u8* s = static_cast<const u8*>(src);
  parallel_for(n, dsize + ssize, nthreads, [=](std::size_t begin, std::size_t end) {
    fn(d + begin * dsize, s + begin * ssize, end - begin);
  });
}

}  // namespace bps
