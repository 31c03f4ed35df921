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
#include <ucp/api/ucp.h>
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
                                      int, double, const std::string&, std::string* err) {
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
void UcxRawStream::send(const std::string&, double) {}
std::string UcxRawStream::recv(std::size_t, double, bool) { return ""; }
void UcxRawStream::close() {}

#else  // BPS_WITH_UCX

namespace {

// The UCP functions used, looked up in the library ucx_load() opened.
struct Api {
#define BPS_UCX_FN(name) decltype(&::name) name = nullptr;
#define BPS_UCX_FNS(X)                                                                    \
  X(ucp_config_read) X(ucp_config_release) X(ucp_config_modify) X(ucp_init_version) X(ucp_worker_create)       \
  X(ucp_worker_destroy) X(ucp_worker_get_efd) X(ucp_worker_arm) X(ucp_worker_progress)    \
  X(ucp_worker_query) X(ucp_listener_create) X(ucp_listener_destroy) X(ucp_listener_query) \
  X(ucp_listener_reject) X(ucp_ep_create) X(ucp_ep_close_nbx) X(ucp_stream_send_nbx)      \
  X(ucp_stream_recv_nbx) X(ucp_stream_recv_request_test) X(ucp_request_check_status)      \
  X(ucp_request_free) X(ucs_status_string)
  BPS_UCX_FNS(BPS_UCX_FN)
#undef BPS_UCX_FN
};

std::mutex g_mu;
bool g_tried = false;
std::string g_err = "UCX is not loaded (byteps_like.transport.ucx_native.load() loads it)";
Api g_api;
ucp_context_h g_ctx = nullptr;

const char* status_text(ucs_status_t s) { return g_api.ucs_status_string(s); }

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

// ---- an endpoint's error state, which outlives its link until UCX has closed it ----------
struct EpState {
  std::atomic<int> status{UCS_OK};  // set by the error callback (the peer left, ...)
  int wake_fd = -1;
};

void on_ep_error(void* arg, ucp_ep_h, ucs_status_t status) {
  auto* st = static_cast<EpState*>(arg);
  st->status = status;
  if (st->wake_fd >= 0) {
    std::uint64_t one = 1;
    ssize_t r = ::write(st->wake_fd, &one, sizeof one);
    (void)r;
  }
}

class Worker : public UcxWorker {
 public:
  explicit Worker(int wake_fd) : wake_fd_(wake_fd) {
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    // the loop thread progresses it; a worker's connect (its hello) and any thread's send
    // post on it too
    wp.thread_mode = UCS_THREAD_MODE_MULTI;
    ucs_status_t s = g_api.ucp_worker_create(g_ctx, &wp, &w_);
    if (s != UCS_OK)
      throw std::runtime_error(std::string("UCX: cannot make a worker: ") + status_text(s));
    ucp_worker_attr_t wa{};
    wa.field_mask = UCP_WORKER_ATTR_FIELD_THREAD_MODE;
    if (g_api.ucp_worker_query(w_, &wa) != UCS_OK || wa.thread_mode != UCS_THREAD_MODE_MULTI) {
      g_api.ucp_worker_destroy(w_);
      throw std::runtime_error("UCX: this libucp has no multi-threaded workers (built "
                               "without --enable-mt)");
    }
    s = g_api.ucp_worker_get_efd(w_, &efd_);
    if (s != UCS_OK) {
      g_api.ucp_worker_destroy(w_);
      throw std::runtime_error(std::string("UCX: no event fd: ") + status_text(s));
    }
  }
  ~Worker() override {
    progress();
    for (auto& c : closing_) {
      if (c.req) g_api.ucp_request_free(c.req);
      delete c.st;
    }
    g_api.ucp_worker_destroy(w_);
  }
  int efd() const override { return efd_; }
  void progress() override {
    while (g_api.ucp_worker_progress(w_) != 0) {
    }
    reap();
  }
  bool arm() override {
    const ucs_status_t s = g_api.ucp_worker_arm(w_);
    return s == UCS_OK;  // UCS_ERR_BUSY: events wait
  }
  ucp_worker_h handle() const { return w_; }
  int wake_fd() const { return wake_fd_; }

  // An endpoint is closed in the background (flushing what was posted); its state goes with it.
  void close_later(ucp_ep_h ep, EpState* st) {
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    // a broken endpoint cannot flush
    p.flags = st->status.load() != UCS_OK ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    void* req = g_api.ucp_ep_close_nbx(ep, &p);
    std::lock_guard<std::mutex> g(mu_);
    if (req == nullptr || UCS_PTR_IS_ERR(req)) {
      st->wake_fd = -1;
      dead_.push_back(st);  // its error callback cannot come any more after this progress
    } else {
      closing_.push_back({req, st});
    }
  }

 private:
  void reap() {
    std::lock_guard<std::mutex> g(mu_);
    for (auto* st : dead_) delete st;
    dead_.clear();
    for (std::size_t i = 0; i < closing_.size();) {
      if (g_api.ucp_request_check_status(closing_[i].req) != UCS_INPROGRESS) {
        g_api.ucp_request_free(closing_[i].req);
        delete closing_[i].st;
        closing_[i] = closing_.back();
        closing_.pop_back();
      } else {
        ++i;
      }
    }
  }

  struct Closing {
    void* req;
    EpState* st;
  };
  ucp_worker_h w_ = nullptr;
  int efd_ = -1, wake_fd_ = -1;
  std::mutex mu_;
  std::vector<Closing> closing_;
  std::vector<EpState*> dead_;
};

std::atomic<int> g_next_key{-1000};

// ---- one stream over a UCP endpoint ---------------------------------------------------------
class UcxLink : public Link {
 public:
  UcxLink(Worker* w, ucp_ep_h ep, EpState* st)
      : w_(w), ep_(ep), st_(st), key_(g_next_key.fetch_sub(1)) {}
  ~UcxLink() override { release(); }

  int key() const override { return key_; }
  bool progressed() const override { return true; }
  bool hung() const override { return hung_.load() || st_->status.load() != UCS_OK; }
  bool more() const override { return more_; }

  ssize_t read(char* p, std::size_t n, std::string* err) override {
    if (rreq_) {  // a read posted on p before: collect it
      std::size_t len = 0;
      const ucs_status_t s = g_api.ucp_stream_recv_request_test(rreq_, &len);
      if (s == UCS_INPROGRESS) return broken(err) ? kFailed : (more_ = false, kAgain);
      g_api.ucp_request_free(rreq_);
      rreq_ = nullptr;
      if (s != UCS_OK) return fail(err, "receive failed: ", s);
      if (rbuf_ != p || len > n) return fail(err, "internal: a UCX read moved", UCS_OK);
      more_ = true;
      return static_cast<ssize_t>(len);
    }
    if (hung_.load()) return 0;
    ucp_request_param_t prm{};
    prm.op_attr_mask = UCP_OP_ATTR_FIELD_DATATYPE;
    prm.datatype = ucp_dt_make_contig(1);
    std::size_t len = 0;
    void* r = g_api.ucp_stream_recv_nbx(ep_, p, n, &len, &prm);
    if (r == nullptr) {  // what had arrived, even from a peer that has left since
      more_ = true;
      return static_cast<ssize_t>(len);
    }
    if (broken(err)) {  // nothing more will come
      if (!UCS_PTR_IS_ERR(r)) g_api.ucp_request_free(r);  // UCX drops it with the endpoint
      return 0;
    }
    if (UCS_PTR_IS_ERR(r)) return fail(err, "receive failed: ", UCS_PTR_STATUS(r));
    rreq_ = r;  // stays posted on p: the next read into p collects it
    rbuf_ = p;
    more_ = false;
    return kAgain;
  }

  ssize_t write(std::deque<Out>& q) override {
    if (broken(nullptr) || hung_.load()) return kFailed;
    // post every message not posted yet, whole, as one iov send
    for (std::size_t i = posted_; i < q.size(); ++i) {
      Out& o = q[i];
      inflight_.emplace_back();
      Sent& s = inflight_.back();
      s.n = 0;
      auto add = [&](const void* p, std::size_t len) {
        if (len == 0) return;
        s.iov[s.n].buffer = const_cast<void*>(p);
        s.iov[s.n].length = len;
        ++s.n;
      };
      add(&o.hdr, sizeof(Header));
      if (o.hdr.flags & kFlagMeta) {
        add(&o.meta_len, 4);
        add(o.meta.data(), o.meta.size());
      }
      if (o.plen) add(o.payload, o.plen);
      ucp_request_param_t prm{};
      prm.op_attr_mask = UCP_OP_ATTR_FIELD_DATATYPE;
      prm.datatype = ucp_dt_make_iov();
      void* r = g_api.ucp_stream_send_nbx(ep_, s.iov, s.n, &prm);
      if (UCS_PTR_IS_ERR(r)) {
        inflight_.pop_back();
        return kFailed;
      }
      s.req = r;
      s.bytes = o.total() - o.sent;
      ++posted_;
    }
    // report the messages UCX is done with, in order
    std::size_t done = 0, msgs = 0;
    while (!inflight_.empty()) {
      Sent& s = inflight_.front();
      if (s.req) {
        const ucs_status_t st = g_api.ucp_request_check_status(s.req);
        if (st == UCS_INPROGRESS) break;
        g_api.ucp_request_free(s.req);
        s.req = nullptr;
        if (st != UCS_OK) return kFailed;
      }
      done += s.bytes;
      ++msgs;
      inflight_.pop_front();
    }
    posted_ -= msgs;
    return done > 0 ? static_cast<ssize_t>(done) : kInFlight;
  }

  void hangup() override {
    hung_ = true;
    wake();
  }

  void release() override {
    if (!ep_) return;
    if (rreq_) g_api.ucp_request_free(rreq_);  // UCX drops it with the endpoint
    rreq_ = nullptr;
    for (auto& s : inflight_)
      if (s.req) g_api.ucp_request_free(s.req);
    inflight_.clear();
    posted_ = 0;
    // the payloads of what was in flight may go now: force the close, nothing more is sent
    st_->status = st_->status.load() == UCS_OK ? UCS_ERR_CANCELED : st_->status.load();
    w_->close_later(ep_, st_);
    ep_ = nullptr;
  }

  void watch(int, int evfd, bool in, bool out) override {
    // UCX readiness comes from the worker's progress: wake the loop when it has something to
    // do for this stream now (a message to post, or reading to resume)
    if (out || (in && !in_)) wake(evfd);
    in_ = in;
  }

 private:
  bool broken(std::string* err) const {
    const int s = st_->status.load();
    if (s == UCS_OK) return false;
    if (err) *err = std::string("the UCX endpoint failed: ") +
                    status_text(static_cast<ucs_status_t>(s));
    return true;
  }
  ssize_t fail(std::string* err, const char* what, ucs_status_t s) {
    *err = std::string(what) + (s == UCS_OK ? "" : status_text(s));
    return kFailed;
  }
  void wake(int fd = -1) {
    if (fd < 0) fd = w_->wake_fd();
    std::uint64_t one = 1;
    ssize_t r = ::write(fd, &one, sizeof one);
    (void)r;
  }

  struct Sent {
    void* req = nullptr;
    ucp_dt_iov_t iov[4];
    std::size_t n = 0;
    std::size_t bytes = 0;
  };
  Worker* w_;
  ucp_ep_h ep_;
  EpState* st_;
  const int key_;
  void* rreq_ = nullptr;
  char* rbuf_ = nullptr;
  bool more_ = true;
  bool in_ = true;
  std::atomic<bool> hung_{false};
  std::size_t posted_ = 0;  // messages at the queue's front posted to UCX
  std::deque<Sent> inflight_;
};

ucp_ep_params_t ep_params(EpState* st) {
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  ep.err_handler.cb = on_ep_error;
  ep.err_handler.arg = st;
  return ep;
}

// Blocking transfer of exactly n bytes for the hello (the caller's thread progresses the
// worker; the loop thread may too: the worker is multi-threaded).
bool ucx_io_full(Worker* w, ucp_ep_h ep, EpState* st, char* p, std::size_t n, bool out,
                 double deadline, std::string* err) {
  ucp_request_param_t prm{};
  prm.op_attr_mask = UCP_OP_ATTR_FIELD_DATATYPE | (out ? 0 : UCP_OP_ATTR_FIELD_FLAGS);
  prm.datatype = ucp_dt_make_contig(1);
  prm.flags = out ? 0 : UCP_STREAM_RECV_FLAG_WAITALL;
  std::size_t len = 0;
  void* r = out ? g_api.ucp_stream_send_nbx(ep, p, n, &prm)
                : g_api.ucp_stream_recv_nbx(ep, p, n, &len, &prm);
  if (UCS_PTR_IS_ERR(r)) {
    *err = status_text(UCS_PTR_STATUS(r));
    return false;
  }
  while (r != nullptr) {
    const ucs_status_t s = g_api.ucp_request_check_status(r);
    if (s != UCS_INPROGRESS) {
      g_api.ucp_request_free(r);
      if (s != UCS_OK) {
        *err = status_text(s);
        return false;
      }
      break;
    }
    if (st->status.load() != UCS_OK || monotonic_now() > deadline) {
      *err = st->status.load() != UCS_OK
                 ? status_text(static_cast<ucs_status_t>(st->status.load()))
                 : "timed out";
      g_api.ucp_request_free(r);  // released with the endpoint, which the caller closes
      return false;
    }
    if (g_api.ucp_worker_progress(w->handle()) == 0) std::this_thread::yield();
  }
  return true;
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
  p.features = UCP_FEATURE_STREAM | UCP_FEATURE_WAKEUP;
  p.mt_workers_shared = 1;
  s = g_api.ucp_init_version(UCP_API_MAJOR, UCP_API_MINOR, &p, cfg, &g_ctx);
  g_api.ucp_config_release(cfg);
  if (s != UCS_OK) {
    g_ctx = nullptr;
    g_err = std::string("UCX initialisation failed: ") + status_text(s);
    *err = g_err;
    return false;
  }
  err->clear();
  return true;
}

std::string ucx_unavailable() {
  std::lock_guard<std::mutex> g(g_mu);
  return g_ctx ? "" : g_err;
}

std::unique_ptr<UcxWorker> make_ucx_worker(int wake_fd) {
  const std::string why = ucx_unavailable();
  if (!why.empty()) throw std::runtime_error("data plane: UCX streams unavailable: " + why);
  return std::unique_ptr<UcxWorker>(new Worker(wake_fd));
}

std::unique_ptr<Link> ucx_open_stream(UcxWorker* uw, const std::string& host, int port,
                                      int rank, std::uint32_t job, int stream, double deadline,
                                      const std::string& key, std::string* err) {
  auto* w = static_cast<Worker*>(uw);
  sockaddr_storage ss{};
  socklen_t sl = 0;
  *err = sockaddr_of(host, port, &ss, &sl, false);
  if (!err->empty()) return nullptr;
  while (true) {  // a server not listening yet refuses: try again until the deadline
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
    std::size_t got = 0;  // bytes from the server: none means it was not reached
    const IoFull io = [&](char* p, std::size_t n, bool out, double dl, std::string* e) {
      const bool ok = ucx_io_full(w, h, st, p, n, out, dl, e);
      if (ok && !out) got += n;
      return ok;
    };
    std::unique_ptr<UcxLink> link(new UcxLink(w, h, st));
    std::string e;
    if (say_hello(io, rank, job, stream, deadline, key, &e)) {
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
  ucp_ep_h ep = nullptr;
  EpState* st = nullptr;
};

UcxRawStream::UcxRawStream(const std::string& host, int port) : impl_(new Impl) {
  const std::string why = ucx_unavailable();
  if (!why.empty()) throw std::runtime_error("UCX streams unavailable: " + why);
  impl_->w.reset(new Worker(-1));
  sockaddr_storage ss{};
  socklen_t sl = 0;
  const std::string e = sockaddr_of(host, port, &ss, &sl, false);
  if (!e.empty()) throw std::runtime_error(e);
  impl_->st = new EpState();
  ucp_ep_params_t ep = ep_params(impl_->st);
  ep.field_mask |= UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR;
  ep.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
  ep.sockaddr.addr = reinterpret_cast<const sockaddr*>(&ss);
  ep.sockaddr.addrlen = sl;
  const ucs_status_t s = g_api.ucp_ep_create(impl_->w->handle(), &ep, &impl_->ep);
  if (s != UCS_OK) {
    delete impl_->st;
    throw std::runtime_error(std::string("cannot make a UCX endpoint: ") + status_text(s));
  }
}

UcxRawStream::~UcxRawStream() { close(); }

void UcxRawStream::send(const std::string& bytes, double timeout) {
  if (!impl_->ep) throw std::runtime_error("closed");
  std::string err;
  std::string copy = bytes;
  if (!ucx_io_full(impl_->w.get(), impl_->ep, impl_->st, &copy[0], copy.size(), true,
                   monotonic_now() + timeout, &err))
    throw std::runtime_error("send failed: " + err);
}

std::string UcxRawStream::recv(std::size_t n, double timeout, bool all) {
  if (!impl_->ep) throw std::runtime_error("closed");
  std::string out(n, '\0');
  ucp_request_param_t prm{};
  prm.op_attr_mask = UCP_OP_ATTR_FIELD_DATATYPE | UCP_OP_ATTR_FIELD_FLAGS;
  prm.datatype = ucp_dt_make_contig(1);
  prm.flags = all ? UCP_STREAM_RECV_FLAG_WAITALL : 0;
  std::size_t len = 0;
  const double deadline = monotonic_now() + timeout;
  void* r = g_api.ucp_stream_recv_nbx(impl_->ep, &out[0], n, &len, &prm);
  if (UCS_PTR_IS_ERR(r)) return "";  // the peer is gone
  while (r != nullptr) {
    const ucs_status_t s = g_api.ucp_stream_recv_request_test(r, &len);
    if (s != UCS_INPROGRESS) {
      g_api.ucp_request_free(r);
      if (s != UCS_OK) return "";
      break;
    }
    if (impl_->st->status.load() != UCS_OK) {  // the peer closed: what came before it is read
      g_api.ucp_request_free(r);
      close();
      return "";
    }
    if (monotonic_now() > deadline) {
      g_api.ucp_request_free(r);
      close();
      throw std::runtime_error("timed out");
    }
    if (g_api.ucp_worker_progress(impl_->w->handle()) == 0) std::this_thread::yield();
  }
  out.resize(len);
  return out;
}

void UcxRawStream::close() {
  if (!impl_ || !impl_->ep) return;
  impl_->st->status = UCS_ERR_CANCELED;
  impl_->w->close_later(impl_->ep, impl_->st);
  impl_->ep = nullptr;
  impl_->w.reset();
}

#endif  // BPS_WITH_UCX

}  // namespace dp
}  // namespace bps
