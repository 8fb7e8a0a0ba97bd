#include "comm/process_group_comm.h"

#include "checks.h"

namespace hsync {

ProcessGroupComm::ProcessGroupComm(c10::intrusive_ptr<c10d::ProcessGroup> group)
    : group_(std::move(group)) {
  HSYNC_CHECK(group_, "process group is None (call torch.distributed.init_process_group first)");
}

std::string ProcessGroupComm::backend() const { return group_->getBackendName(); }

void ProcessGroupComm::all_reduce_sum(const at::Tensor& tensor) {
  std::vector<at::Tensor> tensors{tensor};
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp::SUM;
  pending_.push_back(group_->allreduce(tensors, options));
}

void ProcessGroupComm::broadcast(const at::Tensor& tensor, int root) {
  std::vector<at::Tensor> tensors{tensor};
  c10d::BroadcastOptions options;
  options.rootRank = root;
  pending_.push_back(group_->broadcast(tensors, options));
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
