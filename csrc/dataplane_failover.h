// Losing a server, the worker's side (dataplane_client.cc; the server's side is
// dataplane_server_failover.cc, which says how a moved key is re-seeded): what the client
// keeps of each key, and where a key goes once servers are lost.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "dataplane_io.h"
#include "dtype.h"
#include "ops.h"

namespace bps {
namespace dp {

// What a client keeps of a key while losing a server is on (DataClient::set_failover).
struct KeyRecord {
  std::string decl;               // its declaration, as its first round sent it
  int orig = -1;                  // the server it was first assigned to (the worker's map)
  int owner = -1;                 // the server its last push went to
  bool retry = false;             // moved: its pushes carry FLAG_RETRY until a round completes
  // The answer of its last completed round, as it came (undivided; a compressed key's
  // encoded sum): answers are received here and copied out, so neither a cut-off answer nor
  // one that reached only some workers loses anything. round -1: none (or being received).
  std::vector<char> shadow;
  std::uint64_t len = 0;
  std::int64_t round = -1;
  std::uint32_t flags = 0;        // FLAG_COMPRESSED and the contributors, as in a PULL_RESP
  int wire_dtype = 0;
  int conn = 0;                   // its lane
};

// Rendezvous (highest random weight) hashing: the server of `key` among `alive`, so that
// losing a server moves only the keys that server held. -1 when none is alive.
inline std::uint64_t hrw_score(std::uint64_t key, int server) {
  std::uint64_t z = key ^ (0x9E3779B97F4A7C15ull * static_cast<std::uint64_t>(server + 1));
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;  // splitmix64's finaliser
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

inline int hrw_owner(std::uint64_t key, const std::vector<int>& alive) {
  int best = -1;
  std::uint64_t top = 0;
  for (int s : alive) {
    const std::uint64_t v = hrw_score(key, s);
    if (best < 0 || v > top || (v == top && s < best)) best = s, top = v;
  }
  return best;
}

// The server of `key`, first assigned to `server`, among n: that one until it is gone(), then
// rendezvous hashing over the servers neither gone() nor down (up() false: no streams).
template <typename Gone, typename Up>
int route_key(std::uint64_t key, int server, std::size_t n, Gone gone, Up up) {
  if (server >= 0 && static_cast<std::size_t>(server) < n && !gone(server)) return server;
  std::vector<int> alive;
  for (std::size_t i = 0; i < n; ++i)
    if (!gone(i) && up(i)) alive.push_back(static_cast<int>(i));
  return hrw_owner(key, alive);
}

// dst = src / div (div 1: a copy) in blocks that stay in the cache between the copy and the
// division, so an answer received into its key's shadow costs about one more read of it
inline void copy_scaled(DType kdt, char* dst, const char* src, std::size_t len,
                        std::int64_t div) {
  constexpr std::size_t kBlock = 64 << 10;
  const std::size_t isz = itemsize(kdt);
  for (std::size_t at = 0; at < len; at += kBlock) {
    const std::size_t n = std::min(kBlock, len - at);
    std::memcpy(dst + at, src + at, n);
    if (div > 1) scale_into(kdt, dst + at, n / isz, div, 1);
  }
}

// The seed of key k: its last completed round's answer, with its declaration.
inline Out seed_out(int rank, std::uint32_t job, std::uint64_t key, const KeyRecord& k) {
  Out o;
  auto bytes = std::make_shared<std::vector<char>>(k.shadow.begin(), k.shadow.begin() + k.len);
  const std::size_t isz = std::max<std::size_t>(1, wire_itemsize(k.wire_dtype));
  o.hdr = make_header(kPush, kRoleWorker, rank, kFlagSeed | kFlagDeclare | kFlagMeta | k.flags,
                      job, key, k.round, static_cast<std::uint8_t>(k.wire_dtype), k.len / isz,
                      k.len);
  o.meta = k.decl;
  o.payload = bytes->data();
  o.plen = k.len;
  o.keep = bytes;
  return o;
}

}  // namespace dp
}  // namespace bps
