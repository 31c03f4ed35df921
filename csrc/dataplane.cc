// The native data plane (dataplane.h): epoll I/O loops, the server's chunked summation and the
// worker's priority/credit scheduler with receive-into-place.
#include "dataplane.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <queue>
#include <stdexcept>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include <sys/random.h>
#ifdef __GLIBC__
#include <malloc.h>  // malloc_trim
#endif

#include "dtype.h"
#include "ops.h"
#include "sha256.h"

namespace bps {
namespace dp {

namespace {

constexpr std::size_t kChunk = 512 * 1024;          // summation granule on the server
constexpr std::size_t kReadBudget = 16u << 20;      // bytes one connection reads per wakeup
constexpr double kHelloTimeout = 5.0;               // seconds a stream may take to say hello
constexpr std::size_t kStoreOverhead = 1024;        // a store's own bytes beyond its buffers
// Replies queued unwritten, for the whole server (Counters::queued_bytes): each stream may hold
// its share, kReplyBudget over the streams open, at least kMinShare; a stream over its share is
// not read (its peer's next requests wait in the kernel) until it is down to half of it, and
// one that stays over it for kUnreadTimeout without taking a byte is closed. So a peer that
// never reads its replies costs the server at most its share, whatever it sends.
constexpr std::size_t kReplyBudget = 32u << 20;
constexpr std::size_t kMinShare = 16u << 10;
constexpr double kUnreadTimeout = 10.0;
constexpr std::size_t kMaxErrorText = 1024;         // an error reply's message, in bytes

std::string json_escape(const std::string& s) {
  std::string out;
  out.reserve(s.size() + 8);
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out;
}

// The value of "field" in one of our declarations (flat JSON written by the runtime): a
// string's raw text, or an array's or number's text; empty when absent.
std::string json_field(const std::string& j, const char* field, char* kind) {
  const std::string pat = std::string("\"") + field + "\":";
  const std::size_t at = j.find(pat);
  if (at == std::string::npos) return "";
  std::size_t i = at + pat.size();
  if (i >= j.size()) return "";
  *kind = j[i];
  if (j[i] == '"') {
    std::string out;
    for (++i; i < j.size() && j[i] != '"'; ++i) {
      if (j[i] == '\\' && i + 1 < j.size()) ++i;
      out += j[i];
    }
    return out;
  }
  const char close = j[i] == '[' ? ']' : ',';
  const std::size_t end = j.find(j[i] == '[' ? close : ',', i);
  if (end == std::string::npos) return j.substr(i, j.find('}', i) - i);
  return j.substr(i, end - i + (close == ']' ? 1 : 0));
}

// A declaration as people read it, as the ZeroMQ path prints it: 'w' shape (7, 3) float32.
std::string describe_decl(const std::string& decl) {
  char k1 = 0, k2 = 0, k3 = 0;
  const std::string name = json_field(decl, "name", &k1);
  std::string shape = json_field(decl, "shape", &k2);
  const std::string dtype = json_field(decl, "dtype", &k3);
  if (k1 != '"' || k2 != '[' || k3 != '"' || shape.size() < 2) {
    return decl.size() > 300 ? decl.substr(0, 300) + "..." : decl;  // not ours: as it came
  }
  std::string dims = shape.substr(1, shape.size() - 2), tuple = "(";
  std::size_t n = 0, start = 0;
  while (start <= dims.size() && !dims.empty()) {
    std::size_t comma = dims.find(',', start);
    if (comma == std::string::npos) comma = dims.size();
    if (n++) tuple += ", ";
    tuple += dims.substr(start, comma - start);
    start = comma + 1;
  }
  tuple += n == 1 ? ",)" : ")";
  return "'" + name + "' shape " + tuple + " " + dtype + " uncompressed";
}

const char* type_name(int t) {
  switch (t) {
#define BPS_TYPE_CASE(cname, pyname, value) \
  case cname: return #pyname;
    BPS_WIRE_MSG_TYPES(BPS_TYPE_CASE)
#undef BPS_TYPE_CASE
    default: return "?";
  }
}

void set_nonblocking(int fd) {
  const int fl = fcntl(fd, F_GETFL, 0);
  fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

void set_nodelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

// ---- the authenticated hello (a job secret turns it on) --------------------------------------
// worker: HELLO + nonce Nc (32) -> server: HELLO + Ns (32) + HMAC(K, "bpsl-srv"|ctx|Nc|Ns)
// -> worker: HELLO + HMAC(K, "bpsl-cli"|ctx|Ns|Nc); ctx = job, rank, stream. Each side proves
// it holds the key derived from the secret; the nonces make every proof fresh.
constexpr std::size_t kNonce = 32;

void random_bytes(std::uint8_t* out, std::size_t n) {
  while (n > 0) {
    const ssize_t k = getrandom(out, n, 0);
    if (k < 0) {
      if (errno == EINTR) continue;
      throw std::runtime_error(std::string("data plane: getrandom failed: ") +
                               std::strerror(errno));
    }
    out += k;
    n -= static_cast<std::size_t>(k);
  }
}

void hello_mac(const std::string& key, const char* who, std::uint32_t job, std::int32_t rank,
               std::uint64_t stream, const std::uint8_t* first, const std::uint8_t* second,
               std::uint8_t out[32]) {
  std::string msg(who);
  msg.append(reinterpret_cast<const char*>(&job), sizeof job);
  msg.append(reinterpret_cast<const char*>(&rank), sizeof rank);
  msg.append(reinterpret_cast<const char*>(&stream), sizeof stream);
  msg.append(reinterpret_cast<const char*>(first), kNonce);
  msg.append(reinterpret_cast<const char*>(second), kNonce);
  hmac_sha256(key.data(), key.size(), msg.data(), msg.size(), out);
}

// ---- one outgoing message ------------------------------------------------------------------
struct Out {
  Header hdr;
  std::string meta;          // sent as u32 length + bytes when hdr.flags has kFlagMeta
  std::uint32_t meta_len = 0;
  const char* payload = nullptr;
  std::size_t plen = 0;
  std::shared_ptr<void> keep;            // keeps the payload's owner alive
  std::function<void(bool)> done;        // called once: true when fully written
  std::size_t sent = 0;

  std::size_t total() const {
    return sizeof(Header) + ((hdr.flags & kFlagMeta) ? 4 + meta.size() : 0) + plen;
  }
  // the memory it holds while queued: the record and its JSON (a payload has its own owner)
  std::size_t cost() const { return sizeof(Out) + meta.capacity(); }
};

}  // namespace

int wire_to_kernel_dtype(int code) {
  return code >= 0 && code < kNumWireDTypes ? kWireDTypes[code].kernel : -1;
}
std::size_t wire_itemsize(int code) {
  return code >= 0 && code < kNumWireDTypes ? kWireDTypes[code].itemsize : 0;
}

double monotonic_now() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + ts.tv_nsec * 1e-9;
}

// ---- a stream --------------------------------------------------------------------------------
constexpr std::size_t kMaxQueuedOut = 1 << 16;  // messages a stream may hold unwritten, at most

class Conn : public std::enable_shared_from_this<Conn> {
 public:
  explicit Conn(int fd, Counters* counters) : fd_(fd), counters_(counters) {}
  virtual ~Conn() = default;

  int fd() const { return fd_; }

  // Queue a message and write what the socket takes now (any thread).
  void send(Out&& o) {
    std::vector<std::function<void(bool)>> finished;
    {
      std::lock_guard<std::mutex> g(wmu_);
      if (!closed_ && outq_.size() >= kMaxQueuedOut) {
        // a peer that does not read, past the share that stopped its reading (answers to
        // pulls that waited can still come): it loses the stream
        drop_unread_locked();
        if (o.done) finished.push_back(std::move(o.done));
      } else if (closed_) {
        if (o.done) finished.push_back(std::move(o.done));
      } else {
        enqueue_locked(std::move(o));
        flush_locked(&finished);
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
      }
    }
    if (dropped) dropped(false);
  }

  // The loop calls these.
  void on_writable() {
    std::vector<std::function<void(bool)>> finished;
    {
      std::lock_guard<std::mutex> g(wmu_);
      if (!closed_) flush_locked(&finished);
    }
    for (auto& f : finished) f(true);
  }

  // Returns false when the connection must close. Reads up to kReadBudget bytes, and stops
  // when the replies queued on this stream are over its share (queue_share()): the stream is
  // not read again until they are written down to half of it.
  bool on_readable() {
    if (!reading_.load()) {  // not read: the peer hung up or the stream was shut
      why_ = unread_ ? "the peer left its replies unread" : "the peer closed the connection";
      return false;
    }
    std::size_t budget = kReadBudget;
    while (budget > 0) {
      if (rleft_ == 0) {
        if (!advance()) return false;
        if (queued_.load() > queue_share() && pause_reading()) return true;
        continue;
      }
      const std::size_t want = std::min(rleft_, budget);
      const ssize_t n = ::recv(fd_, rptr_, want, 0);
      if (n > 0) {
        rptr_ += n;
        rleft_ -= static_cast<std::size_t>(n);
        budget -= static_cast<std::size_t>(n);
        counters_->bytes_in += static_cast<std::uint64_t>(n);
        continue;
      }
      if (n == 0) {
        why_ = "the peer closed the connection";
        return false;
      }
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return true;
      why_ = std::string("receive failed: ") + std::strerror(errno);
      return false;
    }
    return true;
  }

  // Loop thread only: close the socket and drop what was queued.
  void close_now() {
    std::vector<std::function<void(bool)>> dropped;
    {
      std::lock_guard<std::mutex> g(wmu_);
      if (closed_) return;
      closed_ = true;
      closed_flag_ = true;
      for (auto& o : outq_)
        if (o.done) dropped.push_back(std::move(o.done));
      std::deque<Out>().swap(outq_);  // its blocks too
      counters_->queued_bytes -= queued_.exchange(0);
      if (!reading_.load()) counters_->paused--;
      reading_ = true;
      ::close(fd_);
    }
    for (auto& f : dropped) f(false);
    on_closed();
  }

  // Any thread: make the loop close this connection soon.
  void shut() {
    std::lock_guard<std::mutex> g(wmu_);
    if (!closed_) ::shutdown(fd_, SHUT_RDWR);
  }

  void set_epoll(int epfd) {
    std::lock_guard<std::mutex> g(wmu_);
    epfd_ = epfd;
  }
  const std::string& why() const { return why_; }
  double created = monotonic_now();

  // The loop's tick: a stream not read for its unread replies that has taken no byte of them
  // for kUnreadTimeout is closed (true: it was, counted as unread_closed).
  bool drop_if_unread(double now) {
    std::lock_guard<std::mutex> g(wmu_);
    if (closed_ || reading_.load() || unread_ || now - progress_ < kUnreadTimeout) return false;
    drop_unread_locked();
    return true;
  }

 protected:
  // Called when rleft_ reaches 0: set up the next read target (rptr_, rleft_); false closes.
  virtual bool advance() = 0;
  virtual void on_closed() {}
  // The bytes of replies this stream may hold unwritten before it is not read (unbounded: a
  // worker's streams, whose queue its own credit bounds).
  virtual std::size_t queue_share() const { return SIZE_MAX; }

  void expect(char* p, std::size_t n) {
    rptr_ = p;
    rleft_ = n;
  }

  int fd_;
  Counters* counters_;
  char* rptr_ = nullptr;
  std::size_t rleft_ = 0;
  std::string why_;
  std::atomic<bool> closed_flag_{false};

 private:
  void flush_locked(std::vector<std::function<void(bool)>>* finished) {
    while (!outq_.empty()) {
      iovec iov[48];
      int niov = 0;
      std::size_t idx = 0;
      // a message takes up to 4 iovecs: header, meta length, meta, payload
      for (auto it = outq_.begin(); it != outq_.end() && niov + 4 <= 48; ++it, ++idx) {
        Out& o = *it;
        std::size_t skip = o.sent;
        auto add = [&](const void* p, std::size_t len) {
          if (skip >= len) {
            skip -= len;
            return;
          }
          iov[niov].iov_base = const_cast<char*>(static_cast<const char*>(p) + skip);
          iov[niov].iov_len = len - skip;
          ++niov;
          skip = 0;
        };
        add(&o.hdr, sizeof(Header));
        if (o.hdr.flags & kFlagMeta) {
          add(&o.meta_len, 4);
          add(o.meta.data(), o.meta.size());
        }
        if (o.plen) add(o.payload, o.plen);
      }
      msghdr mh{};
      mh.msg_iov = iov;
      mh.msg_iovlen = niov;
      const ssize_t n = ::sendmsg(fd_, &mh, MSG_NOSIGNAL);
      if (n < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
          arm(true);
          return;
        }
        ::shutdown(fd_, SHUT_RDWR);  // the loop sees it and closes the connection
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

  // Loop thread: stop reading this stream; false when its queue was written meanwhile.
  bool pause_reading() {
    std::lock_guard<std::mutex> g(wmu_);
    if (closed_ || queued_.load() <= queue_share()) return false;
    reading_ = false;
    counters_->paused++;
    arm(armed_out_);
    return true;
  }

  // The peer does not read its replies: count it and make the loop close the stream.
  void drop_unread_locked() {
    if (!unread_) counters_->unread_closed++;
    unread_ = true;
    ::shutdown(fd_, SHUT_RDWR);  // the loop sees it and closes the connection
  }

  // epoll interest: reading unless paused (hang-ups are reported either way), writing when
  // something waits for the socket
  void arm(bool out) {
    const bool in = reading_.load();
    if ((out == armed_out_ && in == armed_in_) || epfd_ < 0) return;
    epoll_event ev{};
    ev.events = EPOLLRDHUP | (in ? EPOLLIN : 0) | (out ? EPOLLOUT : 0);
    ev.data.fd = fd_;
    if (epoll_ctl(epfd_, EPOLL_CTL_MOD, fd_, &ev) == 0) armed_out_ = out, armed_in_ = in;
  }

  std::mutex wmu_;
  std::deque<Out> outq_;
  bool closed_ = false;
  bool unread_ = false;  // closed for leaving its replies unread
  bool armed_out_ = false, armed_in_ = true;
  bool long_ = false;   // outq_ held many messages since it was last empty
  std::atomic<bool> reading_{true};   // false: over its share, not read
  std::atomic<std::size_t> queued_{0};  // cost() of outq_
  double progress_ = 0;  // when the queue last took a byte (or began to fill)
  int epfd_ = -1;
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

// ---- an epoll loop -------------------------------------------------------------------------
class IoLoop {
 public:
  using Tick = std::function<void(const std::unordered_map<int, std::shared_ptr<Conn>>&)>;

  IoLoop() {
    epfd_ = epoll_create1(EPOLL_CLOEXEC);
    evfd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (epfd_ < 0 || evfd_ < 0) throw std::runtime_error("data plane: epoll/eventfd failed");
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = evfd_;
    epoll_ctl(epfd_, EPOLL_CTL_ADD, evfd_, &ev);
  }
  ~IoLoop() {
    stop();
    ::close(epfd_);
    ::close(evfd_);
  }

  void start(Tick tick) {
    tick_ = std::move(tick);
    th_ = std::thread([this] { run(); });
  }

  void add(std::shared_ptr<Conn> c) {
    {
      std::lock_guard<std::mutex> g(mu_);
      adds_.push_back(std::move(c));
    }
    wake();
  }

  void stop() {
    if (stop_.exchange(true)) {
      if (th_.joinable() && th_.get_id() != std::this_thread::get_id()) th_.join();
      return;
    }
    wake();
    if (th_.joinable()) th_.join();
    for (auto& kv : conns_) kv.second->close_now();
    conns_.clear();
    std::lock_guard<std::mutex> g(mu_);
    for (auto& c : adds_) c->close_now();
    adds_.clear();
  }

  void close_conn(const std::shared_ptr<Conn>& c) {
    epoll_ctl(epfd_, EPOLL_CTL_DEL, c->fd(), nullptr);
    conns_.erase(c->fd());
    c->close_now();
  }

 private:
  void wake() {
    std::uint64_t one = 1;
    ssize_t r = ::write(evfd_, &one, sizeof one);
    (void)r;
  }

  void run() {
    epoll_event evs[64];
    double last_tick = monotonic_now();
    while (!stop_.load()) {
      {
        std::lock_guard<std::mutex> g(mu_);
        for (auto& c : adds_) {
          epoll_event ev{};
          ev.events = EPOLLIN | EPOLLRDHUP;
          ev.data.fd = c->fd();
          c->set_epoll(epfd_);
          if (epoll_ctl(epfd_, EPOLL_CTL_ADD, c->fd(), &ev) == 0) {
            conns_[c->fd()] = c;
            c->on_writable();  // what was queued before the loop knew the stream
          } else {
            c->close_now();
          }
        }
        adds_.clear();
      }
      const int n = epoll_wait(epfd_, evs, 64, 250);
      for (int i = 0; i < n; ++i) {
        const int fd = evs[i].data.fd;
        if (fd == evfd_) {
          std::uint64_t v;
          ssize_t r = ::read(evfd_, &v, sizeof v);
          (void)r;
          continue;
        }
        auto it = conns_.find(fd);
        if (it == conns_.end()) continue;
        std::shared_ptr<Conn> c = it->second;
        if (evs[i].events & EPOLLOUT) c->on_writable();
        if (evs[i].events & (EPOLLIN | EPOLLERR | EPOLLHUP | EPOLLRDHUP)) {
          if (!c->on_readable()) close_conn(c);
        }
      }
      const double now = monotonic_now();
      if (tick_ && now - last_tick > 0.5) {
        last_tick = now;
        tick_(conns_);
      }
    }
  }

  int epfd_ = -1, evfd_ = -1;
  std::thread th_;
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::vector<std::shared_ptr<Conn>> adds_;
  std::unordered_map<int, std::shared_ptr<Conn>> conns_;
  Tick tick_;
};

// =============================================================================================
// server
// =============================================================================================
struct Store {
  std::uint64_t key = 0;
  int wire_dtype = 0;
  DType kdt = DType::kFloat32;
  std::size_t nbytes = 0, count = 0, nchunks = 0;
  std::string decl;
  int decl_rank = 0;
  std::unique_ptr<char[]> buf[2];
  std::unique_ptr<std::uint32_t[]> fill[2];   // pushes summed into each chunk this round
  std::unique_ptr<std::mutex[]> chunk_mu;
  std::mutex mu;                               // everything below
  std::int64_t round = 0, completed = -1;
  // elastic membership epochs (reset_epoch): a push begun in an older generation sums nothing
  // more and completes nothing; read under chunk_mu (sum_chunk) or mu, written under both
  std::atomic<std::uint64_t> gen{0};
  std::uint64_t charged = 0;                   // its bytes of the memory budget
  int contrib[2] = {0, 0};                     // pushes summed into each buffer's round
  std::vector<std::uint8_t> pushed;            // per worker rank, this round
  int started = 0, finished = 0;               // pushes begun / summed this round
  double round_started = 0;
  std::string failed;
  std::string failed_kind = "mismatch", failed_extra;  // the error kind and extra JSON members
  struct Pending {
    std::weak_ptr<Conn> conn;
    std::int64_t round;
  };
  std::vector<Pending> pending;
};

class ServerConn;

class ServerImpl {
 public:
  ServerImpl(int num_workers, int server_rank, std::uint32_t job, int io_threads,
             std::uint64_t max_msg, std::uint64_t max_store, int max_conns, std::string key)
      : num_workers_(num_workers), rank_(server_rank), job_(job), max_msg_(max_msg),
        max_store_(max_store), max_conns_(max_conns), key_(std::move(key)),
        joined_(static_cast<std::size_t>(std::max(0, num_workers)), 0),
        required_(num_workers) {
    for (int i = 0; i < std::max(1, io_threads); ++i) loops_.emplace_back(new IoLoop());
  }
  ~ServerImpl() { close(); }

  int listen(const std::string& host, int port) {
    addrinfo hints{}, *res = nullptr;
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE;
    const std::string ps = std::to_string(port);
    const int rc = getaddrinfo(host.empty() || host == "*" ? nullptr : host.c_str(), ps.c_str(),
                               &hints, &res);
    if (rc != 0) throw std::runtime_error("data plane: cannot resolve " + host + ": " +
                                          gai_strerror(rc));
    std::string err = "no address";
    for (addrinfo* a = res; a; a = a->ai_next) {
      const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, 0);
      if (fd < 0) continue;
      int one = 1;
      setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
      if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 1024) == 0) {
        lfd_ = fd;
        break;
      }
      err = std::strerror(errno);
      ::close(fd);
    }
    freeaddrinfo(res);
    if (lfd_ < 0) throw std::runtime_error("data plane: cannot listen on " + host + ":" + ps +
                                           ": " + err);
    sockaddr_storage ss{};
    socklen_t sl = sizeof ss;
    getsockname(lfd_, reinterpret_cast<sockaddr*>(&ss), &sl);
    return ss.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port)
                                    : ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  }

  void start() {
    for (auto& l : loops_) l->start([this](const auto& conns) { tick(conns); });
    acceptor_ = std::thread([this] { accept_loop(); });
  }

  void close() {
    if (closing_.exchange(true)) return;
    if (acceptor_.joinable()) acceptor_.join();
    if (lfd_ >= 0) ::close(lfd_);
    lfd_ = -1;
    for (auto& l : loops_) l->stop();
  }

  bool claim_zmq_key(std::uint64_t key) {
    std::lock_guard<std::mutex> g(map_mu_);
    if (stores_.count(key)) return false;
    zmq_keys_.insert(key);
    return true;
  }

  // Memory the ZeroMQ path's stores take (positive) or give back (negative), charged to the
  // same budget as the native stores: false, and nothing charged, when it does not fit.
  bool reserve(std::int64_t bytes) {
    std::lock_guard<std::mutex> g(map_mu_);
    if (bytes < 0) {
      const std::uint64_t back = static_cast<std::uint64_t>(-bytes);
      store_bytes_ -= std::min<std::uint64_t>(back, store_bytes_);
      return true;
    }
    if (store_bytes_ + static_cast<std::uint64_t>(bytes) > max_store_) return false;
    store_bytes_ += static_cast<std::uint64_t>(bytes);
    return true;
  }

  void reject(const std::string& reason) {
    std::lock_guard<std::mutex> g(rej_mu_);
    rejected_[reason]++;
  }
  std::map<std::string, std::uint64_t> rejected() {
    std::lock_guard<std::mutex> g(rej_mu_);
    return rejected_;
  }
  std::map<std::string, std::uint64_t> stats() {
    std::map<std::string, std::uint64_t> s = c_.snapshot();
    s["pushes"] = c_.pushes;
    s["rounds"] = c_.rounds;
    s["bytes_summed"] = c_.bytes_summed;
    s["connections"] = c_.connections;
    s["live_connections"] = static_cast<std::uint64_t>(std::max(0, live_conns_.load()));
    s["io_threads"] = loops_.size();
    {
      std::lock_guard<std::mutex> g(map_mu_);
      s["keys"] = stores_.size();
      s["store_bytes"] = store_bytes_;
    }
    std::uint64_t rej = 0;
    for (auto& kv : rejected()) rej += kv.second;
    s["rejected"] = rej;
    return s;
  }

  std::vector<StallInfo> stalls(double min_age) {
    std::vector<std::shared_ptr<Store>> all;
    {
      std::lock_guard<std::mutex> g(map_mu_);
      for (auto& kv : stores_) all.push_back(kv.second);
    }
    const double now = monotonic_now();
    std::vector<StallInfo> out;
    for (auto& st : all) {
      std::lock_guard<std::mutex> g(st->mu);
      if (st->started == 0 || !st->failed.empty() || now - st->round_started < min_age) continue;
      StallInfo si{st->key, st->round, now - st->round_started, {}, st->decl};
      for (int r = 0; r < num_workers_; ++r)
        if (st->pushed[r]) si.pushed.push_back(r);
      out.push_back(std::move(si));
    }
    return out;
  }

  // ---- called by connections (their loop thread) ----
  Counters c_;
  const int num_workers_;
  std::atomic<int> rank_;
  const std::uint32_t job_;
  const std::uint64_t max_msg_, max_store_;
  const int max_conns_;
  const std::string key_;   // empty: streams are not authenticated
  // membership (set_members): mem_mu_ is taken after a store's mu, never before it
  std::mutex mem_mu_;
  std::vector<std::uint8_t> joined_;
  std::map<int, std::string> left_;
  std::atomic<int> required_{0};  // pushes that complete a round: workers not joined
  std::atomic<std::int64_t> round_base_{0};  // elastic: the epoch's first round (new keys')

  // extra: more JSON members, already encoded (",\"rank\":1"), or empty
  void send_error(const std::shared_ptr<Conn>& conn, const Header& h, const char* kind,
                  const std::string& text, const std::string& extra = std::string()) {
    Out o;
    o.hdr = make_header(kError, kRoleServer, rank_.load(), kFlagMeta, job_, h.key, h.round);
    // the message capped (it may quote a peer's declaration): a reply costs its queue little
    std::size_t cut = text.size();
    if (cut > kMaxErrorText) {  // at a character's first byte (UTF-8)
      cut = kMaxErrorText;
      while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) --cut;
    }
    const std::string capped = cut < text.size() ? text.substr(0, cut) + "..." : text;
    o.meta = std::string("{\"kind\":\"") + kind + "\",\"message\":\"" + json_escape(capped) +
             "\",\"type\":\"" + type_name(h.type) + "\"" + extra + "}";
    o.meta.shrink_to_fit();
    conn->send(std::move(o));
  }

  void send_resp(const std::shared_ptr<Conn>& conn, const std::shared_ptr<Store>& st,
                 std::int64_t round) {
    Out o;
    // st->contrib is written under st->mu when the round completes, before any answer for it
    const int n = st->contrib[round & 1];
    const std::uint32_t flags =
        n < num_workers_ ? kFlagContrib | (static_cast<std::uint32_t>(n) << kContribShift) : 0;
    o.hdr = make_header(kPullResp, kRoleServer, rank_.load(), flags, job_, st->key, round,
                        static_cast<std::uint8_t>(st->wire_dtype), st->count, st->nbytes);
    o.payload = st->buf[round & 1].get();
    o.plen = st->nbytes;
    o.keep = st;
    conn->send(std::move(o));
  }

  // A push's header (and declaration) arrived: the store it sums into, or null after an
  // error reply (the caller discards the payload).
  std::shared_ptr<Store> begin_push(const std::shared_ptr<Conn>& conn, const Header& h,
                                    const std::string& meta, std::uint64_t* gen) {
    const int kdt = wire_to_kernel_dtype(h.dtype);
    if (kdt < 0) {
      reject("dtype that cannot be summed");
      send_error(conn, h, "protocol", "server " + std::to_string(rank_.load()) + ": dtype code " +
                 std::to_string(h.dtype) + " cannot be summed");
      return nullptr;
    }
    if (h.flags & (kFlagCompressed | kFlagAsync)) {
      reject("compressed or async push on the native data plane");
      send_error(conn, h, "protocol", "server " + std::to_string(rank_.load()) +
                 ": compressed and asynchronous pushes travel over ZeroMQ, not the native data "
                 "plane");
      return nullptr;
    }
    std::shared_ptr<Store> st;
    {
      std::lock_guard<std::mutex> g(map_mu_);
      auto it = stores_.find(h.key);
      if (it != stores_.end()) {
        st = it->second;
      } else {
        const std::int64_t base = round_base_.load();
        if (base > 0 && h.round < base) {  // an elastic epoch that is over: no new key
          reject("push of a superseded epoch");
          send_error(conn, h, "epoch", "key " + std::to_string(h.key) + ": push from worker "
                     "rank " + std::to_string(h.rank) + " belongs to a membership epoch that "
                     "has ended");
          return nullptr;
        }
        if (!(h.flags & kFlagDeclare) || meta.empty()) {
          reject("push of an undeclared key");
          send_error(conn, h, "protocol", "first push of key " + std::to_string(h.key) +
                     " from worker rank " + std::to_string(h.rank) + " carries no declaration");
          return nullptr;
        }
        if (zmq_keys_.count(h.key)) {
          reject("key served over ZeroMQ");
          send_error(conn, h, "mismatch", "key " + std::to_string(h.key) + " (" + meta +
                     ") is served over ZeroMQ by another worker (compressed, or sent from "
                     "device memory) but worker rank " + std::to_string(h.rank) + " pushed it "
                     "over the native data plane; every worker must use the same "
                     "BYTEPS_DATA_PLANE, compressor and transport settings");
          return nullptr;
        }
        if (h.nbytes == 0) {
          reject("empty partition");
          send_error(conn, h, "protocol", "push of key " + std::to_string(h.key) +
                     " with no bytes");
          return nullptr;
        }
        // two buffers, the declaration kept for comparisons and the per-chunk bookkeeping
        const std::size_t nchunks = (h.nbytes + kChunk - 1) / kChunk;
        const std::uint64_t need = 2 * h.nbytes + meta.size() + kStoreOverhead +
                                   nchunks * (2 * sizeof(std::uint32_t) + sizeof(std::mutex));
        if (store_bytes_ + need > max_store_) {
          reject("server memory budget exhausted");
          send_error(conn, h, "protocol", "server " + std::to_string(rank_.load()) + ": key " +
                     std::to_string(h.key) + " needs " + std::to_string(need) +
                     " bytes, over the budget of " + std::to_string(max_store_) +
                     " (BYTEPS_SERVER_MAX_BYTES); " + std::to_string(store_bytes_) +
                     " bytes are held");
          return nullptr;
        }
        st = std::make_shared<Store>();
        st->key = h.key;
        st->wire_dtype = h.dtype;
        st->kdt = static_cast<DType>(kdt);
        st->nbytes = h.nbytes;
        st->count = h.count;
        st->nchunks = nchunks;
        st->decl = meta;
        st->decl_rank = h.rank;
        for (int b = 0; b < 2; ++b) {
          st->buf[b].reset(new char[h.nbytes]);
          st->fill[b].reset(new std::uint32_t[st->nchunks]());
        }
        st->chunk_mu.reset(new std::mutex[st->nchunks]);
        st->pushed.assign(num_workers_, 0);
        st->round = round_base_.load();  // a key first declared in a later elastic epoch
        st->charged = need;
        stores_[h.key] = st;
        store_bytes_ += need;
      }
    }
    std::lock_guard<std::mutex> g(st->mu);
    // Checked in this order, as on the ZeroMQ path (server/core.py, _check): a push that
    // declares another tensor than the key's is a worker disagreeing, whatever its size; its
    // dtype and size otherwise (rejected alone); its round (rejected alone, whatever it
    // declares); then a real mismatch fails the key, naming both sides.
    const bool mismatch = (h.flags & kFlagDeclare) && meta != st->decl;
    if (!mismatch && (h.dtype != st->wire_dtype || h.nbytes != st->nbytes)) {
      reject("wrong dtype or size for a declared key");
      send_error(conn, h, "protocol", "push to key " + std::to_string(h.key) + " from worker "
                 "rank " + std::to_string(h.rank) + ": " + std::to_string(h.nbytes) +
                 " bytes of dtype code " + std::to_string(h.dtype) + ", but the key holds " +
                 std::to_string(st->nbytes) + " bytes of dtype code " +
                 std::to_string(st->wire_dtype));
      return nullptr;
    }
    // a push for another round is rejected alone, whatever it declares
    if (h.round != st->round || st->pushed[h.rank]) {
      reject("push out of round");
      // one text for both causes and no round number: the reply tells nobody the open round
      send_error(conn, h, "protocol", "key " + std::to_string(h.key) + ": push from worker "
                 "rank " + std::to_string(h.rank) + " for round " + std::to_string(h.round) +
                 ", a round that is not open or that this rank has pushed already");
      return nullptr;
    }
    if (mismatch && st->failed.empty()) {
      fail_key_locked(*st, "tensor mismatch on key " + std::to_string(h.key) + ": worker rank " +
                      std::to_string(st->decl_rank) + " declared " + describe_decl(st->decl) +
                      " but worker rank " + std::to_string(h.rank) + " declared " +
                      describe_decl(meta) +
                      "; every worker must declare the same tensors, in the same order, with "
                      "the same shape, dtype and compressor");
    }
    if (!st->failed.empty()) {
      send_error(conn, h, st->failed_kind.c_str(), st->failed, st->failed_extra);
      return nullptr;
    }
    std::map<int, std::string> left;
    {
      std::lock_guard<std::mutex> m(mem_mu_);
      if (joined_[h.rank]) {
        reject("push after join()");
        send_error(conn, h, "protocol", "key " + std::to_string(h.key) + ": push from worker "
                   "rank " + std::to_string(h.rank) + ", which has called join(); a joined "
                   "rank pushes again only after every rank has joined");
        return nullptr;
      }
      left = left_;
    }
    st->pushed[h.rank] = 1;
    *gen = st->gen.load();
    if (st->started++ == 0) st->round_started = monotonic_now();
    if (!left.empty() && doom_if_left_locked(*st, left)) {
      send_error(conn, h, st->failed_kind.c_str(), st->failed, st->failed_extra);
      return nullptr;
    }
    return st;
  }

  void sum_chunk(Store& st, std::int64_t round, std::size_t offset, const char* data,
                 std::size_t len, std::uint64_t gen) {
    const std::size_t c = offset / kChunk;
    const int par = static_cast<int>(round & 1);
    char* dst = st.buf[par].get() + offset;
    std::lock_guard<std::mutex> g(st.chunk_mu[c]);
    if (st.gen.load() != gen) return;  // begun before a membership epoch reset: dropped
    if (st.fill[par][c]++ == 0) {
      std::memcpy(dst, data, len);
    } else {
      add_into(st.kdt, dst, data, len / itemsize(st.kdt), 1);
    }
  }

  void finish_push(const std::shared_ptr<Conn>& conn, const std::shared_ptr<Store>& st,
                   const Header& h, std::uint64_t gen) {
    std::vector<Store::Pending> answer;
    std::int64_t done_round = -1;
    bool failed;
    {
      std::lock_guard<std::mutex> g(st->mu);
      if (st->gen.load() != gen) {  // the epoch it belonged to was reset meanwhile
        reject("push of a superseded epoch");
        send_error(conn, h, "epoch", "key " + std::to_string(h.key) + ": push from worker "
                   "rank " + std::to_string(h.rank) + " belongs to a membership epoch that "
                   "ended while it arrived; it was dropped");
        return;
      }
      c_.pushes++;
      c_.bytes_summed += h.nbytes;
      failed = !st->failed.empty();
      if (!failed) {
        Out ack;
        ack.hdr = make_header(kPushAck, kRoleServer, rank_.load(), 0, job_, h.key, h.round);
        conn->send(std::move(ack));
        if (h.flags & kFlagPull) st->pending.push_back({conn, h.round});
        ++st->finished;
        done_round = complete_if_ready_locked(*st, &answer);
      } else {
        send_error(conn, h, st->failed_kind.c_str(), st->failed, st->failed_extra);
      }
    }
    for (auto& p : answer) {
      if (auto c = p.conn.lock()) send_resp(c, st, done_round);
    }
  }

  // The open round is complete once every worker rank that has not joined has pushed (and
  // summed) it: close it, hand its waiting pulls to the caller, return its number (-1: open).
  std::int64_t complete_if_ready_locked(Store& st, std::vector<Store::Pending>* answer) {
    const int need = required_.load();
    if (st.finished == 0 || st.finished < need || st.finished != st.started) return -1;
    const std::int64_t done = st.round;
    st.contrib[done & 1] = st.finished;
    st.completed = st.round;
    st.round++;
    st.started = st.finished = 0;
    std::fill(st.pushed.begin(), st.pushed.end(), 0);
    // the next round sums into the other buffer, last used two rounds ago
    std::fill(st.fill[st.round & 1].get(), st.fill[st.round & 1].get() + st.nchunks, 0u);
    answer->swap(st.pending);
    c_.rounds++;
    return done;
  }

  // A round that a rank which left the job has not pushed can never complete: fail the key
  // (every waiting and later operation gets the "peer_left" error naming the rank).
  bool doom_if_left_locked(Store& st, const std::map<int, std::string>& left) {
    if (!st.failed.empty() || (st.started == 0 && st.pending.empty())) return false;
    for (auto& kv : left) {
      if (kv.first < 0 || kv.first >= num_workers_ || st.pushed[kv.first]) continue;
      const std::int64_t last = st.round - 1;
      st.failed_kind = "peer_left";
      st.failed_extra = ",\"rank\":" + std::to_string(kv.first) + ",\"last_round\":" +
                        std::to_string(last);
      fail_key_locked(st, kv.second + "; round " + std::to_string(st.round) + " of key " +
                      std::to_string(st.key) + " (" + describe_decl(st.decl) +
                      ") can never complete (the last round it pushed was " + std::to_string(last) +
                      "). Ranks that run fewer steps must call join() when they are done");
      return true;
    }
    return false;
  }

  void set_members(const std::vector<int>& joined, const std::map<int, std::string>& left) {
    {
      std::lock_guard<std::mutex> m(mem_mu_);
      std::fill(joined_.begin(), joined_.end(), 0);
      int n = 0;
      for (int r : joined)
        if (r >= 0 && r < num_workers_ && !joined_[r]) joined_[r] = 1, ++n;
      left_ = left;
      required_.store(num_workers_ - n);
    }
    std::vector<std::shared_ptr<Store>> all;
    {
      std::lock_guard<std::mutex> g(map_mu_);
      for (auto& kv : stores_) all.push_back(kv.second);
    }
    for (auto& st : all) {
      std::vector<Store::Pending> answer;
      std::int64_t done = -1;
      {
        std::lock_guard<std::mutex> g(st->mu);
        if (!st->failed.empty()) continue;
        if (!left.empty() && doom_if_left_locked(*st, left)) continue;
        done = complete_if_ready_locked(*st, &answer);
      }
      for (auto& p : answer) {
        if (auto c = p.conn.lock()) send_resp(c, st, done);
      }
    }
  }

  // Elastic membership: a new epoch. Every open round of the old one is dropped (its waiting
  // pulls get an "epoch" error, pushes still arriving sum nothing), every key restarts at
  // round `round_base` (the epoch in the round's high bits, so a stale push or pull is out of
  // round) and a round completes with `required` pushes. join() state is cleared.
  void reset_epoch(std::int64_t round_base, int required) {
    {
      std::lock_guard<std::mutex> m(mem_mu_);
      std::fill(joined_.begin(), joined_.end(), 0);
      left_.clear();
      required_.store(std::max(1, std::min(required, num_workers_)));
    }
    // every key is forgotten: the new epoch declares its tensors afresh (a name may come back
    // with another shape, a joiner declares in its own order); keys made from now on start at
    // the epoch's base round
    std::vector<std::shared_ptr<Store>> all;
    {
      std::lock_guard<std::mutex> g(map_mu_);
      round_base_.store(round_base);
      for (auto& kv : stores_) {
        all.push_back(kv.second);
        store_bytes_ -= std::min<std::uint64_t>(kv.second->charged, store_bytes_);
      }
      stores_.clear();
      zmq_keys_.clear();
    }
    for (auto& st : all) {
      std::lock_guard<std::mutex> g(st->mu);
      st->gen.fetch_add(1);
      Header h = make_header(kPull, 0, 0, 0, 0, st->key, 0);
      for (auto& p : st->pending) {
        if (auto c = p.conn.lock()) {
          h.round = p.round;
          send_error(c, h, "epoch", "key " + std::to_string(st->key) + ": the membership "
                     "epoch of this round ended (a worker left or joined); the round was "
                     "dropped");
        }
      }
      st->pending.clear();
      if (st->failed_kind == "peer_left") st->failed.clear(), st->failed_kind = "mismatch",
                                          st->failed_extra.clear();
      st->round = round_base;
      st->completed = -1;
      st->started = st->finished = 0;
      std::fill(st->pushed.begin(), st->pushed.end(), 0);
      for (std::size_t c = 0; c < st->nchunks; ++c) {
        std::lock_guard<std::mutex> cg(st->chunk_mu[c]);  // waits out a sum of the old epoch
        st->fill[0][c] = st->fill[1][c] = 0;
      }
    }
  }

  void handle_pull(const std::shared_ptr<Conn>& conn, const Header& h) {
    std::shared_ptr<Store> st;
    {
      std::lock_guard<std::mutex> g(map_mu_);
      auto it = stores_.find(h.key);
      if (it != stores_.end()) st = it->second;
    }
    if (!st) {
      reject("pull of an undeclared key");
      send_error(conn, h, "protocol", "pull of key " + std::to_string(h.key) +
                 " before any push");
      return;
    }
    std::unique_lock<std::mutex> g(st->mu);
    if (!st->failed.empty()) {
      const std::string text = st->failed, kind = st->failed_kind, extra = st->failed_extra;
      g.unlock();
      send_error(conn, h, kind.c_str(), text, extra);
    } else if (h.round == st->completed && h.round >= 0) {
      g.unlock();
      send_resp(conn, st, h.round);
    } else if (h.round == st->round &&
               st->pending.size() < 4 * static_cast<std::size_t>(num_workers_)) {
      st->pending.push_back({conn, h.round});
    } else {
      const bool crowded = h.round == st->round;
      g.unlock();
      reject(crowded ? "too many pulls waiting" : "pull out of round");
      // no round number but the peer's own: the reply tells nobody the open round
      send_error(conn, h, "protocol", "key " + std::to_string(h.key) + ": pull of round " +
                 std::to_string(h.round) + " from worker rank " + std::to_string(h.rank) +
                 (crowded ? ": too many pulls already wait for this round"
                          : ", which is neither the open round nor the last completed one"));
    }
  }

  void fail_key_locked(Store& st, const std::string& text) {
    st.failed = text;
    Header h = make_header(kPull, 0, 0, 0, 0, st.key, 0);
    for (auto& p : st.pending) {
      if (auto c = p.conn.lock()) {
        h.round = p.round;
        send_error(c, h, st.failed_kind.c_str(), text, st.failed_extra);
      }
    }
    st.pending.clear();
  }

 private:
  void accept_loop() {
    std::size_t next = 0;
    while (!closing_.load()) {
      pollfd pfd{lfd_, POLLIN, 0};
      const int r = ::poll(&pfd, 1, 200);
      if (r <= 0) continue;
      const int fd = ::accept4(lfd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) {
        if (errno == EMFILE || errno == ENFILE) {
          reject("file descriptor limit");
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
        }
        continue;
      }
      // Slots for streams that have said hello (and proved the secret, in a job with one):
      // streams that have not are at most a quarter of the slots, and the oldest of them
      // makes room for a new connection, so peers without the secret cannot hold the slots
      // a reconnecting or joining worker needs.
      const bool full = live_conns_.load() >= max_conns_;
      if ((full || unproven_.load() >= std::max(1, max_conns_ / 4)) && !evict_unproven()) {
        reject("too many connections");
        ::close(fd);
        continue;
      }
      set_nodelay(fd);
      live_conns_++;
      unproven_++;
      c_.connections++;
      auto conn = make_conn(fd);
      {
        std::lock_guard<std::mutex> g(slot_mu_);
        unproven_q_.push_back(conn);
      }
      loops_[next++ % loops_.size()]->add(conn);
    }
  }

  // Closes the oldest stream that has not said hello; false when there is none.
  bool evict_unproven();

  std::shared_ptr<Conn> make_conn(int fd);

  void tick(const std::unordered_map<int, std::shared_ptr<Conn>>& conns);

 public:
  std::atomic<int> live_conns_{0};
  std::atomic<int> unproven_{0};  // open streams that have not said hello (or proved it)
  std::atomic<int> closed_since_trim_{0};  // streams closed since memory was last given back
  std::vector<std::unique_ptr<IoLoop>> loops_;

 private:
  std::mutex slot_mu_;
  std::deque<std::weak_ptr<Conn>> unproven_q_;  // in accept order (some proven or closed)
  std::mutex trim_mu_;
  double trimmed_at_ = 0;
  int lfd_ = -1;
  std::thread acceptor_;
  std::atomic<bool> closing_{false};
  std::mutex map_mu_;
  std::unordered_map<std::uint64_t, std::shared_ptr<Store>> stores_;
  std::unordered_set<std::uint64_t> zmq_keys_;
  std::uint64_t store_bytes_ = 0;
  std::mutex rej_mu_;
  std::map<std::string, std::uint64_t> rejected_;
};

class ServerConn : public FramedConn {
 public:
  ServerConn(int fd, ServerImpl* srv) : FramedConn(fd, &srv->c_), srv_(srv) { read_header(); }
  bool hello_done() const { return hello_; }
  // Leaves the streams that have not said hello (hello, close or eviction); false if it had.
  bool prove() {
    if (!unproven_.exchange(false)) return false;
    srv_->unproven_--;
    return true;
  }

 protected:
  void on_closed() override {
    prove();
    srv_->live_conns_--;
    srv_->closed_since_trim_++;
  }
  std::size_t queue_share() const override {
    return std::max(kMinShare, kReplyBudget / std::max(1, srv_->live_conns_.load()));
  }

  bool advance() override {
    switch (state_) {
      case kHdr: return on_header();
      case kMetaLen:
        if (read_meta("meta frame over 1 MiB")) return true;
        srv_->reject("oversized meta");
        return false;
      case kMeta: return after_meta();
      case kPayload: {
        const std::size_t len = static_cast<std::size_t>(rptr_ - scratch_.data());
        srv_->sum_chunk(*store_, h_.round, off_, scratch_.data(), len, gen_);
        off_ += len;
        return next_chunk();
      }
      case kDiscard: return next_discard();
      case kNonceIn: return on_nonce();
      case kMacIn: return on_mac();
    }
    return false;
  }

 private:

  bool on_nonce() {
    Out o;
    if (srv_->key_.empty()) {  // the worker has a secret, this job none: say so plainly
      hello_ = true;
      prove();
      o.hdr = make_header(kHello, kRoleServer, srv_->rank_.load(), 0, srv_->job_, stream_, 0);
      send(std::move(o));
      return read_header();
    }
    auto reply = std::make_shared<std::array<std::uint8_t, 64>>();
    random_bytes(my_nonce_, kNonce);
    std::memcpy(reply->data(), my_nonce_, kNonce);
    hello_mac(srv_->key_, "bpsl-srv", srv_->job_, rank_, stream_, peer_nonce_, my_nonce_,
              reply->data() + kNonce);
    o.hdr = make_header(kHello, kRoleServer, srv_->rank_.load(), kFlagAuth, srv_->job_, stream_,
                        0, 0, 0, 64);
    o.payload = reinterpret_cast<const char*>(reply->data());
    o.plen = 64;
    o.keep = reply;
    send(std::move(o));
    awaiting_mac_ = true;
    return read_header();
  }

  bool on_mac() {
    std::uint8_t want[32];
    hello_mac(srv_->key_, "bpsl-cli", srv_->job_, rank_, stream_, my_nonce_, peer_nonce_, want);
    if (!equal_ct(want, peer_mac_, 32)) {
      srv_->reject("authentication failed");
      why_ = "the worker's proof does not match this job's secret";
      return false;
    }
    awaiting_mac_ = false;
    hello_ = true;
    prove();
    return read_header();
  }

  bool on_header() {
    counters_->msgs_in++;
    if (std::memcmp(h_.magic, kMagic, 4) != 0) {
      srv_->reject("malformed");
      why_ = "bad magic: not a byteps_like peer";
      return false;
    }
    if (h_.version != kVersion) {
      srv_->reject("malformed");
      why_ = "protocol version mismatch";
      return false;
    }
    if (!hello_) {
      if (awaiting_mac_) {  // the worker's proof
        if (h_.type != kHello || !(h_.flags & kFlagAuth) || h_.nbytes != 32 ||
            h_.job != srv_->job_ || h_.rank != rank_) {
          srv_->reject("authentication failed");
          why_ = "no valid proof of the job's secret";
          return false;
        }
        state_ = kMacIn;
        expect(reinterpret_cast<char*>(peer_mac_), 32);
        return true;
      }
      const bool auth = h_.flags & kFlagAuth;
      if (h_.type != kHello || h_.job != srv_->job_ || h_.role != kRoleWorker || h_.rank < 0 ||
          h_.rank >= srv_->num_workers_ || (h_.flags & kFlagMeta) ||
          h_.nbytes != (auth ? kNonce : 0)) {
        srv_->reject("bad hello");
        why_ = "the first message was not a valid hello of this job";
        return false;  // no reply: an unregistered peer learns nothing
      }
      if (!srv_->key_.empty() && !auth) {
        srv_->reject("authentication failed");
        why_ = "a hello without authentication, and this job has a secret";
        return false;
      }
      rank_ = h_.rank;
      stream_ = h_.key;
      if (auth) {  // the worker's nonce first
        state_ = kNonceIn;
        expect(reinterpret_cast<char*>(peer_nonce_), kNonce);
        return true;
      }
      hello_ = true;
      prove();
      Out o;
      o.hdr = make_header(kHello, kRoleServer, srv_->rank_.load(), 0, srv_->job_, h_.key, 0);
      send(std::move(o));
      return read_header();
    }
    if (h_.job != srv_->job_ || h_.rank != rank_ || h_.role != kRoleWorker) {
      srv_->reject("wrong job or rank for this stream");
      why_ = "a message with another job tag or rank than the stream's hello";
      return false;
    }
    if (h_.type == kPush) {
      const std::size_t isz = wire_itemsize(h_.dtype);
      if (!count_matches(h_, isz) || h_.nbytes > srv_->max_msg_) {
        srv_->reject("malformed");
        why_ = "PUSH with an inconsistent or oversized length";
        return false;
      }
    } else if (h_.type != kPull) {
      srv_->reject("unexpected type or rank");
      why_ = std::string("unexpected ") + type_name(h_.type) + " on a data stream";
      return false;
    }
    meta_.clear();
    if (h_.flags & kFlagMeta) return read_meta_len();
    return after_meta();
  }

  bool after_meta() {
    auto self = shared_from_this();
    if (h_.type == kPull) {
      srv_->handle_pull(self, h_);
      return read_header();
    }
    store_ = srv_->begin_push(self, h_, meta_, &gen_);
    off_ = 0;
    if (!store_) {
      discard_left_ = h_.nbytes;
      return next_discard();
    }
    return next_chunk();
  }

  bool next_chunk() {
    if (off_ >= h_.nbytes) {
      srv_->finish_push(shared_from_this(), store_, h_, gen_);
      store_.reset();
      return read_header();
    }
    const std::size_t len = std::min<std::size_t>(kChunk, h_.nbytes - off_);
    if (scratch_.size() < len) scratch_.resize(kChunk);
    state_ = kPayload;
    expect(scratch_.data(), len);
    return true;
  }

  ServerImpl* srv_;
  std::shared_ptr<Store> store_;
  std::uint64_t gen_ = 0;   // the store's epoch generation when this push began
  std::size_t off_ = 0;
  bool hello_ = false, awaiting_mac_ = false;
  int rank_ = -1;
  std::uint64_t stream_ = 0;
  std::uint8_t peer_nonce_[kNonce] = {}, my_nonce_[kNonce] = {}, peer_mac_[32] = {};
  std::atomic<bool> unproven_{true};   // counted in srv_->unproven_
};

bool ServerImpl::evict_unproven() {
  std::lock_guard<std::mutex> g(slot_mu_);
  while (!unproven_q_.empty()) {
    std::shared_ptr<Conn> c = unproven_q_.front().lock();
    unproven_q_.pop_front();
    auto* sc = static_cast<ServerConn*>(c.get());
    if (sc && sc->prove()) {  // counted out now; its loop closes it
      reject("stream without hello evicted for a new one");
      sc->shut();
      return true;
    }
  }
  return false;
}

std::shared_ptr<Conn> ServerImpl::make_conn(int fd) {
  return std::make_shared<ServerConn>(fd, this);
}

void ServerImpl::tick(const std::unordered_map<int, std::shared_ptr<Conn>>& conns) {
  // streams that never said hello are closed: a connection flood holds no descriptor for long;
  // streams whose peer leaves its replies unread are closed too
  const double now = monotonic_now();
  for (auto& kv : conns) {
    auto* sc = static_cast<ServerConn*>(kv.second.get());
    if (!sc->hello_done() && now - sc->created > kHelloTimeout) {
      reject("no hello in time");
      sc->shut();
    } else if (sc->drop_if_unread(now)) {
      reject("replies left unread");
    }
  }
  // the memory of closed streams (their queues, a large meta) goes back to the system, at
  // most once a second
  if (closed_since_trim_.load() > 0 && now - trimmed_at_ > 1.0 && trim_mu_.try_lock()) {
    std::lock_guard<std::mutex> g(trim_mu_, std::adopt_lock);
    if (now - trimmed_at_ > 1.0 && closed_since_trim_.exchange(0) > 0) {
      trimmed_at_ = now;
#ifdef __GLIBC__
      malloc_trim(0);
#endif
    }
  }
}

DataServer::DataServer(int num_workers, int server_rank, std::uint32_t job, int io_threads,
                       std::uint64_t max_msg, std::uint64_t max_store, int max_conns,
                       std::string auth_key)
    : impl_(new ServerImpl(num_workers, server_rank, job, io_threads, max_msg, max_store,
                           max_conns, std::move(auth_key))) {}
DataServer::~DataServer() = default;
int DataServer::listen(const std::string& host, int port) { return impl_->listen(host, port); }
void DataServer::start() { impl_->start(); }
void DataServer::close() { impl_->close(); }
bool DataServer::claim_zmq_key(std::uint64_t key) { return impl_->claim_zmq_key(key); }
bool DataServer::reserve(std::int64_t bytes) { return impl_->reserve(bytes); }
void DataServer::set_rank(int rank) { impl_->rank_ = rank; }
std::map<std::string, std::uint64_t> DataServer::stats() { return impl_->stats(); }
std::map<std::string, std::uint64_t> DataServer::rejected() { return impl_->rejected(); }
std::vector<StallInfo> DataServer::stalls(double min_age) { return impl_->stalls(min_age); }
void DataServer::set_members(const std::vector<int>& joined,
                             const std::map<int, std::string>& left) {
  impl_->set_members(joined, left);
}
void DataServer::reset_epoch(std::int64_t round_base, int required) {
  impl_->reset_epoch(round_base, required);
}

// =============================================================================================
// client
// =============================================================================================
struct Op;
struct Part {
  PartSpec spec;
  bool dispatched = false, acked = false, done = false;
  double t_sent = 0, t_acked = 0, t_done = 0;
};
struct Op {
  std::uint64_t id = 0;
  int priority = 0;
  const char* src = nullptr;
  char* dst = nullptr;
  int wire_dtype = 0;
  DType kdt = DType::kFloat32;
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

class ClientConn;

class ClientImpl {
 public:
  ClientImpl(int rank, std::uint32_t job, int io_threads, std::uint64_t credit,
             std::uint64_t max_msg, std::string key)
      : rank_(rank), job_(job), key_(std::move(key)), credit_(credit), max_msg_(max_msg) {
    for (int i = 0; i < std::max(1, io_threads); ++i) {
      loops_.emplace_back(new IoLoop());
      loops_.back()->start(nullptr);
    }
  }
  ~ClientImpl() { close(); }

  void connect(int server, const std::string& host, int port, int streams, double timeout);

  void submit(std::uint64_t id, int priority, const char* src, char* dst, int wire_dtype,
              std::int64_t divisor, std::vector<PartSpec> parts) {
    auto op = std::make_shared<Op>();
    op->id = id;
    op->priority = priority;
    op->src = src;
    op->dst = dst;
    op->wire_dtype = wire_dtype;
    const int kdt = wire_to_kernel_dtype(wire_dtype);
    if (kdt < 0) throw std::invalid_argument("submit: wire dtype cannot be summed");
    op->kdt = static_cast<DType>(kdt);
    op->divisor = divisor;
    op->parts.resize(parts.size());
    for (std::size_t i = 0; i < parts.size(); ++i) op->parts[i].spec = std::move(parts[i]);
    op->remaining = parts.size();
    std::vector<Ready> ready;
    {
      std::lock_guard<std::mutex> g(mu_);
      if (closed_) throw std::runtime_error("the data plane is closed");
      if (ops_.count(id)) throw std::invalid_argument("submit: operation id in use");
      ops_[id] = op;
      for (std::size_t i = 0; i < op->parts.size(); ++i) {
        const PartSpec& s = op->parts[i].spec;
        if (s.server < 0 || s.server >= static_cast<int>(servers_.size()) ||
            servers_[s.server].conns.empty()) {
          fail_locked(*op, "internal", -1, "no data-plane connection to server " +
                      std::to_string(s.server));
          break;
        }
        if (!servers_[s.server].lost.empty()) {
          fail_locked(*op, "peer_lost", s.server, servers_[s.server].lost);
          break;
        }
        pq_.push(QItem{priority, seq_++, op, i});
      }
      maybe_report_locked(op);
      dispatch_locked(&ready);
    }
    send_ready(ready, true);
  }

  // The caller takes this completion itself: completions() leaves it alone meanwhile.
  bool wait(std::uint64_t id, double timeout) {
    std::unique_lock<std::mutex> g(mu_);
    auto pred = [&] { return done_.count(id) || !ops_.count(id) || closed_; };
    waited_.insert(id);
    bool ok;
    if (timeout < 0) {
      cv_.wait(g, pred);
      ok = true;
    } else {
      ok = cv_.wait_for(g, std::chrono::duration<double>(timeout), pred);
    }
    if (!ok) waited_.erase(id);  // no longer claimed: the completion thread may take it
    return ok;
  }

  bool take(std::uint64_t id, Completion* out) {
    std::lock_guard<std::mutex> g(mu_);
    auto it = done_.find(id);
    if (it == done_.end()) return false;
    *out = std::move(it->second);
    done_.erase(it);
    ops_.erase(id);
    waited_.erase(id);
    return true;
  }

  std::vector<Completion> completions(double timeout) {
    std::unique_lock<std::mutex> g(mu_);
    auto unclaimed = [&] {
      if (closed_) return true;
      for (auto& kv : done_)
        if (!waited_.count(kv.first)) return true;
      return false;
    };
    cv_.wait_for(g, std::chrono::duration<double>(timeout), unclaimed);
    std::vector<Completion> out;
    for (auto it = done_.begin(); it != done_.end();) {
      if (waited_.count(it->first)) {
        ++it;
        continue;
      }
      ops_.erase(it->first);
      out.push_back(std::move(it->second));
      it = done_.erase(it);
    }
    return out;
  }

  void close() {
    {
      std::lock_guard<std::mutex> g(mu_);
      if (closed_) return;
      closed_ = true;
    }
    for (auto& l : loops_) l->stop();   // closes every stream: their ops fail
    std::lock_guard<std::mutex> g(mu_);
    for (auto& kv : ops_) {
      fail_locked(*kv.second, "closed", -1, "the data plane was closed");
      kv.second->active = 0;
      maybe_report_locked(kv.second);
    }
    cv_.notify_all();
  }

  // Hold every partition in the queue (paused) or let them go in priority order again.
  void set_paused(bool paused) {
    std::vector<Ready> ready;
    {
      std::lock_guard<std::mutex> g(mu_);
      paused_ = paused;
      dispatch_locked(&ready);
    }
    send_ready(ready, true);
  }

  std::vector<std::uint64_t> take_dispatch_log() {
    std::lock_guard<std::mutex> g(mu_);
    std::vector<std::uint64_t> out;
    out.swap(log_);
    return out;
  }

  std::map<std::string, std::uint64_t> stats() {
    std::map<std::string, std::uint64_t> s = c_.snapshot();
    s["io_threads"] = loops_.size();
    std::lock_guard<std::mutex> g(mu_);
    s["inflight_bytes"] = inflight_bytes_;
    s["ops"] = ops_.size();
    std::uint64_t streams = 0;
    for (auto& sv : servers_) streams += sv.conns.size();
    s["streams"] = streams;
    return s;
  }

  // ---- called by streams (loop threads) ----
  Counters c_;
  const int rank_;
  const std::uint32_t job_;
  const std::string key_;

  struct Target {
    std::shared_ptr<Op> op;
    std::size_t idx = 0;
    int contrib = 0;  // > 0: the round summed this many pushes (ranks had joined)
  };

  // PUSH_ACK: the push is in the server's hands; its bytes leave the credit.
  void on_ack(int server, const Header& h) {
    std::vector<Ready> ready;
    {
      std::lock_guard<std::mutex> g(mu_);
      auto it = inflight_.find(h.key);
      if (it == inflight_.end() || it->second.op->parts[it->second.idx].spec.round != h.round ||
          it->second.op->parts[it->second.idx].spec.server != server)
        return;
      Part& p = it->second.op->parts[it->second.idx];
      if (p.t_acked == 0) p.t_acked = monotonic_now();
      release_locked(p);
      dispatch_locked(&ready);
    }
    send_ready(ready);
  }

  // PULL_RESP header: where its payload goes (null: discard it).
  char* on_resp(int server, const Header& h, Target* t) {
    std::lock_guard<std::mutex> g(mu_);
    auto it = inflight_.find(h.key);
    if (it == inflight_.end()) return nullptr;
    Op& op = *it->second.op;
    Part& p = op.parts[it->second.idx];
    if (p.spec.round != h.round || p.spec.server != server || op.failed) return nullptr;
    if (h.dtype != op.wire_dtype || h.nbytes != p.spec.nbytes) {
      auto keep = it->second.op;
      fail_locked(op, "protocol", server, "server " + std::to_string(server) +
                  " answered key " + std::to_string(h.key) + " with " +
                  std::to_string(h.nbytes) + " bytes of dtype code " +
                  std::to_string(h.dtype) + ", expected " + std::to_string(p.spec.nbytes) +
                  " bytes of dtype code " + std::to_string(op.wire_dtype));
      maybe_report_locked(keep);
      return nullptr;
    }
    *t = it->second;
    t->contrib = (h.flags & kFlagContrib) ? static_cast<int>(h.flags >> kContribShift) : 0;
    op.active++;
    return op.dst + p.spec.offset;
  }

  void resp_done(const Target& t, bool ok) {
    Op& op = *t.op;
    Part& p = op.parts[t.idx];
    // an average divides by the ranks that pushed: all of them, or those not joined (join())
    const std::int64_t div = t.contrib > 0 && op.divisor > 1 ? t.contrib : op.divisor;
    if (ok && div > 1 && !op.failed)
      scale_into(op.kdt, op.dst + p.spec.offset, p.spec.nbytes / itemsize(op.kdt), div, 1);
    std::vector<Ready> ready;
    {
      std::lock_guard<std::mutex> g(mu_);
      op.active--;
      if (ok && !p.done) {
        release_locked(p);
        p.done = true;
        op.bytes += p.spec.nbytes;
        auto it = inflight_.find(p.spec.key);
        if (it != inflight_.end() && it->second.op.get() == &op) inflight_.erase(it);
        op.remaining--;
        op.t_last = p.t_done = monotonic_now();
        if (p.t_acked == 0) p.t_acked = p.t_done;
      }
      maybe_report_locked(t.op);
      dispatch_locked(&ready);
    }
    send_ready(ready);
  }

  void on_error(int server, const Header& h, const std::string& meta) {
    std::lock_guard<std::mutex> g(mu_);
    auto it = inflight_.find(h.key);
    if (it == inflight_.end()) return;
    auto op = it->second.op;
    if (op->parts[it->second.idx].spec.round != h.round) return;
    fail_locked(*op, "remote", server, meta);
    maybe_report_locked(op);
  }

  void on_stream_lost(int server, const std::string& why) {
    std::lock_guard<std::mutex> g(mu_);
    if (closed_) return;
    ServerSlot& s = servers_[server];
    if (s.lost.empty())
      s.lost = "lost the data-plane connection to server rank " + std::to_string(server) + " (" +
               s.where + "): " + why;
    std::vector<std::shared_ptr<Op>> hit;
    for (auto& kv : ops_) {
      Op& op = *kv.second;
      if (op.reported) continue;
      for (auto& p : op.parts)
        if (p.spec.server == server && !p.done) {
          hit.push_back(kv.second);
          break;
        }
    }
    for (auto& op : hit) {
      fail_locked(*op, "peer_lost", server, s.lost);
      maybe_report_locked(op);
    }
  }

  void sent(const std::shared_ptr<Op>& op) {
    std::lock_guard<std::mutex> g(mu_);
    op->active--;
    maybe_report_locked(op);
  }

 private:
  struct QItem {
    int priority;
    std::uint64_t seq;
    std::shared_ptr<Op> op;
    std::size_t idx;
    bool operator<(const QItem& o) const {  // std::priority_queue pops the largest
      if (priority != o.priority) return priority < o.priority;
      return seq > o.seq;
    }
  };
  struct Ready {
    std::shared_ptr<Op> op;
    std::size_t idx;
    std::shared_ptr<Conn> conn;
  };
  struct ServerSlot {
    std::vector<std::shared_ptr<Conn>> conns;
    std::string where, lost;
  };

  void release_locked(Part& p) {
    if (p.dispatched && !p.acked) {
      p.acked = true;
      inflight_bytes_ -= std::min<std::uint64_t>(inflight_bytes_, p.spec.nbytes);
    }
  }

  void fail_locked(Op& op, const std::string& kind, int server, const std::string& msg) {
    if (op.failed) return;
    op.failed = true;
    op.kind = kind;
    op.err_server = server;
    op.message = msg;
    for (auto& p : op.parts) {
      release_locked(p);
      auto it = inflight_.find(p.spec.key);
      if (it != inflight_.end() && it->second.op.get() == &op) inflight_.erase(it);
    }
  }

  void maybe_report_locked(const std::shared_ptr<Op>& op) {
    if (op->reported || op->active > 0 || !(op->failed || op->remaining == 0)) return;
    op->reported = true;
    Completion c;
    c.op = op->id;
    c.ok = !op->failed;
    c.kind = op->kind;
    c.server = op->err_server;
    c.message = op->message;
    c.t_first_send = op->t_first;
    c.t_last_done = op->t_last;
    c.bytes = op->bytes;
    c.times.reserve(3 * op->parts.size());
    for (const Part& p : op->parts) {
      c.times.push_back(p.t_sent);
      c.times.push_back(p.t_acked);
      c.times.push_back(p.t_done);
    }
    done_[op->id] = std::move(c);
    cv_.notify_all();
  }

  void dispatch_locked(std::vector<Ready>* ready) {
    while (!pq_.empty() && !paused_) {
      const QItem& top = pq_.top();
      Op& op = *top.op;
      Part& p = op.parts[top.idx];
      if (op.failed) {
        pq_.pop();
        continue;
      }
      if (credit_ && inflight_bytes_ > 0 && inflight_bytes_ + p.spec.nbytes > credit_) break;
      ServerSlot& s = servers_[p.spec.server];
      if (!s.lost.empty()) {
        auto keep = top.op;
        pq_.pop();
        fail_locked(op, "peer_lost", p.spec.server, s.lost);
        maybe_report_locked(keep);
        continue;
      }
      p.dispatched = true;
      p.t_sent = monotonic_now();
      if (log_.size() < kDispatchLog) log_.push_back(p.spec.key);
      inflight_bytes_ += p.spec.nbytes;
      inflight_[p.spec.key] = Target{top.op, top.idx};
      if (op.t_first == 0) op.t_first = monotonic_now();
      op.active++;
      ready->push_back(Ready{top.op, top.idx,
                             s.conns[static_cast<std::size_t>(p.spec.conn) % s.conns.size()]});
      pq_.pop();
    }
  }

  // from_user: the submitting (Python) thread, which only queues; I/O threads write inline
  void send_ready(std::vector<Ready>& ready, bool from_user = false) {
    for (auto& r : ready) {
      Op& op = *r.op;
      const PartSpec& s = op.parts[r.idx].spec;
      Out o;
      std::uint32_t flags = kFlagPull;
      if (!s.decl.empty()) {
        flags |= kFlagDeclare | kFlagMeta;
        o.meta = s.decl;
      }
      o.hdr = make_header(kPush, kRoleWorker, rank_, flags, job_, s.key, s.round,
                          static_cast<std::uint8_t>(op.wire_dtype),
                          s.nbytes / itemsize(op.kdt), s.nbytes);
      o.payload = op.src + s.offset;
      o.plen = s.nbytes;
      auto keep = r.op;
      o.done = [this, keep](bool) { sent(keep); };
      if (from_user) {
        r.conn->post(std::move(o));
      } else {
        r.conn->send(std::move(o));
      }
    }
    ready.clear();
  }

  const std::uint64_t credit_, max_msg_;
  std::vector<std::unique_ptr<IoLoop>> loops_;
  std::size_t next_loop_ = 0;
  std::mutex mu_;
  std::condition_variable cv_;
  bool closed_ = false;
  std::vector<ServerSlot> servers_;
  std::unordered_map<std::uint64_t, std::shared_ptr<Op>> ops_;
  std::map<std::uint64_t, Completion> done_;
  std::unordered_set<std::uint64_t> waited_;     // completions a waiter takes itself
  std::priority_queue<QItem> pq_;
  std::uint64_t seq_ = 0;
  std::uint64_t inflight_bytes_ = 0;
  std::unordered_map<std::uint64_t, Target> inflight_;   // key -> partition in flight
  bool paused_ = false;
  static constexpr std::size_t kDispatchLog = 4096;
  std::vector<std::uint64_t> log_;                        // keys in the order they went out

 public:
  std::uint64_t max_msg() const { return max_msg_; }
};

class ClientConn : public FramedConn {
 public:
  ClientConn(int fd, ClientImpl* cli, int server)
      : FramedConn(fd, &cli->c_), cli_(cli), server_(server) {
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
        ClientImpl::Target t = target_;
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
    if (std::memcmp(h_.magic, kMagic, 4) != 0 || h_.version != kVersion ||
        h_.job != cli_->job_ || h_.role != kRoleServer) {
      why_ = "a malformed message or one of another job from the server";
      return false;
    }
    switch (h_.type) {
      case kPushAck:
        cli_->on_ack(server_, h_);
        return read_header();
      case kPullResp: {
        const std::size_t isz = wire_itemsize(h_.dtype);
        if (!count_matches(h_, isz) || h_.nbytes > cli_->max_msg() || (h_.flags & kFlagMeta)) {
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

  ClientImpl* cli_;
  int server_;
  ClientImpl::Target target_;
};

namespace {

bool io_full(int fd, char* p, std::size_t n, bool out, double deadline, std::string* err) {
  while (n > 0) {
    const double left = deadline - monotonic_now();
    if (left <= 0) {
      *err = "timed out";
      return false;
    }
    pollfd pfd{fd, static_cast<short>(out ? POLLOUT : POLLIN), 0};
    const int r = ::poll(&pfd, 1, static_cast<int>(left * 1000) + 1);
    if (r < 0 && errno != EINTR) {
      *err = std::strerror(errno);
      return false;
    }
    if (r <= 0) continue;
    const ssize_t k = out ? ::send(fd, p, n, MSG_NOSIGNAL) : ::recv(fd, p, n, 0);
    if (k > 0) {
      p += k;
      n -= static_cast<std::size_t>(k);
    } else if (k == 0) {
      *err = "the server closed the connection";
      return false;
    } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      *err = std::strerror(errno);
      return false;
    }
  }
  return true;
}

// One stream: connect (retrying until the deadline), say hello, check the answer.
int open_stream(const std::string& host, int port, int rank, std::uint32_t job, int stream,
                double deadline, const std::string& key, std::string* err) {
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  const std::string ps = std::to_string(port);
  const int rc = getaddrinfo(host.c_str(), ps.c_str(), &hints, &res);
  if (rc != 0) {
    *err = std::string("cannot resolve ") + host + ": " + gai_strerror(rc);
    return -1;
  }
  int fd = -1;
  while (fd < 0 && monotonic_now() < deadline) {
    for (addrinfo* a = res; a && fd < 0; a = a->ai_next) {
      const int s = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, 0);
      if (s < 0) continue;
      if (::connect(s, a->ai_addr, a->ai_addrlen) == 0) {
        fd = s;
      } else {
        *err = std::strerror(errno);
        ::close(s);
      }
    }
    if (fd < 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  freeaddrinfo(res);
  if (fd < 0) return -1;
  set_nodelay(fd);
  set_nonblocking(fd);
  const bool auth = !key.empty();
  const std::uint64_t sid = static_cast<std::uint64_t>(stream);
  Header h = make_header(kHello, kRoleWorker, rank, auth ? kFlagAuth : 0, job, sid, 0, 0, 0,
                         auth ? kNonce : 0);
  std::uint8_t nonce[kNonce];
  if (auth) random_bytes(nonce, kNonce);
  Header r{};
  if (!io_full(fd, reinterpret_cast<char*>(&h), sizeof h, true, deadline, err) ||
      (auth && !io_full(fd, reinterpret_cast<char*>(nonce), kNonce, true, deadline, err)) ||
      !io_full(fd, reinterpret_cast<char*>(&r), sizeof r, false, deadline, err)) {
    *err = "no hello from the server (" + *err + "): is it a byteps_like server of this job" +
           (auth ? std::string(" (and does it have the job's secret)?")
                 : std::string("? A server with a secret closes streams that do not "
                               "authenticate: give every node the same BYTEPS_AUTH_SECRET"));
    ::close(fd);
    return -1;
  }
  if (std::memcmp(r.magic, kMagic, 4) != 0 || r.version != kVersion || r.type != kHello ||
      r.job != job || r.role != kRoleServer) {
    *err = "the peer's hello is not that of a byteps_like server of this job";
    ::close(fd);
    return -1;
  }
  if (auth) {
    if (!(r.flags & kFlagAuth) || r.nbytes != 64) {
      *err = "the server does not authenticate its streams: give every node the same "
             "BYTEPS_AUTH_SECRET";
      ::close(fd);
      return -1;
    }
    std::uint8_t got[64], want[32], proof[32];
    if (!io_full(fd, reinterpret_cast<char*>(got), 64, false, deadline, err)) {
      ::close(fd);
      return -1;
    }
    hello_mac(key, "bpsl-srv", job, rank, sid, nonce, got, want);
    if (!equal_ct(want, got + kNonce, 32)) {
      *err = "authentication failed: the server's proof does not match this job's secret "
             "(BYTEPS_AUTH_SECRET differs between nodes)";
      ::close(fd);
      return -1;
    }
    hello_mac(key, "bpsl-cli", job, rank, sid, got, nonce, proof);
    Header a = make_header(kHello, kRoleWorker, rank, kFlagAuth, job, sid, 0, 0, 0, 32);
    if (!io_full(fd, reinterpret_cast<char*>(&a), sizeof a, true, deadline, err) ||
        !io_full(fd, reinterpret_cast<char*>(proof), 32, true, deadline, err)) {
      ::close(fd);
      return -1;
    }
  }
  return fd;
}

}  // namespace

void ClientImpl::connect(int server, const std::string& host, int port, int streams,
                         double timeout) {
  if (server < 0 || streams < 1) throw std::invalid_argument("connect: bad server or streams");
  const double deadline = monotonic_now() + timeout;
  std::vector<std::shared_ptr<Conn>> conns;
  for (int i = 0; i < streams; ++i) {
    std::string err;
    const int fd = open_stream(host, port, rank_, job_, i, deadline, key_, &err);
    if (fd < 0) {
      for (auto& c : conns) c->close_now();
      throw std::runtime_error("data plane: cannot reach server " + std::to_string(server) +
                               " at " + host + ":" + std::to_string(port) + ": " + err);
    }
    conns.push_back(std::make_shared<ClientConn>(fd, this, server));
  }
  {
    std::lock_guard<std::mutex> g(mu_);
    if (static_cast<int>(servers_.size()) <= server) servers_.resize(server + 1);
    servers_[server].conns = conns;
    servers_[server].where = host + ":" + std::to_string(port);
    servers_[server].lost.clear();
  }
  for (auto& c : conns) loops_[next_loop_++ % loops_.size()]->add(c);
}

DataClient::DataClient(int rank, std::uint32_t job, int io_threads, std::uint64_t credit,
                       std::uint64_t max_msg, std::string auth_key)
    : impl_(new ClientImpl(rank, job, io_threads, credit, max_msg, std::move(auth_key))) {}
DataClient::~DataClient() = default;
void DataClient::connect(int server, const std::string& host, int port, int streams,
                         double timeout) {
  impl_->connect(server, host, port, streams, timeout);
}
void DataClient::submit(std::uint64_t op, int priority, const char* src, char* dst,
                        int wire_dtype, std::int64_t divisor, std::vector<PartSpec> parts) {
  impl_->submit(op, priority, src, dst, wire_dtype, divisor, std::move(parts));
}
bool DataClient::wait(std::uint64_t op, double timeout) { return impl_->wait(op, timeout); }
bool DataClient::take(std::uint64_t op, Completion* out) { return impl_->take(op, out); }
std::vector<Completion> DataClient::completions(double timeout) {
  return impl_->completions(timeout);
}
void DataClient::close() { impl_->close(); }
void DataClient::set_paused(bool paused) { impl_->set_paused(paused); }
std::vector<std::uint64_t> DataClient::take_dispatch_log() { return impl_->take_dispatch_log(); }
std::map<std::string, std::uint64_t> DataClient::stats() { return impl_->stats(); }

}  // namespace dp
}  // namespace bps
