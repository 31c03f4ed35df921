// Table pulls answered on the plane's own threads (docs/sparse.md, "On the wire"). A shard's
// kernels (module_tables.cc's TableKernels) keep its arrays in a ServedShard, which the
// server's TableInbox also holds once the tables' thread registered it. A SPARSE_PULL of such a
// shard is answered by the I/O thread that read it when every rule holds: the tables' thread
// opened the shard, the request is int64 ids within BYTEPS_SPARSE_MAX_IDS and the reply within
// BYTEPS_MAX_MESSAGE_BYTES, every id is a row of this shard, the worker's rank and rollback
// generation are current, the stream's replies are within its share, and its round is the
// applied one (answered at once) or the next (parked, charged to its stream, and answered
// when the tables' thread applies the round: TableKernels.apply). Anything else goes to the
// tables' thread (server/sparse.py) as before, which answers it, errors included, with the
// text that names the table, the id and the rank. The shard's lock orders the gather against
// the optimizer and against Python's own writes (restore, forget), so a pull sees a round's
// rows whole.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "table_kernels.h"
#include "wire.h"

namespace bps {
namespace dp {

class Conn;

// A pull parked for the next round: its stream, header and ids, and the charge it holds.
struct ParkedPull {
  std::uint64_t stream = 0;
  std::weak_ptr<Conn> conn;
  Header h{};
  std::string ids;
  std::int64_t cost = 0;
};

// What the tables' thread says of a shard (TableKernels.serve).
struct ServeRules {
  bool open = false;             // the plane may answer its pulls
  std::int64_t applied = 0;      // rounds applied: pulls of this round are answered
  std::uint32_t generation = 0;  // the oldest rollback generation a request may carry
  std::int64_t rows = 0;         // the table's rows (every shard's)
  std::int64_t rank_limit = 0;   // process ranks below this may pull
  std::int64_t park_limit = 0;   // pulls of the next round parked at most
  std::int64_t max_ids = 0;      // BYTEPS_SPARSE_MAX_IDS
  std::uint64_t max_message = 0; // BYTEPS_MAX_MESSAGE_BYTES
};

// A pull handed back to the tables' thread (the shard closed, or its round passed by).
struct ReturnedPull {
  std::uint64_t stream;
  Header h;
  std::string ids;
};

class ServedShard {
 public:
  // The shard's arrays (TableKernels binds them; the numpy arrays live while it does).
  table::Shard s;

  // Kernels' calls on the arrays hold this lock (module_tables.cc).
  std::mutex& lock() { return mu_; }
  // The owner is gone: the arrays are not read again (called holding nothing).
  void retire();
  // The tables' thread's rules; parked pulls of a round now applied are answered, those that
  // may no longer wait are returned (called holding nothing).
  std::vector<ReturnedPull> serve(const ServeRules& rules);
  // Round `applied` is applied (TableKernels.apply, holding lock()): answers the parked pulls
  // of it.
  void applied_locked(std::int64_t applied);
  // A pull from `stream` (an I/O thread): true when answered or parked here, false when it is
  // the tables' thread's.
  bool take(const std::shared_ptr<Conn>& c, std::uint64_t stream, const Header& h,
            const std::string& meta, std::string& ids, int server_rank, std::uint32_t job);
  std::uint64_t answered() const { return answered_.load(); }
  std::uint64_t parked_total() const { return parked_total_.load(); }

 private:
  bool fits_locked(const Header& h, const std::string& ids) const;
  void answer_locked(Conn& c, const Header& h, const std::string& ids);

  std::mutex mu_;
  bool alive_ = true;
  ServeRules rules_;
  std::vector<ParkedPull> parked_;
  int server_rank_ = 0;
  std::uint32_t job_ = 0;
  std::atomic<std::uint64_t> answered_{0}, parked_total_{0};
};

}  // namespace dp
}  // namespace bps
