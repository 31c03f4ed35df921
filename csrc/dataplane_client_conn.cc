// A worker's stream to one server (dataplane_client_conn.h): the server's frames, read in
// place where the client says (PULL_RESP payloads land in dst, a key's shadow or a codec's
// buffer), acknowledgements and errors passed on.
#include "dataplane_client_conn.h"

namespace bps {
namespace dp {
namespace {

class ClientConn : public FramedConn {
 public:
  ClientConn(std::unique_ptr<Link> link, StreamEvents* cli, int server, std::uint32_t job,
             std::uint64_t max_msg, Counters* counters)
      : FramedConn(std::move(link), counters), cli_(cli), server_(server), job_(job),
        max_msg_(max_msg) {
    read_header();
  }

 protected:
  void on_closed() override {
    if (target_.op) {
      cli_->resp_done(target_, false);
      target_ = {};
    }
    cli_->on_stream_lost(server_, why_.empty() ? "closed" : why_);
  }

  bool advance() override {
    switch (state_) {
      case kHdr: return on_header();
      case kMetaLen: return read_meta("meta frame over 1 MiB from the server");
      case kMeta:
        if (h_.type == kError) cli_->on_error(server_, h_, meta_);
        return read_header();
      case kPayload: {
        Target t = target_;
        target_ = {};
        cli_->resp_done(t, true);
        return read_header();
      }
      case kDiscard: return next_discard();
      case kNonceIn:
      case kMacIn: break;  // the worker's handshake runs before the stream joins a loop
    }
    return false;
  }

 private:
  bool on_header() {
    counters_->msgs_in++;
    if (!from_server_of(h_, job_)) {
      why_ = "a malformed message or one of another job from the server";
      return false;
    }
    switch (h_.type) {
      case kPushAck:
        cli_->on_ack(server_, h_);
        return read_header();
      case kPullResp: {
        const std::size_t isz = wire_itemsize(h_.dtype);
        if (!count_matches(h_, isz) || h_.nbytes > max_msg_ || (h_.flags & kFlagMeta)) {
          why_ = "PULL_RESP with an inconsistent or oversized length";
          return false;
        }
        char* dst = cli_->on_resp(server_, h_, &target_);
        if (!dst) {
          discard_left_ = h_.nbytes;
          return next_discard();
        }
        state_ = kPayload;
        expect(dst, h_.nbytes);
        return true;
      }
      case kError:
        if (!(h_.flags & kFlagMeta)) {
          why_ = "ERROR without a message";
          return false;
        }
        return read_meta_len();
      default:
        why_ = std::string("unexpected ") + type_name(h_.type) + " from the server";
        return false;
    }
  }

  StreamEvents* cli_;
  const int server_;
  const std::uint32_t job_;
  const std::uint64_t max_msg_;
  Target target_;
};

}  // namespace

std::shared_ptr<Conn> client_stream(std::unique_ptr<Link> link, StreamEvents* events, int server,
                                     std::uint32_t job, std::uint64_t max_msg,
                                     Counters* counters) {
  return std::make_shared<ClientConn>(std::move(link), events, server, job, max_msg, counters);
}

}  // namespace dp
}  // namespace bps
