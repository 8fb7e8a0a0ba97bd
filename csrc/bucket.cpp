#include "bucket.h"

#include <map>
#include <stdexcept>
#include <string>

namespace hsync {

std::vector<std::vector<int64_t>> compute_bucket_assignment(
    const std::vector<ParamInfo>& params, const std::vector<int64_t>& order,
    int64_t bytes_cap, int64_t first_bytes_cap) {
  if (order.size() != params.size()) {
    throw std::invalid_argument("bucket order has " + std::to_string(order.size()) +
                                " entries for " + std::to_string(params.size()) + " parameters");
  }
  if (bytes_cap <= 0 || first_bytes_cap <= 0) {
    throw std::invalid_argument("bucket caps must be positive");
  }
  std::vector<bool> seen(params.size(), false);

  struct Open {
    int64_t bucket;  // index into `buckets`
    int64_t bytes;
    int64_t closed_count;
  };
  std::map<int64_t, Open> open;  // group -> its bucket being filled
  std::vector<std::vector<int64_t>> buckets;

  for (int64_t index : order) {
    if (index < 0 || index >= static_cast<int64_t>(params.size()) || seen[index]) {
      throw std::invalid_argument("bucket order is not a permutation (bad or repeated index " +
                                  std::to_string(index) + ")");
    }
    seen[index] = true;
    const ParamInfo& param = params[index];
    auto it = open.find(param.group);
    if (it == open.end() || it->second.bucket < 0) {
      int64_t closed = it == open.end() ? 0 : it->second.closed_count;
      buckets.emplace_back();
      it = open.insert_or_assign(param.group, Open{static_cast<int64_t>(buckets.size()) - 1, 0, closed})
               .first;
    }
    Open& bucket = it->second;
    buckets[bucket.bucket].push_back(index);
    bucket.bytes += param.bytes;
    const int64_t cap = bucket.closed_count == 0 ? first_bytes_cap : bytes_cap;
    if (bucket.bytes >= cap) {
      bucket = Open{-1, 0, bucket.closed_count + 1};
    }
  }
  return buckets;
}

}  // namespace hsync
