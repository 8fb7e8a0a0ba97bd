// A communicator that owns an NCCL communicator (ncclComm_t) and a stream of its own.
//
// Note [NCCL bootstrap]
// Rank 0 makes the unique id (nccl_unique_id), it travels through the torch.distributed store
// that torchrun already set up, and every rank then calls ncclCommInitRank with it. hsync has
// no rendezvous or wire protocol of its own.
//
// Note [Stream ordering]
// Collectives run on the communicator's stream. all_reduce_sum first makes that stream wait for
// the caller's current stream (where the bucket was packed); synchronize_through(seq) makes the
// caller's stream wait for the event recorded after collective `seq`. Nothing here blocks the host.
#pragma once

#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <deque>
#include <mutex>
#include <optional>
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

// Note [NCCL failures]
// The communicator is non-blocking (ncclConfig_t::blocking = 0): no NCCL call can hang the host.
// Each collective records an event when it completes. The fault monitor's thread polls those
// events and ncclCommGetAsyncError; on an error, a passed deadline or a peer's posted failure it
// aborts the communicator, which ends the kernels waiting on dead peers. The error is raised on
// the host at the next call into the communicator and when the engine reads the step scalars.
class NcclComm final : public Communicator {
 public:
  NcclComm(const std::string& unique_id, int rank, int world_size, int device_index,
           const FaultOptions& options);
  // Lets collectives in flight finish (for at most kDrainTimeout) and destroys the communicator;
  // aborts it instead if it failed or the drain timed out, so it never blocks for long.
  ~NcclComm() override;
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  void synchronize_through(uint64_t seq) override;

 protected:
  void launch(const at::Tensor& tensor, const Collective& collective) override;

 private:
  struct InFlight {
    Collective collective;
    cudaEvent_t done;
  };

  // Orders the communicator's stream after the caller's and keeps `tensor`'s memory from being
  // reused by the caching allocator until the collective is done.
  void enter(const at::Tensor& tensor);
  // Waits while the non-blocking communicator is still busy with the last call: at most the deadline
  // from `collective`'s issue (from now without one), and no longer once a peer posted a failure.
  void wait_ready(const Collective* collective, const std::string& what);
  std::optional<std::string> poll();  // on the fault monitor's thread
  void abort();                       // on the fault monitor's thread

  static constexpr std::chrono::seconds kDrainTimeout{10};

  int device_index_;
  ncclComm_t comm_ = nullptr;
  c10::cuda::CUDAStream stream_;
  StreamEvent enter_event_;
  std::mutex mutex_;  // guards comm_ calls, in_flight_ and aborted_ against the monitor's thread
  std::deque<InFlight> in_flight_;
  bool aborted_ = false;
};

}  // namespace hsync
