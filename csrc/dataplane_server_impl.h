// The native data plane's server inside the extension (dataplane.h's DataServer is its face):
// ServerImpl, the server, and ServerConn, one of its streams. Internal: nothing here is part of
// the module's interface. Defined by concern:
//   dataplane_server.cc         the keys' stores (dataplane_store.h) and their chunked
//                               summation, rounds, membership and epochs, pulls, failing a key,
//                               rejections and stats; DataServer
//   dataplane_server_admit.cc   the server's life (listen, start, close) and the admission of
//                               its streams: accepted sockets and UCX connection requests,
//                               connection slots, evicting streams without hello, the loops'
//                               tick (hello timeout, replies left unread, memory given back)
//   dataplane_server_backup.cc  backup workers: rounds that complete without the last b
//                               pushes, late pushes, the completed rounds kept for ranks
//                               that fell behind
//   dataplane_server_stream.cc  ServerConn, a stream's protocol: hello (and the proof of the
//                               job's secret), header checks, meta, payload chunks
//   dataplane_server_stale.cc   bounded staleness of asynchronous mode (pulls held back)
//   dataplane_server_sum.cc     a chunk's first push received straight into the store
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "codec.h"
#include "dataplane_auth.h"
#include "dataplane_io.h"
#include "dataplane_store.h"
#include "dataplane_straggle.h"
#include "dataplane_tables.h"
#include "dataplane_ucx.h"

namespace bps {
namespace dp {

constexpr int kWireUint8Code = 7;  // a compressed payload's wire dtype (wire.h)

class ServerConn;
struct Decl;  // decl.h

class ServerImpl {
 public:
  // ---- life (dataplane_server_admit.cc) ----
  ServerImpl(int num_workers, int server_rank, std::uint32_t job, int io_threads,
             std::uint64_t max_msg, std::uint64_t max_store, int max_conns, std::string key,
             bool async_mode);
  ~ServerImpl();
  int listen(const std::string& host, int port);
  int listen_ucx(const std::string& host, int port);
  void start();
  void close();

  // ---- keys, rounds, rejections and stats (dataplane_server.cc) ----
  bool reserve(std::int64_t bytes);
  void reject(const std::string& reason);
  std::map<std::string, std::uint64_t> rejected();
  std::map<std::string, std::uint64_t> stats();
  std::vector<AsyncValue> async_values();                    // dataplane_server_async.cc
  bool adopt_async(std::uint64_t key, std::string value);
  void adopt_locked(Store& st, const Header& h);
  std::vector<StallInfo> stalls(double min_age);
  std::vector<StraggleRow> straggle() { return straggle_.snapshot(); }

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
  Straggle straggle_{num_workers_};  // who held the rounds (dataplane_straggle.h)
  TableInbox tables_;  // the table streams' requests for the tables' thread (dataplane_tables.h)
  // BYTEPS_PARTITION_BYTES: a compressed key's element count is at most one partition of its
  // dtype (its accumulator's size); 0 refuses compressed keys
  std::atomic<std::uint64_t> partition_bytes_{0};
  // BYTEPS_BACKUP_WORKERS (dataplane_server_backup.cc): a key declared with "backup": b
  // completes a round with all but b pushes; at most max_lag_ completed rounds besides the
  // newest are kept for a rank that fell behind (BYTEPS_BACKUP_MAX_LAG)
  std::atomic<int> max_lag_{64};
  std::atomic<std::uint64_t> late_dropped_{0}, backup_rounds_{0}, lag_errors_{0};

  void send_error(const std::shared_ptr<Conn>& conn, const Header& h, const char* kind,
                  const std::string& text, const std::string& extra = std::string());
  void send_resp(const std::shared_ptr<Conn>& conn, const std::shared_ptr<Store>& st,
                 std::int64_t round, int rank = -1);
  void send_value(const std::shared_ptr<Conn>& conn, const Store& st, std::shared_ptr<char> value,
                  std::int64_t round);
  std::shared_ptr<Store> begin_push(const std::shared_ptr<Conn>& conn, const Header& h,
                                    const std::string& meta, std::uint64_t* gen,
                                    std::uint64_t* staged);
  std::shared_ptr<Store> unstage(std::uint64_t* staged);
  std::shared_ptr<Store> store_for_push(const std::shared_ptr<Conn>& conn, const Header& h,
                                        const std::string& meta, int kdt);
  bool may_declare_locked(const std::shared_ptr<Conn>& conn, const Header& h,
                          const std::string& meta);
  std::size_t declared_count(const Decl& d, std::string* why);
  std::unique_ptr<compress::ServerCodec> make_codec(const std::shared_ptr<Conn>& conn,
                                                    const Header& h, const std::string& meta,
                                                    std::uint64_t* pre);
  bool precharge(const std::shared_ptr<Conn>& conn, const Header& h, std::uint64_t bytes);
  std::unique_ptr<compress::ServerCodec> python_codec(const Header& h, const std::string& meta,
                                                      std::size_t n);
  bool encode_sum_locked(Store& st, std::int64_t round);
  void set_codec_factory(CodecFactory f) {
    std::lock_guard<std::mutex> g(factory_mu_);
    factory_ = std::move(f);
  }
  std::shared_ptr<Store> make_store_locked(const Header& h, const std::string& meta, int kdt,
                                           std::size_t nbytes, std::size_t nchunks,
                                           std::uint64_t need);
  bool admit_push_locked(const std::shared_ptr<Conn>& conn, const Header& h,
                         const std::string& meta, Store& st, std::map<int, std::string>* left);
  // Where a push may be received in place, straight into its round's buffer (nullptr: it
  // is received in chunks and summed): a synchronous job of one worker, whose push of a
  // round is the only writer of that round's buffer (one push per rank and round).
  char* land_in_place(Store& st, std::int64_t round);
  // Bytes [offset, offset + len) of a push received in place: its chunks count as summed.
  void landed(Store& st, std::int64_t round, std::size_t offset, std::size_t len,
              std::uint64_t gen);
  void sum_chunk(Store& st, std::int64_t round, std::size_t offset, const char* data,
                 std::size_t len, std::uint64_t gen);
  // The round's first push of chunk [offset, offset + len), all of whose bytes wait in the
  // link's socket: read straight into the round's buffer, the chunk counted as filled
  // (dataplane_server_sum.cc). len when it was; 0 when it was not (another push filled the
  // chunk or holds its lock, the bytes are not all there, a UCX link, asynchronous mode or a
  // compressed key): the caller reads the chunk into scratch and sums it; -1 when the link
  // broke (*why).
  // *avail: the bytes waiting in the link, asked of it at the first chunk that could land
  // (SIZE_MAX until then), less those landed since.
  ssize_t land_chunk(Store& st, std::int64_t round, std::size_t offset, std::size_t len,
                     std::uint64_t gen, Link& link, std::size_t* avail, std::string* why);
  void finish_push(const std::shared_ptr<Conn>& conn, const std::shared_ptr<Store>& st,
                   const Header& h, std::uint64_t gen, const std::uint8_t* payload = nullptr);
  bool decode_push_locked(const std::shared_ptr<Conn>& conn, Store& st, const Header& h,
                          const std::uint8_t* payload);
  std::shared_ptr<char> settled_value_locked(Store& st, std::vector<Store::Pending>* answer);
  void abort_push(const std::shared_ptr<Store>& st);
  std::int64_t complete_if_ready_locked(Store& st, std::vector<Store::Pending>* answer);
  bool doom_if_left_locked(Store& st, const std::map<int, std::string>& left);
  void set_members(const std::vector<int>& joined, const std::map<int, std::string>& left);
  void reset_epoch(std::int64_t round_base, int required);
  void handle_pull(const std::shared_ptr<Conn>& conn, const Header& h);
  // ---- losing a server: a moved key's new server (dataplane_server_failover.cc) ----
  std::shared_ptr<Store> begin_seed(const std::shared_ptr<Conn>& conn, const Header& h,
                                    const std::string& meta, std::uint64_t* gen,
                                    std::uint64_t* staged);
  void finish_seed(const std::shared_ptr<Conn>& conn, const std::shared_ptr<Store>& st,
                   const Header& h, std::uint64_t gen, const std::uint8_t* payload);
  bool answer_retry_locked(const std::shared_ptr<Conn>& conn, const std::shared_ptr<Store>& st,
                           const Header& h);
  void ack_locked(const std::shared_ptr<Conn>& conn, const Header& h);
  void fail_key_locked(Store& st, const std::string& text);
  // ---- bounded staleness of asynchronous mode (dataplane_server_stale.cc) ----
  std::atomic<std::int64_t> staleness_{0};     // BYTEPS_ASYNC_STALENESS; 0: unbounded
  std::atomic<std::uint64_t> stale_holds_{0};  // pulls held back by it (each counted once)
  void set_staleness(std::int64_t s);
  void note_async_push_locked(Store& st, const Header& h);
  bool stale_ok_locked(const Store& st, std::int64_t round);
  void take_due_locked(Store& st, std::vector<Store::Pending>* answer);
  void release_stale();
  // ---- backup workers (dataplane_server_backup.cc) ----
  int backup_decl(const std::string& meta) const;
  int pushes_needed(const Store& st) const;
  bool keep_round_locked(Store& st, std::int64_t round);
  void send_kept_locked(const std::shared_ptr<Conn>& conn, Store& st, std::int64_t round,
                        int rank);
  void send_kept(const std::shared_ptr<Conn>& conn, const std::shared_ptr<Store>& st,
                 std::int64_t round, int rank);
  bool late_push_locked(const std::shared_ptr<Conn>& conn, const std::shared_ptr<Store>& st,
                        const Header& h);
  void trim_kept_locked(Store& st);
  void drop_kept_locked(Store& st);

 private:
  // ---- admission (dataplane_server_admit.cc) ----
  void accept_loop();

  // A new stream: a slot for it, or false (refused and counted; the caller drops it). `make`
  // makes its link once it is taken (nullptr: it could not be).
  template <typename Make>
  bool admit(Make make, std::size_t loop);

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
  std::atomic<int> closed_since_trim_{0};  // streams closed since memory was last given back
  std::atomic<std::uint64_t> meta_bytes_{0};  // large meta frames being read (kMetaBudget)
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
  // asynchronous mode: lost servers' values a moved key's new store starts from (adopt_async)
  std::unordered_map<std::uint64_t, std::string> adopt_;
  std::uint64_t store_bytes_ = 0;
  std::mutex rej_mu_;
  std::map<std::string, std::uint64_t> rejected_;
  std::mutex factory_mu_;
  CodecFactory factory_;  // a registered compressor's server codec (set_codec_factory)
};

// A push's size fits its key (dataplane_server.cc).
bool payload_fits(const Store& st, const Header& h);

// A stream of the server (dataplane_server_stream.cc): the framing's states, driven by
// advance(), from the hello to each message's header, meta and payload.
class ServerConn : public FramedConn {
 public:
  ServerConn(std::unique_ptr<Link> link, ServerImpl* srv);
  bool hello_done() const { return hello_; }
  bool unproven() const { return unproven_.load(); }
  // Leaves the streams that have not said hello (hello, close or eviction); false if it had.
  bool prove() {
    if (!unproven_.exchange(false)) return false;
    srv_->unproven_--;
    return true;
  }

 protected:
  void on_closed() override;
  void on_violation() override { srv_->reject("malformed"); }
  void resumed() override {
    if (table_) srv_->tables_.nudge();  // its waiting requests may be taken again
  }
  std::size_t queue_share() const override;
  bool advance() override;
  void on_read() override;

 private:
  void sum_span(std::size_t upto);
  bool on_nonce();
  bool on_mac();
  bool on_header();
  bool on_meta_len();
  void give_meta();
  bool after_meta();
  bool next_chunk();
  void unstage();
  bool table_header();
  bool table_payload();

  ServerImpl* srv_;
  std::shared_ptr<Store> store_;
  std::vector<std::uint8_t> cbuf_;
  std::uint64_t staged_ = 0;
  std::uint64_t gen_ = 0;   // the store's epoch generation when this push began
  std::size_t off_ = 0;
  std::size_t summed_ = 0;  // bytes of the scratch span summed (whole chunks as they came)
  bool hello_ = false, awaiting_mac_ = false;
  bool in_place_ = false;  // this payload is read straight into the store (land_in_place)
  bool whole_ = false;     // this payload is received whole: a compressed push, or a seed
  int rank_ = -1;
  std::uint64_t stream_ = 0;
  bool table_ = false;             // a table stream (FLAG_TABLE): SPARSE_* requests only
  std::uint64_t table_id_ = 0;     // its id in srv_->tables_, made at its first request
  std::string tpay_;               // a table request's payload being read
  std::uint8_t peer_nonce_[kNonce] = {}, my_nonce_[kNonce] = {}, peer_mac_[32] = {};
  std::atomic<bool> unproven_{true};   // counted in srv_->unproven_
  std::uint32_t meta_charged_ = 0;     // of srv_->meta_bytes_
};

}  // namespace dp
}  // namespace bps
