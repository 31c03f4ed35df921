// The native data plane (dataplane.h): the helpers both ends use and the epoll I/O loop that
// runs their streams (dataplane_io.h). The server is in dataplane_server*.cc (declared in
// dataplane_server_impl.h), the worker's client in dataplane_client.cc, the authenticated
// hello in dataplane_auth.cc.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/eventfd.h>
#include <time.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>

#include "codec.h"
#include "decl.h"
#include "dataplane_io.h"
#include "dataplane_ucx.h"

namespace bps {
namespace dp {

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

// A declaration as people read it, as the ZeroMQ path prints it: 'w' shape (7, 3) float32.
std::string describe_decl(const std::string& raw) {
  Decl d;
  try {
    d = parse_decl(raw);
  } catch (const std::invalid_argument& exc) {
    return std::string("a malformed declaration: ") + exc.what();
  }
  std::string tuple = "(";
  for (std::size_t i = 0; i < d.shape.size(); ++i)
    tuple += (i ? ", " : "") + std::to_string(d.shape[i]);
  tuple += d.shape.size() == 1 ? ",)" : ")";
  std::string how = " uncompressed";
  try {
    if (!d.codec.empty())
      how = " compressed with " + compress::describe(compress::params_from_list(d.codec));
    else if (!d.spec.empty())  // a registered compressor's spec
      how = " compressed with " + (d.spec.size() > 200 ? d.spec.substr(0, 200) + "..." : d.spec);
  } catch (const std::invalid_argument&) {
    how = " compressed (malformed codec parameters)";
  }
  const std::string name = d.name.size() > 200 ? d.name.substr(0, 200) + "..." : d.name;
  return "'" + name + "' shape " + tuple + " " + kWireDTypes[d.dtype].name + how;
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

std::string error_meta(const char* kind, const std::string& text, int type,
                       const std::string& extra) {
  // the message capped (it may quote a peer's declaration): a reply costs its queue little
  std::size_t cut = text.size();
  if (cut > kMaxErrorText) {  // at a character's first byte (UTF-8)
    cut = kMaxErrorText;
    while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) --cut;
  }
  const std::string capped = cut < text.size() ? text.substr(0, cut) + "..." : text;
  std::string meta = std::string("{\"kind\":\"") + kind + "\",\"message\":\"" +
                     json_escape(capped) + "\",\"type\":\"" + type_name(type) + "\"" + extra + "}";
  meta.shrink_to_fit();
  return meta;
}

int listen_tcp(const std::string& host, int port, int* fd_out) {
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
  int lfd = -1;
  for (addrinfo* a = res; a; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 1024) == 0) {
      lfd = fd;
      break;
    }
    err = std::strerror(errno);
    ::close(fd);
  }
  freeaddrinfo(res);
  if (lfd < 0) throw std::runtime_error("data plane: cannot listen on " + host + ":" + ps +
                                        ": " + err);
  *fd_out = lfd;
  sockaddr_storage ss{};
  socklen_t sl = sizeof ss;
  getsockname(lfd, reinterpret_cast<sockaddr*>(&ss), &sl);
  return ss.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port)
                                  : ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
}

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

// ---- the epoll loop (dataplane_io.h) ---------------------------------------------------------
IoLoop::IoLoop() {
  epfd_ = epoll_create1(EPOLL_CLOEXEC);
  evfd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (epfd_ < 0 || evfd_ < 0) throw std::runtime_error("data plane: epoll/eventfd failed");
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = evfd_;
  epoll_ctl(epfd_, EPOLL_CTL_ADD, evfd_, &ev);
}

IoLoop::~IoLoop() {
  stop();
  ucx_.reset();  // after its streams
  ::close(epfd_);
  ::close(evfd_);
}

void IoLoop::start(Tick tick) {
  tick_ = std::move(tick);
  th_ = std::thread([this] { run(); });
}

void IoLoop::add(std::shared_ptr<Conn> c) {
  {
    std::lock_guard<std::mutex> g(mu_);
    adds_.push_back(std::move(c));
  }
  wake();
}

void IoLoop::stop() {
  if (stop_.exchange(true)) {
    if (th_.joinable() && th_.get_id() != std::this_thread::get_id()) th_.join();
    return;
  }
  wake();
  if (th_.joinable()) th_.join();
  for (auto& kv : conns_) kv.second->close_now();
  conns_.clear();
  ucx_conns_.clear();
  {
    std::lock_guard<std::mutex> g(mu_);
    for (auto& c : adds_) c->close_now();
    adds_.clear();
  }
  // the UCX worker goes with its streams: its connections close, so the peers see them end
  std::lock_guard<std::mutex> g(ucx_mu_);
  ucx_ptr_ = nullptr;
  ucx_.reset();
}

void IoLoop::close_conn(const std::shared_ptr<Conn>& c) {
  if (c->link()->progressed()) {
    ucx_conns_.erase(std::remove(ucx_conns_.begin(), ucx_conns_.end(), c), ucx_conns_.end());
  } else {
    epoll_ctl(epfd_, EPOLL_CTL_DEL, c->key(), nullptr);
  }
  conns_.erase(c->key());
  c->close_now();
}

UcxWorker* IoLoop::ucx() {
  if (UcxWorker* u = ucx_ptr_.load()) return u;
  std::lock_guard<std::mutex> g(ucx_mu_);
  if (!ucx_) {
    ucx_ = make_ucx_worker(evfd_);
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = ucx_->efd();
    epoll_ctl(epfd_, EPOLL_CTL_ADD, ucx_->efd(), &ev);
    ucx_ptr_ = ucx_.get();
  }
  return ucx_.get();
}

bool IoLoop::serve_ucx(UcxWorker* u) {
  u->progress();
  bool busy = false;
  const std::vector<std::shared_ptr<Conn>> conns = ucx_conns_;  // close_conn edits it
  for (const auto& c : conns) {
    c->on_writable();  // posts what was queued, takes what UCX is done with
    Link* l = c->link();
    if (!c->reading() && !l->hung()) continue;  // paused for its unread replies
    if (!c->on_readable()) {
      close_conn(c);
      continue;
    }
    if (c->reading() && l->more()) busy = true;  // stopped at its read budget
  }
  return busy || !u->arm();
}

void IoLoop::wake() {
  std::uint64_t one = 1;
  ssize_t r = ::write(evfd_, &one, sizeof one);
  (void)r;
}

void IoLoop::run() {
  epoll_event evs[64];
  double last_tick = monotonic_now();
  while (!stop_.load()) {
    {
      std::lock_guard<std::mutex> g(mu_);
      for (auto& c : adds_) {
        c->set_epoll(epfd_, evfd_);
        if (c->link()->progressed()) {  // UCX: served after each progress, not by epoll
          conns_[c->key()] = c;
          ucx_conns_.push_back(c);
          c->on_writable();
          continue;
        }
        epoll_event ev{};
        ev.events = EPOLLIN | EPOLLRDHUP;
        ev.data.fd = c->key();
        if (epoll_ctl(epfd_, EPOLL_CTL_ADD, c->key(), &ev) == 0) {
          conns_[c->key()] = c;
          c->on_writable();  // what was queued before the loop knew the stream
        } else {
          c->close_now();
        }
      }
      adds_.clear();
    }
    UcxWorker* u = ucx_ptr_.load();
    const int n = epoll_wait(epfd_, evs, 64, u && serve_ucx(u) ? 0 : 250);
    for (int i = 0; i < n; ++i) {
      const int fd = evs[i].data.fd;
      if (fd == evfd_) {
        std::uint64_t v;
        ssize_t r = ::read(evfd_, &v, sizeof v);
        (void)r;
        continue;
      }
      auto it = conns_.find(fd);
      if (it == conns_.end() || it->second->link()->progressed()) continue;  // UCX: above
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

}  // namespace dp
}  // namespace bps
