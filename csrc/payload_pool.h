// Payload buffers of table messages, recycled (docs/sparse.md, "Where a step's time goes").
// A table request or answer of 100 KB to a few MB is allocated on one thread and freed on
// another once written or read; glibc gives the top of its heap back to the system when more
// than 128 KB is free there and faults it back in at the next message, which cost a worker's
// send of a 110 KB push 63 us against 8 with the heap kept (2-core VM, loopback). So the
// plane keeps a few such buffers for the next message: at most kPoolBuffers, of at most
// kPoolMaxBuffer bytes each, kPoolBytes in all; smaller and larger ones come and go as before.
// drain() gives them all back (a server trims its memory once streams close).
#pragma once

#include <cstddef>
#include <memory>
#include <string>

namespace bps {
namespace dp {

constexpr std::size_t kPoolMinBuffer = 64u << 10;
constexpr std::size_t kPoolMaxBuffer = 8u << 20;
constexpr std::size_t kPoolBuffers = 32;
constexpr std::size_t kPoolBytes = 32u << 20;

// A string of n bytes (their contents unspecified: the caller writes all of them), from the
// pool when one there holds n.
std::string pooled(std::size_t n);
// A string whose bytes are done with: kept for a later pooled() when it fits the pool.
void recycle(std::string&& s);
// The same as a shared buffer for Out::keep: recycled when the last owner lets it go.
std::shared_ptr<std::string> pooled_shared(std::string&& s);
// Every buffer kept goes back to the allocator.
void drain_pool();

}  // namespace dp
}  // namespace bps
