// A worker's stream to one server (dataplane_client_conn.cc): it reads the server's frames and
// tells its client (ClientImpl in dataplane_client.cc) what came, through StreamEvents.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "dataplane_client_ops.h"
#include "dataplane_io.h"

namespace bps {
namespace dp {

// What a stream tells its client (on the stream's loop thread).
class StreamEvents {
 public:
  virtual ~StreamEvents() = default;
  // PUSH_ACK: the push is in the server's hands.
  virtual void on_ack(int server, const Header& h) = 0;
  // PULL_RESP header: where its payload goes (*t filled), or null to discard it.
  virtual char* on_resp(int server, const Header& h, Target* t) = 0;
  // The payload is in (ok), or the stream closed before it was.
  virtual void resp_done(const Target& t, bool ok) = 0;
  // ERROR: the server's message for the request in h.
  virtual void on_error(int server, const Header& h, const std::string& meta) = 0;
  // The stream is gone (why).
  virtual void on_stream_lost(int server, const std::string& why) = 0;
};

// A stream to server index `server` of job `job` over `link`, its answers bounded by max_msg
// bytes, its traffic counted in `counters`.
std::shared_ptr<Conn> client_stream(std::unique_ptr<Link> link, StreamEvents* events, int server,
                                     std::uint32_t job, std::uint64_t max_msg,
                                     Counters* counters);

}  // namespace dp
}  // namespace bps
