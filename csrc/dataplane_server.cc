// The native data plane's server (dataplane.h, DataServer): the keys' stores (dataplane_store.h)
// and their chunked summation, rounds, membership and epochs, pulls, failing a key, rejections
// and stats. Its streams' admission is in dataplane_server_admit.cc, a stream's protocol in
// dataplane_server_stream.cc (ServerImpl and ServerConn: dataplane_server_impl.h).
#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "codec.h"
#include "decl.h"
#include "dataplane_server_impl.h"
#include "dtype.h"
#include "ops.h"

namespace bps {
namespace dp {

constexpr int kWireUint8 = 7;  // a compressed payload's wire dtype (wire.h)
static_assert(kWireDTypes[kWireUint8].itemsize == 1 && kWireDTypes[kWireUint8].kernel == -1,
              "uint8 is wire dtype code 7");

namespace {
// Adds the time from its making to its end to a counter (the server's sum_ns).
class SumTimer {
 public:
  explicit SumTimer(std::atomic<std::uint64_t>& ns)
      : ns_(ns), t0_(std::chrono::steady_clock::now()) {}
  SumTimer(const SumTimer&) = delete;
  SumTimer& operator=(const SumTimer&) = delete;
  ~SumTimer() {
    const auto d = std::chrono::steady_clock::now() - t0_;
    ns_.fetch_add(static_cast<std::uint64_t>(
                      std::chrono::duration_cast<std::chrono::nanoseconds>(d).count()),
                  std::memory_order_relaxed);
  }

 private:
  std::atomic<std::uint64_t>& ns_;
  std::chrono::steady_clock::time_point t0_;
};
}  // namespace

// A push's size fits its key: exactly the key's bytes, or for a compressed key whose codec's
// payloads vary (a registered compressor's) 1 to its largest payload. Checked before the
// payload is read: nothing a peer sends is copied before it passed.
bool payload_fits(const Store& st, const Header& h) {
  if (st.codec && !st.codec->exact()) return h.nbytes >= 1 && h.nbytes <= st.nbytes;
  return h.nbytes == st.nbytes;
}

// Memory the server-held tables (server/sparse.py) take (positive) or give back (negative),
// charged to the same budget as the stores: false, and nothing charged, when it does not fit.
bool ServerImpl::reserve(std::int64_t bytes) {
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

void ServerImpl::reject(const std::string& reason) {
  std::lock_guard<std::mutex> g(rej_mu_);
  rejected_[reason]++;
}

std::map<std::string, std::uint64_t> ServerImpl::rejected() {
  std::lock_guard<std::mutex> g(rej_mu_);
  return rejected_;
}

std::map<std::string, std::uint64_t> ServerImpl::stats() {
  std::map<std::string, std::uint64_t> s = c_.snapshot();
  s["pushes"] = c_.pushes;
  s["rounds"] = c_.rounds;
  s["bytes_summed"] = c_.bytes_summed;
  s["sum_ns"] = c_.sum_ns;
  s["connections"] = c_.connections;
  s["live_connections"] = static_cast<std::uint64_t>(std::max(0, live_conns_.load()));
  // streams closed whose memory the loops' tick has not given back yet (0: it has)
  s["closed_since_trim"] = static_cast<std::uint64_t>(std::max(0, closed_since_trim_.load()));
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
  s["stale_holds"] = stale_holds_.load();
  s["late_pushes_dropped"] = late_dropped_.load();  // backup workers
  s["backup_rounds"] = backup_rounds_.load();
  s["lag_errors"] = lag_errors_.load();
  s["table_pulls_answered"] = tables_.pulls_answered();  // on the I/O threads
  s["table_pulls_parked"] = tables_.pulls_parked();
  return s;
}

std::vector<StallInfo> ServerImpl::stalls(double min_age) {
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

// extra: more JSON members, already encoded (",\"rank\":1"), or empty
void ServerImpl::send_error(const std::shared_ptr<Conn>& conn, const Header& h, const char* kind,
                            const std::string& text, const std::string& extra) {
  Out o;
  o.hdr = make_header(kError, kRoleServer, rank_.load(), kFlagMeta, job_, h.key, h.round);
  o.meta = error_meta(kind, text, h.type, extra);
  conn->send(std::move(o));
}

void ServerImpl::send_resp(const std::shared_ptr<Conn>& conn, const std::shared_ptr<Store>& st,
                           std::int64_t round, int rank) {
  if (st->backup) return send_kept(conn, st, round, rank);  // its kept answer
  Out o;
  // st->contrib is written under st->mu when the round completes, before any answer for it
  const int n = st->contrib[round & 1];
  const std::uint32_t flags =
      (n < num_workers_ ? kFlagContrib | (static_cast<std::uint32_t>(n) << kContribShift) : 0) |
      (st->codec ? kFlagCompressed : 0);
  // a compressed key's answer is its encoded sum, of the size its codec made (rlen, as
  // contrib); any other key's is the whole buffer
  const std::size_t len = st->codec ? st->rlen[round & 1] : st->nbytes;
  o.hdr = make_header(kPullResp, kRoleServer, rank_.load(), flags, job_, st->key, round,
                      static_cast<std::uint8_t>(st->wire_dtype), st->codec ? len : st->count,
                      len);
  o.payload = st->buf[round & 1].get();
  o.plen = len;
  o.keep = st;
  conn->send(std::move(o));
}

// Asynchronous mode: a pull's answer, `value` (which the reply may hold last: charged to it).
void ServerImpl::send_value(const std::shared_ptr<Conn>& conn, const Store& st,
                            std::shared_ptr<char> value, std::int64_t round) {
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
std::shared_ptr<Store> ServerImpl::begin_push(const std::shared_ptr<Conn>& conn, const Header& h,
                                              const std::string& meta, std::uint64_t* gen,
                                              std::uint64_t* staged) {
  if (h.flags & kFlagSeed) return begin_seed(conn, h, meta, gen, staged);
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
  if (st->codec && compressed && payload_fits(*st, h)) {  // received whole, then decoded
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
  if (answer_retry_locked(conn, st, h)) return unstage(staged);
  if (st->backup && h.round < st->round && late_push_locked(conn, st, h))
    return unstage(staged);
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

std::shared_ptr<Store> ServerImpl::unstage(std::uint64_t* staged) {
  if (*staged) reserve(-static_cast<std::int64_t>(*staged));
  *staged = 0;
  return nullptr;
}

// The key's store; made on the key's first push, which must declare it and fit the memory
// budget. Null after an error reply.
std::shared_ptr<Store> ServerImpl::store_for_push(const std::shared_ptr<Conn>& conn,
                                                  const Header& h, const std::string& meta,
                                                  int kdt) {
  std::unique_ptr<compress::ServerCodec> codec;  // outlives the lock: a Python one takes the GIL
  {
    std::lock_guard<std::mutex> g(map_mu_);
    auto it = stores_.find(h.key);
    if (it != stores_.end()) return it->second;
    if (!may_declare_locked(conn, h, meta)) return nullptr;
  }
  // a compressed key's codec, made without the map's lock (a registered compressor's is
  // Python: it takes the GIL, which no thread may wait for while holding a lock of ours), its
  // memory charged to the budget before it is made (pre); the store's charge replaces it
  std::uint64_t pre = 0;
  if ((h.flags & kFlagCompressed) && !(codec = make_codec(conn, h, meta, &pre))) return nullptr;
  std::lock_guard<std::mutex> g(map_mu_);
  store_bytes_ -= std::min<std::uint64_t>(pre, store_bytes_);
  auto it = stores_.find(h.key);
  if (it != stores_.end()) return it->second;  // another stream declared it meanwhile
  // two buffers (async: one), the declaration kept for comparisons, per-chunk bookkeeping;
  // a compressed key's accumulator and codec (its buffers hold the largest payload)
  const std::size_t nbytes = codec ? codec->max_bytes() : h.nbytes;
  const std::size_t nchunks = (nbytes + kChunk - 1) / kChunk;
  const std::uint64_t need =
      (async_ ? 1 : 2) * nbytes + meta.size() + kStoreOverhead +
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
  auto st = make_store_locked(h, meta, kdt, nbytes, nchunks, need);
  if (codec) {
    st->accp = codec->accumulator();
    if (!st->accp) {
      st->acc.reset(new float[codec->n()]());
      st->accp = st->acc.get();
    }
    st->rlen[0] = st->rlen[1] = 0;
    st->codec = std::move(codec);
  }
  return st;
}

// Whether a push may declare a key the server does not hold (map_mu_ held); false after an
// error reply.
bool ServerImpl::may_declare_locked(const std::shared_ptr<Conn>& conn, const Header& h,
                                    const std::string& meta) {
  const std::int64_t base = round_base_.load();
  if (base > 0 && h.round < base) {  // an elastic epoch that is over: no new key
    reject("push of a superseded epoch");
    send_error(conn, h, "epoch", "key " + std::to_string(h.key) + ": push from worker "
               "rank " + std::to_string(h.rank) + " belongs to a membership epoch that "
               "has ended");
    return false;
  }
  if (!(h.flags & kFlagDeclare) || meta.empty()) {
    reject("push of an undeclared key");
    send_error(conn, h, "protocol", "first push of key " + std::to_string(h.key) +
               " from worker rank " + std::to_string(h.rank) + " carries no declaration");
    return false;
  }
  const int backup = backup_decl(meta);
  if (backup < 0 || (backup > 0 && (h.flags & kFlagCompressed))) {
    reject("bad backup workers declaration");
    send_error(conn, h, "protocol", "server " + std::to_string(rank_.load()) + ": key " +
               std::to_string(h.key) + " from worker rank " + std::to_string(h.rank) + ": " +
               (backup < 0 ? "BYTEPS_BACKUP_WORKERS must be 1 to " +
                                 std::to_string(num_workers_ - 1) + " (one below the workers)"
                           : std::string("BYTEPS_BACKUP_WORKERS does not combine with a "
                                         "compressor; unset one of them")));
    return false;
  }
  if (h.nbytes == 0) {
    reject("empty partition");
    send_error(conn, h, "protocol", "push of key " + std::to_string(h.key) +
               " with no bytes");
    return false;
  }
  try {
    parse_decl(meta);
  } catch (const std::invalid_argument& exc) {
    reject("malformed declaration");
    send_error(conn, h, "protocol", "first push of key " + std::to_string(h.key) +
               " from worker rank " + std::to_string(h.rank) + ": " + exc.what());
    return false;
  }
  return true;
}

// A compressed declaration's element count: at most one partition of the declared dtype
// (BYTEPS_PARTITION_BYTES); 0 with *why set when it is not one.
std::size_t ServerImpl::declared_count(const Decl& d, std::string* why) {
  const std::string dtype = kWireDTypes[d.dtype].name;  // a known code (parse_decl)
  const bool floating = dtype == "float32" || dtype == "float16" || dtype == "bfloat16" ||
                        dtype == "float64";
  const std::uint64_t limit = floating ? partition_bytes_.load() / wire_itemsize(d.dtype) : 0;
  if (!floating) {
    *why = "declared dtype '" + dtype + "' is not one workers compress "
           "(float32, float16, bfloat16, float64)";
  } else if (d.count == 0 || d.count > limit) {
    *why = "element count " + std::to_string(d.count) + " is not an integer in 1.." +
           std::to_string(limit) + ", one partition of " + dtype + " (BYTEPS_PARTITION_BYTES=" +
           std::to_string(partition_bytes_.load()) + " on this server; workers and servers "
           "must use the same)";
  } else {
    return d.count;
  }
  return 0;
}

// The server's codec of a compressed key's first push, of at most one partition of the
// declared dtype (BYTEPS_PARTITION_BYTES): a built-in codec from the declaration's parameters
// (compression.native_params), its payload exactly the push's size; or, for a registered
// compressor (a spec without them), the Python codec the factory makes (set_codec_factory),
// the push's payload at most its max_bytes. Null after an error reply.
std::unique_ptr<compress::ServerCodec> ServerImpl::make_codec(const std::shared_ptr<Conn>& conn,
                                                              const Header& h,
                                                              const std::string& meta,
                                                              std::uint64_t* pre) {
  std::string why;
  std::unique_ptr<compress::ServerCodec> codec;
  try {
    const Decl d = parse_decl(meta);  // checked already (may_declare_locked)
    const bool native = !d.codec.empty();
    std::size_t n = 0;
    if (!native && d.spec.empty()) {
      why = "the declaration carries no native codec parameters and no compressor spec";
    } else if (!(n = declared_count(d, &why))) {
      // why says it
    } else if (native) {
      const compress::CodecParams p = compress::params_from_list(d.codec);
      compress::validate(p, n);  // its sum, two encoded sums, residual, indices: charged first
      const std::uint64_t est = 4 * n + 2 * compress::payload_bytes(p, n) + (p.ef ? 4 * n : 0) +
                                (p.id == compress::kRandomK ? 4 * p.k : 0) +
                                sizeof(compress::FramedCodec);
      if (!precharge(conn, h, est)) return nullptr;
      *pre = est;
      codec.reset(new compress::FramedCodec(p, h.key, n));
    } else {  // a Python codec: its sum and an n-float state charged first, the rest after
      if (!precharge(conn, h, 8 * static_cast<std::uint64_t>(n))) return nullptr;
      *pre = 8 * static_cast<std::uint64_t>(n);
      codec = python_codec(h, meta, n);
    }
    if (codec && codec->max_bytes() > max_msg_) {
      why = "its codec's payloads take up to " + std::to_string(codec->max_bytes()) +
            " bytes, over BYTEPS_MAX_MESSAGE_BYTES (" + std::to_string(max_msg_) + ")";
    } else if (codec && (codec->exact() ? h.nbytes != codec->max_bytes()
                                        : h.nbytes > codec->max_bytes())) {
      why = "a payload of " + std::to_string(h.nbytes) + " bytes, but its codec of " +
            std::to_string(n) + " elements takes " + (codec->exact() ? "" : "at most ") +
            std::to_string(codec->max_bytes());
    } else if (codec) {
      return codec;
    }
  } catch (const std::invalid_argument& exc) {
    why = exc.what();
  } catch (...) {  // the codec could not be made (CodecFault, bad_alloc): nothing stays charged
    reserve(-static_cast<std::int64_t>(*pre));
    *pre = 0;
    throw;
  }
  reserve(-static_cast<std::int64_t>(*pre));
  *pre = 0;
  reject("bad compressor declaration");
  send_error(conn, h, "protocol", "server " + std::to_string(rank_.load()) + ": compressed "
             "push of key " + std::to_string(h.key) + " (" + describe_decl(meta) +
             ") from worker rank " + std::to_string(h.rank) + ": " + why);
  return nullptr;  // codec, if any, is dropped here: no lock of ours is held
}

// The memory a compressed declaration's codec will take, charged to the budget before the codec
// is made (a declaration costs a peer a few bytes; its codec up to a partition's worth); false
// after an error reply when it does not fit.
bool ServerImpl::precharge(const std::shared_ptr<Conn>& conn, const Header& h,
                           std::uint64_t bytes) {
  if (reserve(static_cast<std::int64_t>(bytes))) return true;
  reject("server memory budget exhausted");
  send_error(conn, h, "protocol", "server " + std::to_string(rank_.load()) + ": key " +
             std::to_string(h.key) + " from worker rank " + std::to_string(h.rank) +
             ": its codec needs " + std::to_string(bytes) + " bytes, over what is left of the "
             "budget of " + std::to_string(max_store_) + " (BYTEPS_SERVER_MAX_BYTES)");
  return false;
}

// A registered compressor's server codec, from the factory the server process gave
// (set_codec_factory); throws std::invalid_argument saying why there is none.
std::unique_ptr<compress::ServerCodec> ServerImpl::python_codec(const Header& h,
                                                                const std::string& meta,
                                                                std::size_t n) {
  CodecFactory make;
  {
    std::lock_guard<std::mutex> g(factory_mu_);
    make = factory_;
  }
  if (!make)
    throw std::invalid_argument("this server makes no codec of a registered compressor "
                                "(no codec factory)");
  std::unique_ptr<compress::ServerCodec> codec = make(h.key, n, meta);
  if (!codec || codec->n() != n)
    throw std::invalid_argument("the compressor's server codec is not one of " +
                                std::to_string(n) + " elements");
  return codec;
}

std::shared_ptr<Store> ServerImpl::make_store_locked(const Header& h, const std::string& meta,
                                                     int kdt, std::size_t nbytes,
                                                     std::size_t nchunks, std::uint64_t need) {
  auto st = std::make_shared<Store>();
  st->key = h.key;
  st->wire_dtype = h.dtype;
  st->kdt = static_cast<DType>(kdt);
  st->nbytes = nbytes;  // a compressed key's: its codec's largest payload
  st->count = nbytes == h.nbytes ? h.count : nbytes;  // (uint8)
  st->rlen[0] = st->rlen[1] = nbytes;
  st->nchunks = nchunks;
  st->decl = meta;
  st->decl_rank = h.rank;
  st->backup = std::max(0, backup_decl(meta));
  st->served.assign(num_workers_, -1);
  if (async_) {  // the value starts at zero (or a lost server's): every push is added to it
    st->value.reset(new char[nbytes](), std::default_delete<char[]>());
    adopt_locked(*st, h);
  } else {
    for (int b = 0; b < 2; ++b) {
      st->buf[b].reset(new char[nbytes]);
      st->fill[b].reset(new std::uint32_t[st->nchunks]());
    }
  }
  st->chunk_mu.reset(new std::mutex[st->nchunks]);
  st->pushed.assign(num_workers_, 0);
  st->arrived.assign(num_workers_, 0.0);
  // a key first declared in a later elastic epoch starts at its base; a key moved here from
  // a lost server (a retried push) at the round the workers are in
  st->round = std::max(round_base_.load(), (h.flags & kFlagRetry) ? h.round : 0);
  st->charged = need;
  stores_[h.key] = st;
  store_bytes_ += need;
  return st;
}

// Whether a push may sum into the key's store (st.mu held); false after an error reply.
// *left: the ranks that left the job (join()), for the caller.
bool ServerImpl::admit_push_locked(const std::shared_ptr<Conn>& conn, const Header& h,
                                   const std::string& meta, Store& st,
                                   std::map<int, std::string>* left) {
  // Checked in this order, as on the ZeroMQ path (server/core.py, _check): a push that
  // declares another tensor than the key's is a worker disagreeing, whatever its size; its
  // dtype and size otherwise (rejected alone); its round (rejected alone, whatever it
  // declares); then a real mismatch fails the key, naming both sides.
  const bool mismatch = (h.flags & kFlagDeclare) && meta != st.decl;
  if (!mismatch && (h.dtype != st.wire_dtype || !payload_fits(st, h))) {
    const bool upto = st.codec && !st.codec->exact();
    reject("wrong dtype or size for a declared key");
    send_error(conn, h, "protocol", "push to key " + std::to_string(h.key) + " (" +
               describe_decl(st.decl) + ") from worker rank " + std::to_string(h.rank) +
               ": " + std::to_string(h.nbytes) +
               " bytes of dtype code " + std::to_string(h.dtype) + ", but the key holds " +
               (upto ? "payloads of at most " : "") + std::to_string(st.nbytes) +
               " bytes of dtype code " + std::to_string(st.wire_dtype));
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

char* ServerImpl::land_in_place(Store& st, std::int64_t round) {
  if (num_workers_ != 1 || async_ || st.codec) return nullptr;
  return st.buf[round & 1].get();
}

void ServerImpl::landed(Store& st, std::int64_t round, std::size_t offset, std::size_t len,
                        std::uint64_t gen) {
  const int par = static_cast<int>(round & 1);
  for (std::size_t at = offset; at < offset + len; at += kChunk) {
    std::lock_guard<std::mutex> g(st.chunk_mu[at / kChunk]);
    if (st.gen.load() != gen) return;  // begun before a membership epoch reset: dropped
    st.fill[par][at / kChunk]++;
  }
}

void ServerImpl::sum_chunk(Store& st, std::int64_t round, std::size_t offset, const char* data,
                           std::size_t len, std::uint64_t gen) {
  const std::size_t c = offset / kChunk;
  const int par = static_cast<int>(round & 1);
  std::lock_guard<std::mutex> g(st.chunk_mu[c]);
  if (st.gen.load() != gen) return;  // begun before a membership epoch reset: dropped
  const SumTimer timed(c_.sum_ns);
  if (async_) {  // the value is the store's alone while a push is in flight
    add_into(st.kdt, st.value.get() + offset, data, len / itemsize(st.kdt), 1);
  } else if (st.fill[par][c]++ == 0) {
    std::memcpy(st.buf[par].get() + offset, data, len);
  } else {
    add_into(st.kdt, st.buf[par].get() + offset, data, len / itemsize(st.kdt), 1);
  }
}

// payload: a compressed key's whole payload (null for others, summed chunk by chunk)
void ServerImpl::finish_push(const std::shared_ptr<Conn>& conn, const std::shared_ptr<Store>& st,
                             const Header& h, std::uint64_t gen, const std::uint8_t* payload) {
  if (h.flags & kFlagSeed) return finish_seed(conn, st, h, gen, payload);
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
      if (h.flags & kFlagPull) st->pending.push_back({conn, h.round, h.rank});
      if (async_) {
        note_async_push_locked(*st, h);
        value = settled_value_locked(*st, &answer);
      } else {
        ++st->finished;
        st->arrived[h.rank] = monotonic_now();  // the straggler report
        done_round = complete_if_ready_locked(*st, &answer);
      }
    } else {
      send_error(conn, h, st->failed_kind.c_str(), st->failed, st->failed_extra);
    }
  }
  for (auto& p : answer) {
    auto c = p.conn.lock();
    if (c && async_) send_value(c, *st, value, p.round);
    else if (c) send_resp(c, st, done_round, p.rank);
  }
}

// A compressed push (st.mu held): decoded into the round's accumulator (the round's first
// push overwrites it), every push of a round of the same step, as server/core.py's engine
// did. A malformed payload leaves the accumulator untouched and takes the push out of the
// round; when others were summed already the round cannot complete: the key fails. False
// after an error reply.
bool ServerImpl::decode_push_locked(const std::shared_ptr<Conn>& conn, Store& st, const Header& h,
                                    const std::uint8_t* payload) {
  const bool first = st.finished == 0;
  auto what = [&] {  // for errors only: not built on every push
    return "compressed key " + std::to_string(h.key) + " (" + describe_decl(st.decl) +
           "): worker rank " + std::to_string(h.rank);
  };
  try {
    std::uint64_t step;
    {
      const SumTimer timed(c_.sum_ns);  // decoding is this key's summation
      step = st.codec->decode(payload, h.nbytes, st.accp, !first);
    }
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
  } catch (const compress::CodecFault& exc) {  // the codec failed, not the payload: the
    reject("server codec failed");             // round cannot complete, tell everyone
    st.failed_kind = "internal";
    fail_key_locked(st, "server " + std::to_string(rank_.load()) + ": " + what() +
                    ": the server's codec failed to decode the push: " + exc.what());
    send_error(conn, h, st.failed_kind.c_str(), st.failed);
    return false;
  } catch (const std::invalid_argument& exc) {  // counted by sender: a peer that sends NaN,
    reject("malformed compressed payload from worker rank " +  // inf or repeated indices shows
           std::to_string(h.rank));                           // in the server's rejections
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
std::shared_ptr<char> ServerImpl::settled_value_locked(Store& st,
                                                       std::vector<Store::Pending>* answer) {
  if (st.started != st.finished) return nullptr;
  take_due_locked(st, answer);  // all of them, unless a staleness bound holds some back
  return st.value;
}

// Asynchronous mode: a push cut off by its stream's loss. The chunks it summed stay in the
// value; the pulls that waited for it are answered once no other push is in flight.
void ServerImpl::abort_push(const std::shared_ptr<Store>& st) {
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
std::int64_t ServerImpl::complete_if_ready_locked(Store& st, std::vector<Store::Pending>* answer) {
  const int need = pushes_needed(st);
  if (st.finished == 0 || st.finished < need || st.finished != st.started) return -1;
  const std::int64_t done = st.round;
  if (st.codec && !encode_sum_locked(st, done)) return -1;  // the key failed
  st.contrib[done & 1] = st.finished;
  if (st.backup && !keep_round_locked(st, done)) return -1;  // the key failed
  straggle_.round(st.pushed, st.arrived);
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

// A compressed key's completed round (st.mu held): the pull is compressed too, the sum
// encoded with the round's step into the round's buffer. False when the codec failed: the
// key fails, naming it (its waiting pulls get the error).
bool ServerImpl::encode_sum_locked(Store& st, std::int64_t round) {
  try {
    st.rlen[round & 1] = st.codec->encode(st.accp, st.step,
                                          reinterpret_cast<std::uint8_t*>(st.buf[round & 1].get()));
    return true;
  } catch (const std::exception& exc) {
    reject("server codec failed");
    st.failed_kind = "internal";
    fail_key_locked(st, "server " + std::to_string(rank_.load()) + ": compressed key " +
                    std::to_string(st.key) + " (" + describe_decl(st.decl) + "): the server's "
                    "codec failed to encode the sum of round " + std::to_string(round) + ": " +
                    exc.what());
    return false;
  }
}

// A round that a rank which left the job has not pushed can never complete: fail the key
// (every waiting and later operation gets the "peer_left" error naming the rank).
bool ServerImpl::doom_if_left_locked(Store& st, const std::map<int, std::string>& left) {
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

void ServerImpl::set_members(const std::vector<int>& joined,
                             const std::map<int, std::string>& left) {
  {
    std::lock_guard<std::mutex> m(mem_mu_);
    std::fill(joined_.begin(), joined_.end(), 0);
    int n = 0;
    for (int r : joined)
      if (r >= 0 && r < num_workers_ && !joined_[r]) joined_[r] = 1, ++n;
    left_ = left;
    required_.store(num_workers_ - n);
  }
  if (async_) return release_stale();  // no rounds: only pulls a staleness bound held
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
      if (auto c = p.conn.lock()) send_resp(c, st, done, p.rank);
    }
  }
}

// Elastic membership: a new epoch. Every open round of the old one is dropped (its waiting
// pulls get an "epoch" error, pushes still arriving sum nothing), every key restarts at
// round `round_base` (the epoch in the round's high bits, so a stale push or pull is out of
// round) and a round completes with `required` pushes. join() state is cleared.
void ServerImpl::reset_epoch(std::int64_t round_base, int required) {
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
    drop_kept_locked(*st);
    st->started = st->finished = 0;
    std::fill(st->pushed.begin(), st->pushed.end(), 0);
    for (std::size_t c = 0; c < st->nchunks && st->fill[0]; ++c) {
      std::lock_guard<std::mutex> cg(st->chunk_mu[c]);  // waits out a sum of the old epoch
      st->fill[0][c] = st->fill[1][c] = 0;
    }
  }
}

void ServerImpl::handle_pull(const std::shared_ptr<Conn>& conn, const Header& h) {
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
  } else if (async_ && st->started == st->finished &&  // the value, whatever the round,
             stale_ok_locked(*st, h.round)) {           // unless a staleness bound holds it
    std::shared_ptr<char> value = st->value;
    g.unlock();
    send_value(conn, *st, std::move(value), h.round);
  } else if (!async_ && h.round >= 0 &&
             (h.round == st->completed || (st->backup && h.round < st->round))) {
    g.unlock();
    send_resp(conn, st, h.round, h.rank);  // backup: a kept round's answer, or the error
  } else if ((async_ || h.round == st->round) &&  // async: once the pushes in flight end
             st->pending.size() < 4 * static_cast<std::size_t>(num_workers_)) {
    st->pending.push_back({conn, h.round, h.rank});
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

void ServerImpl::fail_key_locked(Store& st, const std::string& text) {
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
bool DataServer::reserve(std::int64_t bytes) { return impl_->reserve(bytes); }
void DataServer::set_rank(int rank) { impl_->rank_ = rank; }
void DataServer::set_codec_factory(CodecFactory factory) {
  impl_->set_codec_factory(std::move(factory));
}
void DataServer::set_partition_bytes(std::uint64_t n) { impl_->partition_bytes_ = n; }
void DataServer::set_backup_max_lag(int rounds) { impl_->max_lag_ = std::max(1, rounds); }
std::map<std::string, std::uint64_t> DataServer::stats() { return impl_->stats(); }
std::map<std::string, std::uint64_t> DataServer::rejected() { return impl_->rejected(); }
std::vector<StallInfo> DataServer::stalls(double min_age) { return impl_->stalls(min_age); }
std::vector<StraggleRow> DataServer::straggle() { return impl_->straggle(); }
void DataServer::set_members(const std::vector<int>& joined,
                             const std::map<int, std::string>& left) {
  impl_->set_members(joined, left);
}
std::vector<AsyncValue> DataServer::async_values() { return impl_->async_values(); }
bool DataServer::adopt_async(std::uint64_t key, std::string value) {
  return impl_->adopt_async(key, std::move(value));
}
void DataServer::reset_epoch(std::int64_t round_base, int required) {
  impl_->reset_epoch(round_base, required);
}

}  // namespace dp
}  // namespace bps
