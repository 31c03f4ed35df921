// The native data plane's worker side (dataplane.h, DataClient): the priority and credit
// scheduler of partitions, its streams and receive-into-place.
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <queue>
#include <stdexcept>
#include <unordered_map>
#include <unordered_set>

#include "dataplane_auth.h"
#include "dataplane_client_conn.h"
#include "dataplane_client_ops.h"
#include "dataplane_coder.h"
#include "dataplane_failover.h"
#include "dataplane_io.h"
#include "dataplane_ucx.h"
#include "dtype.h"
#include "ops.h"

namespace bps {
namespace dp {

// =============================================================================================
// client
// =============================================================================================

class ClientImpl : public StreamEvents {
 public:
  ClientImpl(int rank, std::uint32_t job, int io_threads, std::uint64_t credit,
             std::uint64_t max_msg, std::string key, int codec_threads)
      : rank_(rank), job_(job), key_(std::move(key)), credit_(credit), max_msg_(max_msg),
        coders_(codec_threads) {
    for (int i = 0; i < std::max(1, io_threads); ++i) {
      loops_.emplace_back(new IoLoop());
      loops_.back()->start(nullptr);
    }
  }
  ~ClientImpl() { close(); }

  void connect(int server, const std::string& host, int port, int streams, double timeout,
               bool ucx);

  void submit(std::uint64_t id, int priority, const char* src, char* dst, int wire_dtype,
              std::int64_t divisor, std::vector<PartSpec> parts, bool compressed,
              std::uint64_t dst_bytes,
              std::vector<std::shared_ptr<PartCoder>> codecs) {
    auto op = make_op(id, priority, src, dst, wire_dtype, divisor, std::move(parts), compressed,
                      dst_bytes, std::move(codecs));
    std::vector<Ready> ready;
    std::vector<std::size_t> encode;  // a coded op's parts, for the codec threads
    {
      std::lock_guard<std::mutex> g(mu_);
      if (closed_) throw std::runtime_error("the data plane is closed");
      if (ops_.count(id)) throw std::invalid_argument("submit: operation id in use");
      ops_[id] = op;
      for (std::size_t i = 0; i < op->parts.size(); ++i) {
        const PartSpec& s = op->parts[i].spec;
        if (s.server < 0 || s.server >= static_cast<int>(servers_.size()) ||
            (servers_[s.server].conns.empty() && !servers_[s.server].gone)) {
          fail_locked(*op, "internal", -1, "no data-plane connection to server " +
                      std::to_string(s.server));
          break;
        }
        if (failover_ && !s.decl.empty()) keys_[s.key].decl = s.decl;
        if (!servers_[s.server].lost.empty() && !failover_) {
          fail_locked(*op, "peer_lost", s.server, servers_[s.server].lost);
          break;
        }
        if (op->coded) {
          if (i == 0) coded_ops_++;
          op->active++;  // its encode reads src: no completion before it is done
          encode.push_back(i);
        } else {
          pq_.push(QItem{priority, seq_++, op, i});
        }
      }
      maybe_report_locked(op);
      dispatch_locked(&ready);
    }
    send_ready(ready, true);
    for (std::size_t i : encode)
      if (!coders_.post([this, op, i] { encode_part(op, i); })) coded_dropped(op);
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
    gate_.set(false);
    for (auto& l : loops_) l->stop();   // closes every stream: their ops fail
    coders_.stop();  // no codec job touches a caller's buffers once its op is reported
    std::lock_guard<std::mutex> g(mu_);
    for (auto& kv : ops_) {
      fail_locked(*kv.second, "closed", -1, "the data plane was closed");
      kv.second->active = 0;
      maybe_report_locked(kv.second);
    }
    cv_.notify_all();
  }

  void hold_landed(bool on) { gate_.set(on); }

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

  // ---- losing a server (dataplane_failover.h, dataplane_server_failover.cc) ----
  // On: a lost stream parks its server's parts instead of failing them (and tells Python, a
  // "server_lost" completion of id kLostNotice + server), and answers are received into
  // each key's shadow.
  void set_failover(bool on) {
    std::lock_guard<std::mutex> g(mu_);
    failover_ = on;
  }

  // The servers in `gone` are lost for good, and only those (a replacement of one, connected
  // again, is not): every key whose server changes moves (rendezvous hashing over the servers
  // alive), and its parts in flight wait for the new one. With `hold`, the moving keys'
  // pushes wait for resume(), and each moving key whose last round this client completed is
  // seeded on its new server first (wait_seeds()).
  void failover(const std::vector<int>& gone, bool hold) {
    {
      std::lock_guard<std::mutex> g(mu_);
      prev_gone_.assign(servers_.size(), 0);
      for (std::size_t i = 0; i < servers_.size(); ++i) {
        prev_gone_[i] = servers_[i].gone;
        servers_[i].gone = false;
      }
      for (int s : gone) {
        if (s < 0) continue;
        if (static_cast<int>(servers_.size()) <= s) servers_.resize(s + 1);
        ServerSlot& sl = servers_[s];
        sl.gone = true;
        if (sl.lost.empty()) sl.lost = "server rank " + std::to_string(s) + " was lost";
      }
      repark_locked();
      holding_ = seeding_ = hold;
      seed_error_.clear();
      for (auto& kv : keys_) {
        KeyRecord& k = kv.second;
        const int now = k.owner < 0 ? -1 : route_locked(kv.first, k.orig);
        if (now < 0 || now == k.owner) continue;
        k.retry = true;
        k.owner = now;
        if (!hold || k.round < 0 || servers_[now].conns.empty()) continue;
        seed_locked(kv.first, k, now);
      }
    }
  }

  // Waits up to timeout seconds for every seed to be taken: "" when all were, else why not.
  std::string wait_seeds(double timeout) {
    std::unique_lock<std::mutex> g(mu_);
    const bool ok = cv_.wait_for(g, std::chrono::duration<double>(timeout),
                                 [&] { return seeds_out_.empty() || closed_; });
    if (!ok) return std::to_string(seeds_out_.size()) + " seed(s) not acknowledged in time";
    return seed_error_;
  }

  // The failover is over on every worker: the parked parts go to the keys' new servers.
  void resume() {
    std::vector<Ready> ready;
    {
      std::lock_guard<std::mutex> g(mu_);
      holding_ = false;
      for (auto& q : parked_) pq_.push(q);
      parked_.clear();
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
    s["codec_threads"] = static_cast<std::uint64_t>(coders_.threads());
    s["coded_ops"] = coded_ops_;
    s["encode_ns"] = encode_ns_;  // codec threads' time in encodes and decodes
    s["decode_ns"] = decode_ns_;
    std::lock_guard<std::mutex> g(mu_);
    s["inflight_bytes"] = inflight_bytes_;
    // seconds with a partition in flight (sent, its answer not in): the time the wire was asked
    // to work, in ns; a bandwidth is bytes over it (auto compression's meter)
    s["busy_ns"] = static_cast<std::uint64_t>(
        1e9 * (busy_s_ + (busy_parts_ ? monotonic_now() - busy_from_ : 0.0)));
    s["parked"] = parked_.size();
    s["stale_answers"] = stale_answers_;
    s["late_seeds"] = late_seeds_;
    s["landed_held"] = static_cast<std::uint64_t>(gate_.held());
    s["keys_kept"] = keys_.size();
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

  // An operation's record, its arguments checked: codecs (one per part) make it coded.
  static std::shared_ptr<Op> make_op(std::uint64_t id, int priority, const char* src, char* dst,
                                     int wire_dtype, std::int64_t divisor,
                                     std::vector<PartSpec> parts, bool compressed,
                                     std::uint64_t dst_bytes,
                                     std::vector<std::shared_ptr<PartCoder>> codecs) {
    auto op = std::make_shared<Op>();
    op->id = id;
    op->priority = priority;
    op->src = src;
    op->dst = dst;
    op->coded = !codecs.empty();
    const int kdt = wire_to_kernel_dtype(wire_dtype);
    if (op->coded) {
      // compressed: codec payloads, uint8 with FLAG_COMPRESSED (wire_dtype names the source,
      // float32); else casts, in wire_dtype (float16, bfloat16), which the servers sum
      const bool cast = kdt == static_cast<int>(DType::kFloat16) ||
                        kdt == static_cast<int>(DType::kBFloat16);
      if (codecs.size() != parts.size() ||
          (compressed ? kdt != static_cast<int>(DType::kFloat32) : !cast))
        throw std::invalid_argument("submit: a coded operation is float32 and compressed, or "
                                    "a cast to float16/bfloat16, with one codec per part");
      op->kdt = DType::kFloat32;
      if (compressed) wire_dtype = kWireUint8;
    } else if (compressed) {
      if (wire_itemsize(wire_dtype) != 1 || divisor != 1)
        throw std::invalid_argument("submit: a compressed payload is uint8, never divided");
    } else if (kdt < 0) {
      throw std::invalid_argument("submit: wire dtype cannot be summed");
    } else {
      op->kdt = static_cast<DType>(kdt);
    }
    op->wire_dtype = wire_dtype;
    op->compressed = compressed;
    op->dst_bytes = compressed && !op->coded ? dst_bytes : 0;
    op->isz = wire_itemsize(wire_dtype);
    op->divisor = divisor;
    op->parts.resize(parts.size());
    for (std::size_t i = 0; i < parts.size(); ++i) {
      Part& p = op->parts[i];
      p.spec = std::move(parts[i]);
      p.at = p.spec.server;
      p.wire = p.spec.nbytes;
      if (!op->coded) continue;
      p.coder = std::move(codecs[i]);
      if (!p.coder || 4 * p.coder->count() != p.spec.nbytes)
        throw std::invalid_argument("submit: the codec of key " + std::to_string(p.spec.key) +
                                    " is not one of " + std::to_string(p.spec.nbytes / 4) +
                                    " float32 elements");
      p.wire = p.coder->wire_bytes();
      p.out = p.coder->wire_buffer(0);
      p.in = p.coder->wire_buffer(1);
    }
    op->remaining = op->parts.size();
    return op;
  }

  // A codec thread: part i of a coded operation encoded into its push payload, which then
  // joins the send queue at the operation's priority.
  void encode_part(const std::shared_ptr<Op>& op, std::size_t i) {
    Part& p = op->parts[i];
    bool skip;
    {
      std::lock_guard<std::mutex> g(mu_);
      skip = op->failed;
    }
    if (!skip) {
      const double t0 = monotonic_now();
      p.coder->encode(reinterpret_cast<const float*>(op->src + p.spec.offset),
                      static_cast<std::uint64_t>(p.spec.round), p.out);
      encode_ns_ += static_cast<std::uint64_t>((monotonic_now() - t0) * 1e9);
    }
    std::vector<Ready> ready;
    {
      std::lock_guard<std::mutex> g(mu_);
      op->active--;
      if (!op->failed) pq_.push(QItem{op->priority, seq_++, op, i});
      maybe_report_locked(op);
      dispatch_locked(&ready);
    }
    send_ready(ready, true);
  }

  // A codec thread: the server's encoded sum of part t.idx decoded into dst and averaged.
  void decode_part(const Target& t) {
    Op& op = *t.op;
    Part& p = op.parts[t.idx];
    std::string err;
    bool skip;
    {
      std::lock_guard<std::mutex> g(mu_);
      skip = op.failed;
    }
    std::unique_lock<std::mutex> land = landing(t);  // parked meanwhile: not into dst
    if (!skip && p.parks == t.parks) {
      const double t0 = monotonic_now();
      try {
        // an average divides by the ranks that pushed (join(): those not joined), as it lands
        const std::int64_t div = t.contrib > 0 && op.divisor > 1 ? t.contrib : op.divisor;
        p.coder->decode(p.in, p.wire, reinterpret_cast<float*>(op.dst + p.spec.offset), div,
                        static_cast<std::uint64_t>(p.spec.round));
        p.landed = t.failover;
      } catch (const std::invalid_argument& exc) {
        err = exc.what();
      }
      decode_ns_ += static_cast<std::uint64_t>((monotonic_now() - t0) * 1e9);
    }
    if (land) land.unlock();
    gate_.pass();
    if (!err.empty()) {
      std::lock_guard<std::mutex> g(mu_);
      fail_locked(op, "protocol", p.at, "server " + std::to_string(p.at) +
                  "'s answer for key " + std::to_string(p.spec.key) + ": " + err);
    }
    finish_part(t, err.empty() && !skip);
  }

  // A codec job that will never run (the client is closing): its operation fails.
  void coded_dropped(const std::shared_ptr<Op>& op) {
    std::lock_guard<std::mutex> g(mu_);
    fail_locked(*op, "closed", -1, "the data plane was closed");
    if (op->active > 0) op->active--;  // close() may have cleared it already
    maybe_report_locked(op);
  }

  // PUSH_ACK: the push is in the server's hands; its bytes leave the credit.
  void on_ack(int server, const Header& h) override {
    std::vector<Ready> ready;
    {
      std::lock_guard<std::mutex> g(mu_);
      if (seed_answered_locked(server, h, nullptr)) return;
      auto it = inflight_.find(h.key);
      if (it == inflight_.end() || it->second.op->parts[it->second.idx].spec.round != h.round ||
          it->second.op->parts[it->second.idx].at != server)
        return;
      Part& p = it->second.op->parts[it->second.idx];
      if (p.t_acked == 0) p.t_acked = monotonic_now();
      release_locked(p);
      dispatch_locked(&ready);
    }
    send_ready(ready);
  }

  // PULL_RESP header: where its payload goes (null: discard it).
  char* on_resp(int server, const Header& h, Target* t) override {
    std::lock_guard<std::mutex> g(mu_);
    auto it = inflight_.find(h.key);
    if (it == inflight_.end()) return nullptr;
    Op& op = *it->second.op;
    Part& p = op.parts[it->second.idx];
    if (p.spec.round != h.round || p.at != server || op.failed) return nullptr;
    // a compressed answer is the server codec's encoded sum: any size dst has room for (a
    // registered compressor's payloads vary); a coded part's is its codec's payload size; any
    // other answer is the part's exact size
    const std::uint64_t room =
        op.dst_bytes > p.spec.offset ? op.dst_bytes - p.spec.offset : p.spec.nbytes;
    const bool loose = op.compressed && !op.coded;
    const bool fits = loose ? h.nbytes >= 1 && h.nbytes <= room : h.nbytes == p.wire;
    if (h.dtype != op.wire_dtype || !fits) {
      auto keep = it->second.op;
      fail_locked(op, "protocol", server, "server " + std::to_string(server) +
                  " answered key " + std::to_string(h.key) + " with " +
                  std::to_string(h.nbytes) + " bytes of dtype code " +
                  std::to_string(h.dtype) + ", expected " + (loose ? "at most " : "") +
                  std::to_string(loose ? room : p.wire) +
                  " bytes of dtype code " + std::to_string(op.wire_dtype));
      maybe_report_locked(keep);
      return nullptr;
    }
    *t = it->second;
    t->parks = p.parks;
    t->failover = failover_;
    t->len = h.nbytes;
    t->contrib = (h.flags & kFlagContrib) ? static_cast<int>(h.flags >> kContribShift) : 0;
    if (t->contrib > 0) op.contrib = t->contrib;
    op.active++;
    if (failover_ && !op.coded) {  // received into the key's shadow, copied out when whole
      KeyRecord& k = keys_[h.key];
      k.round = -1;
      if (k.shadow.size() < h.nbytes) k.shadow.resize(h.nbytes);
      return t->shadow = k.shadow.data();
    }
    return op.coded ? reinterpret_cast<char*>(p.in) : op.dst + p.spec.offset;
  }

  void resp_done(const Target& t, bool ok) override {
    if (ok && t.op->coded) {  // decoded (and averaged) on a codec thread, never on this one
      if (!coders_.post([this, t] { decode_part(t); })) coded_dropped(t.op);
      return;
    }
    if (ok && t.shadow) {  // copied out of the key's shadow on a codec thread: the I/O
      Target c = t;        // thread goes on reading
      c.copied = true;
      if (!coders_.post([this, c] {
            Op& op = *c.op;
            const std::int64_t div = c.contrib > 0 && op.divisor > 1 ? c.contrib : op.divisor;
            std::unique_lock<std::mutex> land = landing(c);  // parked meanwhile: dst keeps src
            Part& p = op.parts[c.idx];
            if (!op.failed && p.parks == c.parks) {
              copy_scaled(op.kdt, op.dst + p.spec.offset, c.shadow, c.len, op.compressed ? 1 : div);
              p.landed = true;
            }
            if (land) land.unlock();
            gate_.pass();
            finish_part(c, true);
          }))
        coded_dropped(t.op);
      return;
    }
    finish_part(t, ok);
  }

  // A part's result is in dst (ok) or never will be: average it, release its credit, and
  // complete the operation when it was the last.
  void finish_part(const Target& t, bool ok) {
    Op& op = *t.op;
    Part& p = op.parts[t.idx];
    // an average divides by the ranks that pushed: all of them, or those not joined (join())
    const std::int64_t div = t.contrib > 0 && op.divisor > 1 ? t.contrib : op.divisor;
    // a coded part was divided as decoded, a shadowed one as copied out (resp_done)
    if (ok && div > 1 && !op.failed && !op.coded && !t.copied)
      scale_into(op.kdt, op.dst + p.spec.offset, p.spec.nbytes / itemsize(op.kdt), div, 1);
    std::vector<Ready> ready;
    {
      std::lock_guard<std::mutex> g(mu_);
      op.active--;
      if (ok && !p.done && p.parks != t.parks) {
        stale_answers_++;  // it was parked since: it goes again, and this answer is not its
      } else if (ok && !p.done) {
        if (failover_ && keep_answer_locked(op, p, t)) late_seed_locked(p);
        release_locked(p);
        busy_locked(p, false);
        p.done = true;
        op.bytes += t.len;  // the answer's own size (a compressed one's varies)
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

  void on_error(int server, const Header& h, const std::string& meta) override {
    std::lock_guard<std::mutex> g(mu_);
    if (seed_answered_locked(server, h, &meta)) return;
    auto it = inflight_.find(h.key);
    if (it == inflight_.end()) return;
    auto op = it->second.op;
    if (op->parts[it->second.idx].spec.round != h.round) return;
    fail_locked(*op, "remote", server, meta);
    maybe_report_locked(op);
  }

  void on_stream_lost(int server, const std::string& why) override {
    std::lock_guard<std::mutex> g(mu_);
    if (closed_) return;
    ServerSlot& s = servers_[server];
    const bool first = s.lost.empty();
    if (first)
      s.lost = "lost the data-plane connection to server rank " + std::to_string(server) + " (" +
               s.where + "): " + why;
    if (failover_) {  // its parts wait for the key's new server (failover()); Python is told
      lost_locked(server, first);
      return;
    }
    std::vector<std::shared_ptr<Op>> hit;
    for (auto& kv : ops_) {
      Op& op = *kv.second;
      if (op.reported) continue;
      for (auto& p : op.parts)
        if (p.at == server && !p.done) {
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
    std::uint32_t flags = 0;  // FLAG_RETRY: a moved key's push, which re-declares it
    std::string decl;
  };
  struct ServerSlot {
    std::vector<std::shared_ptr<Conn>> conns;
    std::string where, lost;
    bool gone = false;  // lost for good (failover()): its keys have moved
  };

  void release_locked(Part& p) {
    if (p.dispatched && !p.acked) {
      p.acked = true;
      inflight_bytes_ -= std::min<std::uint64_t>(inflight_bytes_, p.wire);
    }
  }
  void busy_locked(Part& p, bool on) {  // p was sent (on) or is answered, failed or parked
    if (p.busy == on) return;
    p.busy = on;
    if (on && busy_parts_++ == 0) busy_from_ = monotonic_now();
    if (!on && --busy_parts_ == 0) busy_s_ += monotonic_now() - busy_from_;
  }

  void fail_locked(Op& op, const std::string& kind, int server, const std::string& msg) {
    if (op.failed) return;
    op.failed = true;
    op.kind = kind;
    op.err_server = server;
    op.message = msg;
    for (auto& p : op.parts) {
      release_locked(p);
      busy_locked(p, false);
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
    c.contrib = op->contrib;
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
      if (credit_ && inflight_bytes_ > 0 && inflight_bytes_ + p.wire > credit_) break;
      p.at = failover_ ? route_locked(p.spec.key, p.spec.server) : p.spec.server;
      if (p.at < 0 || !servers_[p.at].lost.empty() ||
          (holding_ && route_before_locked(p.spec.key, p.spec.server) != p.at)) {
        const QItem item = top;  // top is gone with the pop
        auto keep = top.op;
        pq_.pop();
        if (failover_ && p.at >= 0) {  // its server is lost:
          parked_.push_back(item);  // it waits for the key's new one
          continue;
        }
        fail_locked(op, "peer_lost", p.at < 0 ? p.spec.server : p.at,
                    p.at < 0 ? "every server of the job was lost" : servers_[p.at].lost);
        maybe_report_locked(keep);
        continue;
      }
      ServerSlot& s = servers_[p.at];
      Ready r{top.op, top.idx, s.conns[static_cast<std::size_t>(p.spec.conn) % s.conns.size()]};
      if (failover_) routed_locked(p, &r);
      p.dispatched = true;
      p.t_sent = monotonic_now();
      busy_locked(p, true);
      if (log_.size() < kDispatchLog) log_.push_back(p.spec.key);
      inflight_bytes_ += p.wire;
      inflight_[p.spec.key] = Target{top.op, top.idx};
      if (op.t_first == 0) op.t_first = monotonic_now();
      op.active++;
      ready->push_back(std::move(r));
      pq_.pop();
    }
  }

  // from_user: the submitting (Python) thread, which only queues; I/O threads write inline
  void send_ready(std::vector<Ready>& ready, bool from_user = false) {
    for (auto& r : ready) {
      Op& op = *r.op;
      const Part& part = op.parts[r.idx];
      const PartSpec& s = part.spec;
      Out o;
      std::uint32_t flags = kFlagPull | (op.compressed ? kFlagCompressed : 0) | r.flags;
      if (!s.decl.empty() || !r.decl.empty()) {
        flags |= kFlagDeclare | kFlagMeta;
        o.meta = s.decl.empty() ? r.decl : s.decl;
      }
      o.hdr = make_header(kPush, kRoleWorker, rank_, flags, job_, s.key, s.round,
                          static_cast<std::uint8_t>(op.wire_dtype),
                          part.wire / op.isz, part.wire);
      o.payload = op.coded ? reinterpret_cast<const char*>(part.out) : op.src + s.offset;
      o.plen = part.wire;
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

  // ---- losing a server (helpers; mu_ held) ----
  static constexpr std::uint64_t kLostNotice = 1ull << 63;  // + server: a "server_lost" notice

  // The server that holds `key`, first assigned to `server`: that one until it is gone.
  int route_locked(std::uint64_t key, int server) const {
    return route_key(key, server, servers_.size(), [&](std::size_t i) { return servers_[i].gone; },
                     [&](std::size_t i) { return !servers_[i].conns.empty(); });
  }
  // Where `key` went before the current failover (prev_gone_: the servers gone then).
  int route_before_locked(std::uint64_t key, int server) const {
    return route_key(key, server, servers_.size(),
                     [&](std::size_t i) { return i < prev_gone_.size() && prev_gone_[i]; },
                     [&](std::size_t i) { return !servers_[i].conns.empty(); });
  }
  // The parts in flight (sent, not answered) that `which` picks wait for resume(): their
  // credit comes back and an answer from their old server is no longer theirs.
  template <typename Which>
  void park_locked(Which which) {
    for (auto& kv : ops_) {
      Op& op = *kv.second;
      if (op.reported || op.failed) continue;
      for (std::size_t i = 0; i < op.parts.size(); ++i) {
        Part& p = op.parts[i];
        if (!p.dispatched || p.done || !which(p)) continue;
        std::lock_guard<std::mutex> land(land_mu_[p.spec.key % land_mu_.size()]);
        if (p.landed) continue;  // its answer is in dst: it completes (finish_part)
        release_locked(p);
        busy_locked(p, false);
        p.dispatched = p.acked = false;
        p.parks++;  // an answer landing now is not its own (resp_done, decode_part)
        auto it = inflight_.find(p.spec.key);
        if (it != inflight_.end() && it->second.op.get() == &op) inflight_.erase(it);
        parked_.push_back(QItem{op.priority, seq_++, kv.second, i});
      }
    }
  }
  // Parts in flight whose key's server changed wait for the new one (resume()).
  void repark_locked() {
    park_locked([this](const Part& p) { return p.at != route_locked(p.spec.key, p.spec.server); });
  }
  // A part about to go to p.at: a moved key's push re-declares it and says it is retried.
  void routed_locked(const Part& p, Ready* r) {
    KeyRecord& k = keys_[p.spec.key];
    if (k.orig < 0) k.orig = p.spec.server;
    if (k.owner >= 0 && k.owner != p.at) k.retry = true;
    k.owner = p.at;
    k.conn = p.spec.conn;
    if (k.retry && !k.decl.empty()) {
      r->flags = kFlagRetry;
      if (p.spec.decl.empty()) r->decl = k.decl;
    }
  }
  // A part's answer is whole: the key's shadow now holds its round (a coded part's answer
  // was received into its codec's buffer: copied, it is the compressed size). True when the
  // key moved meanwhile: its answer landed as a failover came (the part was not parked).
  bool keep_answer_locked(const Op& op, const Part& p, const Target& t) {
    KeyRecord& k = keys_[p.spec.key];
    if (op.coded) k.shadow.assign(reinterpret_cast<const char*>(p.in),
                                  reinterpret_cast<const char*>(p.in) + t.len);
    else if (!t.shadow) return false;
    k.round = p.spec.round;
    k.len = t.len;
    k.wire_dtype = op.wire_dtype;
    k.flags = (op.compressed ? kFlagCompressed : 0) |
              (t.contrib > 0 ? kFlagContrib | (static_cast<std::uint32_t>(t.contrib) << kContribShift)
                             : 0);
    k.retry = k.owner >= 0 && k.owner != p.at;  // its next push re-declares it there
    return k.retry;
  }
  // The round of a moved key completed on its old server after the failover's seeding: the
  // key's new server gets it as a late seed (counted in seeds_out_), or the workers whose
  // parts were parked would push that round again there and wait for this one's push. Posted
  // here, before the operation completes, so it goes ahead of the key's next push.
  void late_seed_locked(const Part& p) {
    const KeyRecord& k = keys_[p.spec.key];
    if (!seeding_ || servers_[k.owner].conns.empty() || !servers_[k.owner].lost.empty()) return;
    late_seeds_++;
    seed_locked(p.spec.key, k, k.owner);
  }
  // Seeds `key` with its last completed round (k) on server `to`, on the key's lane: counted
  // in seeds_out_ until acknowledged (wait_seeds). Posted holding mu_: post only queues on
  // the stream (its own lock; a seed has no callback), so the seed is ahead of the key's
  // next push, which is dispatched under mu_ too.
  void seed_locked(std::uint64_t key, const KeyRecord& k, int to) {
    seeds_out_[{key, k.round}] = to;
    const ServerSlot& s = servers_[to];
    s.conns[static_cast<std::size_t>(k.conn) % s.conns.size()]->post(
        seed_out(rank_, job_, key, k));
  }
  // The parts in flight to `server` wait for their key's new server; `notify`: tell Python.
  void lost_locked(int server, bool notify) {
    park_locked([server](const Part& p) { return p.at == server; });
    for (auto it = seeds_out_.begin(); it != seeds_out_.end();) {
      if (it->second != server) { ++it; continue; }
      seed_error_ = "server " + std::to_string(server) + " was lost while it was seeded";
      it = seeds_out_.erase(it);
    }
    if (notify) {
      Completion c;
      c.op = kLostNotice + static_cast<std::uint64_t>(server);
      c.ok = false;
      c.kind = "server_lost";
      c.server = server;
      c.message = servers_[server].lost;
      c.t_first_send = c.t_last_done = 0;
      c.bytes = 0;
      done_[c.op] = std::move(c);
    }
    cv_.notify_all();
  }
  // An acknowledgement or error (meta) that answers a seed: taken here.
  bool seed_answered_locked(int server, const Header& h, const std::string* meta) {
    auto it = seeds_out_.find({h.key, h.round});
    if (it == seeds_out_.end() || it->second != server) return false;
    if (meta) seed_error_ = "server " + std::to_string(server) + " refused the seed of key " +
                            std::to_string(h.key) + ": " + *meta;
    seeds_out_.erase(it);
    cv_.notify_all();
    return true;
  }
  bool failover_ = false;
  bool holding_ = false;      // a failover is in progress: moved keys' parts wait for resume()
  bool seeding_ = false;      // the last failover seeded the moved keys' new servers
  std::vector<char> prev_gone_;  // the servers gone before the current failover
  std::unordered_map<std::uint64_t, KeyRecord> keys_;
  std::vector<QItem> parked_;  // parts whose server is lost, waiting for its keys' new one
  std::map<std::pair<std::uint64_t, std::int64_t>, int> seeds_out_;  // (key, round) -> server
  std::string seed_error_;

  const std::uint64_t credit_, max_msg_;
  CoderPool coders_;
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
  std::uint64_t coded_ops_ = 0;  // coded operations submitted (guarded by mu_)
  std::uint64_t stale_answers_ = 0;  // answers of parts parked meanwhile (guarded by mu_)
  std::uint64_t late_seeds_ = 0;     // seeds of rounds completed after a failover (mu_)
  LandedGate gate_;                  // testing hook (hold_landed)
  // Losing a server: a part's answer lands in dst holding its key's stripe, and parking the
  // part takes it, so a part that will be sent again keeps its src (which may be dst).
  std::array<std::mutex, 64> land_mu_;
  std::unique_lock<std::mutex> landing(const Target& t) {
    if (!t.failover) return {};
    return std::unique_lock<std::mutex>(land_mu_[t.op->parts[t.idx].spec.key % land_mu_.size()]);
  }
  std::atomic<std::uint64_t> encode_ns_{0}, decode_ns_{0};
  std::uint64_t inflight_bytes_ = 0;
  std::uint64_t busy_parts_ = 0;          // partitions sent whose answers are not in
  double busy_from_ = 0, busy_s_ = 0;     // since when some are; seconds some were, in all
  std::unordered_map<std::uint64_t, Target> inflight_;   // key -> partition in flight
  bool paused_ = false;
  static constexpr std::size_t kDispatchLog = 4096;
  std::vector<std::uint64_t> log_;                        // keys in the order they went out
};

void ClientImpl::connect(int server, const std::string& host, int port, int streams,
                         double timeout, bool ucx) {
  if (server < 0 || streams < 1) throw std::invalid_argument("connect: bad server or streams");
  const double deadline = monotonic_now() + timeout;
  std::vector<std::shared_ptr<Conn>> conns;
  std::vector<std::size_t> where;  // the loop of each stream
  for (int i = 0; i < streams; ++i) {
    std::string err;
    const std::size_t loop = next_loop_++ % loops_.size();
    std::unique_ptr<Link> link;
    if (ucx) {
      link = ucx_open_stream(loops_[loop]->ucx(), host, port, rank_, job_, i, deadline, key_,
                             &err);
    } else {
      const int fd = open_stream(host, port, rank_, job_, i, deadline, key_, &err);
      if (fd >= 0) link.reset(new TcpLink(fd));
    }
    if (!link) {
      for (auto& c : conns) c->close_now();
      throw std::runtime_error("data plane: cannot reach server " + std::to_string(server) +
                               " at " + host + ":" + std::to_string(port) +
                               (ucx ? " (UCX): " : ": ") + err);
    }
    conns.push_back(client_stream(std::move(link), this, server, job_, max_msg_, &c_));
    where.push_back(loop);
  }
  {
    std::lock_guard<std::mutex> g(mu_);
    if (static_cast<int>(servers_.size()) <= server) servers_.resize(server + 1);
    servers_[server].conns = conns;
    servers_[server].where = host + ":" + std::to_string(port);
    servers_[server].lost.clear();
  }
  for (std::size_t i = 0; i < conns.size(); ++i) loops_[where[i]]->add(conns[i]);
}

DataClient::DataClient(int rank, std::uint32_t job, int io_threads, std::uint64_t credit,
                       std::uint64_t max_msg, std::string auth_key, int codec_threads)
    : impl_(new ClientImpl(rank, job, io_threads, credit, max_msg, std::move(auth_key),
                           codec_threads)) {}
DataClient::~DataClient() = default;
void DataClient::connect(int server, const std::string& host, int port, int streams,
                         double timeout, bool ucx) {
  impl_->connect(server, host, port, streams, timeout, ucx);
}
void DataClient::submit(std::uint64_t op, int priority, const char* src, char* dst,
                        int wire_dtype, std::int64_t divisor, std::vector<PartSpec> parts,
                        bool compressed, std::uint64_t dst_bytes,
                        std::vector<std::shared_ptr<PartCoder>> codecs) {
  impl_->submit(op, priority, src, dst, wire_dtype, divisor, std::move(parts), compressed,
                dst_bytes, std::move(codecs));
}
bool DataClient::wait(std::uint64_t op, double timeout) { return impl_->wait(op, timeout); }
bool DataClient::take(std::uint64_t op, Completion* out) { return impl_->take(op, out); }
std::vector<Completion> DataClient::completions(double timeout) {
  return impl_->completions(timeout);
}
void DataClient::close() { impl_->close(); }
void DataClient::set_paused(bool paused) { impl_->set_paused(paused); }
void DataClient::hold_landed(bool on) { impl_->hold_landed(on); }
void DataClient::set_failover(bool on) { impl_->set_failover(on); }
void DataClient::failover(const std::vector<int>& lost, bool hold) { impl_->failover(lost, hold); }
std::string DataClient::wait_seeds(double timeout) { return impl_->wait_seeds(timeout); }
void DataClient::resume() { impl_->resume(); }
std::vector<std::uint64_t> DataClient::take_dispatch_log() { return impl_->take_dispatch_log(); }
std::map<std::string, std::uint64_t> DataClient::stats() { return impl_->stats(); }

}  // namespace dp
}  // namespace bps
