// The native data plane's streams (dataplane.h): an outgoing message, a stream with its send
// queue and its share of the server's reply budget, the framing both ends read, and the epoll
// loop that runs them (dataplane.cc). The server (dataplane_server_stream.cc) and the worker's
// client (dataplane_client.cc) derive their streams from FramedConn; the authenticated hello is
// in dataplane_auth.h. Internal to the extension: nothing here is part of the module's interface.
#pragma once

#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "dataplane.h"

namespace bps {
namespace dp {

// The server's summation granule: a push is received and summed a chunk at a time, as its
// bytes arrive, in pieces that stay in the core's cache (256 KiB: the bytes the kernel just
// copied in are added while still in L2, with the store's chunk beside them); the first push
// of a chunk whose bytes are all waiting in the socket is received straight into the store
// (dataplane_server_sum.cc). Was 512 KiB (docs/performance.md, "Server CPU").
constexpr std::size_t kChunk = 256 * 1024;
// A server's TCP stream reads a push's bytes that do not go straight into the store into a
// span of this many bytes (4 chunks: fewer reads when the bytes wait), summing each chunk of it
// as soon as it is complete (ServerConn::on_read), while the kernel's copy of it is in cache.
constexpr std::size_t kTcpAhead = 4 * kChunk;
// A UCX stream's payloads travel in rendezvous pieces of this size (4 MiB: one per default
// partition); a server's UCX stream reads a push's chunks a piece at a time. Large pieces,
// because UCX's TCP transport copies the part of a piece that its receive segment (1 MiB)
// took in with the piece's header and receives only the rest in place: 512 KiB pieces were
// mostly copied (docs/performance.md).
constexpr std::size_t kUcxPiece = 4u << 20;
static_assert(kUcxPiece % kChunk == 0, "a piece is whole chunks");
constexpr std::size_t kUcxAhead = kUcxPiece;
constexpr std::size_t kReadBudget = 16u << 20;      // bytes one connection reads per wakeup
constexpr double kHelloTimeout = 5.0;               // seconds a stream may take to say hello
constexpr std::size_t kStoreOverhead = 1024;        // a store's own bytes beyond its buffers
// Replies queued unwritten, for the whole server (Counters::queued_bytes): each stream may hold
// its share, kReplyBudget over the streams open, at least kMinShare (only kMinShare while the
// server's queues together are over kReplyBudget, whatever order the streams came in); a
// stream over its share is not read (its peer's next requests wait in the kernel) until it is
// down to half of it, and one that stays over it for kUnreadTimeout without taking a byte is
// closed. So a peer that never reads its replies costs the server at most its share, whatever
// it sends, and all of them together the budget and kMinShare a stream.
constexpr std::size_t kReplyBudget = 32u << 20;
constexpr std::size_t kMinShare = 16u << 10;
constexpr double kUnreadTimeout = 10.0;
constexpr std::size_t kMaxErrorText = 1024;         // an error reply's message, in bytes
// Meta frames (declarations, <= 1 MiB each) being read: one of up to kFreeMeta bytes costs a
// stream nothing more, larger ones share kMetaBudget for the whole server, so streams that
// announce 1 MiB frames and send them slowly cannot make a server hold 1 MiB each.
constexpr std::size_t kFreeMeta = 4096;
constexpr std::size_t kMetaBudget = 16u << 20;

// helpers (dataplane.cc)
std::string json_escape(const std::string& s);
// A declaration (decl.h) as people read it, as the ZeroMQ path prints it: 'w' shape (7, 3)
// float32; what is wrong with it when it is malformed.
std::string describe_decl(const std::string& decl);
const char* type_name(int t);  // a message type's name, "?" for an unknown one
// An ERROR reply's JSON: kind, the text capped at kMaxErrorText bytes, the type it answers,
// then `extra` (more members, already encoded: ",\"rank\":1", or empty).
std::string error_meta(const char* kind, const std::string& text, int type,
                       const std::string& extra);
// Whether a header a worker's stream read is one of this wire version from a server of job
// `job` (the client's and the table client's first check of every message).
inline bool from_server_of(const Header& h, std::uint32_t job) {
  return std::memcmp(h.magic, kMagic, 4) == 0 && h.version == kVersion && h.job == job &&
         h.role == kRoleServer;
}
void set_nonblocking(int fd);
void set_nodelay(int fd);
// A listening TCP socket on host:port (port 0: ephemeral; host "" or "*": every address) into
// *fd; returns the bound port. std::runtime_error naming host:port when it cannot.
int listen_tcp(const std::string& host, int port, int* fd);

// ---- one outgoing message ------------------------------------------------------------------
struct Out {
  Header hdr;
  std::string meta;          // sent as u32 length + bytes when hdr.flags has kFlagMeta
  std::uint32_t meta_len = 0;
  const char* payload = nullptr;
  std::size_t plen = 0;
  std::shared_ptr<void> keep;            // keeps the payload's owner alive
  // payload bytes this reply may be the last to hold (an asynchronous-mode snapshot of a
  // store's value, which the store replaces when a push comes): charged to the queue as its own
  std::size_t owned = 0;
  std::function<void(bool)> done;        // called once: true when fully written
  std::size_t sent = 0;

  std::size_t total() const {
    return sizeof(Header) + ((hdr.flags & kFlagMeta) ? 4 + meta.size() : 0) + plen;
  }
  // the memory it holds while queued: the record, its JSON and a payload it owns (others have
  // their own owner, charged there)
  std::size_t cost() const { return sizeof(Out) + meta.capacity() + owned; }
};

// ---- the byte-moving layer under a stream: a TCP socket (TcpLink, below) or a UCX endpoint
// (dataplane_ucx.cc). Conn and FramedConn own the queue, the framing, the budgets and the
// rules; a Link only moves bytes and says when it can move more.
class Link {
 public:
  static constexpr ssize_t kAgain = -1;     // nothing now: wait for the loop to say so
  static constexpr ssize_t kFailed = -2;    // the stream is broken
  static constexpr ssize_t kInFlight = -3;  // writes posted, none done yet: the loop calls back
  virtual ~Link() = default;
  // The stream's name in its loop: the socket for TCP, a negative number for UCX.
  virtual int key() const = 0;
  // True when the loop drives it by progress rather than by epoll readiness (UCX).
  virtual bool progressed() const { return false; }
  // (progressed links) The stream ended or was hung up: the loop reads it, paused or not, to
  // close it. more(): its last read found data, so more may wait without an event.
  virtual bool hung() const { return false; }
  virtual bool more() const { return false; }
  // (progressed links) Why the peer's messages broke the stream's rules: a UCX peer that
  // keeps sending what is not read (*unread true), or one that breaks the message framing
  // under the stream (false); nullptr while it has not.
  virtual const char* flooded(bool*) const { return nullptr; }
  // Reads up to n bytes into p: > 0 bytes read, 0 the peer closed, kAgain or kFailed (*err).
  // A UCX read may stay posted on p: the next call with the same p collects it.
  virtual ssize_t read(char* p, std::size_t n, std::string* err) = 0;
  // Bytes that a read now would take without waiting, as far as the link knows (0: unknown;
  // a UCX link says 0). The server receives a chunk straight into its store only when all of
  // it waits (dataplane_server_sum.cc).
  virtual std::size_t waiting() const { return 0; }
  // Writes from q, whose front message has q.front().sent bytes written: the bytes now written
  // and done with (their buffers may go), or kAgain / kInFlight / kFailed. A UCX link posts
  // whole messages and reports them when UCX is done with them.
  virtual ssize_t write(std::deque<Out>& q) = 0;
  // The same write in two steps, so that the stream's lock is not held during the system call
  // (TCP): gather() describes the bytes of q from its front on (under the stream's lock),
  // write_gathered() writes them (without it: other threads queue meanwhile, and a sender
  // that holds the GIL does not wait for a socket write of the loop's). false: this link
  // cannot (UCX), and write() runs under the lock.
  struct Gathered {
    static constexpr int kMax = 48;  // a message takes up to 4: header, meta length, meta, payload
    iovec iov[kMax];
    int n = 0;
  };
  virtual bool gather(const std::deque<Out>&, Gathered*) const { return false; }
  virtual ssize_t write_gathered(const Gathered&) { return kFailed; }
  virtual void hangup() = 0;   // any thread: the loop sees the stream end soon
  virtual void release() = 0;  // the loop closes the stream: the socket or endpoint goes
  // what the loop should watch: reading unless paused, writing when something waits
  virtual void watch(int epfd, int evfd, bool in, bool out) = 0;
};

class TcpLink : public Link {
 public:
  explicit TcpLink(int fd) : fd_(fd) {}
  int key() const override { return fd_; }
  ssize_t read(char* p, std::size_t n, std::string* err) override {
    for (;;) {
      const ssize_t k = ::recv(fd_, p, n, 0);
      if (k >= 0) return k;
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return kAgain;
      *err = std::string("receive failed: ") + std::strerror(errno);
      return kFailed;
    }
  }
  std::size_t waiting() const override {
    int n = 0;
    return ::ioctl(fd_, FIONREAD, &n) == 0 && n > 0 ? static_cast<std::size_t>(n) : 0;
  }
  bool gather(const std::deque<Out>& q, Gathered* g) const override {
    g->n = 0;
    for (auto it = q.begin(); it != q.end() && g->n + 4 <= Gathered::kMax; ++it) {
      const Out& o = *it;
      std::size_t skip = o.sent;
      auto add = [&](const void* p, std::size_t len) {
        if (skip >= len) {
          skip -= len;
          return;
        }
        g->iov[g->n].iov_base = const_cast<char*>(static_cast<const char*>(p) + skip);
        g->iov[g->n].iov_len = len - skip;
        ++g->n;
        skip = 0;
      };
      add(&o.hdr, sizeof(Header));
      if (o.hdr.flags & kFlagMeta) {
        add(&o.meta_len, 4);
        add(o.meta.data(), o.meta.size());
      }
      if (o.plen) add(o.payload, o.plen);
    }
    return true;
  }
  ssize_t write_gathered(const Gathered& g) override {
    msghdr mh{};
    mh.msg_iov = const_cast<iovec*>(g.iov);
    mh.msg_iovlen = static_cast<std::size_t>(g.n);
    for (;;) {
      const ssize_t n = ::sendmsg(fd_, &mh, MSG_NOSIGNAL);
      if (n >= 0) return n;
      if (errno == EINTR) continue;
      return errno == EAGAIN || errno == EWOULDBLOCK ? kAgain : kFailed;
    }
  }
  ssize_t write(std::deque<Out>& q) override {
    Gathered g;
    gather(q, &g);
    return write_gathered(g);
  }
  void hangup() override { ::shutdown(fd_, SHUT_RDWR); }
  void release() override { ::close(fd_); }
  void watch(int epfd, int, bool in, bool out) override {
    epoll_event ev{};
    ev.events = EPOLLRDHUP | (in ? static_cast<std::uint32_t>(EPOLLIN) : 0u) |
                (out ? static_cast<std::uint32_t>(EPOLLOUT) : 0u);
    ev.data.fd = fd_;
    epoll_ctl(epfd, EPOLL_CTL_MOD, fd_, &ev);
  }

 private:
  int fd_;
};

// ---- a stream --------------------------------------------------------------------------------
constexpr std::size_t kMaxQueuedOut = 1 << 16;  // messages a stream may hold unwritten, at most

class Conn : public std::enable_shared_from_this<Conn> {
 public:
  Conn(std::unique_ptr<Link> link, Counters* counters)
      : link_(std::move(link)), counters_(counters) {}
  virtual ~Conn() = default;

  int key() const { return link_->key(); }
  Link* link() const { return link_.get(); }
  bool reading() const { return reading_.load(); }

  // Queue a message and write what the socket takes now (any thread).
  void send(Out&& o) {
    std::vector<std::function<void(bool)>> finished;
    {
      std::unique_lock<std::mutex> g(wmu_);
      if (!closed_ && outq_.size() >= kMaxQueuedOut) {
        // a peer that does not read, past the share that stopped its reading (answers to
        // pulls that waited can still come): it loses the stream
        drop_unread_locked();
        if (o.done) finished.push_back(std::move(o.done));
      } else if (closed_) {
        if (o.done) finished.push_back(std::move(o.done));
      } else {
        enqueue_locked(std::move(o));
        flush_locked(g, &finished);
        pause_if_over_locked();
      }
    }
    for (auto& f : finished) f(!closed_flag_.load());
  }

  // Queue a message for the loop thread to write: nothing is copied or written here, so a
  // caller holding the GIL returns at once.
  void post(Out&& o) {
    std::function<void(bool)> dropped;
    {
      std::lock_guard<std::mutex> g(wmu_);
      if (closed_) {
        dropped = std::move(o.done);
      } else {
        enqueue_locked(std::move(o));
        arm(true);  // the loop writes once the socket is writable (at once, usually)
        pause_if_over_locked();
      }
    }
    if (dropped) dropped(false);
  }

  // The loop calls these.
  void on_writable() {
    std::vector<std::function<void(bool)>> finished;
    {
      std::unique_lock<std::mutex> g(wmu_);
      if (!closed_) flush_locked(g, &finished);
    }
    for (auto& f : finished) f(true);
  }

  // Returns false when the connection must close. Reads up to kReadBudget bytes, and stops
  // when the replies queued on this stream are over its share (queue_share()): the stream is
  // not read again until they are written down to half of it.
  bool on_readable() {
    bool unread = false;
    if (const char* f = link_->flooded(&unread)) {
      std::lock_guard<std::mutex> g(wmu_);
      if (unread && !unread_) counters_->unread_closed++;  // it leaves its replies unread
      if (!unread) on_violation();
      unread_ = unread_ || unread;
      why_ = f;
      return false;
    }
    if (!reading_.load()) {  // not read: the peer hung up or the stream was shut
      std::lock_guard<std::mutex> g(wmu_);
      why_ = unread_ ? "the peer left its replies unread" : "the peer closed the connection";
      return false;
    }
    std::size_t budget = kReadBudget;
    while (budget > 0) {
      if (rleft_ == 0) {
        if (!advance()) return false;
        budget -= std::min(budget, took_);  // bytes advance() received itself (in place)
        took_ = 0;
        if (queued_.load() > queue_share() && pause_reading()) return true;
        continue;
      }
      const std::size_t want = std::min(rleft_, budget);
      const ssize_t n = link_->read(rptr_, want, &why_);
      if (n > 0) {
        rptr_ += n;
        rleft_ -= static_cast<std::size_t>(n);
        budget -= static_cast<std::size_t>(n);
        counters_->bytes_in += static_cast<std::uint64_t>(n);
        if (rleft_ > 0) on_read();  // (a full target goes to advance())
        continue;
      }
      if (n == 0) {
        why_ = "the peer closed the connection";
        return false;
      }
      if (n == Link::kAgain) return true;
      return false;  // why_ says why
    }
    return true;
  }

  // Loop thread only: close the socket and drop what was queued.
  void close_now() {
    std::vector<std::function<void(bool)>> dropped;
    {
      std::unique_lock<std::mutex> g(wmu_);
      if (closed_) return;
      closing_ = true;  // a write in progress on another thread stops at its next turn
      written_.wait(g, [&] { return !writing_; });
      closed_ = true;
      closed_flag_ = true;
      for (auto& o : outq_)
        if (o.done) dropped.push_back(std::move(o.done));
      std::deque<Out>().swap(outq_);  // its blocks too
      counters_->queued_bytes -= queued_.exchange(0);
      if (!reading_.load()) counters_->paused--;
      reading_ = true;
      link_->release();
    }
    for (auto& f : dropped) f(false);
    on_closed();
  }

  // Any thread: make the loop close this connection soon.
  void shut() {
    std::lock_guard<std::mutex> g(wmu_);
    if (!closed_) link_->hangup();
  }

  void set_epoll(int epfd, int evfd) {
    std::lock_guard<std::mutex> g(wmu_);
    epfd_ = epfd;
    evfd_ = evfd;
  }
  const std::string& why() const { return why_; }
  double created = monotonic_now();

  // A table stream's requests that wait for the server's tables' thread (dataplane_tables.h):
  // charged (delta > 0) and given back (delta < 0, once the thread took them) as the stream's
  // queued replies are, so a stream over its share is not read until the thread has taken
  // them down to half of it (any thread).
  void charge_held(std::int64_t delta) {
    std::lock_guard<std::mutex> g(wmu_);
    if (closed_) return;  // close_now gave back what was queued, held requests included
    queued_ += static_cast<std::size_t>(delta);
    held_ += static_cast<std::size_t>(delta);
    counters_->queued_bytes += static_cast<std::uint64_t>(delta);
    if (delta < 0 && !reading_.load() && !unread_ && queued_.load() <= queue_share() / 2) {
      reading_ = true;
      counters_->paused--;
      arm(armed_out_);
      resumed();
    }
  }

  // Whether the replies queued unwritten (held requests aside) are over the stream's share:
  // the tables' thread takes no more of its requests until they are written (any thread).
  bool replies_over_share() const { return queued_.load() - held_.load() > queue_share(); }

  // The loop's tick: a stream not read for its unread replies that has taken no byte of them
  // for kUnreadTimeout is closed (true: it was, counted as unread_closed); not one whose
  // requests wait for the tables' thread (the server's delay, not the peer's).
  // (A stream is paused when its queue is over its share, but the share grows as other streams
  // close: one paused for its replies is closed whatever their size now, or it would wait for
  // a flush its peer never allows.)
  bool drop_if_unread(double now) {
    std::lock_guard<std::mutex> g(wmu_);
    if (closed_ || reading_.load() || unread_ || now - progress_ < kUnreadTimeout ||
        queued_.load() == held_.load())  // paused for its held requests alone
      return false;
    drop_unread_locked();
    return true;
  }

 protected:
  // Called when rleft_ reaches 0: set up the next read target (rptr_, rleft_); false closes.
  virtual bool advance() = 0;
  // Called after a read that left part of the target to come (the server sums what is whole).
  virtual void on_read() {}
  virtual void on_closed() {}
  virtual void on_violation() {}  // the peer broke the link's message rules (flooded())
  // The stream is read again (its queue went down to half its share); called holding its
  // lock, so it may take only locks that are never held while taking a stream's.
  virtual void resumed() {}
  // The bytes of replies this stream may hold unwritten before it is not read (unbounded: a
  // worker's streams, whose queue its own credit bounds).
  virtual std::size_t queue_share() const { return SIZE_MAX; }

  void expect(char* p, std::size_t n) {
    rptr_ = p;
    rleft_ = n;
  }

  std::unique_ptr<Link> link_;
  Counters* counters_;
  char* rptr_ = nullptr;
  std::size_t rleft_ = 0;
  std::size_t took_ = 0;  // bytes advance() read from the link itself, for the read budget
  std::string why_;
  std::atomic<bool> closed_flag_{false};

 private:
  // Writes what the socket takes now. Over TCP the system call runs without the lock (lk),
  // one thread at a time (writing_): a thread that finds another writing leaves the queue to
  // it, and that one writes what was queued meanwhile before it returns (the queue's messages
  // stay where they are while more are queued: a deque's push_back moves no element).
  void flush_locked(std::unique_lock<std::mutex>& lk,
                    std::vector<std::function<void(bool)>>* finished) {
    while (!outq_.empty()) {
      if (writing_ || closing_) return;
      ssize_t n;
      Link::Gathered gathered;
      if (link_->gather(outq_, &gathered)) {
        writing_ = true;
        lk.unlock();
        n = link_->write_gathered(gathered);
        lk.lock();
        writing_ = false;
        if (closing_) written_.notify_all();
      } else {
        n = link_->write(outq_);
      }
      if (n == Link::kInFlight) return;  // the loop calls on_writable when UCX is done
      if (n == Link::kAgain) {
        arm(true);
        return;
      }
      if (n < 0) {
        link_->hangup();  // the loop sees it and closes the connection
        return;
      }
      counters_->bytes_out += static_cast<std::uint64_t>(n);
      progress_ = monotonic_now();
      std::size_t left = static_cast<std::size_t>(n);
      while (left > 0 && !outq_.empty()) {
        Out& o = outq_.front();
        const std::size_t rest = o.total() - o.sent;
        if (left >= rest) {
          left -= rest;
          counters_->msgs_out++;
          if (o.done) finished->push_back(std::move(o.done));
          const std::size_t c = o.cost();
          queued_ -= c;
          counters_->queued_bytes -= c;
          outq_.pop_front();
        } else {
          o.sent += left;
          left = 0;
        }
      }
      if (!reading_.load() && !unread_ && queued_.load() <= queue_share() / 2) {
        reading_ = true;  // written down to half its share: read the stream again
        counters_->paused--;
        resumed();
      }
    }
    if (outq_.empty() && long_) {  // a long queue's block map goes back too
      std::deque<Out>().swap(outq_);
      long_ = false;
    }
    arm(false);
  }

  void enqueue_locked(Out&& o) {
    if (o.hdr.flags & kFlagMeta) o.meta_len = static_cast<std::uint32_t>(o.meta.size());
    const std::size_t c = o.cost();
    if (outq_.empty()) progress_ = monotonic_now();  // the wait for the peer starts now
    queued_ += c;
    counters_->queued_bytes += c;
    outq_.push_back(std::move(o));
    if (outq_.size() > 256) long_ = true;
  }

  // A reply queued from another thread than the loop's (a table's answer): a stream over its
  // share is not read from now on, as one the loop's own replies took over it.
  void pause_if_over_locked() {
    if (reading_.load() && !unread_ && queued_.load() > queue_share()) {
      reading_ = false;
      counters_->paused++;
      arm(armed_out_);
    }
  }

  // Loop thread: stop reading this stream; false when its queue was written meanwhile.
  bool pause_reading() {
    std::lock_guard<std::mutex> g(wmu_);
    if (closed_ || queued_.load() <= queue_share()) return false;
    if (!reading_.load()) return true;  // paused already (send() found it over its share)
    reading_ = false;
    counters_->paused++;
    arm(armed_out_);
    return true;
  }

  // The peer does not read its replies: count it and make the loop close the stream.
  void drop_unread_locked() {
    if (!unread_) counters_->unread_closed++;
    unread_ = true;
    link_->hangup();  // the loop sees it and closes the connection
  }

  // epoll interest: reading unless paused (hang-ups are reported either way), writing when
  // something waits for the socket
  void arm(bool out) {
    const bool in = reading_.load();
    if ((out == armed_out_ && in == armed_in_ && !(out && link_->progressed())) || epfd_ < 0)
      return;
    link_->watch(epfd_, evfd_, in, out);
    armed_out_ = out, armed_in_ = in;
  }

  std::mutex wmu_;
  std::condition_variable written_;  // close_now waits on it for a write in progress to end
  std::deque<Out> outq_;
  bool closed_ = false;
  bool writing_ = false;  // a thread is in the link's write without the lock
  bool closing_ = false;  // close_now waits for that write: no other begins
  bool unread_ = false;  // closed for leaving its replies unread
  bool armed_out_ = false, armed_in_ = true;
  bool long_ = false;   // outq_ held many messages since it was last empty
  std::atomic<bool> reading_{true};   // false: over its share, not read
  std::atomic<std::size_t> queued_{0};  // cost() of outq_, and held_
  std::atomic<std::size_t> held_{0};  // of queued_: requests for the tables' thread
  double progress_ = 0;  // when the queue last took a byte (or began to fill)
  int epfd_ = -1, evfd_ = -1;
};

// ---- the framing both ends read: header, optional meta (u32 length + JSON), payload --------
class FramedConn : public Conn {
 public:
  using Conn::Conn;

 protected:
  enum State { kHdr, kMetaLen, kMeta, kPayload, kDiscard, kNonceIn, kMacIn };

  bool read_header() {
    state_ = kHdr;
    if (meta_.capacity() > 4096) std::string().swap(meta_);  // a large meta was read: freed
    expect(reinterpret_cast<char*>(&h_), sizeof h_);
    return true;
  }

  bool read_meta_len() {
    state_ = kMetaLen;
    expect(reinterpret_cast<char*>(&meta_len_), 4);
    return true;
  }

  // After the length: false (and why_) when it is over the 1 MiB bound, before any allocation.
  bool read_meta(const char* over) {
    if (meta_len_ > kMaxMeta) {
      why_ = over;
      return false;
    }
    meta_.resize(meta_len_);
    state_ = kMeta;
    expect(meta_.data(), meta_len_);
    return true;
  }

  // Reads and drops discard_left_ bytes (a payload that was answered with an error), a chunk
  // at a time, then the next header. Into one buffer of the loop thread's (a stream stays on
  // its loop), not one per stream: what is dropped may be overwritten by another stream.
  bool next_discard() {
    if (discard_left_ == 0) return read_header();
    thread_local std::unique_ptr<char[]> sink(new char[kChunk]);
    const std::size_t len = std::min<std::size_t>(kChunk, discard_left_);
    discard_left_ -= len;
    state_ = kDiscard;
    expect(sink.get(), len);
    return true;
  }

  State state_ = kHdr;
  Header h_{};
  std::uint32_t meta_len_ = 0;
  std::string meta_;
  std::vector<char> scratch_;
  std::size_t discard_left_ = 0;
};

// ---- an epoll loop (dataplane.cc) ----------------------------------------------------------
class UcxWorker;  // dataplane_ucx.h

class IoLoop {
 public:
  using Tick = std::function<void(const std::unordered_map<int, std::shared_ptr<Conn>>&)>;

  IoLoop();
  ~IoLoop();
  // Runs the loop on a thread of its own; `tick` is called about twice a second with its
  // streams (the server closes silent or unread ones).
  void start(Tick tick);
  void add(std::shared_ptr<Conn> c);  // any thread
  void stop();
  void close_conn(const std::shared_ptr<Conn>& c);  // loop thread
  // The loop's UCX worker, made on first use (any thread); throws when UCX is unavailable.
  UcxWorker* ucx();

 private:
  void wake();
  void run();
  // Progresses the UCX worker and serves the UCX streams; true when the loop must not sleep.
  bool serve_ucx(UcxWorker* u);

  int epfd_ = -1, evfd_ = -1;
  std::thread th_;
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::vector<std::shared_ptr<Conn>> adds_;
  std::unordered_map<int, std::shared_ptr<Conn>> conns_;
  std::vector<std::shared_ptr<Conn>> ucx_conns_;  // those of conns_ on UCX (loop thread)
  std::mutex ucx_mu_;
  std::unique_ptr<UcxWorker> ucx_;
  std::atomic<UcxWorker*> ucx_ptr_{nullptr};
  Tick tick_;
};

}  // namespace dp
}  // namespace bps
