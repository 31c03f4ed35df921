// Server-held tables on the native data plane (dataplane_tables.h): the server's inbox of
// table requests and the worker's table client.
#include "dataplane_tables.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <stdexcept>
#include <utility>

#include "dataplane_auth.h"
#include "dataplane_io.h"
#include "dataplane_server_impl.h"
#include "dataplane_ucx.h"
#include "payload_pool.h"

namespace bps {
namespace dp {

bool table_request_type(int t) {
  return t == kSparseCreate || t == kSparsePull || t == kSparsePush || t == kSparseSave ||
         t == kSparseLoad;
}

bool table_answer_type(int t) { return t == kSparseRows || t == kSparseAck || t == kError; }

namespace {

// An outgoing table message: the caller's header (its FLAG_META and nbytes must match the
// meta and payload), the payload owned by the queue and charged to it.
Out table_out(const Header& h, std::string meta, std::string payload) {
  if (std::memcmp(h.magic, kMagic, 4) != 0 || h.version != kVersion)
    throw std::invalid_argument("table message: not a header of this wire version");
  if (h.nbytes != payload.size() || bool(h.flags & kFlagMeta) != !meta.empty() ||
      meta.size() > kMaxMeta)
    throw std::invalid_argument("table message: the header's nbytes or FLAG_META does not "
                                "match its payload and meta");
  Out o;
  o.hdr = h;
  o.meta = std::move(meta);
  if (!payload.empty()) {
    auto keep = pooled_shared(std::move(payload));  // its buffer serves a later message
    o.payload = keep->data();
    o.plen = o.owned = keep->size();
    o.keep = std::move(keep);
  }
  return o;
}

}  // namespace

// ---- the server's inbox ------------------------------------------------------------------
std::uint64_t TableInbox::add_stream(const std::shared_ptr<Conn>& c) {
  std::lock_guard<std::mutex> g(mu_);
  for (auto it = streams_.begin(); it != streams_.end();)  // those closed since
    it = it->second.expired() ? streams_.erase(it) : std::next(it);
  streams_[next_] = c;
  return next_++;
}

void TableInbox::put(const std::shared_ptr<Conn>& c, std::uint64_t id, const Header& h,
                     std::string meta, std::string payload) {
  if (h.type == kSparsePull) {  // answered (or parked) on this thread when its shard allows
    std::shared_ptr<ServedShard> shard;
    {
      std::lock_guard<std::mutex> g(mu_);
      auto it = served_.find(h.key);
      if (it != served_.end()) shard = it->second;
    }
    if (shard && shard->take(c, id, h, meta, payload, rank_ ? rank_->load() : 0, job_)) return;
  }
  const std::int64_t cost =
      static_cast<std::int64_t>(meta.size() + payload.size()) + kTableOverhead;
  c->charge_held(cost);
  std::lock_guard<std::mutex> g(mu_);
  Held held{TableMessage{id, -1, h, std::move(meta), std::move(payload), {}}, c, cost};
  q_.push_back(std::move(held));
  cv_.notify_one();
}

// The requests that may be taken now: all but those of streams over their share (and the
// later ones of such a stream, to keep its order); a closed stream's are taken (and answered
// into nothing).
std::vector<TableInbox::Held> TableInbox::ready_locked() {
  std::vector<Held> got;
  std::deque<Held> keep;
  std::vector<const Conn*> over;
  std::map<const Conn*, std::size_t> taken;  // of each stream in this take
  for (Held& held : q_) {
    auto c = held.conn.lock();
    const bool wait = got.size() >= kTableBatch ||
                      (c && (std::find(over.begin(), over.end(), c.get()) != over.end() ||
                             taken[c.get()] >= kTableStreamBatch || c->replies_over_share()));
    if (wait) {
      if (c && std::find(over.begin(), over.end(), c.get()) == over.end()) over.push_back(c.get());
      keep.push_back(std::move(held));
    } else {
      if (c) ++taken[c.get()];
      got.push_back(std::move(held));
    }
  }
  q_.swap(keep);
  return got;
}

std::vector<TableMessage> TableInbox::take(double timeout) {
  std::vector<Held> got;
  {
    std::unique_lock<std::mutex> lk(mu_);
    const auto until = std::chrono::steady_clock::now() +
                       std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                           std::chrono::duration<double>(std::max(0.0, timeout)));
    for (;;) {
      if (!closed_) got = ready_locked();
      if (!got.empty() || woken_ || closed_) break;
      if (cv_.wait_until(lk, until) == std::cv_status::timeout) {
        if (!closed_) got = ready_locked();
        break;
      }
    }
    woken_ = false;
  }
  std::vector<TableMessage> out;
  out.reserve(got.size());
  for (Held& held : got) {
    if (auto c = held.conn.lock()) c->charge_held(-held.cost);  // its stream may read again
    out.push_back(std::move(held.m));
  }
  return out;
}

void TableInbox::identify(const std::atomic<int>* rank, std::uint32_t job) {
  std::lock_guard<std::mutex> g(mu_);
  rank_ = rank;
  job_ = job;
}

void TableInbox::serve(std::uint64_t key, std::shared_ptr<ServedShard> shard) {
  std::lock_guard<std::mutex> g(mu_);
  served_[key] = std::move(shard);
}

std::uint64_t TableInbox::pulls_answered() {
  std::lock_guard<std::mutex> g(mu_);
  std::uint64_t n = 0;
  for (auto& kv : served_) n += kv.second->answered();
  return n;
}

std::uint64_t TableInbox::pulls_parked() {
  std::lock_guard<std::mutex> g(mu_);
  std::uint64_t n = 0;
  for (auto& kv : served_) n += kv.second->parked_total();
  return n;
}

void TableInbox::nudge() {
  std::lock_guard<std::mutex> g(mu_);
  cv_.notify_all();
}

bool TableInbox::send(std::uint64_t id, const Header& h, std::string meta, std::string payload) {
  Out o = table_out(h, std::move(meta), std::move(payload));
  std::shared_ptr<Conn> c;
  {
    std::lock_guard<std::mutex> g(mu_);
    auto it = streams_.find(id);
    if (it != streams_.end()) c = it->second.lock();
  }
  if (!c) return false;
  c->post(std::move(o));  // the stream's loop writes it: the tables' thread goes on
  return true;
}

void TableInbox::wake() {
  std::lock_guard<std::mutex> g(mu_);
  woken_ = true;
  cv_.notify_all();
}

void TableInbox::close() {
  std::lock_guard<std::mutex> g(mu_);
  closed_ = true;
  q_.clear();
  cv_.notify_all();
}

std::vector<TableMessage> DataServer::table_requests(double timeout) {
  return impl_->tables_.take(timeout);
}
bool DataServer::table_send(std::uint64_t conn, const Header& h, std::string meta,
                            std::string payload) {
  return impl_->tables_.send(conn, h, std::move(meta), std::move(payload));
}
void DataServer::table_wake() { impl_->tables_.wake(); }
void DataServer::table_serve(std::uint64_t key, std::shared_ptr<ServedShard> shard) {
  impl_->tables_.serve(key, std::move(shard));
}

// ---- the worker's table client -----------------------------------------------------------
class TableConn;

class TableClientImpl {
 public:
  TableClientImpl(int rank, std::uint32_t job, std::uint64_t max_msg, std::string key,
                  std::uint64_t budget)
      : rank_(rank), job_(job), max_msg_(max_msg), key_(std::move(key)), budget_(budget) {
    loop_.start(nullptr);
  }
  ~TableClientImpl() { close(); }

  void connect(int server, const std::string& host, int port, double timeout, bool ucx);
  bool send(int server, const Header& h, std::string meta, std::string payload) {
    Out o = table_out(h, std::move(meta), std::move(payload));
    std::shared_ptr<Conn> c;
    {
      std::lock_guard<std::mutex> g(mu_);
      auto it = conns_.find(server);
      if (closed_ || it == conns_.end()) return false;
      c = it->second;
    }
    c->post(std::move(o));  // the stream's loop writes it: the caller goes on
    return true;
  }

  // An answer (the loop thread): held for answers(), within the budget; past it the loop
  // waits for them to be taken (one answer alone may be larger: it was checked against
  // BYTEPS_MAX_MESSAGE_BYTES).
  void arrived(int server, const Header& h, std::string meta, std::string payload) {
    const std::uint64_t n = meta.size() + payload.size() + kTableOverhead;
    std::unique_lock<std::mutex> lk(mu_);
    room_.wait(lk, [&] { return closed_ || held_ == 0 || held_ + n <= budget_; });
    if (closed_) return;
    held_ += n;
    q_.push_back(TableMessage{0, server, h, std::move(meta), std::move(payload), {}});
    cv_.notify_all();
  }

  void lost(int server, const Conn* conn, std::string why) {
    std::lock_guard<std::mutex> g(mu_);
    auto it = conns_.find(server);
    if (it != conns_.end() && it->second.get() == conn) conns_.erase(it);
    TableMessage m;
    m.server = server;
    m.lost = why.empty() ? std::string("the table stream closed") : std::move(why);
    q_.push_back(std::move(m));
    cv_.notify_all();
  }

  std::vector<TableMessage> answers(double timeout) {
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait_for(lk, std::chrono::duration<double>(std::max(0.0, timeout)),
                 [&] { return !q_.empty() || closed_; });
    std::vector<TableMessage> out;
    if (closed_) return out;
    out.reserve(q_.size());
    for (auto& m : q_) out.push_back(std::move(m));
    q_.clear();
    held_ = 0;
    room_.notify_all();
    return out;
  }

  std::uint64_t held() {
    std::lock_guard<std::mutex> g(mu_);
    return held_;
  }

  void close() {
    {
      std::lock_guard<std::mutex> g(mu_);
      if (closed_) return;
      closed_ = true;
      cv_.notify_all();
      room_.notify_all();  // a loop waiting for room gives up its answer
    }
    loop_.stop();  // closes every stream
    std::lock_guard<std::mutex> g(mu_);
    conns_.clear();
    q_.clear();
  }

  Counters c_;
  const int rank_;
  const std::uint32_t job_;
  const std::uint64_t max_msg_;
  const std::string key_;
  const std::uint64_t budget_;

 private:
  IoLoop loop_;
  std::mutex mu_;
  std::condition_variable cv_, room_;
  std::uint64_t held_ = 0;  // bytes of the answers in q_
  std::map<int, std::shared_ptr<Conn>> conns_;
  std::deque<TableMessage> q_;
  bool closed_ = false;
};

// A table stream's worker end: answers (SPARSE_ROWS, SPARSE_ACK, ERROR), each checked against
// the job and BYTEPS_MAX_MESSAGE_BYTES before anything is allocated for it.
class TableConn : public FramedConn {
 public:
  TableConn(TableClientImpl* cli, int server, std::unique_ptr<Link> link)
      : FramedConn(std::move(link), &cli->c_), cli_(cli), server_(server) {
    read_header();  // its first target: an answer's header
  }

 protected:
  void on_closed() override { cli_->lost(server_, this, why_); }

  bool advance() override {
    switch (state_) {
      case kHdr: return on_header();
      case kMetaLen: return read_meta("meta frame over 1 MiB from the server");
      case kMeta: return after_meta();
      case kPayload: return deliver();
      default: return false;
    }
  }

 private:
  bool on_header() {
    counters_->msgs_in++;
    const bool ours = from_server_of(h_, cli_->job_);
    if (!ours || !table_answer_type(h_.type) || h_.nbytes > cli_->max_msg_) {
      why_ = ours ? std::string("unexpected ") + type_name(h_.type) + " of " +
                        std::to_string(h_.nbytes) + " bytes on the table stream"
                  : std::string("a malformed message or one of another job on the table stream");
      return false;
    }
    meta_.clear();
    if (h_.flags & kFlagMeta) return read_meta_len();
    return after_meta();
  }

  bool after_meta() {
    payload_ = pooled(static_cast<std::size_t>(h_.nbytes));
    if (h_.nbytes == 0) return deliver();
    state_ = kPayload;
    expect(&payload_[0], static_cast<std::size_t>(h_.nbytes));
    return true;
  }

  bool deliver() {
    cli_->arrived(server_, h_, std::move(meta_), std::move(payload_));
    meta_.clear();
    payload_.clear();
    return read_header();
  }

  TableClientImpl* cli_;
  int server_;
  std::string payload_;
};

void TableClientImpl::connect(int server, const std::string& host, int port, double timeout,
                              bool ucx) {
  const double deadline = monotonic_now() + timeout;
  std::string err;
  std::unique_ptr<Link> link;
  if (ucx) {
    link = ucx_open_stream(loop_.ucx(), host, port, rank_, job_, 0, deadline, key_, &err, true);
  } else {
    const int fd = open_stream(host, port, rank_, job_, 0, deadline, key_, &err, true);
    if (fd >= 0) link.reset(new TcpLink(fd));
  }
  if (!link)
    throw std::runtime_error("tables: cannot reach server " + std::to_string(server) + " at " +
                             host + ":" + std::to_string(port) + (ucx ? " (UCX): " : ": ") + err);
  auto c = std::make_shared<TableConn>(this, server, std::move(link));
  bool closed;
  {
    std::lock_guard<std::mutex> g(mu_);
    closed = closed_;
    if (!closed) conns_[server] = c;
  }
  if (closed) {  // closing it reports it lost, which takes mu_
    c->close_now();
    throw std::runtime_error("tables: the table client is closed");
  }
  loop_.add(c);
}

TableClient::TableClient(int rank, std::uint32_t job, std::uint64_t max_message_bytes,
                         std::string auth_key, std::uint64_t answer_budget)
    : impl_(new TableClientImpl(rank, job, max_message_bytes, std::move(auth_key),
                                answer_budget)) {}
TableClient::~TableClient() = default;
void TableClient::connect(int server, const std::string& host, int port, double timeout,
                          bool ucx) {
  impl_->connect(server, host, port, timeout, ucx);
}
bool TableClient::send(int server, const Header& h, std::string meta, std::string payload) {
  return impl_->send(server, h, std::move(meta), std::move(payload));
}
std::vector<TableMessage> TableClient::answers(double timeout) { return impl_->answers(timeout); }
void TableClient::close() { impl_->close(); }
std::map<std::string, std::uint64_t> TableClient::stats() {
  auto st = impl_->c_.snapshot();
  st["answers_held"] = impl_->held();
  return st;
}

}  // namespace dp
}  // namespace bps
