// A communicator over a torch.distributed process group (gloo on CPU). The process group runs
// each collective on its own threads, so backward keeps computing while buckets are reduced.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <vector>

#include "comm/communicator.h"

namespace hsync {

class ProcessGroupComm final : public Communicator {
 public:
  explicit ProcessGroupComm(c10::intrusive_ptr<c10d::ProcessGroup> group);

  int rank() const override { return group_->getRank(); }
  int world_size() const override { return group_->getSize(); }
  std::string backend() const override;

  void all_reduce_sum(const at::Tensor& tensor) override;
  void broadcast(const at::Tensor& tensor, int root) override;
  void synchronize() override;

 private:
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  std::vector<c10::intrusive_ptr<c10d::Work>> pending_;
};

}  // namespace hsync
