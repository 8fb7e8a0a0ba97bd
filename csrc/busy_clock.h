// A rank's own time for a step, without the time it waited for its peers.
//
// Note [Busy time]
// The balancer plans from each rank's own time for a step (StepStats.busy_seconds): from the end
// of its previous weighted step to the end of its own work in this one, less the time it waited
// for its peers in between: for the root's buffers in a forward (Engine::broadcast_coalesced),
// for the step's total weight before a gradient can be packed (Engine::resolve_pack_scale, Note
// [Weighted reduction]), for Join's exchange in a forward (hsync/ddp.py), for every rank's
// fingerprint of a collective in debug mode (Note [Collective fingerprints]). Counted as work, such a
// wait makes a fast rank look as slow as the slow rank it waits for, and the fitted costs drift
// toward an equal split.
// One definition on every device: the interval and each wait are measured on the timeline where
// the rank's work runs. On the CPU a wait blocks the host, and both are readings of the host's
// clock. On a GPU the host only queues a wait (the stream waits for an event of the
// communicator's) and runs ahead, so the host's clock sees nothing of it: the interval is two
// CUDA events on the current stream, and each wait is bracketed by two more, recorded just before
// and just after it. The stream's time between those two is the time it stood idle for the peers
// (or for the host, when the host itself blocked in between), so busy = interval - waits holds
// there as on the CPU. Reading it waits for the interval's end on the device.
//
// Note [A host that blocks]
// On a GPU, busy = interval - waits also counts the stream's idle time while the host is blocked,
// which is right when the host is busy (a launch-bound step is the host's work) and wrong when it
// waits for a peer. The host never waits for a peer in hsync's own code, but a CUDA call may
// synchronise the whole context (every stream of this process, the communicator's too): the first
// launch of a kernel under lazy module loading (CUDA's default since 12.2), a cudaFree. Made while
// a collective waits for a slower peer, such a call holds the host until the peer arrives; the
// stream runs dry, and if its bracketed wait for that collective is not queued yet, the idle time
// falls outside every bracket and the peer's time counts as this rank's work. This explains the
// first measured step with gradients as bucket views on an H200 (419-429 ms with the peer sleeping
// 400 ms before its backward, 0.2 ms in later steps; other cases 13-27 ms): the step scalars'
// all-reduce was issued as the backward began, and the first gradient, accumulated into its bucket
// view by autograd's in-place add (a kernel that step launched for the first time: in the step
// before, .grad was None), came before the first gradient's hook bracketed the wait for the
// scalars. So on a GPU the scalars' all-reduce is issued at the first gradient, just before the
// stream's bracketed wait for it: the host launches nothing in between. The cost is the small
// all-reduce's latency in the stream, no longer hidden behind the backward's first layers.
// Collectives that overlap work by design are still in flight while the host queues that work (a
// bucket's all-reduce during the backward, hsync.ShardedOptimizer's broadcasts during the next
// forward): a kernel first launched then (a new shape's GEMM after the Balancer's plan changes the
// micro-batch) can still count a slower peer's time, once. CUDA_MODULE_LOADING=EAGER removes that
// too, at the cost of loading every kernel at start.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Event.h>

#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

namespace hsync {

// An instant on the timeline where a device's work runs: the host's clock on the CPU, a CUDA event
// on the current stream on a GPU.
class Instant {
 public:
  static Instant now(at::Device device);
  // Seconds from `earlier` to this instant; on a GPU this waits for the device to reach it.
  double seconds_since(const Instant& earlier) const;

 private:
  std::chrono::steady_clock::time_point host_;
  std::shared_ptr<c10::Event> event_;  // null on the CPU
};

// A finished interval of a rank's work: its length and the waits for peers inside it.
class BusyInterval {
 public:
  BusyInterval(Instant start, Instant end, std::vector<std::pair<Instant, Instant>> waits);
  // The interval's seconds less its waits': Note [Busy time].
  double seconds() const;

 private:
  Instant start_;
  Instant end_;
  std::vector<std::pair<Instant, Instant>> waits_;
};

// Measures intervals of a rank's work on one device, and the waits for peers inside them.
class BusyClock {
 public:
  explicit BusyClock(at::Device device) : device_(device) {}

  // Starts a new interval (the end of a weighted step), forgetting the last one's waits.
  void start();
  // Ends the running interval; none if none was started. Waits after this are not counted.
  std::optional<BusyInterval> stop();
  // The running interval's seconds so far less its waits', without ending it; none if none is
  // running. On a GPU this waits for the device to reach the present.
  std::optional<double> seconds_so_far();

  // Brackets a wait for peers; waits nested in one are part of it. Outside an interval, nothing.
  void begin_wait();
  void end_wait();

 private:
  at::Device device_;
  std::mutex mutex_;  // waits may be bracketed on autograd's threads
  std::optional<Instant> start_;
  std::optional<Instant> wait_begun_;
  int wait_depth_ = 0;
  std::vector<std::pair<Instant, Instant>> waits_;
};

// A wait for peers, bracketed for the clock's running interval while it lives.
class PeerWait {
 public:
  explicit PeerWait(BusyClock& clock) : clock_(clock) { clock_.begin_wait(); }
  // Runs while an error unwinds the stack too (a CUDA error in the wait): one from reading the time then would
  // end the process, so the clock loses this wait instead (end_wait leaves it whole) and the first error is raised.
  ~PeerWait() {
    try {
      clock_.end_wait();
    } catch (...) {  // NOLINT(bugprone-empty-catch): see above
    }
  }
  PeerWait(const PeerWait&) = delete;
  PeerWait& operator=(const PeerWait&) = delete;

 private:
  BusyClock& clock_;
};

}  // namespace hsync
