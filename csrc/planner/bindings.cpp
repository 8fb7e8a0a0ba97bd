// hsync._planner: the split search for hsync.balance.planner, bound without torch.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

#include "split_search.h"

namespace py = pybind11;

namespace {

using Doubles = py::array_t<double, py::array::c_style | py::array::forcecast>;

// The ordered costs and the cost models, checked at the boundary: the search assumes them sound.
std::pair<std::vector<double>, std::vector<hsync::planner::RankCost>> checked(
    const char* name, const Doubles& ordered, const Doubles& fixed_s, const Doubles& per_unit_s,
    const Doubles& micro_cap) {
  const py::ssize_t world = fixed_s.size();
  if (per_unit_s.size() != world || micro_cap.size() != world || ordered.ndim() != 1) {
    throw std::invalid_argument(std::string("hsync._planner.") + name +
                                ": one fixed_s, per_unit_s and micro_cap per rank");
  }
  if (world == 0) throw std::invalid_argument("cannot split a step among zero ranks");
  std::vector<double> costs(ordered.data(), ordered.data() + ordered.size());
  for (double cost : costs) {
    if (!(cost > 0) || std::isinf(cost)) throw std::invalid_argument("every example needs a finite positive cost");
  }
  std::vector<hsync::planner::RankCost> ranks;
  ranks.reserve(world);
  for (py::ssize_t r = 0; r < world; ++r) {
    const hsync::planner::RankCost rank{fixed_s.at(r), per_unit_s.at(r), micro_cap.at(r)};
    if (!(rank.fixed_s >= 0 && rank.per_unit_s > 0 && rank.micro_cap > 0) || std::isinf(rank.per_unit_s)) {
      std::ostringstream message;
      message << "rank " << r << ": a cost model needs fixed_s >= 0, 0 < per_unit_s < inf and micro_cap > 0, got "
              << "fixed_s=" << rank.fixed_s << ", per_unit_s=" << rank.per_unit_s << ", micro_cap=" << rank.micro_cap;
      throw std::invalid_argument(message.str());
    }
    ranks.push_back(rank);
  }
  return {std::move(costs), std::move(ranks)};
}

std::vector<int64_t> shortest_split(const Doubles& ordered, const Doubles& fixed_s, const Doubles& per_unit_s,
                                    const Doubles& micro_cap) {
  const auto [costs, ranks] = checked("shortest_split", ordered, fixed_s, per_unit_s, micro_cap);
  py::gil_scoped_release release;
  return hsync::planner::shortest_split(costs, ranks);
}

double split_time(const Doubles& ordered, const std::vector<int64_t>& starts, const Doubles& fixed_s,
                  const Doubles& per_unit_s, const Doubles& micro_cap) {
  const auto [costs, ranks] = checked("split_time", ordered, fixed_s, per_unit_s, micro_cap);
  bool ordered_runs = starts.size() == ranks.size() + 1 && starts.front() == 0 &&
                      starts.back() == static_cast<int64_t>(costs.size());
  for (size_t r = 0; ordered_runs && r < ranks.size(); ++r) ordered_runs = starts[r] <= starts[r + 1];
  if (!ordered_runs) {
    throw std::invalid_argument("hsync._planner.split_time: starts must run from 0 to the number of examples, "
                                "one per rank and the end, never decreasing");
  }
  py::gil_scoped_release release;
  return hsync::planner::split_time(costs, starts, ranks);
}

}  // namespace

PYBIND11_MODULE(_planner, m) {
  m.doc() = "The split search of hsync.balance.planner (plain C++, no torch)";
  m.def("shortest_split", &shortest_split, py::arg("ordered"), py::arg("fixed_s"), py::arg("per_unit_s"),
        py::arg("micro_cap"),
        "Starts of each rank's run of `ordered` (costs, longest first), and the end, in the shortest split");
  m.def("split_time", &split_time, py::arg("ordered"), py::arg("starts"), py::arg("fixed_s"), py::arg("per_unit_s"),
        py::arg("micro_cap"), "The predicted step time of the split of `ordered` at `starts` under these models");
}
