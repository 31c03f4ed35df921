// The native data plane's server (dataplane.h, DataServer): its streams, the keys' stores and
// their chunked summation, rounds, membership and epochs, the bounds on what peers can make it
// hold (connection slots, replies left unread).
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <deque>
#include <map>
#include <stdexcept>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#ifdef __GLIBC__
#include <malloc.h>  // malloc_trim
#endif

#include "codec.h"
#include "dataplane_auth.h"
#include "dataplane_io.h"
#include "dataplane_store.h"
#include "dataplane_ucx.h"
#include "dtype.h"
#include "ops.h"
#include "sha256.h"

namespace bps {
namespace dp {

constexpr int kWireUint8 = 7;  // a compressed payload's wire dtype (wire.h)
static_assert(kWireDTypes[kWireUint8].itemsize == 1 && kWireDTypes[kWireUint8].kernel == -1,
              "uint8 is wire dtype code 7");

// =============================================================================================
// server (its keys' stores: dataplane_store.h)
// =============================================================================================
class ServerConn;

class ServerImpl {
 public:
  ServerImpl(int num_workers, int server_rank, std::uint32_t job, int io_threads,
             std::uint64_t max_msg, std::uint64_t max_store, int max_conns, std::string key,
             bool async_mode)
      : num_workers_(num_workers), rank_(server_rank), job_(job), max_msg_(max_msg),
        max_store_(max_store), max_conns_(max_conns), key_(std::move(key)), async_(async_mode),
        joined_(static_cast<std::size_t>(std::max(0, num_workers)), 0),
        required_(num_workers) {
    for (int i = 0; i < std::max(1, io_threads); ++i) loops_.emplace_back(new IoLoop());
  }
  ~ServerImpl() { close(); }

  int listen(const std::string& host, int port) { return listen_tcp(host, port, &lfd_); }

  // Streams over UCX instead (dataplane_ucx.h): a UCP listener on the first loop's worker,
  // whose connection requests pass the same admission as accepted sockets.
  int listen_ucx(const std::string& host, int port) {
    UcxWorker* w = loops_[0]->ucx();
    ucx_listener_ = ucx_listen(w, host, port, [this](const auto& make) {
      // the streams spread over the loops, each endpoint on its loop's worker
      const std::size_t loop = next_ucx_++ % loops_.size();
      return !closing_.load() && admit([&] { return make(loops_[loop]->ucx()); }, loop);
    });
    return ucx_listener_->port();
  }

  void start() {
    for (auto& l : loops_) l->start([this](const auto& conns) { tick(conns); });
    if (lfd_ >= 0) acceptor_ = std::thread([this] { accept_loop(); });
  }

  void close() {
    if (closing_.exchange(true)) return;
    if (acceptor_.joinable()) acceptor_.join();
    if (lfd_ >= 0) ::close(lfd_);
    lfd_ = -1;
    ucx_listener_.reset();
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
    s["meta_bytes"] = meta_bytes_.load();
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
    if (async_) return {};  // no rounds across workers: nothing waits for anyone
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
  const bool async_;  // BYTEPS_ENABLE_ASYNC: no rounds; pushes add to Store::value at once
  // membership (set_members): mem_mu_ is taken after a store's mu, never before it
  std::mutex mem_mu_;
  std::vector<std::uint8_t> joined_;
  std::map<int, std::string> left_;
  std::atomic<int> required_{0};  // pushes that complete a round: workers not joined
  std::atomic<std::int64_t> round_base_{0};  // elastic: the epoch's first round (new keys')
  // BYTEPS_PARTITION_BYTES: a compressed key's element count is at most one partition of its
  // dtype (its accumulator's size); 0 refuses compressed keys
  std::atomic<std::uint64_t> partition_bytes_{0};

  // extra: more JSON members, already encoded (",\"rank\":1"), or empty
  void send_error(const std::shared_ptr<Conn>& conn, const Header& h, const char* kind,
                  const std::string& text, const std::string& extra = std::string()) {
    Out o;
    o.hdr = make_header(kError, kRoleServer, rank_.load(), kFlagMeta, job_, h.key, h.round);
    o.meta = error_meta(kind, text, h.type, extra);
    conn->send(std::move(o));
  }

  void send_resp(const std::shared_ptr<Conn>& conn, const std::shared_ptr<Store>& st,
                 std::int64_t round) {
    Out o;
    // st->contrib is written under st->mu when the round completes, before any answer for it
    const int n = st->contrib[round & 1];
    const std::uint32_t flags =
        (n < num_workers_ ? kFlagContrib | (static_cast<std::uint32_t>(n) << kContribShift) : 0) |
        (st->codec ? kFlagCompressed : 0);
    o.hdr = make_header(kPullResp, kRoleServer, rank_.load(), flags, job_, st->key, round,
                        static_cast<std::uint8_t>(st->wire_dtype), st->count, st->nbytes);
    o.payload = st->buf[round & 1].get();
    o.plen = st->nbytes;
    o.keep = st;
    conn->send(std::move(o));
  }

  // Asynchronous mode: a pull's answer, `value` (which the reply may hold last: charged to it).
  void send_value(const std::shared_ptr<Conn>& conn, const Store& st, std::shared_ptr<char> value,
                  std::int64_t round) {
    Out o;
    o.hdr = make_header(kPullResp, kRoleServer, rank_.load(), 0, job_, st.key, round,
                        static_cast<std::uint8_t>(st.wire_dtype), st.count, st.nbytes);
    o.payload = value.get();
    o.plen = o.owned = st.nbytes;
    o.keep = std::move(value);
    conn->send(std::move(o));
  }

  // A push's header (and declaration) arrived: the store it sums into, or null after an
  // error reply (the caller discards the payload).
  // *staged: the bytes of the memory budget taken for receiving a compressed payload whole
  // (the caller gives them back with reserve(-staged) once it is decoded or dropped).
  std::shared_ptr<Store> begin_push(const std::shared_ptr<Conn>& conn, const Header& h,
                                    const std::string& meta, std::uint64_t* gen,
                                    std::uint64_t* staged) {
    const bool compressed = h.flags & kFlagCompressed;
    const int kdt = compressed ? static_cast<int>(DType::kFloat32) : wire_to_kernel_dtype(h.dtype);
    if (compressed && (async_ || h.dtype != kWireUint8)) {
      reject(async_ ? "compressed push in asynchronous mode" : "compressed push not of uint8");
      send_error(conn, h, "protocol", "server " + std::to_string(rank_.load()) + ": key " +
                 std::to_string(h.key) + " from worker rank " + std::to_string(h.rank) +
                 (async_ ? ": compression needs synchronous mode; unset BYTEPS_ENABLE_ASYNC or "
                           "push without a compressor"
                         : ": a compressed payload travels as uint8"));
      return nullptr;
    }
    if (kdt < 0) {
      reject("dtype that cannot be summed");
      send_error(conn, h, "protocol", "server " + std::to_string(rank_.load()) + ": dtype code " +
                 std::to_string(h.dtype) + " cannot be summed");
      return nullptr;
    }
    if ((h.flags & kFlagAsync) && !async_) {
      reject("async push to a synchronous server");
      send_error(conn, h, "protocol", "server " + std::to_string(rank_.load()) +
                 ": an asynchronous push to a server in synchronous mode");
      return nullptr;
    }
    std::shared_ptr<Store> st = store_for_push(conn, h, meta, kdt);
    if (!st) return nullptr;
    if (st->codec && compressed && h.nbytes == st->nbytes) {  // received whole, then decoded
      if (!reserve(static_cast<std::int64_t>(h.nbytes))) {
        reject("server memory budget exhausted");
        send_error(conn, h, "protocol", "server " + std::to_string(rank_.load()) + ": key " +
                   std::to_string(h.key) + ": no room in the memory budget "
                   "(BYTEPS_SERVER_MAX_BYTES) to receive a compressed push of " +
                   std::to_string(h.nbytes) + " bytes");
        return nullptr;
      }
      *staged = h.nbytes;
    }
    std::lock_guard<std::mutex> g(st->mu);
    std::map<int, std::string> left;
    if (!admit_push_locked(conn, h, meta, *st, &left)) return unstage(staged);
    *gen = st->gen.load();
    if (async_) {
      if (st->started == st->finished && st->value.use_count() > 1) {  // a reply holds it: copy
        std::shared_ptr<char> copy(new char[st->nbytes], std::default_delete<char[]>());
        std::memcpy(copy.get(), st->value.get(), st->nbytes);
        st->value = std::move(copy);
      }
      ++st->started;
      return st;
    }
    st->pushed[h.rank] = 1;
    if (st->started++ == 0) st->round_started = monotonic_now();
    if (!left.empty() && doom_if_left_locked(*st, left)) {
      send_error(conn, h, st->failed_kind.c_str(), st->failed, st->failed_extra);
      return unstage(staged);
    }
    return st;
  }

  std::shared_ptr<Store> unstage(std::uint64_t* staged) {
    if (*staged) reserve(-static_cast<std::int64_t>(*staged));
    *staged = 0;
    return nullptr;
  }

  // The key's store; made on the key's first push, which must declare it and fit the memory
  // budget. Null after an error reply.
  std::shared_ptr<Store> store_for_push(const std::shared_ptr<Conn>& conn, const Header& h,
                                        const std::string& meta, int kdt) {
    std::lock_guard<std::mutex> g(map_mu_);
    auto it = stores_.find(h.key);
    if (it != stores_.end()) return it->second;
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
    std::unique_ptr<compress::FramedCodec> codec;
    if ((h.flags & kFlagCompressed) && !(codec = make_codec(conn, h, meta))) return nullptr;
    // two buffers (async: one), the declaration kept for comparisons, per-chunk bookkeeping;
    // a compressed key's accumulator and codec
    const std::size_t nchunks = (h.nbytes + kChunk - 1) / kChunk;
    const std::uint64_t need =
        (async_ ? 1 : 2) * h.nbytes + meta.size() + kStoreOverhead +
        nchunks * ((async_ ? 0 : 2 * sizeof(std::uint32_t)) + sizeof(std::mutex)) +
        (codec ? sizeof(float) * codec->n() + codec->held_bytes() : 0);
    if (store_bytes_ + need > max_store_) {
      reject("server memory budget exhausted");
      send_error(conn, h, "protocol", "server " + std::to_string(rank_.load()) + ": key " +
                 std::to_string(h.key) + " needs " + std::to_string(need) +
                 " bytes, over the budget of " + std::to_string(max_store_) +
                 " (BYTEPS_SERVER_MAX_BYTES); " + std::to_string(store_bytes_) +
                 " bytes are held");
      return nullptr;
    }
    auto st = make_store_locked(h, meta, kdt, nchunks, need);
    if (codec) {
      st->acc.reset(new float[codec->n()]());
      st->codec = std::move(codec);
    }
    return st;
  }

  // The server's codec of a compressed key's first push: its parameters from the declaration
  // (compression.native_params), checked, of at most one partition of the declared dtype
  // (BYTEPS_PARTITION_BYTES), its payload exactly the push's size. Null after an error reply.
  std::unique_ptr<compress::FramedCodec> make_codec(const std::shared_ptr<Conn>& conn,
                                                    const Header& h, const std::string& meta) {
    std::string why;
    try {
      char kind = 0;
      const std::string dtype = json_field_text(meta, "dtype", &kind);
      const std::string count = json_field_text(meta, "count", &kind);
      std::size_t isz = 0;
      if (dtype == "float32") isz = 4;
      else if (dtype == "float16" || dtype == "bfloat16") isz = 2;
      else if (dtype == "float64") isz = 8;
      std::vector<std::uint64_t> list;
      const std::uint64_t limit = isz ? partition_bytes_.load() / isz : 0;
      char* end = nullptr;
      const unsigned long long n =
          count.empty() || count[0] == '-' ? 0 : std::strtoull(count.c_str(), &end, 10);
      if (!decl_codec(meta, &list)) {
        why = "the declaration carries no native codec parameters";
      } else if (!isz) {
        why = "declared dtype '" + dtype.substr(0, 16) + "' is not one workers compress "
              "(float32, float16, bfloat16, float64)";
      } else if (n == 0 || end == nullptr || *end != '\0' || n > limit) {
        why = "element count " + count.substr(0, 24) + " is not an integer in 1.." +
              std::to_string(limit) + ", one partition of " + dtype + " (BYTEPS_PARTITION_BYTES=" +
              std::to_string(partition_bytes_.load()) + " on this server; workers and servers "
              "must use the same)";
      } else {
        const compress::CodecParams p = compress::params_from_list(list);
        compress::validate(p, n);
        if (compress::payload_bytes(p, n) != h.nbytes) {
          why = "a payload of " + std::to_string(h.nbytes) + " bytes, but " +
                compress::describe(p) + " of " + std::to_string(n) + " elements takes " +
                std::to_string(compress::payload_bytes(p, n));
        } else {
          return std::unique_ptr<compress::FramedCodec>(new compress::FramedCodec(p, h.key, n));
        }
      }
    } catch (const std::invalid_argument& exc) {
      why = exc.what();
    }
    reject("bad compressor declaration");
    send_error(conn, h, "protocol", "server " + std::to_string(rank_.load()) + ": compressed "
               "push of key " + std::to_string(h.key) + " (" + describe_decl(meta) +
               ") from worker rank " + std::to_string(h.rank) + ": " + why);
    return nullptr;
  }

  std::shared_ptr<Store> make_store_locked(const Header& h, const std::string& meta, int kdt,
                                           std::size_t nchunks, std::uint64_t need) {
    auto st = std::make_shared<Store>();
    st->key = h.key;
    st->wire_dtype = h.dtype;
    st->kdt = static_cast<DType>(kdt);
    st->nbytes = h.nbytes;
    st->count = h.count;
    st->nchunks = nchunks;
    st->decl = meta;
    st->decl_rank = h.rank;
    if (async_) {  // the value starts at zero: every push is added to it
      st->value.reset(new char[h.nbytes](), std::default_delete<char[]>());
    } else {
      for (int b = 0; b < 2; ++b) {
        st->buf[b].reset(new char[h.nbytes]);
        st->fill[b].reset(new std::uint32_t[st->nchunks]());
      }
    }
    st->chunk_mu.reset(new std::mutex[st->nchunks]);
    st->pushed.assign(num_workers_, 0);
    st->round = round_base_.load();  // a key first declared in a later elastic epoch
    st->charged = need;
    stores_[h.key] = st;
    store_bytes_ += need;
    return st;
  }

  // Whether a push may sum into the key's store (st.mu held); false after an error reply.
  // *left: the ranks that left the job (join()), for the caller.
  bool admit_push_locked(const std::shared_ptr<Conn>& conn, const Header& h,
                         const std::string& meta, Store& st, std::map<int, std::string>* left) {
    // Checked in this order, as on the ZeroMQ path (server/core.py, _check): a push that
    // declares another tensor than the key's is a worker disagreeing, whatever its size; its
    // dtype and size otherwise (rejected alone); its round (rejected alone, whatever it
    // declares); then a real mismatch fails the key, naming both sides.
    const bool mismatch = (h.flags & kFlagDeclare) && meta != st.decl;
    if (!mismatch && (h.dtype != st.wire_dtype || h.nbytes != st.nbytes)) {
      reject("wrong dtype or size for a declared key");
      send_error(conn, h, "protocol", "push to key " + std::to_string(h.key) + " (" +
                 describe_decl(st.decl) + ") from worker rank " + std::to_string(h.rank) +
                 ": " + std::to_string(h.nbytes) +
                 " bytes of dtype code " + std::to_string(h.dtype) + ", but the key holds " +
                 std::to_string(st.nbytes) + " bytes of dtype code " +
                 std::to_string(st.wire_dtype));
      return false;
    }
    // a push for another round is rejected alone, whatever it declares (asynchronous mode
    // has no rounds)
    if (!async_ && (h.round != st.round || st.pushed[h.rank])) {
      reject("push out of round");
      // one text for both causes and no round number: the reply tells nobody the open round
      send_error(conn, h, "protocol", "key " + std::to_string(h.key) + ": push from worker "
                 "rank " + std::to_string(h.rank) + " for round " + std::to_string(h.round) +
                 ", a round that is not open or that this rank has pushed already");
      return false;
    }
    if (mismatch && st.failed.empty()) {
      fail_key_locked(st, "tensor mismatch on key " + std::to_string(h.key) + ": worker rank " +
                      std::to_string(st.decl_rank) + " declared " + describe_decl(st.decl) +
                      " but worker rank " + std::to_string(h.rank) + " declared " +
                      describe_decl(meta) +
                      "; every worker must declare the same tensors, in the same order, with "
                      "the same shape, dtype and compressor");
    }
    if (!st.failed.empty()) {
      send_error(conn, h, st.failed_kind.c_str(), st.failed, st.failed_extra);
      return false;
    }
    if (!async_) {  // join() does not hold asynchronous pushes back
      std::lock_guard<std::mutex> m(mem_mu_);
      if (joined_[h.rank]) {
        reject("push after join()");
        send_error(conn, h, "protocol", "key " + std::to_string(h.key) + ": push from worker "
                   "rank " + std::to_string(h.rank) + ", which has called join(); a joined "
                   "rank pushes again only after every rank has joined");
        return false;
      }
      *left = left_;
    }
    return true;
  }

  void sum_chunk(Store& st, std::int64_t round, std::size_t offset, const char* data,
                 std::size_t len, std::uint64_t gen) {
    const std::size_t c = offset / kChunk;
    const int par = static_cast<int>(round & 1);
    std::lock_guard<std::mutex> g(st.chunk_mu[c]);
    if (st.gen.load() != gen) return;  // begun before a membership epoch reset: dropped
    if (async_) {  // the value is the store's alone while a push is in flight
      add_into(st.kdt, st.value.get() + offset, data, len / itemsize(st.kdt), 1);
    } else if (st.fill[par][c]++ == 0) {
      std::memcpy(st.buf[par].get() + offset, data, len);
    } else {
      add_into(st.kdt, st.buf[par].get() + offset, data, len / itemsize(st.kdt), 1);
    }
  }

  // payload: a compressed key's whole payload (null for others, summed chunk by chunk)
  void finish_push(const std::shared_ptr<Conn>& conn, const std::shared_ptr<Store>& st,
                   const Header& h, std::uint64_t gen, const std::uint8_t* payload = nullptr) {
    std::vector<Store::Pending> answer;
    std::shared_ptr<char> value;  // asynchronous mode: what the answered pulls get
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
      if (payload && st->failed.empty() && !decode_push_locked(conn, *st, h, payload)) return;
      c_.pushes++;
      c_.bytes_summed += h.nbytes;
      failed = !st->failed.empty();
      if (async_) ++st->finished;  // failed or not: pulls wait only for pushes in flight
      if (!failed) {
        Out ack;
        ack.hdr = make_header(kPushAck, kRoleServer, rank_.load(), 0, job_, h.key, h.round);
        conn->send(std::move(ack));
        if (h.flags & kFlagPull) st->pending.push_back({conn, h.round});
        if (async_) {
          value = settled_value_locked(*st, &answer);
        } else {
          ++st->finished;
          done_round = complete_if_ready_locked(*st, &answer);
        }
      } else {
        send_error(conn, h, st->failed_kind.c_str(), st->failed, st->failed_extra);
      }
    }
    for (auto& p : answer) {
      auto c = p.conn.lock();
      if (c && async_) send_value(c, *st, value, p.round);
      else if (c) send_resp(c, st, done_round);
    }
  }

  // A compressed push (st.mu held): decoded into the round's accumulator (the round's first
  // push overwrites it), every push of a round of the same step, as server/core.py's engine
  // did. A malformed payload leaves the accumulator untouched and takes the push out of the
  // round; when others were summed already the round cannot complete: the key fails. False
  // after an error reply.
  bool decode_push_locked(const std::shared_ptr<Conn>& conn, Store& st, const Header& h,
                          const std::uint8_t* payload) {
    const bool first = st.finished == 0;
    auto what = [&] {  // for errors only: not built on every push
      return "compressed key " + std::to_string(h.key) + " (" + describe_decl(st.decl) +
             "): worker rank " + std::to_string(h.rank);
    };
    try {
      const std::uint64_t step = st.codec->decode(payload, h.nbytes, st.acc.get(), !first);
      if (first) {
        st.step = step;
      } else if (step != st.step) {  // added already: the round is inconsistent now
        fail_key_locked(st, what() + " pushed step " + std::to_string(step) + " while the round "
                        "holds step " + std::to_string(st.step) + "; every worker must push "
                        "the tensor the same number of times");
        send_error(conn, h, st.failed_kind.c_str(), st.failed, st.failed_extra);
        return false;
      }
      return true;
    } catch (const std::invalid_argument& exc) {
      reject("malformed compressed payload");
      st.pushed[h.rank] = 0;
      --st.started;
      if (st.finished > 0) {  // the round cannot complete without it: tell everyone waiting
        fail_key_locked(st, what() + " sent a malformed payload (" + exc.what() + ")");
        send_error(conn, h, "protocol", st.failed);
      } else {
        send_error(conn, h, "protocol", what() + " sent a malformed payload: " + exc.what());
      }
      return false;
    }
  }

  // Asynchronous mode: with no push in flight, the value and the pulls to answer with it.
  std::shared_ptr<char> settled_value_locked(Store& st, std::vector<Store::Pending>* answer) {
    if (st.started != st.finished) return nullptr;
    answer->swap(st.pending);
    return st.value;
  }

  // Asynchronous mode: a push cut off by its stream's loss. The chunks it summed stay in the
  // value; the pulls that waited for it are answered once no other push is in flight.
  void abort_push(const std::shared_ptr<Store>& st) {
    if (!async_) return;  // a synchronous round waits for that rank; the scheduler ends it
    std::vector<Store::Pending> answer;
    std::shared_ptr<char> value;
    {
      std::lock_guard<std::mutex> g(st->mu);
      ++st->finished;
      value = settled_value_locked(*st, &answer);
    }
    for (auto& p : answer) {
      if (auto c = p.conn.lock()) send_value(c, *st, value, p.round);
    }
  }

  // The open round is complete once every worker rank that has not joined has pushed (and
  // summed) it: close it, hand its waiting pulls to the caller, return its number (-1: open).
  std::int64_t complete_if_ready_locked(Store& st, std::vector<Store::Pending>* answer) {
    const int need = required_.load();
    if (st.finished == 0 || st.finished < need || st.finished != st.started) return -1;
    const std::int64_t done = st.round;
    if (st.codec)  // the pull is compressed too: the sum, encoded with the round's step
      st.codec->encode(st.acc.get(), st.step,
                       reinterpret_cast<std::uint8_t*>(st.buf[done & 1].get()));
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
    if (async_) return;  // no round waits for anyone: nothing to complete or fail
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
      for (std::size_t c = 0; c < st->nchunks && st->fill[0]; ++c) {
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
    } else if (async_ && st->started == st->finished) {  // the value, whatever the round
      std::shared_ptr<char> value = st->value;
      g.unlock();
      send_value(conn, *st, std::move(value), h.round);
    } else if (!async_ && h.round == st->completed && h.round >= 0) {
      g.unlock();
      send_resp(conn, st, h.round);
    } else if ((async_ || h.round == st->round) &&  // async: once the pushes in flight end
               st->pending.size() < 4 * static_cast<std::size_t>(num_workers_)) {
      st->pending.push_back({conn, h.round});
    } else {
      const bool crowded = async_ || h.round == st->round;
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
      const auto tcp = [fd] {
        set_nodelay(fd);
        return std::unique_ptr<Link>(new TcpLink(fd));
      };
      if (!admit(tcp, next++)) ::close(fd);
    }
  }

  // A new stream: a slot for it, or false (refused and counted; the caller drops it). `make`
  // makes its link once it is taken (nullptr: it could not be).
  template <typename Make>
  bool admit(Make make, std::size_t loop) {
    // Slots for streams that have said hello (and proved the secret, in a job with one):
    // streams that have not are at most a quarter of the slots, and the oldest of them
    // makes room for a new connection, so peers without the secret cannot hold the slots
    // a reconnecting or joining worker needs.
    const bool full = live_conns_.load() >= max_conns_;
    if ((full || unproven_.load() >= std::max(1, max_conns_ / 4)) && !evict_unproven()) {
      reject("too many connections");
      return false;
    }
    std::unique_ptr<Link> link = make();
    if (!link) return false;
    live_conns_++;
    unproven_++;
    c_.connections++;
    auto conn = make_conn(std::move(link));
    {
      std::lock_guard<std::mutex> g(slot_mu_);
      prune_unproven_locked();
      unproven_q_.push_back(conn);
    }
    loops_[loop % loops_.size()]->add(conn);
    return true;
  }

  // Closes the oldest stream that has not said hello; false when there is none.
  bool evict_unproven();
  // Drops the streams at the queue's front that have said hello or closed, so the queue holds
  // about the streams accepted within a hello timeout, not every stream ever accepted.
  void prune_unproven_locked();

  std::shared_ptr<Conn> make_conn(std::unique_ptr<Link> link);

  void tick(const std::unordered_map<int, std::shared_ptr<Conn>>& conns);

 public:
  std::atomic<int> live_conns_{0};
  std::atomic<int> unproven_{0};  // open streams that have not said hello (or proved it)
  std::atomic<int> closed_since_trim_{0};
  std::atomic<std::uint64_t> meta_bytes_{0};  // large meta frames being read (kMetaBudget)  // streams closed since memory was last given back
  std::vector<std::unique_ptr<IoLoop>> loops_;

 private:
  std::mutex slot_mu_;
  std::deque<std::weak_ptr<Conn>> unproven_q_;  // in accept order (some proven or closed)
  std::mutex trim_mu_;
  double trimmed_at_ = 0;
  int lfd_ = -1;
  std::unique_ptr<UcxListener> ucx_listener_;
  std::size_t next_ucx_ = 0;  // the loop of the next UCX stream (the listener's loop thread)
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
  ServerConn(std::unique_ptr<Link> link, ServerImpl* srv)
      : FramedConn(std::move(link), &srv->c_), srv_(srv) {
    read_header();
  }
  bool hello_done() const { return hello_; }
  bool unproven() const { return unproven_.load(); }
  // Leaves the streams that have not said hello (hello, close or eviction); false if it had.
  bool prove() {
    if (!unproven_.exchange(false)) return false;
    srv_->unproven_--;
    return true;
  }

 protected:
  void on_closed() override {
    if (store_) srv_->abort_push(store_);  // cut off in the middle of a push's payload
    store_.reset();
    unstage();
    give_meta();
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
      case kMetaLen: return on_meta_len();
      case kMeta:
        give_meta();
        return after_meta();
      case kPayload: {
        if (store_->codec) {  // a compressed payload, received whole: decoded by finish_push
          off_ = h_.nbytes;
          return next_chunk();
        }
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

  // A meta frame's length: within the 1 MiB bound, and a large one within what the server's
  // streams may hold of meta frames being read (kMetaBudget), else the stream is closed.
  bool on_meta_len() {
    if (meta_len_ > kMaxMeta) {
      srv_->reject("oversized meta");
      why_ = "meta frame over 1 MiB";
      return false;
    }
    if (meta_len_ > kFreeMeta) {
      if (srv_->meta_bytes_.fetch_add(meta_len_) + meta_len_ > kMetaBudget) {
        srv_->meta_bytes_ -= meta_len_;
        srv_->reject("meta frames over the server's budget");
        why_ = "the server holds too many large meta frames being read";
        return false;
      }
      meta_charged_ = meta_len_;
    }
    return read_meta("meta frame over 1 MiB");
  }

  void give_meta() {
    srv_->meta_bytes_ -= meta_charged_;
    meta_charged_ = 0;
  }

  bool after_meta() {
    auto self = shared_from_this();
    if (h_.type == kPull) {
      srv_->handle_pull(self, h_);
      return read_header();
    }
    store_ = srv_->begin_push(self, h_, meta_, &gen_, &staged_);
    off_ = 0;
    if (!store_) {
      discard_left_ = h_.nbytes;
      return next_discard();
    }
    return next_chunk();
  }

  bool next_chunk() {
    if (off_ >= h_.nbytes) {
      srv_->finish_push(shared_from_this(), store_, h_, gen_,
                        store_->codec ? cbuf_.data() : nullptr);
      store_.reset();
      unstage();
      return read_header();
    }
    if (store_->codec) {  // staged (charged to the budget by begin_push) and read whole
      cbuf_.resize(h_.nbytes);
      state_ = kPayload;
      expect(reinterpret_cast<char*>(cbuf_.data()), h_.nbytes);
      return true;
    }
    const std::size_t len = std::min<std::size_t>(kChunk, h_.nbytes - off_);
    if (scratch_.size() < len) scratch_.resize(kChunk);
    state_ = kPayload;
    expect(scratch_.data(), len);
    return true;
  }

  // A compressed payload's staging: given back after each push (payloads of a partition's
  // size must not stay with every stream), with its charge to the memory budget.
  void unstage() {
    if (staged_) srv_->reserve(-static_cast<std::int64_t>(staged_));
    staged_ = 0;
    if (cbuf_.capacity() > kChunk) std::vector<std::uint8_t>().swap(cbuf_);
  }

  ServerImpl* srv_;
  std::shared_ptr<Store> store_;
  std::vector<std::uint8_t> cbuf_;
  std::uint64_t staged_ = 0;
  std::uint64_t gen_ = 0;   // the store's epoch generation when this push began
  std::size_t off_ = 0;
  bool hello_ = false, awaiting_mac_ = false;
  int rank_ = -1;
  std::uint64_t stream_ = 0;
  std::uint8_t peer_nonce_[kNonce] = {}, my_nonce_[kNonce] = {}, peer_mac_[32] = {};
  std::atomic<bool> unproven_{true};   // counted in srv_->unproven_
  std::uint32_t meta_charged_ = 0;     // of srv_->meta_bytes_
};

void ServerImpl::prune_unproven_locked() {
  while (!unproven_q_.empty()) {
    std::shared_ptr<Conn> c = unproven_q_.front().lock();
    if (c && static_cast<ServerConn*>(c.get())->unproven()) return;
    unproven_q_.pop_front();
  }
}

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

std::shared_ptr<Conn> ServerImpl::make_conn(std::unique_ptr<Link> link) {
  return std::make_shared<ServerConn>(std::move(link), this);
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
                       std::string auth_key, bool async_mode)
    : impl_(new ServerImpl(num_workers, server_rank, job, io_threads, max_msg, max_store,
                           max_conns, std::move(auth_key), async_mode)) {}
DataServer::~DataServer() = default;
int DataServer::listen(const std::string& host, int port) { return impl_->listen(host, port); }
int DataServer::listen_ucx(const std::string& host, int port) {
  return impl_->listen_ucx(host, port);
}
void DataServer::start() { impl_->start(); }
void DataServer::close() { impl_->close(); }
bool DataServer::claim_zmq_key(std::uint64_t key) { return impl_->claim_zmq_key(key); }
bool DataServer::reserve(std::int64_t bytes) { return impl_->reserve(bytes); }
void DataServer::set_rank(int rank) { impl_->rank_ = rank; }
void DataServer::set_partition_bytes(std::uint64_t n) { impl_->partition_bytes_ = n; }
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

}  // namespace dp
}  // namespace bps
