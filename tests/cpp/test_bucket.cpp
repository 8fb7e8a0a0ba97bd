// C++ unit tests of the bucket assignment; plain C++, run by ctest (see CMakeLists.txt).
#include <cstdlib>
#include <iostream>
#include <stdexcept>
#include <vector>

#include "bucket.h"

using hsync::compute_bucket_assignment;
using hsync::ParamInfo;
using Buckets = std::vector<std::vector<int64_t>>;

namespace {

int failures = 0;

void expect(bool ok, const char* what) {
  if (!ok) {
    std::cerr << "FAILED: " << what << "\n";
    ++failures;
  }
}

void first_bucket_is_small_and_others_fill_to_the_cap() {
  std::vector<ParamInfo> params(6, ParamInfo{400, 0});
  const Buckets buckets = compute_bucket_assignment(params, {5, 4, 3, 2, 1, 0}, 1000, 400);
  expect(buckets == Buckets({{5}, {4, 3, 2}, {1, 0}}), "first bucket closes at its own cap");
}

void dtypes_are_bucketed_apart() {
  std::vector<ParamInfo> params{{8, 0}, {8, 1}, {8, 0}, {8, 1}};
  const Buckets buckets = compute_bucket_assignment(params, {0, 1, 2, 3}, 1 << 20, 1 << 20);
  expect(buckets == Buckets({{0, 2}, {1, 3}}), "one bucket per group, ordered by first use");
}

void a_bad_order_is_refused() {
  std::vector<ParamInfo> params(3, ParamInfo{8, 0});
  bool threw = false;
  try {
    compute_bucket_assignment(params, {0, 2, 2}, 100, 100);
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  expect(threw, "a repeated index throws invalid_argument");
}

}  // namespace

int main() {
  first_bucket_is_small_and_others_fill_to_the_cap();
  dtypes_are_bucketed_apart();
  a_bad_order_is_refused();
  if (failures == 0) std::cout << "bucket assignment: all checks passed\n";
  return failures == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
