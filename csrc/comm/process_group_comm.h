// A communicator over a torch.distributed process group (gloo on CPU). The process group runs
// each collective on its own threads, so backward keeps computing while buckets are reduced.
//
// It holds the group weakly: torch.distributed owns it, and destroy_process_group() must be able
// to tear it down then. A group kept alive by us until interpreter exit is destroyed after its
// threads' runtime is gone, which aborts the process.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <vector>

#include "comm/communicator.h"

namespace hsync {

class ProcessGroupComm final : public Communicator {
 public:
  explicit ProcessGroupComm(c10::intrusive_ptr<c10d::ProcessGroup> group);

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  std::string backend() const override;

  void all_reduce_sum(const at::Tensor& tensor) override;
  void broadcast(const at::Tensor& tensor, int root) override;
  void synchronize() override;

 private:
  c10::intrusive_ptr<c10d::ProcessGroup> group() const;

  c10::weak_intrusive_ptr<c10d::ProcessGroup> group_;
  int rank_;
  int world_size_;
  std::string backend_;
  std::vector<c10::intrusive_ptr<c10d::Work>> pending_;
};

}  // namespace hsync
