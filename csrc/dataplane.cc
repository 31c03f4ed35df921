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

namespace {

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

// The text of the JSON object "field" holds in a declaration (its braces balanced, strings
// skipped), at most 200 characters; empty when absent.
std::string json_object(const std::string& j, const char* field) {
  const std::string pat = std::string("\"") + field + "\":{";
  const std::size_t at = j.find(pat);
  if (at == std::string::npos) return "";
  const std::size_t start = at + pat.size() - 1;
  int depth = 0;
  bool str = false;
  std::size_t i = start;
  for (; i < j.size(); ++i) {
    const char c = j[i];
    if (str) {
      if (c == '\\') ++i;
      else if (c == '"') str = false;
    } else if (c == '"') {
      str = true;
    } else if (c == '{') {
      ++depth;
    } else if (c == '}' && --depth == 0) {
      break;
    }
  }
  const std::string text = j.substr(start, i + 1 - start);
  return text.size() > 200 ? text.substr(0, 200) + "..." : text;
}

}  // namespace

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
  std::vector<std::uint64_t> codec;
  std::string how = " uncompressed";
  try {
    if (decl_codec(decl, &codec))
      how = " compressed with " + compress::describe(compress::params_from_list(codec));
    else if (!json_object(decl, "compressor").empty())  // a registered compressor's spec
      how = " compressed with " + json_object(decl, "compressor");
  } catch (const std::invalid_argument&) {
    how = " compressed (malformed codec parameters)";
  }
  return "'" + name + "' shape " + tuple + " " + dtype + how;
}

std::string json_field_text(const std::string& decl, const char* field, char* kind) {
  return json_field(decl, field, kind);
}

bool decl_codec(const std::string& decl, std::vector<std::uint64_t>* out) {
  char kind = 0;
  const std::string text = json_field(decl, "native_codec", &kind);
  if (text.empty()) return false;
  out->clear();
  if (kind != '[' || text.size() < 2 || text.back() != ']')
    throw std::invalid_argument("native_codec: not an array of integers");
  std::uint64_t v = 0;
  bool digit = false;
  for (std::size_t i = 1; i < text.size(); ++i) {
    const char c = text[i];
    if (c >= '0' && c <= '9') {
      const std::uint64_t d = static_cast<std::uint64_t>(c - '0');
      if (v > (~0ULL - d) / 10) throw std::invalid_argument("native_codec: a value over 2^64");
      v = v * 10 + d;
      digit = true;
    } else if ((c == ',' || c == ']') && digit && out->size() < 16) {
      out->push_back(v);
      v = 0;
      digit = false;
    } else {
      throw std::invalid_argument("native_codec: not an array of at most 16 integers");
    }
  }
  return true;
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
