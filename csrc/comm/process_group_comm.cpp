#include "comm/process_group_comm.h"

#include <algorithm>
#include <cctype>

#include "checks.h"

namespace hsync {
namespace {

const c10::intrusive_ptr<c10d::ProcessGroup>& checked(const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  HSYNC_CHECK(group, "process group is None (call torch.distributed.init_process_group first)");
  return group;
}

// The backend's message without the C++ backtrace that c10::Error carries.
std::string reason(const std::exception& error) {
  const auto* c10_error = dynamic_cast<const c10::Error*>(&error);
  std::string text = c10_error ? c10_error->what_without_backtrace() : error.what();
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
  return text;
}

// Gloo closes the connections of a collective that timed out, and every later collective on them
// fails at once with that reason: after one of hsync's past its deadline, or after a framework's
// own on the same group (which the framework may have swallowed: Lightning's SIGTERM broadcast).
bool timed_out(std::string why) {
  std::transform(why.begin(), why.end(), why.begin(), [](unsigned char c) { return std::tolower(c); });
  return why.find("timeout") != std::string::npos || why.find("timed out") != std::string::npos;
}

}  // namespace

ProcessGroupComm::ProcessGroupComm(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                   const FaultOptions& options)
    : Communicator(checked(group)->getRank(), group->getSize(), group->getBackendName(), options),
      group_(group) {}

c10::intrusive_ptr<c10d::ProcessGroup> ProcessGroupComm::group() const {
  auto group = group_.lock();
  HSYNC_CHECK(group, "the process group was destroyed (torch.distributed.destroy_process_group) while a "
              "WeightedDDP model still uses it");
  return group;
}

void ProcessGroupComm::launch(const at::Tensor& tensor, const Collective& collective) {
  std::vector<at::Tensor> tensors{tensor};
  c10::intrusive_ptr<c10d::Work> work;
  switch (collective.op) {
    case Op::kAllReduce: {
      c10d::AllreduceOptions options;
      options.reduceOp = c10d::ReduceOp::SUM;
      options.timeout = timeout() + kBackendGrace;
      work = group()->allreduce(tensors, options);
      break;
    }
    case Op::kBroadcast: {
      c10d::BroadcastOptions options;
      options.rootRank = collective.root;
      options.timeout = timeout() + kBackendGrace;
      work = group()->broadcast(tensors, options);
      break;
    }
    case Op::kReduce: {
      c10d::ReduceOptions options;
      options.reduceOp = c10d::ReduceOp::SUM;
      options.rootRank = collective.root;
      options.timeout = timeout() + kBackendGrace;
      work = group()->reduce(tensors, options);
      break;
    }
  }
  auto future = work->getFuture();
  future->addCallback([completion = completion_](c10::ivalue::Future&) {
    const std::lock_guard<std::mutex> lock(completion->mutex);
    completion->done.notify_all();
  });
  // Collectives done without error let go of their tensors now rather than when waited for: a bucket
  // released once sent (Note [Owned buckets]) is freed as its reduce ends, not at the end of the step.
  const auto done = std::find_if(pending_.begin(), pending_.end(), [](const Pending& p) {
    return !p.future->completed() || p.future->hasError();
  });
  pending_.erase(pending_.begin(), done);
  pending_.push_back({std::move(work), std::move(future), collective});
}

void ProcessGroupComm::synchronize_through(uint64_t seq) {
  // Take them off the list first: after a failure nothing must be waited on again.
  const auto later = std::find_if(pending_.begin(), pending_.end(),
                                  [seq](const Pending& p) { return p.collective.seq > seq; });
  std::vector<Pending> due(std::make_move_iterator(pending_.begin()), std::make_move_iterator(later));
  pending_.erase(pending_.begin(), later);
  try {
    monitor().check();
    for (const Pending& p : due) wait(p);
  } catch (...) {
    // The later collectives (a step's buckets, issued after its scalars) will never be waited on, and
    // their works hold the backend's connections: a survivor that destroys the group and goes on must
    // close them now, as a peer still waiting on this rank learns of the failure no sooner.
    // Note [Failing fast]. The backend keeps a work it still runs.
    pending_.clear();
    throw;
  }
}

void ProcessGroupComm::wait(const Pending& p) {
  const Clock::time_point deadline = p.collective.issued + timeout();
  if (!p.future->completed()) {
    const WaitingScope waiting(monitor(), p.collective.issued, p.collective.seq, &p.collective);
    std::unique_lock<std::mutex> lock(completion_->mutex);
    // The future, not the work: gloo runs the future's callbacks before it marks the work completed.
    while (!p.future->completed()) {
      monitor().check(&p.collective);
      const Clock::time_point now = Clock::now();
      if (now >= deadline) {
        lock.unlock();
        monitor().fail(p.collective.describe() + " did not complete within the " + seconds(timeout()) +
                       " deadline: a peer is stopped, hung, or far slower than this rank" +
                       monitor().peers_not_there(p.collective.seq, &p.collective) +
                       ". If steps legitimately differ this much, raise WeightedDDP(timeout=...) or HSYNC_TIMEOUT");
      }
      const std::string exited = monitor().exited_peer(p.collective.describe(), p.collective.issued);
      if (!exited.empty()) {
        lock.unlock();
        monitor().fail(exited);
      }
      completion_->done.wait_for(lock, std::min<Clock::duration>(FaultMonitor::kPollInterval, deadline - now));
    }
  }
  try {
    p.work->wait();
  } catch (const std::exception& error) {
    const std::string why = reason(error);
    monitor().fail(p.collective.describe() + " failed after " + seconds(Clock::now() - p.collective.issued) +
                   ": " + why +
                   (timed_out(why) ? ". A collective on this process group timed out: a peer is stopped or hung"
                                   : ". A peer probably exited (killed, crashed or out of memory)") +
                   monitor().peers_gone());
  }
}

}  // namespace hsync
