// Failure detection shared by every communicator: the collective deadline, this rank's first
// failure, and a board in the torch.distributed store on which ranks post their failures.
//
// Note [Failing fast]
// A rank that sees a collective fail (a peer's socket closed, a deadline passed, an NCCL async
// error) records the failure here and posts it under a key of the store that torchrun (or
// init_process_group) already set up. A background thread polls that key, so peers waiting on a
// collective of their own stop within a poll interval instead of waiting out their deadline, and
// the error they raise names the rank that saw the failure first. The thread also runs the
// communicator's own poll (NCCL: completion and async errors) and its abort on failure. Store
// calls run off the training loop: a store whose host is frozen must not freeze it. The thread
// posts to the board and polls it from threads of its own (one visit at a time), so a frozen store
// stops neither its poll (on NCCL, the deadline itself) nor its abort; it costs the board alone.
//
// A rank that failed is out of the job, whichever communicator saw it: its failure (its own, or
// one a peer posted) spreads to every other communicator of the process (the engine's, each
// channel's, each group's), which posts it on its own board and aborts. So a peer waiting for this
// rank in another group, with a longer deadline, stops at once too, and the error names the rank
// that saw the failure first. Communicators built afterwards start clean: a trainer that regroups
// the survivors after a failure (DDP's _update_process_group, a new quorum) goes on over them.
//
// The board is read only once a wait is store_poll_after() old, and its store may die with the lost
// rank (torchft's quorum store lives in one replica). On gloo the connections tell sooner: a rank
// whose collective failed lets go of its later ones at once (their works hold gloo's connections),
// so a survivor that destroys the group to regroup closes them, and a peer still waiting on it there
// (in a ring, a rank that exchanges nothing with the lost one) fails at once. NCCL peers on P2P or
// shared-memory links see no such close, and neither do the peers of a rank whose forked children
// (DataLoader workers) keep its sockets open after it died: Note [A dead peer with open connections].
//
// Note [Naming the lost rank]
// A collective that fails says only that a connection closed or that time ran out; the rank it
// waited for is named from the store.
// - A frozen peer closes no socket. Each rank that has waited for a collective long enough to poll
//   the board posts which collective it waits for (its number on this communicator) under a key of
//   its own, and takes it back once that wait ends; at the deadline the survivor reads its peers' keys
//   and names those waiting for none: they are stopped, hung, or elsewhere. A peer waiting for a later
//   collective has passed this one, and one waiting for an earlier collective is stuck behind another
//   (where broadcasts from different roots follow each other, survivors wait at different ones): it is
//   named only where no peer waits for none. The polling starts at half the deadline (at
//   most kStorePollAfter), so survivors with this rank's deadline have posted by then; one with a
//   longer deadline posts later, so where several peers have not posted, the board is read again
//   until they have or kStorePollAfter has passed. A wait outside the communicator's
//   collectives (a user's communication hook, Note [Hook order]) posts the last collective it waits
//   beyond, which its peers stuck with it have completed too.
// - A peer that waits under the same number for another collective (a broadcast where this rank
//   all-reduces: a call made on some ranks only) is named with what it waits in. Each post carries
//   what its collective is, and the two are compared without their sizes.
// - A dead peer's sockets close at once, before anyone has waited. Each monitor posts its process
//   (host, PID namespace, PID) before its constructor returns, so before the communicator's first
//   collective (a peer may die right after it); a survivor whose collective failed looks up the
//   peers that share its host and PID namespace and names those whose process has exited (or is
//   stopped). A dead peer on another host stays unnamed: gloo's message gives its address.
//
// Note [A dead peer with open connections]
// A peer's death closes its connections only when every process holding them is gone: a rank's
// DataLoader workers (forked, so holding its sockets) outlive it by seconds, and NCCL's P2P and
// shared-memory links have no connection to close at all. No survivor then sees a failure to post,
// and all would wait out their deadline. So a rank that has waited store_poll_after() for a
// collective also looks at the processes of its peers on this host: one that has exited fails the
// collective at once, named. The monitor's thread reads which they are as soon as every peer has
// posted its own, not when a wait begins: the store's host may be the peer that dies (rank 0 under
// init_process_group's env:// or tcp://, torchft's quorum store in one replica), and its forked
// children then keep the store's connections open too, with nobody to answer on them. A stopped one is left to the deadline (a debugger or job control may resume it). A peer
// that exited once its own part was done (a reduce's sender) while this rank still waits on a
// third for seconds would be named too; a program whose ranks end alike never leaves one so.
//
// Note [Forked children]
// A process forked from a rank (a DataLoader worker) inherits the memory of every communicator but
// none of its threads, and a mutex a thread held at the fork stays locked there forever. Its copy
// of a dropped wrapper is destroyed by the child's garbage collector when a reference cycle is
// collected: that destructor must then touch neither the threads nor the locks nor the NCCL
// communicator, which are the parent's. It leaves them as they are (the child's copy of the memory
// is reclaimed when the child exits), and the parent's own copy tears down as always.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include <unistd.h>

namespace hsync {

using Clock = std::chrono::steady_clock;

// Where a monitor's failure came from.
enum class Origin : int {
  kOwn,      // one of this communicator's collectives failed, or its own poll saw a failure
  kPeer,     // a peer posted it on this communicator's board
  kSibling,  // another communicator of this process failed: Note [Failing fast]
};

// What a collective is for; named in errors and compared across ranks in debug mode.
enum class Purpose : int {
  kStepScalars = 1,
  kBucket = 2,
  kBucketOrder = 3,
  kBroadcast = 4,
  kFingerprint = 5,
  kHost = 6,  // a decision of hsync's Python side (hsync/collectives.py), named by its label
  kBucketFlags = 7,  // the owned buckets' flags, to every rank: Note [Owned buckets]
};

// What a collective does with the ranks' tensors (sums are SUM).
enum class Op : int {
  kAllReduce = 0,  // every rank gets the sum
  kBroadcast = 1,  // every rank gets the root's
  kReduce = 2,     // the root gets the sum; the others' tensors are left undefined
};

// One collective as issued by this rank.
struct Collective {
  uint64_t seq = 0;          // counts this communicator's collectives from 1, the same on every rank
  Op op = Op::kAllReduce;
  int root = -1;             // a broadcast's or a reduce's root
  Purpose purpose = Purpose::kBucket;
  int64_t index = -1;        // the bucket, for kBucket
  int64_t numel = 0;
  at::ScalarType dtype = at::kFloat;
  std::string label;         // what a kHost collective is for, or what a kBroadcast carries, as its
                             // caller names it; for a kFingerprint, the collective it precedes
  Clock::time_point issued;

  // For example "all-reduce #12 of bucket 3 (262144 x Float)".
  std::string describe() const;
  // The same without its size: what ranks compare to tell whether they wait in one collective.
  std::string describe_kind() const;
};

std::string seconds(Clock::duration elapsed);  // "2.31 s"

class FaultMonitor {
 public:
  // `store` may be null (no board: each rank relies on its own deadline). `key` must be unique to
  // one communicator of one run (the caller includes torchrun's restart count).
  FaultMonitor(c10::intrusive_ptr<c10d::Store> store, std::string key, int rank, int world_size,
               std::string backend, std::chrono::milliseconds timeout);
  // Stops the thread; a thread stuck in a frozen store is left behind rather than waited for.
  // Note [Forked children].
  ~FaultMonitor();
  FaultMonitor(const FaultMonitor&) = delete;
  FaultMonitor& operator=(const FaultMonitor&) = delete;

  std::chrono::milliseconds timeout() const { return timeout_; }

  // Whether this process is a fork of the one that built the monitor: Note [Forked children].
  bool in_forked_child() const { return getpid() != creator_; }

  // Records this rank's failure (the first one wins), posts it for the peers and throws it.
  [[noreturn]] void fail(const std::string& what);

  bool failed() const;

  // Since when this rank has waited for its oldest collective not yet complete (none: nothing is
  // awaited), and that collective's number (0: a wait for no one collective). The board is polled
  // only once that wait is store_poll_after() old (besides one read of the peers' processes as the
  // communicator starts): a healthy step never waits that long, so hundreds of ranks do not hammer
  // one store, and a rank that polls its peers' store while they exit can upset their teardown.
  // The first poll posts `seq`, and what `collective` is where given: Note [Naming the lost rank].
  void set_waiting_since(std::optional<Clock::time_point> since, uint64_t seq = 0,
                         const Collective* collective = nullptr);

  // For a collective past its deadline, "; rank 1 has not reached it" (or "ranks 1 and 3 have"),
  // naming the peers not seen waiting for the collective numbered `seq`, or "; rank 1 waits in
  // broadcast #7 ... instead" where a peer waits for another collective under that number (`mine`,
  // where given, is this rank's); empty where all were there, or the store does not answer within
  // seconds. Where several were not, it may wait up to kStorePollAfter for them to post. Note
  // [Naming the lost rank].
  std::string peers_not_there(uint64_t seq, const Collective* mine = nullptr) const;

  // For a collective that failed, "; rank 1 (process 4242, on this host) has exited" (or "is
  // stopped"), naming the peers on this host whose process has; empty where none has, or the store
  // does not answer within seconds. Note [Naming the lost rank].
  std::string peers_gone() const;

  // For a wait for `waiting_for` begun at `since`, once it is store_poll_after() old and a peer on this
  // host has exited, why it cannot complete: "<waiting_for> cannot complete after 2.00 s: a peer exited
  // (...) with its connections left open (...); rank 1 (process 4242, on this host) has exited"; empty
  // otherwise, and where the thread has not read yet which peers are on this host. Reads no store:
  // Note [A dead peer with open connections].
  std::string exited_peer(const std::string& waiting_for, Clock::time_point since) const;

  // Throws if this rank failed or a peer posted a failure; `waiting_for` names what was being waited on.
  void check(const Collective* waiting_for = nullptr) const;

  // Set once by the communicator, before the first collective: `poll` runs on the monitor's thread
  // every kPollInterval and returns what failed if it sees a failure; `abort` runs once on the
  // first failure, this rank's or a peer's, after this rank's own failure is posted (an abort may
  // take long). A hook that throws is reported as the failure: the thread never terminates the process.
  void set_hooks(std::function<std::optional<std::string>()> poll, std::function<void()> abort);
  // Removes them, waiting for a run in progress: the communicator's destructor calls it first.
  void clear_hooks();

  static constexpr std::chrono::milliseconds kPollInterval{50};
  static constexpr std::chrono::milliseconds kStorePollAfter{2000};
  static constexpr std::chrono::milliseconds kStorePollInterval{500};
  static constexpr std::chrono::milliseconds kExitShowsWithin{500};  // peers_gone's look at a killed peer
  std::chrono::milliseconds store_poll_after() const { return std::min(kStorePollAfter, timeout_ / 2); }

 private:
  // peers_not_there where the board cannot be read: the peers on this host that are stopped or have exited.
  std::string peers_without_a_board() const;

  struct State;  // shared with the thread, which may outlive the monitor (see the destructor)
  static void watch(const std::shared_ptr<State>& state);
  // Lists `state` among the process's monitors, which a failure spreads to.
  static void enroll(const std::shared_ptr<State>& state);
  // Fails every other monitor of the process that has not failed yet with `failure` (seen by `from`).
  static void spread(const State* from, const std::string& failure);
  // The board's store, or null (none, or its host is gone).
  c10::intrusive_ptr<c10d::Store> store_copy() const;

  std::shared_ptr<State> state_;
  std::chrono::milliseconds timeout_;
  pid_t creator_;
  std::thread thread_;
};

// Runs `work` on a thread of its own and waits for it at most `limit`, or until `give_up()` holds;
// returns whether it finished. Unfinished work is left running, so it must own what it touches:
// for calls that can hang (a store whose host froze, an NCCL abort). Never throws (what `work`
// throws is dropped); if no thread can be started, runs `work` here.
bool run_bounded(std::function<void()> work, Clock::duration limit, const std::function<bool()>& give_up = {});

// Marks the host waiting for a collective issued at `since`, numbered `seq` (0: for no one
// collective; FaultMonitor::set_waiting_since), for as long as it lives.
class WaitingScope {
 public:
  WaitingScope(FaultMonitor& monitor, Clock::time_point since, uint64_t seq = 0,
               const Collective* collective = nullptr)
      : monitor_(monitor) {
    monitor_.set_waiting_since(since, seq, collective);
  }
  ~WaitingScope() { monitor_.set_waiting_since(std::nullopt); }
  WaitingScope(const WaitingScope&) = delete;
  WaitingScope& operator=(const WaitingScope&) = delete;

 private:
  FaultMonitor& monitor_;
};

}  // namespace hsync
