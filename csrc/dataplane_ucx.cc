// UCX streams of the native data plane (dataplane_ucx.h). Built against the libucx wheel's
// headers when setup.py found them (BPS_WITH_UCX); libucp itself is opened at run time, so the
// extension loads and serves TCP streams on machines without UCX.
#include "dataplane_ucx.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>
#include <thread>

#include "dataplane_auth.h"

#if BPS_WITH_UCX
#include <dlfcn.h>
#include <unistd.h>

#include "dataplane_ucx_internal.h"
#endif

namespace bps {
namespace dp {

#if !BPS_WITH_UCX

bool ucx_built() { return false; }
bool ucx_load(const std::string&, const std::map<std::string, std::string>&, std::string* err) {
  *err = ucx_unavailable();
  return false;
}
std::string ucx_unavailable() {
  return "this byteps_like._core was built without UCX's headers: install the `ucx` extra "
         "(the libucx wheel) first, then build byteps_like again (pip install --no-deps "
         "--force-reinstall, or pip install -e . in a source tree)";
}
std::unique_ptr<UcxWorker> make_ucx_worker(int) { throw std::runtime_error(ucx_unavailable()); }
std::unique_ptr<Link> ucx_open_stream(UcxWorker*, const std::string&, int, int, std::uint32_t,
                                      int, double, const std::string&, std::string* err, bool) {
  *err = ucx_unavailable();
  return nullptr;
}
std::unique_ptr<UcxListener> ucx_listen(UcxWorker*, const std::string&, int, UcxAccept) {
  throw std::runtime_error(ucx_unavailable());
}
struct UcxRawStream::Impl {};
UcxRawStream::UcxRawStream(const std::string&, int) {
  throw std::runtime_error(ucx_unavailable());
}
UcxRawStream::~UcxRawStream() = default;
void UcxRawStream::send(const std::string&, double, bool) {}
std::string UcxRawStream::recv(std::size_t, double, bool) { return ""; }
void UcxRawStream::close() {}

#else  // BPS_WITH_UCX

using namespace ucxi;  // NOLINT: the link's internals (dataplane_ucx_internal.h)

namespace ucxi {
ucp_context_h g_ctx = nullptr;
}  // namespace ucxi

namespace {

std::mutex g_mu;
bool g_tried = false;
std::string g_err = "UCX is not loaded (byteps_like.transport.ucx_native.load() loads it)";
pid_t g_pid = 0;  // the process that made the context: a forked child may not use it

std::string sockaddr_of(const std::string& host, int port, sockaddr_storage* ss,
                        socklen_t* len, bool passive) {
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  const std::string ps = std::to_string(port);
  const int rc = getaddrinfo(host.empty() || host == "*" ? nullptr : host.c_str(), ps.c_str(),
                             &hints, &res);
  if (rc != 0) return std::string("cannot resolve ") + host + ": " + gai_strerror(rc);
  std::memcpy(ss, res->ai_addr, res->ai_addrlen);
  *len = res->ai_addrlen;
  freeaddrinfo(res);
  return "";
}

// The hello's transfers over a link not yet in a loop: exactly n bytes out or in.
bool ucx_io_full(UcxLink* link, char* p, std::size_t n, bool out, double deadline,
                 std::string* err) {
  if (out) return link->send_bytes(p, n, deadline, err);
  const ssize_t got = link->recv_bytes(p, n, true, deadline, err);
  if (got == static_cast<ssize_t>(n)) return true;
  if (err->empty()) *err = "the peer closed the stream";
  return false;
}

// The listener's context: the worker, the server's admission, the listener itself.
struct ListenCtx {
  Worker* w;
  UcxAccept take;
  ucp_listener_h l = nullptr;
};

void on_conn_request(ucp_conn_request_h req, void* arg) {
  auto* ctx = static_cast<ListenCtx*>(arg);
  bool made = false;
  const bool taken = ctx->take([&](UcxWorker* on) -> std::unique_ptr<Link> {
    auto* w = static_cast<Worker*>(on);
    auto* st = new EpState();
    st->wake_fd = w->wake_fd();
    ucp_ep_params_t ep = ep_params(st);
    ep.field_mask |= UCP_EP_PARAM_FIELD_CONN_REQUEST;
    ep.conn_request = req;
    ucp_ep_h h = nullptr;
    if (g_api.ucp_ep_create(w->handle(), &ep, &h) != UCS_OK) {
      delete st;
      return nullptr;
    }
    made = true;
    return std::unique_ptr<Link>(new UcxLink(w, h, st));
  });
  if (!taken && !made) g_api.ucp_listener_reject(ctx->l, req);
}

class Listener : public UcxListener {
 public:
  Listener(Worker* w, const std::string& host, int port, UcxAccept take) {
    ctx_.w = w;
    ctx_.take = std::move(take);
    sockaddr_storage ss{};
    socklen_t sl = 0;
    const std::string e = sockaddr_of(host, port, &ss, &sl, true);
    if (!e.empty()) throw std::runtime_error("data plane (UCX): " + e);
    ucp_listener_params_t lp{};
    lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
    lp.sockaddr.addr = reinterpret_cast<const sockaddr*>(&ss);
    lp.sockaddr.addrlen = sl;
    lp.conn_handler.cb = on_conn_request;
    lp.conn_handler.arg = &ctx_;
    const ucs_status_t s = g_api.ucp_listener_create(w->handle(), &lp, &ctx_.l);
    if (s != UCS_OK)
      throw std::runtime_error("data plane (UCX): cannot listen on " + host + ":" +
                               std::to_string(port) + ": " + status_text(s));
    ucp_listener_attr_t la{};
    la.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
    g_api.ucp_listener_query(ctx_.l, &la);
    port_ = la.sockaddr.ss_family == AF_INET6
                ? ntohs(reinterpret_cast<sockaddr_in6*>(&la.sockaddr)->sin6_port)
                : ntohs(reinterpret_cast<sockaddr_in*>(&la.sockaddr)->sin_port);
  }
  ~Listener() override { g_api.ucp_listener_destroy(ctx_.l); }
  int port() const override { return port_; }

 private:
  ListenCtx ctx_;
  int port_ = 0;
};

}  // namespace

bool ucx_built() { return true; }

bool ucx_load(const std::string& path, const std::map<std::string, std::string>& settings,
              std::string* err) {
  std::lock_guard<std::mutex> g(g_mu);
  if (g_tried) {
    *err = g_ctx ? "" : g_err;
    return g_ctx != nullptr;
  }
  g_tried = true;
  void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    g_err = std::string("cannot open libucp (") + path + "): " + dlerror();
    *err = g_err;
    return false;
  }
  bool ok = true;
#define BPS_UCX_SYM(name)                                                         \
  g_api.name = reinterpret_cast<decltype(g_api.name)>(dlsym(h, #name));            \
  if (!g_api.name) {                                                               \
    ok = false;                                                                    \
    g_err = "libucp at " + path + " has no " #name " (UCX older than the headers?)"; \
  }
  BPS_UCX_FNS(BPS_UCX_SYM)
#undef BPS_UCX_SYM
  if (!ok) {
    *err = g_err;
    return false;
  }
  ucp_config_t* cfg = nullptr;
  ucs_status_t s = g_api.ucp_config_read(nullptr, nullptr, &cfg);
  if (s != UCS_OK) {
    g_err = std::string("UCX configuration: ") + status_text(s);
    *err = g_err;
    return false;
  }
  for (const auto& kv : settings) {
    s = g_api.ucp_config_modify(cfg, kv.first.c_str(), kv.second.c_str());
    if (s != UCS_OK) {
      g_api.ucp_config_release(cfg);
      g_err = "UCX setting " + kv.first + "=" + kv.second + ": " + status_text(s);
      *err = g_err;
      return false;
    }
  }
  ucp_params_t p{};
  p.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  p.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  p.mt_workers_shared = 1;
  s = g_api.ucp_init_version(UCP_API_MAJOR, UCP_API_MINOR, &p, cfg, &g_ctx);
  g_api.ucp_config_release(cfg);
  if (s != UCS_OK) {
    g_ctx = nullptr;
    g_err = std::string("UCX initialisation failed: ") + status_text(s);
    *err = g_err;
    return false;
  }
  g_pid = getpid();
  err->clear();
  return true;
}

std::string ucx_unavailable() {
  std::lock_guard<std::mutex> g(g_mu);
  if (g_ctx && getpid() != g_pid) {  // UCX's context, threads and connections stay with it
    return "UCX was set up in process " + std::to_string(g_pid) + ", and this process (" +
           std::to_string(getpid()) + ") is a fork of it: a forked child cannot use its "
           "parent's UCX context. Start the child with the 'spawn' or 'forkserver' start "
           "method, or fork before the parent uses BYTEPS_TRANSPORT=ucx";
  }
  return g_ctx ? "" : g_err;
}

std::unique_ptr<UcxWorker> make_ucx_worker(int wake_fd) {
  const std::string why = ucx_unavailable();
  if (!why.empty()) throw std::runtime_error("data plane: UCX streams unavailable: " + why);
  return std::unique_ptr<UcxWorker>(new Worker(wake_fd));
}

namespace {

// A client endpoint of worker w to the address ss (a stream's link, not connected until its
// first exchange); null and *err when UCX cannot make one.
std::unique_ptr<UcxLink> client_link(Worker* w, const sockaddr_storage& ss, socklen_t sl,
                                     std::string* err) {
  auto* st = new EpState();
  ucp_ep_params_t ep = ep_params(st);
  ep.field_mask |= UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR;
  ep.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
  ep.sockaddr.addr = reinterpret_cast<const sockaddr*>(&ss);
  ep.sockaddr.addrlen = sl;
  ucp_ep_h h = nullptr;
  const ucs_status_t s = g_api.ucp_ep_create(w->handle(), &ep, &h);
  if (s != UCS_OK) {
    delete st;
    *err = std::string("cannot make a UCX endpoint: ") + status_text(s);
    return nullptr;
  }
  return std::unique_ptr<UcxLink>(new UcxLink(w, h, st));
}

}  // namespace

std::unique_ptr<Link> ucx_open_stream(UcxWorker* uw, const std::string& host, int port,
                                      int rank, std::uint32_t job, int stream, double deadline,
                                      const std::string& key, std::string* err, bool table) {
  auto* w = static_cast<Worker*>(uw);
  sockaddr_storage ss{};
  socklen_t sl = 0;
  *err = sockaddr_of(host, port, &ss, &sl, false);
  if (!err->empty()) return nullptr;
  while (true) {  // a server not listening yet refuses: try again until the deadline
    std::unique_ptr<UcxLink> link = client_link(w, ss, sl, err);
    if (!link) return nullptr;
    EpState* st = link->state();
    std::size_t got = 0;  // bytes from the server: none means it was not reached
    const IoFull io = [&](char* p, std::size_t n, bool out, double dl, std::string* e) {
      const bool ok = ucx_io_full(link.get(), p, n, out, dl, e);
      if (ok && !out) got += n;
      return ok;
    };
    std::string e;
    if (say_hello(io, rank, job, stream, deadline, key, &e, table)) {
      st->wake_fd = w->wake_fd();
      return link;
    }
    // nothing listening there (yet): the endpoint never connected
    const int why = st->status.load();
    const bool refused = got == 0 && (why == UCS_ERR_NOT_CONNECTED || why == UCS_ERR_UNREACHABLE);
    link.reset();  // closes the endpoint
    *err = refused ? std::string("nothing accepts UCX connections there (") +
                         status_text(static_cast<ucs_status_t>(why)) + ")"
                   : e;
    if (!refused || monotonic_now() + 0.1 > deadline) return nullptr;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

std::unique_ptr<UcxListener> ucx_listen(UcxWorker* w, const std::string& host, int port,
                                        UcxAccept take) {
  return std::unique_ptr<UcxListener>(
      new Listener(static_cast<Worker*>(w), host, port, std::move(take)));
}

// ---- a bare stream for the tests that play a hostile peer ----------------------------------
struct UcxRawStream::Impl {
  std::unique_ptr<Worker> w;
  std::unique_ptr<UcxLink> link;
};

UcxRawStream::UcxRawStream(const std::string& host, int port) : impl_(new Impl) {
  const std::string why = ucx_unavailable();
  if (!why.empty()) throw std::runtime_error("UCX streams unavailable: " + why);
  impl_->w.reset(new Worker(-1));
  sockaddr_storage ss{};
  socklen_t sl = 0;
  std::string e = sockaddr_of(host, port, &ss, &sl, false);
  if (e.empty()) impl_->link = client_link(impl_->w.get(), ss, sl, &e);
  if (!impl_->link) throw std::runtime_error(e);
}

UcxRawStream::~UcxRawStream() { close(); }

// One eager message of the stream (its next sequence number), as a hostile peer would send.
void UcxRawStream::send(const std::string& bytes, double timeout, bool rndv) {
  if (!impl_->link) throw std::runtime_error("closed");
  std::string err;
  if (!impl_->link->send_bytes(bytes.data(), bytes.size(), monotonic_now() + timeout, &err,
                               rndv))
    throw std::runtime_error("send failed: " + err);
}

std::string UcxRawStream::recv(std::size_t n, double timeout, bool all) {
  if (!impl_->link) throw std::runtime_error("closed");
  std::string out(n, '\0');
  std::string err;
  const ssize_t got = impl_->link->recv_bytes(&out[0], n, all, monotonic_now() + timeout, &err);
  if (got < 0 && err == "timed out") {
    close();
    throw std::runtime_error("timed out");
  }
  if (got <= 0) {  // the peer closed (what came before it was read)
    close();
    return "";
  }
  out.resize(static_cast<std::size_t>(got));
  return out;
}

void UcxRawStream::close() {
  if (!impl_ || !impl_->link) return;
  impl_->link.reset();  // closes the endpoint
  impl_->w.reset();
}

#endif  // BPS_WITH_UCX

}  // namespace dp
}  // namespace bps
