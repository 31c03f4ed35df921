// The native data plane (dataplane.h): the helpers both ends use and the epoll I/O loop that
// runs their streams (dataplane_io.h). The server is in dataplane_server.cc, the worker's
// client in dataplane_client.cc, the authenticated hello in dataplane_auth.cc.
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/eventfd.h>
#include <time.h>

#include <cstdio>
#include <stdexcept>

#include "dataplane_io.h"

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
  std::lock_guard<std::mutex> g(mu_);
  for (auto& c : adds_) c->close_now();
  adds_.clear();
}

void IoLoop::close_conn(const std::shared_ptr<Conn>& c) {
  epoll_ctl(epfd_, EPOLL_CTL_DEL, c->fd(), nullptr);
  conns_.erase(c->fd());
  c->close_now();
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

}  // namespace dp
}  // namespace bps
