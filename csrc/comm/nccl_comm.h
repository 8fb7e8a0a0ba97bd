// A communicator that owns an NCCL communicator (ncclComm_t) and a stream of its own.
//
// Note [NCCL bootstrap]
// Rank 0 makes the unique id (nccl_unique_id), it travels through the torch.distributed store
// that torchrun already set up, and every rank then calls ncclCommInitRank with it. hsync has
// no rendezvous or wire protocol of its own.
//
// Note [Stream ordering]
// Collectives run on the communicator's stream, one of hsync's own (not from torch's pool, which
// hands the same streams to other users: a drain would then wait on their work too). all_reduce_sum first makes that stream wait for
// the caller's current stream (where the bucket was packed); synchronize_through(seq) makes the
// caller's stream wait for the event recorded after collective `seq`. The host never waits for the
// device here (it may wait for NCCL to connect: Note [NCCL setup allowance]).
#pragma once

#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <nccl.h>

// NCCL's features by the version that brought them, in one place.
// ncclCommRevoke: ends a communicator's calls in progress without freeing it (NCCL 2.28.7).
#define HSYNC_NCCL_HAS_REVOKE (NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 7))

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "comm/communicator.h"

namespace hsync {

std::string nccl_unique_id();
std::string nccl_version();

// A stream of hsync's own on one device, which lives as long as the process, as torch's pooled
// streams do: a tensor that a collective used is recorded on it (recordStream), and whenever that
// tensor is freed, its owner's communicator gone or not, the caching allocator records an event
// on the stream. Destroyed with the communicator, the stream made that event fail, and the
// failure ended the process from a tensor's destructor.
class OwnStream {
 public:
  explicit OwnStream(int device_index);
  OwnStream(const OwnStream&) = delete;
  OwnStream& operator=(const OwnStream&) = delete;

  const c10::cuda::CUDAStream& get() const { return stream_; }
  cudaStream_t stream() const { return stream_.stream(); }

 private:
  c10::cuda::CUDAStream stream_;
};

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
// Collectives run on a blocking communicator, as torch's do: ncclAllReduce returns once the work
// is queued, with no thread or host polling of its own (a non-blocking communicator starts a
// thread per call in NCCL 2.27+ and leaves the caller to poll). Each collective records an event
// when it completes. The fault monitor's thread polls those events and ncclCommGetAsyncError; on
// an error, a passed deadline or a peer's posted failure it posts this rank's failure, then aborts
// the communicator. The abort ends kernels that wait on dead peers, and a host call blocked while
// connecting to one, so no lock of ours is held across an NCCL call; a gate lets no call start
// after the abort began. With NCCL >= 2.28.7 a blocked call is first ended by ncclCommRevoke and
// the abort waits for it to return; older NCCL gives a call in progress kEnqueueGrace to return,
// then frees the communicator under one still blocked (torch's watchdog runs the same risk). A
// revoke (which on a blocking communicator synchronises streams inline) and an abort can each
// hang (NVIDIA/nccl#829), so each runs on a thread of its own under kTeardownLimit; past that it
// is left to finish there, and a communicator whose revoke hung is not aborted under it. The
// error is raised on the host at the next call into the communicator and when the engine reads
// the step scalars.
//
// Note [NCCL setup allowance]
// Creating the communicator, and each collective of a size not yet completed (NCCL connects to
// peers lazily, at the first use of an algorithm and protocol), can take far longer than a step,
// most of all with several ranks on one time-sliced GPU. Those get max(timeout, kSetupAllowance)
// instead of the collective deadline. Setup runs on a thread of its own, so the constructor can
// give up on it at that allowance or at a peer's posted failure.
class NcclComm final : public Communicator {
 public:
  NcclComm(const std::string& unique_id, int rank, int world_size, int device_index,
           const FaultOptions& options);
  // Lets collectives in flight finish and destroys the communicator, or aborts it if it failed or
  // did not drain; each within kTeardownLimit, so it never blocks for long.
  ~NcclComm() override;
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  void synchronize_through(uint64_t seq) override;

 protected:
  void launch(const at::Tensor& tensor, const Collective& collective) override;

 private:
  struct InFlight {
    Collective collective;
    cudaEvent_t done = nullptr;  // null while the host is still in NCCL's call
  };

  // The communicator, made on a thread of its own: Note [NCCL setup allowance].
  ncclComm_t create(const std::string& unique_id);
  // Orders the communicator's stream after the caller's and keeps `tensor`'s memory from being
  // reused by the caching allocator until the collective is done.
  void enter(const at::Tensor& tensor);
  cudaEvent_t take_event();  // a spare completion event, or a new one
  std::optional<std::string> poll();  // on the fault monitor's thread
  void abort();                       // on the fault monitor's thread, or the destructor's
  // Finalizes and destroys `comm` (an abort if finalizing fails), or aborts it, within kTeardownLimit.
  void tear_down_within_limit(ncclComm_t comm, bool destroy) const;
  bool drain();                       // waits (bounded) for the stream; whether it emptied

  static constexpr std::chrono::seconds kSetupAllowance{120};
  static constexpr std::chrono::seconds kTeardownLimit{10};
  // How long an abort on NCCL without ncclCommRevoke waits for a call in progress to return.
  static constexpr std::chrono::milliseconds kEnqueueGrace{1000};

  int device_index_;
  std::chrono::milliseconds setup_allowance_;
  OwnStream stream_;
  StreamEvent enter_event_;
  ncclComm_t comm_ = nullptr;
  // The gate between NCCL calls and the abort: no call starts once aborted_ is set, and the
  // abort knows whether one is in progress. Taken before mutex_ where both are.
  std::mutex call_mutex_;
  std::condition_variable calls_changed_;
  int calls_in_progress_ = 0;
  std::atomic<bool> aborted_{false};
  std::mutex mutex_;  // guards the members below against the monitor's thread; never held in NCCL
  std::deque<InFlight> in_flight_;
  std::vector<cudaEvent_t> spare_events_;
  std::set<std::pair<int64_t, int>> completed_sizes_;  // (numel, dtype) of collectives completed
};

}  // namespace hsync
