// A key's store on the native data plane's server (dataplane_server.cc): its buffers, the
// chunk table of their summation, its round, the pulls waiting for it. Synchronous mode sums
// round r into buf[r % 2]; asynchronous mode (BYTEPS_ENABLE_ASYNC) keeps the running value.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "codec.h"
#include "dataplane_io.h"
#include "dtype.h"

namespace bps {
namespace dp {

struct Store {
  std::uint64_t key = 0;
  int wire_dtype = 0;
  DType kdt = DType::kFloat32;
  std::size_t nbytes = 0, count = 0, nchunks = 0;
  std::string decl;
  int decl_rank = 0;
  std::unique_ptr<char[]> buf[2];
  std::unique_ptr<std::uint32_t[]> fill[2];   // pushes summed into each chunk this round
  // Asynchronous mode instead of buf and fill: the running value, every push added into it.
  // Pull replies share it while they are written; a push that finds it shared (no push in
  // flight) sums into a copy, so a reply never changes under its writer. Pulls are answered
  // only while no push is in flight (started == finished), so each sees whole pushes.
  std::shared_ptr<char> value;
  // A compressed key (codec.h): pushes are payloads of the server's codec, decoded (the first
  // of a round) or added into *accp, the round's float32 sum, all under mu; on completion the
  // sum is encoded with the step its pushes carry into buf[round % 2] (rlen[round % 2]
  // bytes), the pulls' answer. accp is acc, or the accumulator a Python codec provides.
  std::unique_ptr<compress::ServerCodec> codec;
  std::unique_ptr<float[]> acc;
  float* accp = nullptr;
  std::size_t rlen[2] = {0, 0};
  std::uint64_t step = 0;
  std::unique_ptr<std::mutex[]> chunk_mu;
  std::mutex mu;                               // everything below
  std::int64_t round = 0, completed = -1;
  // elastic membership epochs (reset_epoch): a push begun in an older generation sums nothing
  // more and completes nothing; read under chunk_mu (sum_chunk) or mu, written under both
  std::atomic<std::uint64_t> gen{0};
  std::uint64_t charged = 0;                   // its bytes of the memory budget
  int contrib[2] = {0, 0};                     // pushes summed into each buffer's round
  std::vector<std::uint8_t> pushed;            // per worker rank, this round
  std::vector<double> arrived;                 // per worker rank: when its push was summed
  int started = 0, finished = 0;               // pushes begun / summed this round (async: ever)
  double round_started = 0;
  std::string failed;
  std::string failed_kind = "mismatch", failed_extra;  // the error kind and extra JSON members
  // Asynchronous mode with a staleness bound (dataplane_server_stale.cc): per worker rank,
  // the newest round it pushed (-1: none; empty until the first push is noted)
  std::vector<std::int64_t> last_push;
  struct Pending {
    std::weak_ptr<Conn> conn;
    std::int64_t round;
    bool held = false;  // held back by the staleness bound (counted once)
    int rank = -1;  // the worker rank that waits (-1: not known)
  };
  std::vector<Pending> pending;
  // Backup workers (BYTEPS_BACKUP_WORKERS, dataplane_server_backup.cc): a key declared with
  // "backup": b completes a round with all but b pushes; every completed round's answer is kept
  // (a copy, charged to the memory budget) until every worker rank has had it, so a rank that
  // fell behind gets the same sums in the same order. Oldest first; rounds below kept_from
  // were dropped (over BYTEPS_BACKUP_MAX_LAG or the budget): a rank asking for one is named
  // in an error.
  struct Kept {
    std::int64_t round = 0;
    int contrib = 0;
    std::shared_ptr<char> data;
  };
  int backup = 0;  // b; 0: every round waits for every worker
  std::deque<Kept> kept;
  std::vector<std::int64_t> served;  // per worker rank: the newest round it was answered
  std::int64_t kept_from = 0;
};

}  // namespace dp
}  // namespace bps
