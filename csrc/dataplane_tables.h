// Server-held embedding tables on the native data plane (docs/sparse.md, "On the wire"). Each
// worker process that uses tables opens one table stream to each server: a HELLO with
// FLAG_TABLE and the process's rank (below the machines times BYTEPS_LOCAL_SIZE), then its
// SPARSE_* requests, each a header, an optional JSON meta frame and a payload of at most
// BYTEPS_MAX_MESSAGE_BYTES, answered on the same stream with SPARSE_ROWS, SPARSE_ACK or ERROR.
//
// The plane's I/O threads move every byte, check every length before allocating, and
// authenticate the stream as they do a data stream's. The tables' rules (rounds, optimizers,
// membership, survival) are Python's (server/sparse.py): its one thread takes the requests
// from the server's TableInbox and answers through it. A request waits there charged to its
// stream's share of the reply budget (Conn::charge_held): a stream over its share is not read
// until the tables' thread has taken its requests, so peers that send faster than the tables
// are served are held back by TCP, not buffered. The worker's end is a TableClient: one I/O
// thread, its streams, and the answers waiting for the worker's Python thread.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "dataplane.h"
#include "dataplane_table_pulls.h"

namespace bps {
namespace dp {

class Conn;

// Process ranks a machine may have on a table stream (server/table.py's MAX_LOCAL_SIZE: the
// tables check the exact bound, BYTEPS_LOCAL_SIZE, once the first table is declared).
constexpr int kMaxTableLocalSize = 256;
// Requests table_requests hands over at most at once, and at most of one stream: a stream's
// share is looked at when its requests are taken, so what one take may answer beyond it is
// kTableStreamBatch answers (with 256, 20 streams that never read held 16 MiB of answers each
// over a 1.5 MiB share: +250 MiB at a server's peak for a 32 MiB reply budget).
constexpr std::size_t kTableBatch = 256;
constexpr std::size_t kTableStreamBatch = 8;
// What a waiting request costs beside its meta and payload.
constexpr std::int64_t kTableOverhead = 256;

bool table_request_type(int type);  // SPARSE_CREATE, _PULL, _PUSH, _SAVE, _LOAD
bool table_answer_type(int type);   // SPARSE_ROWS, SPARSE_ACK, ERROR

// A server's table requests, from its streams' loop threads to the tables' thread.
class TableInbox {
 public:
  // The id a table stream's answers are sent by (made at its first request).
  std::uint64_t add_stream(const std::shared_ptr<Conn>& c);
  // A request (loop thread), charged to its stream until taken.
  void put(const std::shared_ptr<Conn>& c, std::uint64_t id, const Header& h, std::string meta,
           std::string payload);
  // The server's rank and job, which the pulls answered here carry (dataplane_table_pulls.h).
  void identify(const std::atomic<int>* rank, std::uint32_t job);
  // A shard whose pulls the I/O threads answer (table key -> its kernels' ServedShard).
  void serve(std::uint64_t key, std::shared_ptr<ServedShard> shard);
  // Pulls answered here and pulls parked here for their round, since the start.
  std::uint64_t pulls_answered();
  std::uint64_t pulls_parked();
  // Every request waiting (at most kTableBatch, kTableStreamBatch of a stream), in order per
  // stream, but none of a stream whose replies queued unwritten are over its share
  // (Conn::replies_over_share: a peer that asks faster than it reads is not answered faster
  // than it reads); once there is one, after timeout seconds, or at once after wake() or
  // close().
  std::vector<TableMessage> take(double timeout);
  void nudge();  // a stream's replies were written down: look again (any thread)
  bool send(std::uint64_t id, const Header& h, std::string meta, std::string payload);
  void wake();
  void close();

 private:
  struct Held {
    TableMessage m;
    std::weak_ptr<Conn> conn;
    std::int64_t cost;
  };
  std::vector<Held> ready_locked();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Held> q_;
  std::unordered_map<std::uint64_t, std::weak_ptr<Conn>> streams_;
  std::unordered_map<std::uint64_t, std::shared_ptr<ServedShard>> served_;
  const std::atomic<int>* rank_ = nullptr;
  std::uint32_t job_ = 0;
  std::uint64_t next_ = 1;
  bool woken_ = false, closed_ = false;
};

// Bytes of answers a worker's table client holds for its Python thread (answers()) at most,
// besides one answer of up to BYTEPS_MAX_MESSAGE_BYTES: past it the client's loop waits for
// them to be taken, reading nothing meanwhile, so TCP holds the servers back.
constexpr std::uint64_t kAnswerBudget = 256u << 20;

class TableClientImpl;
// A worker process's table streams, one to each server, on a loop of their own.
class TableClient {
 public:
  TableClient(int rank, std::uint32_t job, std::uint64_t max_message_bytes, std::string auth_key,
              std::uint64_t answer_budget = kAnswerBudget);
  ~TableClient();
  // Opens the table stream to a server (TCP, or UCX streams: ucx_load() first) and says hello;
  // std::runtime_error with the reason when it cannot within timeout seconds.
  void connect(int server, const std::string& host, int port, double timeout, bool ucx = false);
  // Queues a request on the stream to `server`; false when there is none (never opened, or
  // closed: its `lost` notice says why).
  bool send(int server, const Header& h, std::string meta, std::string payload);
  // Every answer (and lost-stream notice) waiting, once there is one or after timeout seconds;
  // none once closed.
  std::vector<TableMessage> answers(double timeout);
  void close();
  std::map<std::string, std::uint64_t> stats();

 private:
  std::unique_ptr<TableClientImpl> impl_;
};

}  // namespace dp
}  // namespace bps
