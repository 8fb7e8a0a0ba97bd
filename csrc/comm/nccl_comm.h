// A communicator that owns an NCCL communicator (ncclComm_t) and a stream of its own.
//
// Note [NCCL bootstrap]
// Rank 0 makes the unique id (nccl_unique_id), it travels through the torch.distributed store
// that torchrun already set up, and every rank then calls ncclCommInitRank with it. hsync has
// no rendezvous or wire protocol of its own.
//
// Note [Stream ordering]
// Collectives run on the communicator's stream. all_reduce_sum first makes that stream wait for
// the caller's current stream (where the bucket was packed); synchronize() makes the caller's
// stream wait for the communicator's. Nothing here blocks the host.
#pragma once

#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <string>

#include "comm/communicator.h"

namespace hsync {

std::string nccl_unique_id();
std::string nccl_version();

// An event for ordering streams on one device, destroyed with its owner.
class StreamEvent {
 public:
  explicit StreamEvent(int device_index);  // CUDA events belong to the device current at creation
  ~StreamEvent();
  StreamEvent(const StreamEvent&) = delete;
  StreamEvent& operator=(const StreamEvent&) = delete;

  // Makes `waiter` wait for the work enqueued on `signaller` so far.
  void order(cudaStream_t signaller, cudaStream_t waiter);

 private:
  cudaEvent_t event_ = nullptr;
};

class NcclComm final : public Communicator {
 public:
  NcclComm(const std::string& unique_id, int rank, int world_size, int device_index);
  // Lets collectives in flight finish (for at most kDrainTimeout) and destroys the communicator;
  // aborts it instead if a peer failed or the drain timed out, so it never blocks for long.
  ~NcclComm() override;
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  std::string backend() const override { return "nccl"; }

  void all_reduce_sum(const at::Tensor& tensor) override;
  void broadcast(const at::Tensor& tensor, int root) override;
  void synchronize() override;

 private:
  // Orders the communicator's stream after the caller's and keeps `tensor`'s memory from being
  // reused by the caching allocator until the collective is done.
  void enter(const at::Tensor& tensor);

  static constexpr std::chrono::seconds kDrainTimeout{10};

  int rank_;
  int world_size_;
  int device_index_;
  ncclComm_t comm_ = nullptr;
  c10::cuda::CUDAStream stream_;
  StreamEvent enter_event_;
  StreamEvent exit_event_;
};

}  // namespace hsync
