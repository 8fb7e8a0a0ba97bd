// The shortest split of one step's examples among ranks of different speeds and memory: the search at
// the heart of hsync.balance.planner.split_step (Note [Cost model] and Note [Split search] there).
// Plain C++, no torch: the Python module that binds it, hsync._planner, imports without torch.
#pragma once

#include <cstdint>
#include <vector>

namespace hsync::planner {

// One rank's cost model: a step of `units` of work takes fixed_s + units * per_unit_s seconds, in
// micro-batches of at most micro_cap units each (infinity: no cap).
struct RankCost {
  double fixed_s;
  double per_unit_s;
  double micro_cap;
};

// Where each rank's run of `ordered` (example costs, longest first) starts, and the end: runs in rank
// order with the shortest predicted step, every rank at least one example while there are enough.
std::vector<int64_t> shortest_split(const std::vector<double>& ordered, const std::vector<RankCost>& ranks);

// The predicted time of the split of `ordered` at `starts` (world + 1 entries, as shortest_split
// gives them) under `ranks`: the slowest rank's, each rank's units summed micro-batch by micro-batch
// as hsync.balance.planner.step_time sums them.
double split_time(const std::vector<double>& ordered, const std::vector<int64_t>& starts,
                  const std::vector<RankCost>& ranks);

}  // namespace hsync::planner
