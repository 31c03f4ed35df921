// A stream's bytes over UCX active messages (dataplane_ucx_internal.h): the worker and its
// active-message handler, which files each arrival under its endpoint in order (bounded), and
// UcxLink, which reads them as the framing asks (eager bytes copied, rendezvous pieces
// received straight into the framing's target) and posts each outgoing message as one eager
// message and its payload's rendezvous pieces.
#if BPS_WITH_UCX

#include <unistd.h>

#include <cstring>
#include <stdexcept>
#include <thread>

#include "dataplane_ucx.h"
#include "dataplane_ucx_internal.h"

namespace bps {
namespace dp {
namespace ucxi {

namespace {

std::atomic<int> g_next_key{-1000};
thread_local bool t_in_progress = false;

// Every active message of every stream: filed under its endpoint's state by sequence number.
// A message without its endpoint (the sender did not ask for one, or the stream is gone) is
// dropped; one that breaks the stream's bounds marks it flooded and is dropped (a refused
// rendezvous fails its send).
ucs_status_t on_am(void* arg, const void* header, std::size_t hlen, void* data, std::size_t len,
                   const ucp_am_recv_param_t* prm) {
  auto* w = static_cast<Worker*>(arg);
  const bool rndv = prm->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV;
  const ucs_status_t refuse = rndv ? UCS_ERR_REJECTED : UCS_OK;
  if (!(prm->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) || hlen != 8) return refuse;
  std::uint64_t seq;
  std::memcpy(&seq, header, 8);
  int fd = -1;
  {
    std::lock_guard<std::mutex> g(w->map_mu());
    EpState* st = w->find(prm->reply_ep);
    if (!st) return refuse;
    std::lock_guard<std::mutex> g2(st->mu);
    if (st->flood.load() != kNoFlood) return refuse;
    const std::size_t cost = kPieceCost + (rndv ? 0 : len);
    int why = kNoFlood;
    if (seq < st->next_seq || st->in.count(seq)) why = kBadSeq;
    else if (rndv && len > kMaxPiece) why = kBigPiece;
    else if (st->held + cost > kMaxHeld) why = kHeldOver;
    if (why == kNoFlood) {
      Piece& p = st->in[seq];
      if (rndv) {
        p.desc = data;
        p.len = len;
      } else {
        p.bytes.assign(static_cast<const char*>(data), len);
      }
      st->held += cost;
    } else {
      st->flood = why;
    }
    if (!t_in_progress || why != kNoFlood) fd = st->wake_fd;
    if (why != kNoFlood) {
      if (fd >= 0) wake_fd(fd);
      return refuse;
    }
  }
  if (fd >= 0) wake_fd(fd);
  return rndv ? UCS_INPROGRESS : UCS_OK;
}

// A UCX request's status: UCS_INPROGRESS while it runs (*req kept), else freed (*req null).
ucs_status_t reap(void** req) {
  const ucs_status_t s = g_api.ucp_request_check_status(*req);
  if (s == UCS_INPROGRESS) return s;
  g_api.ucp_request_free(*req);
  *req = nullptr;
  return s;
}

}  // namespace

Api g_api;

bool in_progress() { return t_in_progress; }

void wake_fd(int fd) {
  std::uint64_t one = 1;
  ssize_t r = ::write(fd, &one, sizeof one);
  (void)r;
}

ucp_ep_params_t ep_params(EpState* st) {
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  ep.err_handler.cb = [](void* arg, ucp_ep_h, ucs_status_t status) {
    auto* s = static_cast<EpState*>(arg);
    s->status = status;
    if (s->wake_fd >= 0) wake_fd(s->wake_fd);
  };
  ep.err_handler.arg = st;
  return ep;
}

// ---- the worker -------------------------------------------------------------------------------
extern ucp_context_h g_ctx;  // dataplane_ucx.cc

Worker::Worker(int wake_fd) : wake_fd_(wake_fd) {
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
  std::string why;
  if (g_api.ucp_worker_query(w_, &wa) != UCS_OK || wa.thread_mode != UCS_THREAD_MODE_MULTI)
    why = "UCX: this libucp has no multi-threaded workers (built without --enable-mt)";
  ucp_am_handler_param_t hp{};
  hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                  UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
  hp.id = kAmId;
  hp.flags = UCP_AM_FLAG_WHOLE_MSG;
  hp.cb = on_am;
  hp.arg = this;
  if (why.empty() && (s = g_api.ucp_worker_set_am_recv_handler(w_, &hp)) != UCS_OK)
    why = std::string("UCX: cannot set the active-message handler: ") + status_text(s);
  if (why.empty() && (s = g_api.ucp_worker_get_efd(w_, &efd_)) != UCS_OK)
    why = std::string("UCX: no event fd: ") + status_text(s);
  if (!why.empty()) {
    g_api.ucp_worker_destroy(w_);
    throw std::runtime_error(why);
  }
}

Worker::~Worker() {
  progress();
  for (auto& c : closing_) {
    if (c.req) g_api.ucp_request_free(c.req);
    delete c.st;
  }
  for (auto* st : dead_) delete st;
  g_api.ucp_worker_destroy(w_);
}

void Worker::progress() {
  // bounded: the loop serves its streams between rounds, so arrivals do not pile up unread
  t_in_progress = true;
  loop_ = std::this_thread::get_id();
  for (int i = 0; i < 64 && g_api.ucp_worker_progress(w_) != 0; ++i) {
  }
  t_in_progress = false;
  reap();
}

void Worker::attach(ucp_ep_h ep, EpState* st) {
  std::lock_guard<std::mutex> g(map_mu_);
  eps_[ep] = st;
}

void Worker::close_later(ucp_ep_h ep, EpState* st, bool force) {
  {
    std::lock_guard<std::mutex> g(map_mu_);
    eps_.erase(ep);  // a handler running now holds map_mu_: none uses st after this
  }
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = force || st->status.load() != UCS_OK ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  void* req = g_api.ucp_ep_close_nbx(ep, &p);
  std::lock_guard<std::mutex> g(mu_);
  if (req == nullptr || UCS_PTR_IS_ERR(req)) {
    st->wake_fd = -1;
    dead_.push_back(st);  // its error callback cannot come any more after this progress
  } else {
    closing_.push_back({req, st});
  }
}

void Worker::reap() {
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

// ---- the link: reading -----------------------------------------------------------------------
UcxLink::UcxLink(Worker* w, ucp_ep_h ep, EpState* st)
    : w_(w), ep_(ep), st_(st), key_(g_next_key.fetch_sub(1)) {
  w_->attach(ep_, st_);
}

const char* UcxLink::flooded(bool* unread) const {
  const int why = st_->flood.load();
  if (unread) *unread = why == kHeldOver;
  switch (why) {
    case kHeldOver:
      return "the peer sent more than 32 MiB of messages that its stream did not read (it "
             "leaves its replies unread, or sends faster than the server reads)";
    case kBadSeq: return "a UCX message out of its stream's sequence";
    case kBigPiece: return "a UCX rendezvous piece over 4 MiB";
    default: return nullptr;
  }
}

bool UcxLink::broken(std::string* err) const {
  const int s = st_->status.load();
  if (s == UCS_OK) return false;
  if (err) *err = std::string("the UCX endpoint failed: ") +
                  status_text(static_cast<ucs_status_t>(s));
  return true;
}

ssize_t UcxLink::fail(std::string* err, const std::string& what) {
  *err = what;
  return kFailed;
}

// The arrivals that are next in sequence move from the endpoint's state to the link.
void UcxLink::take_arrivals() {
  std::lock_guard<std::mutex> g(st_->mu);
  for (auto it = st_->in.begin(); it != st_->in.end() && it->first == st_->next_seq;) {
    mine_.push_back(std::move(it->second));
    it = st_->in.erase(it);
    ++st_->next_seq;
  }
}

// The rendezvous pieces received in place, from the front: their bytes (p must be where the
// first landed), 0 when none has finished yet, kFailed when one failed.
ssize_t UcxLink::retire(char* p, std::string* err) {
  if (p != post_at_) return fail(err, "internal: a UCX read moved");
  std::size_t done = 0;
  while (!posted_.empty()) {
    Posted& f = posted_.front();
    if (f.req) {
      const ucs_status_t s = reap(&f.req);
      if (s == UCS_INPROGRESS) break;
      if (s != UCS_OK) return fail(err, std::string("UCX receive failed: ") + status_text(s));
    }
    done += f.len;
    posted_.pop_front();
  }
  post_at_ += done;
  return static_cast<ssize_t>(done);
}

// Posts the rendezvous pieces at mine_'s front that fit before `end`, each into its place.
void UcxLink::post_direct(char* end) {
  while (!mine_.empty() && mine_.front().desc && !mine_.front().req &&
         mine_.front().len <= static_cast<std::size_t>(end - post_end_)) {
    Piece& f = mine_.front();
    ucp_request_param_t prm{};
    prm.op_attr_mask = UCP_OP_ATTR_FIELD_DATATYPE;
    prm.datatype = ucp_dt_make_contig(1);
    void* r = g_api.ucp_am_recv_data_nbx(w_->handle(), f.desc, post_end_, f.len, &prm);
    if (UCS_PTR_IS_ERR(r)) {  // UCX owns the descriptor now: the stream is broken
      st_->status = UCS_PTR_STATUS(r);
      r = nullptr;
    }
    posted_.push_back({r, f.len});
    post_end_ += f.len;
    {
      std::lock_guard<std::mutex> g(st_->mu);
      st_->held -= kPieceCost;
    }
    mine_.pop_front();
  }
}

// No piece in place: eager bytes are copied out; a rendezvous piece is posted into p (with
// those after it that fit), or, larger than n, received into a bounce buffer first.
ssize_t UcxLink::read_pieces(char* p, std::size_t n, std::string* err) {
  std::size_t got = 0;
  while (got < n && !mine_.empty()) {
    Piece& f = mine_.front();
    if (f.desc && !f.req && f.len <= n - got) {
      if (got > 0) break;  // the bytes copied first
      post_at_ = post_end_ = p;
      post_direct(p + n);
      return retire(p, err);
    }
    if (f.desc && !f.req) {  // larger than the read: received whole, then copied out
      f.bytes.resize(f.len);
      ucp_request_param_t prm{};
      prm.op_attr_mask = UCP_OP_ATTR_FIELD_DATATYPE;
      prm.datatype = ucp_dt_make_contig(1);
      void* r = g_api.ucp_am_recv_data_nbx(w_->handle(), f.desc, &f.bytes[0], f.len, &prm);
      if (UCS_PTR_IS_ERR(r))
        return fail(err, std::string("UCX receive failed: ") + status_text(UCS_PTR_STATUS(r)));
      f.req = r;
      if (!r) f.desc = nullptr;
    }
    if (f.req) {
      const ucs_status_t s = reap(&f.req);
      if (s == UCS_INPROGRESS) break;
      if (s != UCS_OK) return fail(err, std::string("UCX receive failed: ") + status_text(s));
      f.desc = nullptr;
    }
    const std::size_t k = std::min(n - got, f.bytes.size() - off_);
    std::memcpy(p + got, f.bytes.data() + off_, k);
    got += k;
    off_ += k;
    if (off_ == f.bytes.size()) {
      std::lock_guard<std::mutex> g(st_->mu);
      st_->held -= kPieceCost + (f.len ? 0 : f.bytes.size());
      off_ = 0;
      mine_.pop_front();
    }
  }
  return static_cast<ssize_t>(got);
}

ssize_t UcxLink::read(char* p, std::size_t n, std::string* err) {
  if (const char* f = flooded(nullptr)) return fail(err, f);
  take_arrivals();
  ssize_t got;
  if (!posted_.empty()) {
    got = retire(p, err);
    if (got == 0 && !posted_.empty()) post_direct(p + n);  // more fit behind those
  } else {
    got = read_pieces(p, n, err);
  }
  if (got != 0) {
    more_ = got > 0;
    return got;
  }
  more_ = false;
  if (!posted_.empty() || (!mine_.empty() && mine_.front().req)) {
    return broken(err) ? kFailed : kAgain;  // in flight: UCX wakes the loop when it lands
  }
  if (broken(err) || hung_.load()) return 0;  // nothing more will come
  return kAgain;
}

// ---- the link: writing -----------------------------------------------------------------------
// One eager message (header, meta and a small payload), then the payload's rendezvous pieces.
bool UcxLink::post_message(Out& o) {
  inflight_.emplace_back();
  Sent& s = inflight_.back();
  std::size_t n = 0;
  auto add = [&](const void* p, std::size_t len) {
    if (len == 0) return;
    s.iov[n].buffer = const_cast<void*>(p);
    s.iov[n].length = len;
    ++n;
  };
  const bool eager = o.plen < kEagerPayload;
  add(&o.hdr, sizeof(Header));
  if (o.hdr.flags & kFlagMeta) {
    add(&o.meta_len, 4);
    add(o.meta.data(), o.meta.size());
  }
  if (eager) add(o.payload, o.plen);
  s.bytes = o.total() - o.sent;
  auto post = [&](const void* buf, std::size_t count, ucp_datatype_t dt, std::uint32_t fl) {
    const std::uint64_t seq = send_seq_++;
    ucp_request_param_t prm{};
    prm.op_attr_mask = UCP_OP_ATTR_FIELD_DATATYPE | UCP_OP_ATTR_FIELD_FLAGS;
    prm.datatype = dt;
    prm.flags = fl | UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_COPY_HEADER;
    void* r = g_api.ucp_am_send_nbx(ep_, kAmId, &seq, sizeof seq, buf, count, &prm);
    if (UCS_PTR_IS_ERR(r)) return false;
    if (r) s.reqs.push_back(r);
    return true;
  };
  if (!post(s.iov, n, ucp_dt_make_iov(), UCP_AM_SEND_FLAG_EAGER)) return false;
  for (std::size_t off = 0; !eager && off < o.plen; off += kUcxPiece) {
    if (!post(o.payload + off, std::min(kUcxPiece, o.plen - off), ucp_dt_make_contig(1),
              UCP_AM_SEND_FLAG_RNDV))
      return false;
  }
  return true;
}

ssize_t UcxLink::write(std::deque<Out>& q) {
  if (broken(nullptr) || hung_.load()) return kFailed;
  if (!w_->on_loop()) {
    // another thread's send (a reply a stream of another loop completed, a worker's next
    // partition): the loop posts it. Posting here would wait on the worker's spin lock while
    // the loop's progress holds it receiving megabytes, burning a core (measured: 8% of the
    // samples of a 256 MiB push_pull)
    wake_fd(w_->wake_fd());
    return kInFlight;
  }
  for (std::size_t i = sent_posted_; i < q.size(); ++i) {  // every message not posted yet
    if (!post_message(q[i])) return kFailed;
    ++sent_posted_;
  }
  // report the messages UCX is done with, in order
  std::size_t done = 0, msgs = 0;
  while (!inflight_.empty()) {
    Sent& s = inflight_.front();
    while (!s.reqs.empty()) {
      const ucs_status_t st = reap(&s.reqs.back());
      if (st == UCS_INPROGRESS) break;
      s.reqs.pop_back();
      if (st != UCS_OK) return kFailed;
    }
    if (!s.reqs.empty()) break;
    done += s.bytes;
    ++msgs;
    inflight_.pop_front();
  }
  sent_posted_ -= msgs;
  return done > 0 ? static_cast<ssize_t>(done) : kInFlight;
}

void UcxLink::hangup() {
  hung_ = true;
  wake_fd(w_->wake_fd());
}

void UcxLink::watch(int, int evfd, bool in, bool out) {
  // UCX readiness comes from the worker's progress: wake the loop when it has something to
  // do for this stream now (a message to post, or reading to resume)
  if (out || (in && !in_)) wake_fd(evfd >= 0 ? evfd : w_->wake_fd());
  in_ = in;
}

// Receives still landing in a buffer of the framing's (a worker's output) must be over
// before the stream's owner may free it: the endpoint is closed by force and the worker
// progressed until they end (they fail with the endpoint), for at most a few seconds.
void UcxLink::wait_posted() {
  const double until = monotonic_now() + 5.0;
  auto pending = [&] {
    for (auto& f : posted_)
      if (f.req && g_api.ucp_request_check_status(f.req) == UCS_INPROGRESS) return true;
    for (auto& f : mine_)
      if (f.req && g_api.ucp_request_check_status(f.req) == UCS_INPROGRESS) return true;
    return false;
  };
  while (pending() && monotonic_now() < until) {
    if (g_api.ucp_worker_progress(w_->handle()) == 0) std::this_thread::yield();
  }
  for (auto& f : posted_)
    if (f.req) g_api.ucp_request_free(f.req);
  posted_.clear();
}

void UcxLink::release() {
  if (!ep_) return;
  const bool receiving = !posted_.empty();
  for (auto& f : mine_) {  // rendezvous pieces never received: their senders are answered
    if (f.desc && !f.req) g_api.ucp_am_data_release(w_->handle(), f.desc);
  }
  for (auto& s : inflight_)
    for (void* r : s.reqs) g_api.ucp_request_free(r);
  inflight_.clear();
  sent_posted_ = 0;
  st_->status = st_->status.load() == UCS_OK ? UCS_ERR_CANCELED : st_->status.load();
  {
    std::lock_guard<std::mutex> g(st_->mu);  // what arrived and was never taken
    for (auto& kv : st_->in)
      if (kv.second.desc) g_api.ucp_am_data_release(w_->handle(), kv.second.desc);
    st_->in.clear();
  }
  w_->close_later(ep_, st_, true);
  ep_ = nullptr;
  if (receiving || !mine_.empty()) wait_posted();
  for (auto& f : mine_)
    if (f.req) g_api.ucp_request_free(f.req);
  mine_.clear();
}

// ---- blocking helpers: the hello and the tests' raw streams ----------------------------------
bool UcxLink::send_bytes(const char* p, std::size_t n, double deadline, std::string* err,
                         bool rndv) {
  const std::uint64_t seq = send_seq_++;
  ucp_request_param_t prm{};
  prm.op_attr_mask = UCP_OP_ATTR_FIELD_DATATYPE | UCP_OP_ATTR_FIELD_FLAGS;
  prm.datatype = ucp_dt_make_contig(1);
  prm.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_COPY_HEADER |
              (rndv ? UCP_AM_SEND_FLAG_RNDV : UCP_AM_SEND_FLAG_EAGER);
  void* r = g_api.ucp_am_send_nbx(ep_, kAmId, &seq, sizeof seq, p, n, &prm);
  if (UCS_PTR_IS_ERR(r)) {
    *err = status_text(UCS_PTR_STATUS(r));
    return false;
  }
  while (r != nullptr) {
    const ucs_status_t s = reap(&r);
    if (s != UCS_INPROGRESS) {
      if (s != UCS_OK) *err = status_text(s);
      return s == UCS_OK;
    }
    if (broken(err) || monotonic_now() > deadline) {
      if (err->empty()) *err = "timed out";
      g_api.ucp_request_free(r);  // released with the endpoint, which the caller closes
      return false;
    }
    if (g_api.ucp_worker_progress(w_->handle()) == 0) std::this_thread::yield();
  }
  return true;
}

ssize_t UcxLink::recv_bytes(char* p, std::size_t n, bool all, double deadline,
                            std::string* err) {
  std::size_t got = 0;
  while (got < n) {
    const ssize_t k = read(p + got, n - got, err);
    if (k > 0) {
      got += static_cast<std::size_t>(k);
      if (!all && posted_.empty()) break;  // none still lands in p
      continue;
    }
    if (k == 0 || k == kFailed) {
      if (err->empty()) *err = "the peer closed the stream";
      return k == 0 ? static_cast<ssize_t>(got) : -1;
    }
    if (monotonic_now() > deadline) {
      *err = "timed out";
      return -1;
    }
    if (g_api.ucp_worker_progress(w_->handle()) == 0) std::this_thread::yield();
  }
  return static_cast<ssize_t>(got);
}

}  // namespace ucxi
}  // namespace dp
}  // namespace bps

#endif  // BPS_WITH_UCX
