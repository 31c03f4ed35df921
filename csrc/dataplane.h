// The native data plane: worker <-> server partition traffic over plain TCP, moved by compiled
// I/O threads that never hold the GIL (docs/architecture.md, "The native data plane").
//
// Python decides, this code moves bytes. Python opens the job (registration, node table,
// declarations' policy, errors shown to users); this code sends partitions, receives them
// straight into their destination (the worker's output, the server's chunked summation), sums,
// replies, scales averages and reports completions in batches.
//
// The framing on a stream is the wire protocol's 52-byte header (wire.h, which
// byteps_like/wire.py reads too: magic, version, type, dtype, role, rank, flags, job, key,
// round, count, nbytes), then, when
// FLAG_META is set, a u32 length and that many bytes of JSON, then nbytes of payload for PUSH
// and PULL_RESP. Every length is checked against the header and the configured maximum before
// any memory is taken. Nothing here reads the environment or includes Python.h.
//
// The code, by concern: dataplane_io.h and dataplane.cc (streams, their send queues and the
// epoll loop), dataplane_ucx.h/.cc (the UCX link, worker and listener), dataplane_auth.h/.cc
// (the authenticated hello), the server (DataServer; ServerImpl and ServerConn declared in
// dataplane_server_impl.h): dataplane_server.cc (its keys' stores, dataplane_store.h, rounds,
// membership and epochs), dataplane_server_admit.cc (listen, start, close, the admission of
// its streams and their slots) and dataplane_server_stream.cc (a stream's protocol: hello,
// header, meta, chunks), and dataplane_client.cc (DataClient). None of these files is over
// 1,000 lines and no function in them over 80 (tests/unit/test_layering.py holds it for all of
// csrc/, without exceptions).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "dataplane_straggle.h"  // StraggleRow
#include "wire.h"  // the header, message types, flags, roles and dtype codes

namespace bps {
namespace compress {
class ServerCodec;  // codec.h
}
namespace dp {
class PartCoder;  // dataplane_coder.h

// A registered compressor's server codec, whose math is Python (module.cc makes it): called on
// an I/O thread, holding no lock of the server, for a compressed key's first push whose
// declaration carries a compressor spec and no native codec parameters, with (key, element
// count, the declaration's JSON); returns the codec or throws std::invalid_argument saying
// why there is none.
using CodecFactory = std::function<std::unique_ptr<compress::ServerCodec>(
    std::uint64_t, std::size_t, const std::string&)>;


// The kernels' DType of a wire dtype code (wire.h) that can be summed; -1 for the others.
int wire_to_kernel_dtype(int wire_code);
std::size_t wire_itemsize(int wire_code);  // 0 for an unknown code

struct Counters {
  std::atomic<std::uint64_t> bytes_in{0}, bytes_out{0}, msgs_in{0}, msgs_out{0};
  std::atomic<std::uint64_t> pushes{0}, rounds{0}, bytes_summed{0}, connections{0};
  // nanoseconds a server spent summing pushes into its stores (and decoding compressed ones)
  std::atomic<std::uint64_t> sum_ns{0};
  // streams closed because their peer left its replies unread (dataplane.cc, kUnreadTimeout)
  std::atomic<std::uint64_t> unread_closed{0};
  // memory of the messages queued unwritten on every stream (their Out records and JSON; a
  // payload is the store's or the caller's, charged there), and the streams that stopped
  // being read because theirs was over its share of kReplyBudget
  std::atomic<std::uint64_t> queued_bytes{0}, paused{0};
  // losing a server (dataplane_server_failover.cc): seeds a server took as a round's sum, and
  // retried pushes it answered from one
  std::atomic<std::uint64_t> seeds{0}, retries_answered{0};
  // asynchronous mode: moved keys whose new store started from a lost server's snapshot
  std::atomic<std::uint64_t> async_adopted{0};
  // a server's push bytes received straight into a store's chunk, the chunk's first push with
  // all of it waiting in the socket (dataplane_server_sum.cc), not into a scratch piece
  std::atomic<std::uint64_t> landed_bytes{0};
  // the traffic counters every stream keeps, by name
  std::map<std::string, std::uint64_t> snapshot() const {
    return {{"bytes_in", bytes_in},           {"bytes_out", bytes_out},
            {"msgs_in", msgs_in},             {"msgs_out", msgs_out},
            {"unread_closed", unread_closed}, {"queued_bytes", queued_bytes},
            {"paused", paused},               {"seeds", seeds},
            {"retries_answered", retries_answered}, {"landed_bytes", landed_bytes},
            {"async_adopted", async_adopted}};
  }
};

class IoLoop;
class Conn;

// ---- server ------------------------------------------------------------------------------
struct StallInfo {
  std::uint64_t key;
  std::int64_t round;
  double age;
  std::vector<int> pushed;
  std::string decl;
};

struct AsyncValue {
  std::uint64_t key;
  int wire_dtype;
  std::string value;
};

// One message of a table stream (dataplane_tables.h), as it came: header, JSON meta ("" when
// none) and payload. A server's request names the stream to answer on (conn); a worker's
// answer names its server, and `lost` (not empty) says instead that the stream to that server
// closed, and why.
struct TableMessage {
  std::uint64_t conn = 0;
  int server = -1;
  Header h{};
  std::string meta, payload, lost;
};

class ServerImpl;
class ServedShard;
class DataServer {
 public:
  // auth_key: the key derived from the job's secret; empty turns authentication off.
  // async_mode (BYTEPS_ENABLE_ASYNC): no rounds across workers; every push is added to the
  // key's value at once, a pull answers the value once no push of the key is in flight.
  DataServer(int num_workers, int server_rank, std::uint32_t job, int io_threads,
             std::uint64_t max_message_bytes, std::uint64_t max_store_bytes, int max_conns,
             std::string auth_key, bool async_mode = false);
  ~DataServer();
  int listen(const std::string& host, int port);  // returns the bound port
  // Listens for UCX streams instead (ucx_load() first); returns the bound port.
  int listen_ucx(const std::string& host, int port);
  void start();
  void close();
  // Charge (bytes > 0) or give back (bytes < 0) memory of the server-held tables
  // (server/sparse.py) to the same budget as the stores; false, charging nothing, when it
  // does not fit.
  bool reserve(std::int64_t bytes);
  void set_rank(int rank);  // known once the scheduler's node table arrives
  // The maker of registered compressors' server codecs (CodecFactory); until it is set, their
  // pushes are refused with a bad-compressor-declaration error.
  void set_codec_factory(CodecFactory factory);
  // BYTEPS_PARTITION_BYTES: bounds a compressed key's element count (one partition of its
  // dtype); until it is set, compressed pushes are refused.
  void set_partition_bytes(std::uint64_t nbytes);
  // BYTEPS_ASYNC_STALENESS (asynchronous mode): a pull of round r is answered once every
  // worker rank not joined or left has pushed round r - rounds of the key; 0 (the default):
  // unbounded. std::invalid_argument for a negative bound, or a bound in synchronous mode.
  void set_staleness(std::int64_t rounds);
  // BYTEPS_BACKUP_MAX_LAG: a key declared with backup workers ("backup": b, the workers'
  // BYTEPS_BACKUP_WORKERS) completes a round with all but b pushes and keeps each completed
  // round until every rank had it, the newest and at most `rounds` before it
  // (dataplane_server_backup.cc; default 64).
  void set_backup_max_lag(int rounds);
  std::map<std::string, std::uint64_t> stats();
  std::map<std::string, std::uint64_t> rejected();
  std::vector<StallInfo> stalls(double min_age);
  // The straggler report, per worker rank: held (the others waited for it), waited
  // (dataplane_straggle.h)
  std::vector<StraggleRow> straggle();
  // Membership (join()): rounds need pushes from every worker rank not in `joined`; a rank in
  // `left` (text: who and why) finished without joining, so a round it has not pushed fails
  // with a "peer_left" error naming it. Open rounds are completed or failed at once.
  void set_members(const std::vector<int>& joined, const std::map<int, std::string>& left);
  // Elastic membership epochs: drop every open round (waiting pulls get an "epoch" error, a
  // push still arriving sums nothing), restart every key at round `round_base` and complete a
  // round with `required` pushes; join() state is cleared.
  void reset_epoch(std::int64_t round_base, int required);
  // Asynchronous mode's snapshots (dataplane_server_async.cc, server/async_snapshots.py):
  // every key's value as it stands between two pushes, (key, wire dtype, bytes) ...
  std::vector<AsyncValue> async_values();
  // ... and a lost server's, taken by the store a moved key's first push here makes (a
  // retried push): the value then starts from `value` instead of zero. Charged to the memory
  // budget until a store takes it; false, keeping nothing, when it does not fit.
  bool adopt_async(std::uint64_t key, std::string value);
  // Server-held tables (dataplane_tables.h): the requests the table streams received, every
  // one waiting (in arrival order per stream), once there is one, after timeout seconds, or at
  // once after table_wake() or close() (then maybe none) ...
  std::vector<TableMessage> table_requests(double timeout);
  // ... an answer on the stream a request came on (false: it is closed) ...
  bool table_send(std::uint64_t conn, const Header& h, std::string meta, std::string payload);
  // ... and a wake-up for the thread waiting in table_requests. A registered shard's pulls
  // are answered by the I/O threads themselves when its rules allow (dataplane_table_pulls.h).
  void table_wake();
  void table_serve(std::uint64_t key, std::shared_ptr<ServedShard> shard);

 private:
  std::unique_ptr<ServerImpl> impl_;
};

// ---- client ------------------------------------------------------------------------------
struct PartSpec {
  std::uint64_t key;
  std::int64_t round;
  int server, conn;
  std::uint64_t offset, nbytes;
  std::string decl;  // JSON declaration (round 0), empty otherwise
};

struct Completion {
  std::uint64_t op;
  bool ok;
  std::string kind;     // "", "mismatch", "protocol", "internal", "peer_lost", "closed"
  int server;           // the server that answered the error, -1 when none
  std::string message;
  double t_first_send, t_last_done;  // CLOCK_MONOTONIC seconds (time.monotonic())
  std::uint64_t bytes;
  int contrib = 0;      // pushes the server's round summed when fewer than all (join()), or 0
  // per partition, in submission order: sent, acknowledged (push done), received (pull done);
  // 0 where it did not happen
  std::vector<double> times;
};

class ClientImpl;
class DataClient {
 public:
  // codec_threads: the threads that encode and decode coded operations' partitions (started
  // at the first one).
  DataClient(int rank, std::uint32_t job, int io_threads, std::uint64_t credit_bytes,
             std::uint64_t max_message_bytes, std::string auth_key, int codec_threads = 1);
  ~DataClient();
  // Connects `streams` TCP connections to a server and says hello on each; throws
  // std::runtime_error with the reason when it cannot within timeout seconds.
  // ucx: the streams are UCX endpoints (ucx_load() first; the server listens with listen_ucx).
  void connect(int server, const std::string& host, int port, int streams, double timeout,
               bool ucx = false);
  // Queues an operation of several partitions of one tensor. src/dst stay valid until the
  // operation's completion is taken. divisor > 1 divides the result (average) in place.
  // compressed: the partitions are codec payloads (uint8, FLAG_COMPRESSED) the server decodes
  // and answers with its encoded sum, which lands in dst as it came (divisor 1), of any size
  // up to dst_bytes (dst's size; the completion's bytes say how many came).
  // codecs (one per part): a coded operation. src and dst are float32 and parts' offsets and
  // sizes are theirs; each part is encoded by its coder (step = its round) on the codec
  // threads before its push, travels as the coder's payload -- a built-in codec's (compressed,
  // wire_dtype float32) or a cast's (wire_dtype float16 or bfloat16, summed as such) -- and the
  // server's answer is decoded into dst there and divided by divisor. A coder is used by one
  // operation at a time (the caller's rounds of a tensor are sequential).
  void submit(std::uint64_t op, int priority, const char* src, char* dst, int wire_dtype,
              std::int64_t divisor, std::vector<PartSpec> parts, bool compressed = false,
              std::uint64_t dst_bytes = 0,
              std::vector<std::shared_ptr<PartCoder>> codecs = {});
  // Waits (without consuming) until `op` has completed; false on timeout.
  bool wait(std::uint64_t op, double timeout);
  // Takes the completion of `op` if it has completed.
  bool take(std::uint64_t op, Completion* out);
  // Takes every completion, waiting up to timeout seconds for the first.
  std::vector<Completion> completions(double timeout);
  void close();
  std::map<std::string, std::uint64_t> stats();
  // Hold queued partitions (paused) or release them in priority order; for observing the
  // scheduler, as a test of priorities does.
  void set_paused(bool paused);
  // Testing hook: while on, an answer landed in dst waits before it completes its partition
  // (the window in which a failover may come); stats()["landed_held"] counts those waiting.
  void hold_landed(bool on);
  // The keys of the partitions sent since the last call, in order (the first 4096).
  std::vector<std::uint64_t> take_dispatch_log();
  // Losing a server (dataplane_failover.h): with failover on, a lost stream parks its
  // server's parts (and completes a "server_lost" notice) instead of failing them;
  // failover(lost, hold) moves the keys of the lost servers to the others and, with hold,
  // seeds them and holds their pushes until resume(); wait_seeds says "" once every seed was
  // taken, else why not.
  void set_failover(bool on);
  void failover(const std::vector<int>& lost, bool hold);
  std::string wait_seeds(double timeout);
  void resume();

 private:
  std::unique_ptr<ClientImpl> impl_;
};

double monotonic_now();

// ---- UCX streams (dataplane_ucx.cc) --------------------------------------------------------
// Opens libucp at `path` (the libucx wheel's, which Python finds) and makes the process's UCP
// context; UCX reads its UCX_* environment (UCX_TLS, ...) here, then `settings` (UCX names
// without the UCX_ prefix: "TCP_RX_SEG_SIZE" -> "1M") are applied over it. True when UCX
// streams can be used; otherwise *err says why. A second call returns the first call's answer.
bool ucx_load(const std::string& path, const std::map<std::string, std::string>& settings,
              std::string* err);
// "" when UCX streams are usable (ucx_load succeeded), else why not.
std::string ucx_unavailable();
// Whether the extension was built with UCX's headers (without them it cannot load UCX).
bool ucx_built();

// A bare UCX stream to host:port, bytes out and in as they are (no hello, no framing): for the
// tests that play a hostile or foreign peer over UCX, as they do with a raw socket over TCP.
class UcxRawStream {
 public:
  UcxRawStream(const std::string& host, int port);
  ~UcxRawStream();
  // All of it, as one message of the stream (eager, or with rendezvous: `rndv`); throws when
  // it cannot or the peer refused it.
  void send(const std::string& bytes, double timeout, bool rndv = false);
  // Up to n bytes (all n when `all`) once some came: "" when the peer closed the stream;
  // throws std::runtime_error("timed out") after timeout seconds.
  std::string recv(std::size_t n, double timeout, bool all);
  void close();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dp
}  // namespace bps
