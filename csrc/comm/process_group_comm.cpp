#include "comm/process_group_comm.h"

#include "checks.h"

namespace hsync {

ProcessGroupComm::ProcessGroupComm(c10::intrusive_ptr<c10d::ProcessGroup> group) : group_(group) {
  HSYNC_CHECK(group, "process group is None (call torch.distributed.init_process_group first)");
  rank_ = group->getRank();
  world_size_ = group->getSize();
  backend_ = group->getBackendName();
}

std::string ProcessGroupComm::backend() const { return backend_; }

c10::intrusive_ptr<c10d::ProcessGroup> ProcessGroupComm::group() const {
  auto group = group_.lock();
  HSYNC_CHECK(group, "the process group was destroyed (torch.distributed.destroy_process_group) while a "
              "WeightedDDP model still uses it");
  return group;
}

void ProcessGroupComm::all_reduce_sum(const at::Tensor& tensor) {
  std::vector<at::Tensor> tensors{tensor};
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp::SUM;
  pending_.push_back(group()->allreduce(tensors, options));
}

void ProcessGroupComm::broadcast(const at::Tensor& tensor, int root) {
  std::vector<at::Tensor> tensors{tensor};
  c10d::BroadcastOptions options;
  options.rootRank = root;
  pending_.push_back(group()->broadcast(tensors, options));
}

void ProcessGroupComm::synchronize() {
  // Clear first: if a wait throws (a peer died), the failed work must not be waited on again.
  auto pending = std::move(pending_);
  pending_.clear();
  for (auto& work : pending) {
    work->wait();
  }
}

}  // namespace hsync
