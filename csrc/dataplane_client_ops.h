// The native client's records of its operations (dataplane_client.cc): an operation (one
// tensor's push_pull, several partitions) and each of its parts.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "dataplane.h"
#include "dataplane_coder.h"
#include "dtype.h"

namespace bps {
namespace dp {

// the wire dtype of codec payloads (wire.h's table)
constexpr int kWireUint8 = 7;
static_assert(kWireDTypes[kWireUint8].name[0] == 'u' && kWireDTypes[kWireUint8].itemsize == 1,
              "wire dtype code 7 is uint8");

struct Op;
struct Part {
  PartSpec spec;
  int at = -1;  // the server it went to: spec.server, or the key's new one once that is lost
  bool dispatched = false, acked = false, done = false;
  bool busy = false;  // sent, its answer not in (the client's busy time counts it)
  // times a failover parked it (its stripe of ClientImpl::land_mu_ held): an answer accepted
  // before is not its own any more, since the part will be sent again
  std::uint32_t parks = 0;
  // its answer is in dst (set holding the stripe): parking it then would push the answer
  // again as its gradient, so a failover leaves it to complete (and seed its key's new server)
  bool landed = false;
  double t_sent = 0, t_acked = 0, t_done = 0;
  std::uint64_t wire = 0;  // its bytes on the wire: spec.nbytes, or the codec's payload
  // a coded operation's: the coder that encodes src and decodes into dst, and the encoded
  // push (out) and the server's encoded sum (in), the codec's own buffers (a codec serves one
  // operation at a time: no allocation, no page faults, round after round)
  std::shared_ptr<PartCoder> coder;
  std::uint8_t *out = nullptr, *in = nullptr;
};
struct Op {
  std::uint64_t id = 0;
  int priority = 0;
  const char* src = nullptr;
  char* dst = nullptr;
  int wire_dtype = 0;
  DType kdt = DType::kFloat32;
  std::size_t isz = 4;            // the wire dtype's itemsize
  bool compressed = false;        // codec payloads (uint8): nothing summed or scaled here
  std::uint64_t dst_bytes = 0;    // compressed: dst's size, room for an answer of any size
  bool coded = false;             // float32 in and out, each part encoded/decoded by its coder
  int contrib = 0;                // pushes the server's round summed when fewer than all
  std::int64_t divisor = 1;
  std::vector<Part> parts;
  std::size_t remaining = 0;
  int active = 0;                 // sends and receives touching src/dst right now
  bool failed = false, reported = false;
  std::string kind, message;
  int err_server = -1;
  double t_first = 0, t_last = 0;
  std::uint64_t bytes = 0;
};

// Where an answer of a part goes (the client's inflight_ entry of its key, copied as the
// answer's header comes).
struct Target {
  std::shared_ptr<Op> op;
  std::size_t idx = 0;
  char* shadow = nullptr;  // losing a server: the answer lands in the key's shadow
  bool copied = false;     // ... and was copied out into the operation's dst
  int contrib = 0;         // > 0: the round summed this many pushes (ranks had joined)
  std::uint64_t len = 0;   // the answer's bytes
  std::uint32_t parks = 0;  // the part's parks when its header came (Part::parks)
  bool failover = false;    // losing a server is on (land_mu_ guards dst against parking)
};

// Testing hook (DataClient.hold_landed): while on, a codec thread that has landed an answer in
// dst waits before it completes the part: the window in which a failover may come.
class LandedGate {
 public:
  void set(bool on) {
    std::lock_guard<std::mutex> g(mu_);
    on_ = on;
    cv_.notify_all();
  }
  void pass() {
    if (!on_.load(std::memory_order_relaxed)) return;
    std::unique_lock<std::mutex> g(mu_);
    held_++;
    cv_.wait(g, [this] { return !on_.load(); });
    held_--;
  }
  int held() {
    std::lock_guard<std::mutex> g(mu_);
    return held_;
  }

 private:
  std::atomic<bool> on_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  int held_ = 0;
};

}  // namespace dp
}  // namespace bps
