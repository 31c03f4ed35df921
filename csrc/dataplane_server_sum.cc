// The native data plane's server: a push's first bytes of a chunk received straight into the
// store (ServerImpl::land_chunk). The rest of the receive-and-sum path is in
// dataplane_server_stream.cc (a push's payload, a chunk at a time) and dataplane_server.cc
// (sum_chunk: a chunk received into a stream's scratch piece, copied or added into the store).
//
// Why: a push's chunk used to be received into the stream's scratch piece and then copied (the
// round's first push of the chunk) or added (the others) into the store. The copy is a pass
// over the bytes that the kernel's own copy can do: when every byte of the chunk already waits
// in the socket and no push has filled the chunk this round, the kernel copies it straight
// into the round's buffer, under the chunk's lock, and the chunk counts as filled. The lock is
// only tried: a chunk another stream is summing is read into scratch as before, and a stream
// never waits for another. The bytes must all be waiting because the lock is held while they
// are read: a chunk half read would hold it across the loop's wait for more (docs/performance.md,
// "Server CPU").
#include <poll.h>

#include <cstdint>
#include <mutex>
#include <string>

#include "dataplane_server_impl.h"

namespace bps {
namespace dp {

ssize_t ServerImpl::land_chunk(Store& st, std::int64_t round, std::size_t offset,
                               std::size_t len, std::uint64_t gen, Link& link,
                               std::size_t* avail, std::string* why) {
  if (async_ || st.codec || link.progressed() || offset % kChunk != 0) return 0;
  const std::size_t c = offset / kChunk;
  const int par = static_cast<int>(round & 1);
  std::unique_lock<std::mutex> g(st.chunk_mu[c], std::try_to_lock);
  if (!g.owns_lock() || st.gen.load() != gen || st.fill[par][c] != 0) return 0;
  if (*avail == SIZE_MAX) *avail = link.waiting();  // one question for a run of chunks
  if (*avail < len) return 0;  // not all here: a scratch span, summed as bytes come
  char* at = st.buf[par].get() + offset;
  std::size_t got = 0;
  while (got < len) {
    const ssize_t n = link.read(at + got, len - got, why);
    if (n > 0) {
      got += static_cast<std::size_t>(n);
      continue;
    }
    if (n == Link::kAgain) {
      // the kernel said the bytes wait; should it hand over fewer, wait for the rest a
      // little (the chunk stays unfilled, its next push overwrites it, if they never come)
      pollfd p{link.key(), POLLIN, 0};
      if (::poll(&p, 1, 1000) > 0) continue;
      *why = "a chunk's bytes that the socket reported did not arrive within 1 s";
    } else if (n == 0) {
      *why = "the peer closed the connection";
    }
    c_.bytes_in += got;
    return -1;
  }
  st.fill[par][c]++;
  *avail -= len;
  c_.bytes_in += len;
  c_.landed_bytes += len;
  return static_cast<ssize_t>(len);
}

}  // namespace dp
}  // namespace bps
