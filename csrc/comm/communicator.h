// The communicator interface the engine talks to. One implementation per backend, in its own file
// (as in Horovod's horovod/common/ops): the engine itself never names gloo or NCCL.
//
// Every collective gets a sequence number and a deadline; a failure (a peer died or froze, a
// backend error) is raised on this rank and posted to its peers, see Note [Failing fast]. After
// a failure the communicator refuses further collectives: the ranks' collective streams no
// longer line up.
//
// Note [Collective fingerprints]
// In debug mode (HSYNC_DEBUG_COLLECTIVES=1) each collective is preceded by an all-reduce of
// every rank's fingerprint of it (sequence, kind, purpose, bucket, size, dtype), each rank in its
// own row. The fingerprint has the same size on every rank, so ranks that are about to issue
// different collectives get "collective mismatch" naming both sides, instead of a hang or a
// silently wrong sum. It costs a host synchronisation per collective: debugging only.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <memory>
#include <string>

#include "busy_clock.h"
#include "comm/fault_monitor.h"

namespace hsync {

// How a communicator detects and reports failures.
struct FaultOptions {
  c10::intrusive_ptr<c10d::Store> store;  // the failure board; may be null
  std::string key;                        // the board's key, unique to this communicator and run
  std::chrono::milliseconds timeout{300'000};
  bool debug = false;                     // Note [Collective fingerprints]
};

class Communicator {
 public:
  Communicator(int rank, int world_size, std::string backend, const FaultOptions& options);
  virtual ~Communicator() = default;

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  const std::string& backend() const { return backend_; }
  std::chrono::milliseconds timeout() const { return monitor_->timeout(); }

  // Enqueues an in-place SUM all-reduce of `tensor` and returns its sequence number. Returns at
  // once; collectives run in the order they were issued, overlapping the caller's work. `tensor`
  // must stay untouched until a synchronize covers it. `index` is the bucket, for Purpose::kBucket.
  // `label` names a kHost collective in errors.
  uint64_t all_reduce_sum(const at::Tensor& tensor, Purpose purpose, int64_t index = -1, std::string label = {});

  // Enqueues an in-place broadcast of `tensor` from `root`; `label` names what it carries in errors.
  void broadcast(const at::Tensor& tensor, int root, Purpose purpose, std::string label = {});

  // Enqueues an in-place SUM reduce of `tensor` to `root` and returns its sequence number; on the other
  // ranks `tensor` is undefined afterwards (a backend may use it as scratch).
  uint64_t reduce_sum(const at::Tensor& tensor, int root, Purpose purpose, int64_t index = -1);

  // Orders the caller after the collective numbered `seq` and every one issued before it: blocks
  // the calling thread on CPU, makes the current CUDA stream wait on GPU (no host
  // synchronisation). Later collectives go on meanwhile. Throws a failure.
  virtual void synchronize_through(uint64_t seq) = 0;

  // Orders the caller after every collective issued so far.
  void synchronize();

  // Throws if a collective of this communicator failed here or on a peer.
  void check() const { monitor_->check(); }

  // Records `why` (a failure outside this communicator) as this rank's, posts it to the peers and
  // refuses further collectives, as after a failed one; does not throw.
  void give_up(const std::string& why);

  // The same for a wait of the caller's own that ran out (Note [Hook order]); throws it.
  [[noreturn]] void fail(const std::string& why) { monitor_->fail(why); }

  // Marks this rank waiting for its peers since `since`, for the scope's life, so that a failure a
  // peer posts ends the wait (check() throws it) as it ends a wait for a collective; `seq` is the
  // collective it waits beyond, posted for peers_not_there (Note [Naming the lost rank]).
  WaitingScope waiting_since(Clock::time_point since, uint64_t seq = 0) {
    return WaitingScope(*monitor_, since, seq);
  }

  // "; rank 1 has not reached it", naming the peers not seen waiting beyond collective `seq`: for a
  // wait of the caller's own that ran out. Note [Naming the lost rank].
  std::string peers_not_there(uint64_t seq) const { return monitor_->peers_not_there(seq); }

  // Why a wait of the caller's own begun at `since` cannot complete, where a peer on this host has
  // exited; empty otherwise. Note [A dead peer with open connections].
  std::string exited_peer(const std::string& waiting_for, Clock::time_point since) const {
    return monitor_->exited_peer(waiting_for, since);
  }

  // Brackets the host's waits inside this communicator (debug mode's fingerprint exchanges) as waits
  // for peers on `clock` (Note [Busy time]); nullptr detaches it. `clock` must stay alive until detached.
  void bracket_waits_on(BusyClock* clock) { clock_ = clock; }

 protected:
  // Issues `collective` on `tensor`.
  virtual void launch(const at::Tensor& tensor, const Collective& collective) = 0;

  FaultMonitor& monitor() { return *monitor_; }

 private:
  uint64_t issue(const at::Tensor& tensor, Op op, int root, Purpose purpose, int64_t index, std::string label);
  void verify_fingerprint(const at::Tensor& tensor, const Collective& collective);

  int rank_;
  int world_size_;
  std::string backend_;
  bool debug_;
  BusyClock* clock_ = nullptr;
  uint64_t next_seq_ = 1;  // from 1: 0 stands for no collective (FaultMonitor::set_waiting_since)
  std::unique_ptr<FaultMonitor> monitor_;
};

}  // namespace hsync
