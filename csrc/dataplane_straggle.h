// The straggler report of a synchronous server (issue 38, docs/observability.md): per worker
// rank, how long the other ranks waited for it and how long it waited for the others, from
// the time each push of a round was summed. A completed round's last push is what its round
// waited for: the gap between it and the push before it is the time the last pusher "held"
// the round; every pusher waited from its own push to the last one. The keys of a step run
// in parallel, so each rank's intervals are merged (a union over the rounds as they
// complete, in order of their end), not summed: one rank sleeping 0.2 s before it pushes
// ten keys held the job 0.2 s, not 2 s.
//
// Cost: one clock read per push (Store::arrived, set by finish_push) and, per completed
// round, one pass over the worker ranks under this object's mutex, taken inside a key's
// mutex (nothing is taken inside it). No allocation after construction.
#pragma once

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <vector>

namespace bps {
namespace dp {

struct StraggleRow {
  double held_s = 0;           // the others waited for this rank (merged intervals)
  std::uint64_t held_rounds = 0;  // rounds (of any key) it pushed last, others waiting
  double waited_s = 0;         // this rank waited for the last pusher (merged intervals)
};

class Straggle {
 public:
  explicit Straggle(int num_workers) : rows_(num_workers), held_until_(num_workers, 0.0),
                                       waited_until_(num_workers, 0.0) {}

  // A round completed: `pushed[r]` says whether rank r pushed it, `arrived[r]` when (monotonic
  // seconds). Rounds of one pusher held nobody.
  void round(const std::vector<std::uint8_t>& pushed, const std::vector<double>& arrived) {
    const int n = static_cast<int>(std::min(pushed.size(), rows_.size()));
    int last = -1, count = 0;
    double second = 0;
    for (int r = 0; r < n; ++r) {
      if (!pushed[r]) continue;
      ++count;
      if (last < 0 || arrived[r] > arrived[last]) {
        if (last >= 0) second = std::max(second, arrived[last]);
        last = r;
      } else {
        second = std::max(second, arrived[r]);
      }
    }
    if (count < 2) return;
    const double end = arrived[last];
    std::lock_guard<std::mutex> g(mu_);
    ++rows_[last].held_rounds;
    merge(&rows_[last].held_s, &held_until_[last], second, end);
    for (int r = 0; r < n; ++r)
      if (pushed[r] && r != last) merge(&rows_[r].waited_s, &waited_until_[r], arrived[r], end);
  }

  std::vector<StraggleRow> snapshot() {
    std::lock_guard<std::mutex> g(mu_);
    return rows_;
  }

 private:
  // adds [a, b) minus what is already covered up to *until
  static void merge(double* total, double* until, double a, double b) {
    if (b <= *until || b <= a) return;
    *total += b - std::max(a, *until);
    *until = b;
  }

  std::mutex mu_;
  std::vector<StraggleRow> rows_;
  std::vector<double> held_until_, waited_until_;
};

}  // namespace dp
}  // namespace bps
