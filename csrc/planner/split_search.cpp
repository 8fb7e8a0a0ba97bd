#include "split_search.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace hsync::planner {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// Note [Split search]
// A fill at limit T gives each rank, in order, as many of the examples left as it finishes within T
// (and at least one while there are enough, leaving one for every later rank; the last rank takes
// what is left). The shortest step is the least T whose fill keeps every rank within T. Feasibility is
// monotone in T: taking more early never hurts later ranks, as what is left is fewer and shorter
// examples. A feasible fill's slowest rank is itself an achievable T, so the upper end of the
// bisection drops to it, and the bisection runs until the two ends are adjacent doubles: the result is
// the optimum, not an approximation. A fill costs O(micro-batches) per rank, a few nanoseconds each;
// about sixty fills find the split of 1,024 ranks x 8 examples in well under a millisecond.
//
// Rank times are summed exactly as hsync.balance.planner.step_time sums them (fixed + units *
// per_unit, units added micro-batch by micro-batch, each its size times its first example), and this
// file is compiled without contraction into fused multiply-adds, so every rank, on any machine,
// computes the same split from the same numbers.

class Fills {
 public:
  Fills(const std::vector<double>& ordered, const std::vector<RankCost>& ranks)
      : ordered_(ordered),
        ranks_(ranks),
        total_(static_cast<int64_t>(ordered.size())),
        world_(static_cast<int64_t>(ranks.size())),
        reserve_(total_ >= world_ ? 1 : 0),
        // With equal costs a micro-batch never pads, so a rank's time does not depend on its cap.
        equal_costs_(ordered.empty() || ordered.front() == ordered.back()) {}

  // The fill at `limit` into `starts` (world + 1 entries); its slowest rank's time, or infinity when a
  // rank had to take more than it finishes within `limit`.
  double fill(double limit, std::vector<int64_t>& starts) const {
    starts.assign(1, 0);
    int64_t start = 0;
    double slowest = 0.0;
    for (int64_t r = 0; r < world_; ++r) {
      const bool last = r == world_ - 1;
      const int64_t most = last ? total_ : total_ - (world_ - 1 - r) * reserve_;
      const int64_t least = last ? total_ - start : reserve_;
      const Take take = run_from(start, most, least, ranks_[r], limit);
      if (!take.within) return kInf;
      slowest = std::max(slowest, ranks_[r].fixed_s + take.units * ranks_[r].per_unit_s);
      start += take.examples;
      starts.push_back(start);
    }
    return slowest;
  }

 private:
  struct Take {
    int64_t examples;
    double units;
    bool within;  // whether the rank finishes them within the limit
  };

  // The longest run from `start`, of at least `least` examples and to at most `most`, that `rank`
  // finishes within `limit`: a whole micro-batch at a time, the last one in part.
  Take run_from(int64_t start, int64_t most, int64_t least, const RankCost& rank, double limit) const {
    const double cap = equal_costs_ ? kInf : rank.micro_cap;
    int64_t stop = start;
    double units = 0.0;
    bool within = true;
    const auto time_with = [&](int64_t more, double head) {
      return rank.fixed_s + (units + static_cast<double>(more) * head) * rank.per_unit_s;
    };
    while (stop < most) {
      const double head = ordered_[stop];
      int64_t size = most - stop;
      if (cap < kInf) {  // as many as the cap holds at this micro-batch's first (longest) example
        const double fit = cap / head;
        int64_t holds = fit >= static_cast<double>(size) ? size : std::max<int64_t>(1, static_cast<int64_t>(fit));
        while (holds > 1 && static_cast<double>(holds) * head > cap) --holds;  // the quotient rounded up
        size = std::min(size, holds);
      }
      const double quotient = (limit - time_with(0, head)) / (rank.per_unit_s * head);
      int64_t fits = quotient >= static_cast<double>(size) ? size : quotient > 0 ? static_cast<int64_t>(quotient) : 0;
      while (fits < size && time_with(fits + 1, head) <= limit) ++fits;  // the quotient rounded down
      while (fits > 0 && time_with(fits, head) > limit) --fits;          // or up
      const int64_t owed = least - (stop - start);
      const int64_t taken = owed > 0 ? std::max(fits, std::min(size, owed)) : fits;
      if (taken == 0) break;
      within = within && taken == fits;
      units += static_cast<double>(taken) * head;
      stop += taken;
      if (taken < size && stop - start >= least) break;
    }
    return {stop - start, units, within};
  }

  const std::vector<double>& ordered_;
  const std::vector<RankCost>& ranks_;
  const int64_t total_;
  const int64_t world_;
  const int64_t reserve_;
  const bool equal_costs_;
};

}  // namespace

std::vector<int64_t> shortest_split(const std::vector<double>& ordered, const std::vector<RankCost>& ranks) {
  const Fills fills(ordered, ranks);
  std::vector<int64_t> best, probe_starts;
  double hi = fills.fill(kInf, best);  // every rank takes all it may: always feasible
  // The fluid bound: every rank busy until T on unpadded work. No split beats it.
  double rate = 0.0, fixed_work = 0.0, work = 0.0;
  for (const RankCost& rank : ranks) {
    rate += 1.0 / rank.per_unit_s;
    fixed_work += rank.fixed_s / rank.per_unit_s;
  }
  for (double cost : ordered) work += cost;
  double lo = (work + fixed_work) / rate;
  for (const RankCost& rank : ranks) {
    if (rank.fixed_s > lo) lo = 0.0;  // it assumed every rank takes part; one with this fixed cost may not
  }
  lo = std::min(lo, hi);
  while (true) {
    const double mid = lo + (hi - lo) / 2;
    if (!(lo < mid && mid < hi)) return best;
    const double slowest = fills.fill(mid, probe_starts);
    if (slowest <= mid) {
      hi = slowest;
      best.swap(probe_starts);
    } else {
      lo = mid;
    }
  }
}

double split_time(const std::vector<double>& ordered, const std::vector<int64_t>& starts,
                  const std::vector<RankCost>& ranks) {
  double slowest = 0.0;
  for (size_t r = 0; r < ranks.size(); ++r) {
    double units = 0.0;
    for (int64_t start = starts[r]; start < starts[r + 1];) {
      const double head = ordered[start];  // a micro-batch's first example, its longest
      int64_t stop = start + 1;
      while (stop < starts[r + 1] && static_cast<double>(stop - start + 1) * head <= ranks[r].micro_cap) ++stop;
      units += static_cast<double>(stop - start) * head;
      start = stop;
    }
    slowest = std::max(slowest, ranks[r].fixed_s + units * ranks[r].per_unit_s);
  }
  return slowest;
}

}  // namespace hsync::planner
