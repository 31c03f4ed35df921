// Losing a server, the worker's side (dataplane_client.cc; the server's side is
// dataplane_server_failover.cc, which says how a moved key is re-seeded): what the client
// keeps of each key, and where a key goes once servers are lost.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

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

}  // namespace dp
}  // namespace bps
