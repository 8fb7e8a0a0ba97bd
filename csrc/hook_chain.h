// The buckets of a step that go through a communication hook of the user's, one after another.
//
// Note [Hook order]
// A hook issues collectives of its own on the user's process group, and some issue more from the
// callbacks of their futures, on whichever thread completes the future (PowerSGD all-reduces its
// P matrices when the all-reduce before them completes: on gloo, one of gloo's threads). Called as
// soon as each bucket is complete, as DDP does, the hooks of two buckets and hsync's flag
// all-reduces would reach the group in an order set by the threads' timing, different on each
// rank: on gloo "Received data size doesn't match expected size" and an abort, on NCCL a hang or
// a sum of the wrong tensors. So the hooked buckets of a step form one chain: bucket b's flags are
// all-reduced and its hook is called only once the future of bucket b-1's hook has completed, on
// the thread that completed it. Every rank then issues the same collectives in the same order,
// whatever the threads' timing. Backward still overlaps the chain. On NCCL a hook's future
// completes as soon as its work is queued on the device, so the chain runs on the thread that
// submits each bucket, and the device still overlaps the buckets' collectives with each other.
// The chain owns what it touches (it may outlive the engine through a future's callback), and a
// wait for it has the communicator's deadline, counted from the start of the hook in progress.
// A step ends only once every callback of the chain has let go of it, so the chain (and the user's
// hook state, which may hold the last reference to a process group) is never released on the
// thread that completed a future: a gloo process group ends by joining its own threads, and
// joining the thread it runs on aborts the process ("Resource deadlock avoided").
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/comm.hpp>

#include <condition_variable>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <vector>

#include "comm/communicator.h"

namespace hsync {

// What a hook sees of one bucket, and hsync's part of it.
struct HookedBucket {
  at::Tensor values;              // every gradient of the bucket, flat: what the hook reduces
  at::Tensor tail;                // the non-finite and used flags: all-reduced by hsync itself
  std::vector<size_t> offsets;    // each gradient's place in `values`
  std::vector<size_t> lengths;
  std::vector<at::Tensor> params;
};

class HookChain : public std::enable_shared_from_this<HookChain> {
 public:
  HookChain(std::shared_ptr<Communicator> comm, std::shared_ptr<c10d::CommHookInterface> hook);

  // The buckets, in launch order; between steps only.
  void set_buckets(std::vector<HookedBucket> buckets);

  // Bucket `index` is complete: its flags and hook run now, or after the hooks submitted before it.
  // Buckets are submitted in launch order, each once per step.
  void submit(size_t index);

  // Waits until every submitted bucket's hook has completed, under the communicator's deadline;
  // throws a failure of the chain's collectives. Afterwards seq() and result() are the step's.
  void wait();

  // The sequence number of bucket `index`'s flag all-reduce, and its hook's future, in this step.
  uint64_t seq(size_t index) const { return launched_[index].seq; }
  const c10::intrusive_ptr<c10::ivalue::Future>& result(size_t index) const { return launched_[index].result; }

  // Values written back from a hook's result, as DDP's reducer parses them.
  at::Tensor parse(const c10::IValue& value) const { return hook_->parseHookResult(value); }

  // The engine is gone: a hook's callback still to come runs nothing more.
  void abandon();

 private:
  struct Launched {
    uint64_t seq = 0;
    c10::intrusive_ptr<c10::ivalue::Future> result;
  };

  // The callbacks that hold the chain; apart from it, so that one can say it let go after it did.
  struct Holders {
    std::mutex mutex;
    std::condition_variable released;
    int count = 0;
  };

  void run();  // launches queued buckets until one's hook is still running; on any thread
  void launch(size_t index);

  std::shared_ptr<Communicator> comm_;
  std::shared_ptr<c10d::CommHookInterface> hook_;
  std::vector<HookedBucket> buckets_;
  std::vector<Launched> launched_;

  std::mutex mutex_;
  std::condition_variable idle_;
  std::deque<size_t> queue_;       // submitted, not launched yet
  bool running_ = false;           // a thread is launching, or a hook's future is outstanding
  bool abandoned_ = false;
  Clock::time_point progress_;     // when the hook in progress was called
  size_t in_progress_ = 0;         // its bucket
  uint64_t in_progress_seq_ = 0;   // its flags' all-reduce, once issued
  std::exception_ptr error_;       // what stopped the chain
  std::shared_ptr<Holders> holders_ = std::make_shared<Holders>();
};

}  // namespace hsync
