// What the two files of the UCX link share (built only with BPS_WITH_UCX): the UCP functions
// looked up in the libucp ucx_load() opened, an endpoint's state (its error status and the
// active messages that arrived for it, in order), the worker that progresses them, and
// UcxLink, a stream's bytes over active messages (dataplane_ucx_link.cc).
//
// A stream over UCX is a sequence of active messages (id kAmId), each with an 8-byte header,
// its sequence number on the stream, and data: a message's header, meta length and meta (and
// its payload when that is under kEagerPayload) travel eagerly in one message; a larger
// payload follows in pieces of at most kUcxPiece bytes, each sent with rendezvous, which UCX
// delivers straight into the buffer the framing reads into (a server's span of chunks or its
// round buffer, a worker's output); over UCX's TCP transport only what its receive segment
// took in with a piece's header is copied, the rest is received in place. The framing above
// (FramedConn) still reads a byte stream; the pieces are its bytes in order.
#pragma once

#include <ucp/api/ucp.h>

#include <atomic>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "dataplane_io.h"

namespace bps {
namespace dp {
namespace ucxi {

#define BPS_UCX_FNS(X)                                                                       \
  X(ucp_config_read) X(ucp_config_release) X(ucp_config_modify) X(ucp_init_version)          \
  X(ucp_worker_create) X(ucp_worker_destroy) X(ucp_worker_get_efd) X(ucp_worker_arm)         \
  X(ucp_worker_progress) X(ucp_worker_query) X(ucp_listener_create) X(ucp_listener_destroy)  \
  X(ucp_listener_query) X(ucp_listener_reject) X(ucp_ep_create) X(ucp_ep_close_nbx)          \
  X(ucp_am_send_nbx) X(ucp_am_recv_data_nbx) X(ucp_am_data_release)                          \
  X(ucp_worker_set_am_recv_handler) X(ucp_request_check_status) X(ucp_request_free)          \
  X(ucs_status_string)

struct Api {
#define BPS_UCX_FN(name) decltype(&::name) name = nullptr;
  BPS_UCX_FNS(BPS_UCX_FN)
#undef BPS_UCX_FN
};
extern Api g_api;

inline const char* status_text(ucs_status_t s) { return g_api.ucs_status_string(s); }

constexpr unsigned kAmId = 0x42;            // our active messages' id on every worker
// A payload under this travels with its header in one eager message (copied once more by
// the receiver, which is cheaper than a rendezvous round trip at this size).
constexpr std::size_t kEagerPayload = 32u << 10;
// Bytes of eager messages an endpoint may hold that its stream has not read (a paused
// stream's peer that keeps sending, or one faster than the stream reads): past it the stream
// is closed as leaving its replies unread. Each message held counts kPieceCost more.
constexpr std::size_t kMaxHeld = 32u << 20;
constexpr std::size_t kPieceCost = 256;
// The largest rendezvous piece a receiver accepts (a sender cuts payloads at kUcxPiece).
constexpr std::size_t kMaxPiece = kUcxPiece;

// Why an endpoint's stream must end, found by the active-message handler.
enum Flood : int { kNoFlood = 0, kHeldOver, kBadSeq, kBigPiece };

// One active message of a stream: eager bytes, or a rendezvous descriptor of len bytes.
struct Piece {
  std::string bytes;
  void* desc = nullptr;
  std::size_t len = 0;
  void* req = nullptr;   // a rendezvous piece being received into `bytes` (a bounce)
};

// An endpoint's state, which outlives its link until UCX has closed the endpoint.
struct EpState {
  std::atomic<int> status{UCS_OK};   // set by the error callback (the peer left, ...)
  int wake_fd = -1;
  std::atomic<int> flood{kNoFlood};
  std::mutex mu;                     // the three below
  std::map<std::uint64_t, Piece> in;  // arrived, by sequence number, not yet taken
  std::uint64_t next_seq = 0;        // the next one the stream takes
  std::size_t held = 0;              // kMaxHeld's count (eager bytes + kPieceCost each)
};

class Worker : public UcxWorker {
 public:
  explicit Worker(int wake_fd);
  ~Worker() override;
  int efd() const override { return efd_; }
  void progress() override;
  bool arm() override { return g_api.ucp_worker_arm(w_) == UCS_OK; }  // BUSY: events wait
  ucp_worker_h handle() const { return w_; }
  int wake_fd() const { return wake_fd_; }
  // An endpoint's active messages go to its state from now on (until close_later).
  void attach(ucp_ep_h ep, EpState* st);
  // An endpoint is closed in the background (flushing what was posted unless it is broken or
  // `force`); its state goes with it. Messages that arrive for it later are dropped.
  void close_later(ucp_ep_h ep, EpState* st, bool force);
  // The state of the endpoint an active message came from (map_mu() held), or nullptr.
  EpState* find(ucp_ep_h ep) {
    auto it = eps_.find(ep);
    return it == eps_.end() ? nullptr : it->second;
  }
  std::mutex& map_mu() { return map_mu_; }
  // Whether the calling thread is the one that progresses the worker (its loop's).
  bool on_loop() const { return loop_.load() == std::this_thread::get_id(); }

 private:
  void reap();
  struct Closing {
    void* req;
    EpState* st;
  };
  ucp_worker_h w_ = nullptr;
  int efd_ = -1, wake_fd_ = -1;
  std::mutex mu_;
  std::vector<Closing> closing_;
  std::vector<EpState*> dead_;
  std::mutex map_mu_;
  std::unordered_map<ucp_ep_h, EpState*> eps_;
  std::atomic<std::thread::id> loop_{};
};

// True on a thread inside Worker::progress (a loop thread), which serves its streams after
// it: an arrival there needs no wake-up.
bool in_progress();
void wake_fd(int fd);

// One stream over a UCP endpoint (dataplane_ucx_link.cc).
class UcxLink : public Link {
 public:
  UcxLink(Worker* w, ucp_ep_h ep, EpState* st);
  ~UcxLink() override { release(); }
  int key() const override { return key_; }
  bool progressed() const override { return true; }
  bool hung() const override {
    return hung_.load() || st_->status.load() != UCS_OK || st_->flood.load() != kNoFlood;
  }
  bool more() const override { return more_; }
  const char* flooded(bool* unread) const override;
  ssize_t read(char* p, std::size_t n, std::string* err) override;
  ssize_t write(std::deque<Out>& q) override;
  void hangup() override;
  void release() override;
  void watch(int epfd, int evfd, bool in, bool out) override;

  // Blocking helpers of the hello and the tests' raw streams (the caller progresses).
  // Sends n bytes as one message (eager, or with rendezvous: `rndv`); false and *err when it
  // cannot by the deadline or the peer refused it.
  bool send_bytes(const char* p, std::size_t n, double deadline, std::string* err,
                  bool rndv = false);
  // Reads exactly n bytes (or, !all, what comes first); the bytes read, -1 and *err on
  // failure or the deadline ("timed out").
  ssize_t recv_bytes(char* p, std::size_t n, bool all, double deadline, std::string* err);
  EpState* state() const { return st_; }

 private:
  bool broken(std::string* err) const;
  ssize_t fail(std::string* err, const std::string& what);
  void take_arrivals();
  ssize_t retire(char* p, std::string* err);
  void post_direct(char* end);
  ssize_t read_pieces(char* p, std::size_t n, std::string* err);
  bool post_message(Out& o);
  void wait_posted();

  struct Sent {
    std::vector<void*> reqs;
    ucp_dt_iov_t iov[4];
    std::size_t bytes = 0;
  };
  struct Posted {
    void* req;
    std::size_t len;
  };
  Worker* w_;
  ucp_ep_h ep_;
  EpState* st_;
  const int key_;
  std::uint64_t send_seq_ = 0;
  std::deque<Piece> mine_;        // taken from st_->in, in order
  std::size_t off_ = 0;           // bytes of mine_.front() already read
  std::deque<Posted> posted_;     // rendezvous pieces being received in place, in order
  char* post_at_ = nullptr;       // where the first of posted_ lands (the framing's target)
  char* post_end_ = nullptr;      // where the next one would land
  bool more_ = true;
  bool in_ = true;
  std::atomic<bool> hung_{false};
  std::size_t sent_posted_ = 0;   // messages at the queue's front posted to UCX
  std::deque<Sent> inflight_;
};

ucp_ep_params_t ep_params(EpState* st);

}  // namespace ucxi
}  // namespace dp
}  // namespace bps
