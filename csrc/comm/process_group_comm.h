// A communicator over a torch.distributed process group (gloo on CPU). The process group runs
// each collective on its own threads, so backward keeps computing while buckets are reduced.
//
// It holds the group weakly: torch.distributed owns it, and destroy_process_group() must be able
// to tear it down then. A group kept alive by us until interpreter exit is destroyed after its
// threads' runtime is gone, which aborts the process.
//
// Deadlines: gloo gets the collective timeout too, so a collective stuck on a frozen peer frees
// gloo's thread at the deadline and the process can exit; a synchronize waits on each collective
// until it completes, fails, passes its deadline or a peer posts a failure (Note [Failing fast]).
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <vector>

#include "comm/communicator.h"

namespace hsync {

// Gloo's own deadline comes a little after ours, so a stuck collective is reported as ours (with
// the collective's name) and gloo's thread is still freed right after. The integrations give a
// framework's own collectives on the group the same (hsync/integrations/_world.py).
constexpr std::chrono::milliseconds kBackendGrace{1000};

class ProcessGroupComm final : public Communicator {
 public:
  ProcessGroupComm(const c10::intrusive_ptr<c10d::ProcessGroup>& group, const FaultOptions& options);

  void synchronize_through(uint64_t seq) override;

 protected:
  void launch(const at::Tensor& tensor, const Collective& collective) override;

 private:
  struct Pending {
    c10::intrusive_ptr<c10d::Work> work;
    c10::intrusive_ptr<c10::ivalue::Future> future;  // completes (and notifies) before the work does
    Collective collective;
  };
  // Signalled by each work's future when it completes; shared because a callback may run after
  // the communicator is gone.
  struct Completion {
    std::mutex mutex;
    std::condition_variable done;
  };

  c10::intrusive_ptr<c10d::ProcessGroup> group() const;
  void wait(const Pending& pending);

  c10::weak_intrusive_ptr<c10d::ProcessGroup> group_;
  std::shared_ptr<Completion> completion_ = std::make_shared<Completion>();
  std::vector<Pending> pending_;
};

}  // namespace hsync
