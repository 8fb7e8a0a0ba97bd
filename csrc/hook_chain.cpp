#include "hook_chain.h"

#include "checks.h"

namespace hsync {

HookChain::HookChain(std::shared_ptr<Communicator> comm, std::shared_ptr<c10d::CommHookInterface> hook)
    : comm_(std::move(comm)), hook_(std::move(hook)) {
  HSYNC_CHECK(comm_ != nullptr && hook_ != nullptr, "a hook chain needs a communicator and a hook");
}

void HookChain::set_buckets(std::vector<HookedBucket> buckets) {
  const std::lock_guard<std::mutex> lock(mutex_);
  HSYNC_ASSERT(!running_ && queue_.empty(), "the hooked buckets changed during a step");
  buckets_ = std::move(buckets);
  launched_.assign(buckets_.size(), Launched{});
}

void HookChain::submit(size_t index) {
  {
    const std::lock_guard<std::mutex> lock(mutex_);
    HSYNC_ASSERT(index < buckets_.size(), "bucket ", index, " submitted to a chain of ", buckets_.size());
    queue_.push_back(index);
    if (running_) return;  // the thread running the chain takes it
    running_ = true;
  }
  run();
}

void HookChain::run() {
  for (;;) {
    size_t index = 0;
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      if (abandoned_ || error_ || queue_.empty()) {
        queue_.clear();
        running_ = false;
        idle_.notify_all();
        return;
      }
      index = queue_.front();
      queue_.pop_front();
      progress_ = Clock::now();
      in_progress_ = index;
    }
    try {
      launch(index);
      const std::lock_guard<std::mutex> lock(mutex_);
      in_progress_seq_ = launched_[index].seq;
    } catch (...) {  // a failed collective: nothing after it can line up across ranks
      const std::lock_guard<std::mutex> lock(mutex_);
      error_ = std::current_exception();
      queue_.clear();
      running_ = false;
      idle_.notify_all();
      return;
    }
    const auto& future = launched_[index].result;
    if (!future->completed()) {
      // The thread that completes it goes on; if that happened meanwhile, this call runs the rest now.
      {
        const std::lock_guard<std::mutex> lock(holders_->mutex);
        ++holders_->count;
      }
      future->addCallback([self = shared_from_this(), holders = holders_](c10::ivalue::Future&) mutable {
        self->run();
        self.reset();  // before wait() may return: Note [Hook order]
        const std::lock_guard<std::mutex> lock(holders->mutex);
        --holders->count;
        holders->released.notify_all();
      });
      return;
    }
  }
}

void HookChain::launch(size_t index) {
  const HookedBucket& bucket = buckets_[index];
  Launched& launched = launched_[index];
  launched.seq = comm_->all_reduce_sum(bucket.tail, Purpose::kBucket, static_cast<int64_t>(index));
  std::vector<c10::IntArrayRef> sizes;
  for (const at::Tensor& param : bucket.params) sizes.push_back(param.sizes());
  c10d::GradBucket grad_bucket(index, buckets_.size(), bucket.values, bucket.offsets, bucket.lengths,
                               std::move(sizes), bucket.params, std::nullopt);
  try {
    launched.result = hook_->runHook(grad_bucket);
  } catch (...) {
    // The hook raised: its bucket fails (the engine says so), and the chain goes on, as on every rank.
    launched.result = c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get());
    launched.result->setError(std::current_exception());
  }
}

void HookChain::wait() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (running_) {
    // Waiting beyond the flags of the hook in progress, as posted for the peers: those stuck there with this
    // rank post the same, a frozen one does not (Note [Naming the lost rank]).
    const size_t index = in_progress_;
    const uint64_t seq = in_progress_seq_;
    const Clock::time_point since = progress_;
    const Clock::time_point deadline = since + comm_->timeout();
    const auto waiting = comm_->waiting_since(since, seq);
    while (running_ && in_progress_ == index && in_progress_seq_ == seq) {
      if (Clock::now() >= deadline) {
        lock.unlock();
        comm_->fail("the communication hook of bucket " + std::to_string(index) + " did not complete within the " +
                    seconds(comm_->timeout()) + " deadline: a peer is stopped, hung, or far slower than this "
                    "rank, or the hook's collectives differ across ranks" + comm_->peers_not_there(seq));
      }
      const std::string exited = comm_->exited_peer("the communication hook of bucket " + std::to_string(index), since);
      if (!exited.empty()) {
        lock.unlock();
        comm_->fail(exited);
      }
      lock.unlock();
      comm_->check();
      lock.lock();
      idle_.wait_for(lock, std::min<Clock::duration>(FaultMonitor::kPollInterval, deadline - Clock::now()));
    }
  }
  const std::exception_ptr error = error_;
  lock.unlock();
  {
    // The chain ended in a callback, which lets go of the chain just after: microseconds.
    std::unique_lock<std::mutex> held(holders_->mutex);
    holders_->released.wait(held, [&] { return holders_->count == 0; });
  }
  if (error) std::rethrow_exception(error);
}

void HookChain::abandon() {
  const std::lock_guard<std::mutex> lock(mutex_);
  abandoned_ = true;
}

}  // namespace hsync
