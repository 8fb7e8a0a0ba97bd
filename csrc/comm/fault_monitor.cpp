#include "comm/fault_monitor.h"

#include <c10/util/Exception.h>

#include <cstdio>

namespace hsync {

std::string Collective::describe() const {
  std::string what;
  switch (purpose) {
    case Purpose::kStepScalars: what = "the step scalars"; break;
    case Purpose::kBucket: what = "bucket " + std::to_string(index); break;
    case Purpose::kBucketOrder: what = "the bucket order"; break;
    case Purpose::kBroadcast: what = "parameters and buffers"; break;
    case Purpose::kFingerprint: what = "the debug fingerprints of collective #" + std::to_string(seq); break;
  }
  const std::string from = root >= 0 ? " from rank " + std::to_string(root) : "";
  return std::string(root >= 0 ? "broadcast" : "all-reduce") + " #" + std::to_string(seq) + " of " + what +
         from + " (" + std::to_string(numel) + " x " + c10::toString(dtype) + ")";
}

std::string seconds(Clock::duration elapsed) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.2f s", std::chrono::duration<double>(elapsed).count());
  return text;
}

struct FaultMonitor::State {
  std::mutex mutex;
  std::condition_variable wake;     // stop, or a failure to post
  std::condition_variable changed;   // done or in_hook changed
  bool stop = false;
  bool done = false;                // the thread has returned
  bool in_hook = false;             // the thread is running the communicator's poll or abort
  std::optional<std::string> failure;
  bool failure_is_peers = false;
  bool posted = false;
  bool aborted = false;
  std::function<std::optional<std::string>()> poll;
  std::function<void()> abort;
  c10::intrusive_ptr<c10d::Store> store;
  std::string key;
  std::string prefix;                // "hsync: rank R (backend): "
  std::atomic<int> waiting{0};       // collectives being waited for, see add_waiting
};

namespace {

void post(c10d::Store& store, const std::string& key, const std::string& message) {
  try {
    // First failure wins: an empty expected value sets the key only if it is absent.
    store.compareSet(key, {}, std::vector<uint8_t>(message.begin(), message.end()));
  } catch (const std::exception&) {
    // The store is gone (its host died): peers rely on their own deadline.
  }
}

}  // namespace

// The monitor's thread. It holds its own reference to the state, so it may outlive the monitor.
void FaultMonitor::watch(const std::shared_ptr<State>& s) {
  auto next_store_poll = Clock::now();
  std::unique_lock<std::mutex> lock(s->mutex);
  // Posts this rank's own failure once, without holding the lock during the store call.
  const auto post_own_failure = [&](const c10::intrusive_ptr<c10d::Store>& store) {
    if (!store || !s->failure || s->failure_is_peers || s->posted) return false;
    s->posted = true;
    const std::string message = *s->failure;
    lock.unlock();
    post(*store, s->key, message);
    lock.lock();
    return true;
  };
  while (!s->stop) {
    s->wake.wait_for(lock, FaultMonitor::kPollInterval);
    if (s->stop) break;
    if (s->poll && !s->failure) {
      s->in_hook = true;
      auto poll = s->poll;
      lock.unlock();
      std::optional<std::string> seen = poll();
      lock.lock();
      s->in_hook = false;
      s->changed.notify_all();
      if (seen && !s->failure) s->failure = s->prefix + *seen;
    }
    if (s->failure && !s->aborted && s->abort) {
      s->aborted = true;
      s->in_hook = true;
      auto abort = s->abort;
      lock.unlock();
      abort();
      lock.lock();
      s->in_hook = false;
      s->changed.notify_all();
    }
    // A copy: the destructor may drop the state's reference while a store call runs.
    const c10::intrusive_ptr<c10d::Store> store = s->store;
    if (!store || post_own_failure(store)) continue;
    if (!s->failure && s->waiting.load() > 0 && Clock::now() >= next_store_poll) {
      next_store_poll = Clock::now() + FaultMonitor::kStorePollInterval;
      lock.unlock();
      std::optional<std::string> peer;
      try {
        if (store->check({s->key})) {
          const std::vector<uint8_t> value = store->get(s->key);
          peer = std::string(value.begin(), value.end());
        }
      } catch (const std::exception&) {
        // The store's host ended or died. At the end of a run that is normal, so it is no
        // failure by itself; a collective that needs the dead rank fails on its own.
        lock.lock();
        s->store.reset();
        continue;
      }
      lock.lock();
      if (peer && !s->failure) {
        s->failure = std::move(peer);
        s->failure_is_peers = true;
      }
    }
  }
  post_own_failure(s->store);  // a failure recorded just before the monitor was destroyed
  s->done = true;
  s->changed.notify_all();
}

FaultMonitor::FaultMonitor(c10::intrusive_ptr<c10d::Store> store, std::string key, int rank,
                           std::string backend, std::chrono::milliseconds timeout)
    : state_(std::make_shared<State>()),
      timeout_(timeout) {
  TORCH_CHECK(timeout.count() > 0, "hsync: the collective timeout must be positive, got ", timeout.count(), " ms");
  state_->store = std::move(store);
  state_->key = std::move(key);
  state_->prefix = "hsync: rank " + std::to_string(rank) + " (" + backend + "): ";
  thread_ = std::thread(watch, state_);
}

FaultMonitor::~FaultMonitor() {
  std::unique_lock<std::mutex> lock(state_->mutex);
  state_->stop = true;
  state_->wake.notify_all();
  // A thread inside a store call whose host is frozen may not return for minutes: leave it
  // behind (it holds its own reference to the state), but never while it runs our hooks.
  state_->changed.wait_for(lock, std::chrono::seconds(2), [&] { return state_->done; });
  state_->changed.wait(lock, [&] { return state_->done || !state_->in_hook; });
  state_->poll = nullptr;
  state_->abort = nullptr;
  state_->store.reset();
  const bool done = state_->done;
  lock.unlock();
  if (done) {
    thread_.join();
  } else {
    thread_.detach();
  }
}

void FaultMonitor::set_hooks(std::function<std::optional<std::string>()> poll, std::function<void()> abort) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->poll = std::move(poll);
  state_->abort = std::move(abort);
}

void FaultMonitor::clear_hooks() {
  std::unique_lock<std::mutex> lock(state_->mutex);
  state_->changed.wait(lock, [&] { return !state_->in_hook; });
  state_->poll = nullptr;
  state_->abort = nullptr;
}

void FaultMonitor::fail(const std::string& what) {
  const std::string message = state_->prefix + what;
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    if (!state_->failure) {
      state_->failure = message;
      state_->wake.notify_all();  // the thread posts it and aborts the communicator
    }
  }
  TORCH_CHECK(false, message);
}

void FaultMonitor::add_waiting(int count) { state_->waiting.fetch_add(count); }

bool FaultMonitor::failed() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->failure.has_value();
}

void FaultMonitor::check(const Collective* waiting_for) const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  if (!state_->failure) return;
  if (!state_->failure_is_peers) {
    TORCH_CHECK(false, *state_->failure);
  }
  const std::string waiting =
      waiting_for ? "stopped waiting for " + waiting_for->describe() + " after " +
                        seconds(Clock::now() - waiting_for->issued) + ": "
                  : "stopped: ";
  TORCH_CHECK(false, state_->prefix, waiting, "a peer failed first. ", *state_->failure);
}

}  // namespace hsync
