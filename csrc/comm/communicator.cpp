#include "comm/communicator.h"

#include <algorithm>
#include <optional>

#include "checks.h"

namespace hsync {
namespace {

// seq, op, root, purpose, index, numel, dtype: exact in float64.
constexpr int64_t kFingerprintFields = 7;

void write_fingerprint(const Collective& c, double* row) {
  const double fields[kFingerprintFields] = {
      static_cast<double>(c.seq), static_cast<double>(c.op), static_cast<double>(c.root),
      static_cast<double>(c.purpose), static_cast<double>(c.index), static_cast<double>(c.numel),
      static_cast<double>(c.dtype)};
  std::copy(fields, fields + kFingerprintFields, row);
}

Collective read_fingerprint(const double* row) {
  Collective c;
  c.seq = static_cast<uint64_t>(row[0]);
  c.op = static_cast<Op>(static_cast<int>(row[1]));
  c.root = static_cast<int>(row[2]);
  c.purpose = static_cast<Purpose>(static_cast<int>(row[3]));
  c.index = static_cast<int64_t>(row[4]);
  c.numel = static_cast<int64_t>(row[5]);
  c.dtype = static_cast<at::ScalarType>(static_cast<int>(row[6]));
  return c;
}

}  // namespace

Communicator::Communicator(int rank, int world_size, std::string backend, const FaultOptions& options)
    : rank_(rank),
      world_size_(world_size),
      backend_(std::move(backend)),
      debug_(options.debug),
      monitor_(std::make_unique<FaultMonitor>(options.store, options.key, rank, world_size, backend_,
                                              options.timeout)) {
  HSYNC_CHECK(rank >= 0 && rank < world_size, "rank ", rank, " is outside world size ", world_size);
}

uint64_t Communicator::all_reduce_sum(const at::Tensor& tensor, Purpose purpose, int64_t index, std::string label) {
  return issue(tensor, Op::kAllReduce, -1, purpose, index, std::move(label));
}

void Communicator::broadcast(const at::Tensor& tensor, int root, Purpose purpose, std::string label) {
  HSYNC_CHECK(root >= 0 && root < world_size_, "broadcast root ", root, " is outside world size ", world_size_);
  issue(tensor, Op::kBroadcast, root, purpose, -1, std::move(label));
}

uint64_t Communicator::reduce_sum(const at::Tensor& tensor, int root, Purpose purpose, int64_t index) {
  HSYNC_CHECK(root >= 0 && root < world_size_, "reduce root ", root, " is outside world size ", world_size_);
  return issue(tensor, Op::kReduce, root, purpose, index, {});
}

void Communicator::give_up(const std::string& why) {
  try {
    monitor_->fail(why);
  } catch (const c10::Error&) {
    // fail() throws what it recorded; the caller raises its own error.
  }
}

void Communicator::synchronize() {
  if (next_seq_ == 1) {  // none issued yet
    monitor_->check();
  } else {
    synchronize_through(next_seq_ - 1);
  }
}

uint64_t Communicator::issue(const at::Tensor& tensor, Op op, int root, Purpose purpose, int64_t index,
                             std::string label) {
  monitor_->check();
  Collective collective;
  collective.seq = next_seq_++;
  collective.op = op;
  collective.root = root;
  collective.purpose = purpose;
  collective.index = index;
  collective.numel = tensor.numel();
  collective.dtype = tensor.scalar_type();
  collective.label = std::move(label);
  if (debug_) verify_fingerprint(tensor, collective);
  collective.issued = Clock::now();
  launch(tensor, collective);
  return collective.seq;
}

void Communicator::verify_fingerprint(const at::Tensor& tensor, const Collective& collective) {
  at::Tensor table = at::zeros({world_size_, kFingerprintFields}, at::kDouble);
  write_fingerprint(collective, table[rank_].data_ptr<double>());
  table = table.to(tensor.device());
  Collective gather;
  gather.seq = collective.seq;
  gather.purpose = Purpose::kFingerprint;
  gather.label = collective.describe();  // an error in the exchange names the collective it was for
  gather.numel = table.numel();
  gather.dtype = at::kDouble;
  gather.issued = Clock::now();
  {
    // The host waits here for the slowest rank to reach this collective.
    std::optional<PeerWait> wait;
    if (clock_ != nullptr) wait.emplace(*clock_);
    launch(table, gather);
    synchronize();
    table = table.cpu();
  }
  const double* rows = table.const_data_ptr<double>();
  // A label is known only where it was given: this rank's row is described from the collective itself.
  auto describe_row = [&](int r) {
    return r == rank_ ? collective.describe() : read_fingerprint(rows + r * kFingerprintFields).describe();
  };
  for (int r = 1; r < world_size_; ++r) {
    const double* row = rows + r * kFingerprintFields;
    if (std::equal(rows, rows + kFingerprintFields, row)) continue;
    monitor_->fail("collective mismatch: rank 0 issues " + describe_row(0) + ", rank " + std::to_string(r) +
                   " issues " + describe_row(r) +
                   ". Every rank must make the same calls in the same order: WeightedDDP.backward or "
                   "loss.backward alike, the same no_sync, metric_names and model");
  }
}

}  // namespace hsync
