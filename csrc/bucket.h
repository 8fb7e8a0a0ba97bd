// Bucket assignment: which gradients travel together in one all-reduce.
//
// Note [Bucket order]
// Gradients become ready roughly in reverse registration order (the last layer's first), so
// buckets are filled in that order and launched as soon as they are full: communication of the
// late layers overlaps backward of the early ones. After the first iteration the assignment is
// rebuilt from the order in which gradients were actually ready (rank 0's order, so every rank
// agrees). The first bucket is kept small so that communication starts early.
//
// This header is plain C++ (no torch types) so it can be unit-tested without torch.
#pragma once

#include <cstdint>
#include <vector>

namespace hsync {

constexpr int64_t kDefaultBucketBytesCap = 25 * 1024 * 1024;
constexpr int64_t kDefaultFirstBucketBytesCap = 1024 * 1024;

// What the assignment needs to know of one parameter.
struct ParamInfo {
  int64_t bytes;  // size of its gradient
  int64_t group;  // parameters of different groups (dtype, device) never share a bucket
};

// Returns buckets as lists of parameter indices, in launch order (the order in which their first
// parameter appears in `order`). Within a group, a bucket is closed once it holds at least its
// cap: `first_bytes_cap` for the first bucket of each group, `bytes_cap` for the others.
// `order` must be a permutation of [0, params.size()).
std::vector<std::vector<int64_t>> compute_bucket_assignment(
    const std::vector<ParamInfo>& params, const std::vector<int64_t>& order,
    int64_t bytes_cap, int64_t first_bytes_cap);

}  // namespace hsync
