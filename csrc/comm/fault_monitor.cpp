#include "comm/fault_monitor.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <system_error>
#include <vector>

namespace hsync {

std::string Collective::describe_kind() const {
  std::string what;
  switch (purpose) {
    case Purpose::kStepScalars: what = "the step scalars"; break;
    case Purpose::kBucket: what = "bucket " + std::to_string(index); break;
    case Purpose::kBucketOrder: what = "the bucket order"; break;
    case Purpose::kBroadcast: what = label.empty() ? "parameters and buffers" : label; break;
    case Purpose::kFingerprint: what = "the debug fingerprints of " + label; break;
    case Purpose::kHost:  // another rank's label is not sent
      what = label.empty() ? "a collective of hsync's Python side, named on its rank" : label;
      break;
    case Purpose::kBucketFlags: what = "the owned buckets' flags"; break;
  }
  const char* kind = op == Op::kBroadcast ? "broadcast" : op == Op::kReduce ? "reduce" : "all-reduce";
  std::string where;
  if (op == Op::kBroadcast) where = " from rank " + std::to_string(root);
  if (op == Op::kReduce) where = " to rank " + std::to_string(root);
  return std::string(kind) + " #" + std::to_string(seq) + " of " + what + where;
}

std::string Collective::describe() const {
  return describe_kind() + " (" + std::to_string(numel) + " x " + c10::toString(dtype) + ")";
}

std::string seconds(Clock::duration elapsed) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.2f s", std::chrono::duration<double>(elapsed).count());
  return text;
}

namespace {

// A peer on this host and in this PID namespace: Note [Naming the lost rank].
struct LocalPeer {
  int rank;
  std::string pid;
};

}  // namespace

struct FaultMonitor::State {
  std::mutex mutex;
  std::condition_variable wake;     // stop, or a failure to post
  std::condition_variable changed;   // done or in_hook changed
  bool stop = false;
  bool done = false;                // the thread has returned
  bool in_hook = false;             // the thread is running the communicator's poll or abort
  std::optional<std::string> failure;
  Origin origin = Origin::kOwn;
  bool posted = false;
  bool aborted = false;
  std::function<std::optional<std::string>()> poll;
  std::function<void()> abort;
  c10::intrusive_ptr<c10d::Store> store;
  std::string key;
  std::string prefix;                // "hsync: rank R (backend): "
  int rank = 0;
  int world_size = 1;
  std::string process;               // "host pid-namespace pid": Note [Naming the lost rank]
  // The peers on this host and in this PID namespace, once the thread has read them all from the
  // board: Note [A dead peer with open connections].
  std::optional<std::vector<LocalPeer>> local_peers;
  std::chrono::milliseconds store_poll_after{0};
  std::atomic<Clock::rep> waiting_since{kNotWaiting};  // see set_waiting_since
  std::atomic<uint64_t> waiting_seq{0};
  std::optional<Collective> waiting_for;  // what waiting_seq is, where the waiter said (under mutex)

  static constexpr Clock::rep kNotWaiting = 0;
};

namespace {

// A store call whose host froze can block for the store's own timeout (minutes): the abort that
// follows a post must not wait for it.
constexpr std::chrono::seconds kPostLimit{2};

// Whether a post replaces a value already there.
enum class Posting { kFirstWins, kReplace };

// Sets `key` to `value`, blocking as long as the store does. A store that is gone (its host died)
// takes nothing: peers rely on their own deadline, and a failure is reported without the name the
// post would have given.
void set_on_board(const c10::intrusive_ptr<c10d::Store>& store, const std::string& key, const std::string& value,
                  Posting posting) {
  const std::vector<uint8_t> data(value.begin(), value.end());
  try {
    if (posting == Posting::kFirstWins) {
      store->compareSet(key, {}, data);  // an empty expected value sets the key only if it is absent
    } else {
      store->set(key, data);
    }
  } catch (const std::exception&) {
    // The store is gone: nothing posted, as said above.
  }
}

// set_on_board within kPostLimit: a store whose host froze must not hold this rank up.
void post(const c10::intrusive_ptr<c10d::Store>& store, const std::string& key, const std::string& value,
          Posting posting) {
  run_bounded([store, key, value, posting] { set_on_board(store, key, value, posting); }, kPostLimit);
}

// Where `rank` posts what `what` names ("waiting": the collective it waits for; "process": which
// process it is): Note [Naming the lost rank].
std::string peer_key(const std::string& key, const char* what, int rank) {
  return key + "/" + what + "/" + std::to_string(rank);
}

std::vector<uint8_t> bytes(const std::string& text) { return std::vector<uint8_t>(text.begin(), text.end()); }

// Each peer's value under peer_key(key, what, peer), "" where it posted none (and for `rank`
// itself). Two requests where every peer has posted, whatever the world's size; throws what the
// store throws, and blocks as long as it does.
std::vector<std::string> peer_values(c10d::Store& store, const std::string& key, const char* what, int rank,
                                     int world_size) {
  std::vector<std::string> keys;
  for (int peer = 0; peer < world_size; ++peer) {
    if (peer != rank) keys.push_back(peer_key(key, what, peer));
  }
  std::vector<std::string> values(world_size);
  const auto put = [&values, rank](size_t index, const std::vector<uint8_t>& value) {
    values[static_cast<int>(index) < rank ? index : index + 1] = std::string(value.begin(), value.end());
  };
  if (store.check(keys)) {
    const std::vector<std::vector<uint8_t>> found = store.multiGet(keys);
    for (size_t i = 0; i < found.size(); ++i) put(i, found[i]);
    return values;
  }
  for (size_t i = 0; i < keys.size(); ++i) {
    if (store.check({keys[i]})) put(i, store.get(keys[i]));
  }
  return values;
}

// peer_values, or nothing if the store did not answer within kPostLimit. Bounded, and owning all it
// touches: a frozen store must not hold up the error being raised.
std::optional<std::vector<std::string>> read_peers(const c10::intrusive_ptr<c10d::Store>& store,
                                                   const std::string& key, const char* what, int rank,
                                                   int world_size) {
  struct Found {
    std::mutex mutex;
    std::optional<std::vector<std::string>> values;
  };
  auto found = std::make_shared<Found>();
  run_bounded(
      [found, store, key, what, rank, world_size] {
        std::vector<std::string> values = peer_values(*store, key, what, rank, world_size);
        const std::lock_guard<std::mutex> lock(found->mutex);
        found->values = std::move(values);
      },
      kPostLimit);
  const std::lock_guard<std::mutex> lock(found->mutex);
  return found->values;
}

// "host pid-namespace pid"; "" where the PID namespace cannot be read (no /proc): PIDs then name
// nothing that can be looked up.
std::string this_process() {
  char host[256] = {};
  char pid_namespace[64] = {};
  const ssize_t length = readlink("/proc/self/ns/pid", pid_namespace, sizeof(pid_namespace) - 1);
  if (gethostname(host, sizeof(host) - 1) != 0 || length <= 0) return {};
  return std::string(host) + " " + std::string(pid_namespace, length) + " " + std::to_string(getpid());
}

// The state letter of /proc/PID/stat ('R', 'S', 'T' stopped, 'Z' exited but not yet reaped...),
// 'X' for a process that is gone.
char process_state(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text;
  std::getline(stat, text);
  const size_t name_end = text.rfind(')');  // the name, in parentheses, may hold spaces
  if (name_end == std::string::npos || name_end + 2 >= text.size()) return 'X';
  return text[name_end + 2];
}

// The peers whose process (as posted: Note [Naming the lost rank]) shares this one's host and PID
// namespace, from each rank's post ("" where none, and for this rank).
std::vector<LocalPeer> local_peers_in(const std::vector<std::string>& processes, const std::string& me) {
  std::vector<LocalPeer> found;
  if (me.empty()) return found;
  const std::string place = me.substr(0, me.rfind(' ') + 1);  // "host pid-namespace "
  for (int peer = 0; peer < static_cast<int>(processes.size()); ++peer) {
    const std::string& process = processes[peer];
    if (process.size() <= place.size() || process.compare(0, place.size(), place) != 0) continue;
    const std::string pid = process.substr(place.size());
    if (pid.empty() || pid.find_first_not_of("0123456789") != std::string::npos) continue;  // never throws here
    found.push_back({peer, pid});
  }
  return found;
}

// "; rank 1 (process 4242, on this host) has exited" for each of `peers` whose process has exited
// (or, with `stopped_too`, is stopped).
std::string name_exited(const std::vector<LocalPeer>& peers, bool stopped_too) {
  std::string text;
  for (const auto& peer : peers) {
    const char state = process_state(static_cast<pid_t>(std::strtol(peer.pid.c_str(), nullptr, 10)));
    const char* what = state == 'X' || state == 'Z'                        ? "has exited"
                       : stopped_too && (state == 'T' || state == 't') ? "is stopped"
                                                                         : nullptr;
    if (what) text += "; rank " + std::to_string(peer.rank) + " (process " + peer.pid + ", on this host) " + what;
  }
  return text;
}

// Runs a communicator's hook; what it throws is what failed.
std::optional<std::string> guarded(const std::function<std::optional<std::string>()>& hook, const char* which) {
  try {
    return hook();
  } catch (const c10::Error& error) {
    return std::string("the communicator's ") + which + " raised: " + error.what_without_backtrace();
  } catch (const std::exception& error) {
    return std::string("the communicator's ") + which + " raised: " + error.what();
  } catch (...) {
    return std::string("the communicator's ") + which + " raised an unknown exception";
  }
}

// One visit of the monitor's thread to the board, made on a thread of its own (FaultMonitor::watch).
struct BoardVisit {
  std::optional<std::string> failure;                 // a peer's, posted on the board
  std::optional<std::vector<std::string>> processes;  // every peer's (Note [Naming the lost rank]), once all posted
  bool store_failed = false;                          // the store raised: its host ended or died
  std::atomic<bool> done{false};                      // set last: the fields above are then the visit's
};

}  // namespace

// The monitor's thread. It holds its own reference to the state, so it may outlive the monitor.
void FaultMonitor::watch(const std::shared_ptr<State>& s) {
  auto next_store_poll = Clock::now();
  uint64_t posted_seq = 0;  // the collective this rank last posted it waits for
  std::shared_ptr<BoardVisit> visit;  // in the store, or back and not read yet
  // Until every peer has posted its process: soon at first (the peers post as they start, and one may die
  // soon after), then less often (one may start minutes late).
  auto processes_read_interval = FaultMonitor::kPollInterval;
  std::unique_lock<std::mutex> lock(s->mutex);
  // Runs a hook without holding the lock (the destructor waits while one runs: in_hook) and
  // returns what failed, if anything; a hook that throws failed.
  const auto run_hook = [&](const std::function<std::optional<std::string>()>& hook, const char* which) {
    s->in_hook = true;
    lock.unlock();
    std::optional<std::string> seen = guarded(hook, which);
    lock.lock();
    s->in_hook = false;
    s->changed.notify_all();
    return seen;
  };
  // Posts this rank's own failure once (the first failure wins) from a thread of its own, so that a store whose
  // host froze does not hold up the abort that follows (on NCCL, what ends this rank's wait); the thread's end
  // waits for it (at most kPostLimit), so that a process that exits on the error has posted it.
  std::shared_ptr<std::atomic<bool>> own_failure_posted;  // set once the post is done
  const auto post_own_failure = [&](const c10::intrusive_ptr<c10d::Store>& store) {
    if (!store || !s->failure || s->origin == Origin::kPeer || s->posted) return;
    s->posted = true;
    own_failure_posted = std::make_shared<std::atomic<bool>>(false);
    run_bounded(
        [store, key = s->key, message = *s->failure, done = own_failure_posted] {
          set_on_board(store, key, message, Posting::kFirstWins);
          done->store(true);
        },
        Clock::duration::zero());
  };
  while (!s->stop) {
    s->wake.wait_for(lock, FaultMonitor::kPollInterval);
    if (s->stop) break;
    if (s->poll && !s->failure) {
      const std::function<std::optional<std::string>()> poll = s->poll;
      const std::optional<std::string> seen = run_hook(poll, "poll");
      if (seen && !s->failure) {
        s->failure = s->prefix + *seen;
        const std::string failure = *s->failure;
        lock.unlock();
        spread(s.get(), failure);
        lock.lock();
      }
    }
    // A copy: the destructor may drop the state's reference while a store call runs.
    const c10::intrusive_ptr<c10d::Store> store = s->store;
    post_own_failure(store);  // before the abort, which may take seconds: peers learn at once
    if (s->failure && !s->aborted && s->abort) {
      s->aborted = true;
      const std::function<void()> abort = s->abort;
      const std::optional<std::string> error =
          run_hook([&abort]() -> std::optional<std::string> { abort(); return std::nullopt; }, "abort");
      if (error) std::fprintf(stderr, "%s%s\n", s->prefix.c_str(), error->c_str());
    }
    if (!store || s->failure) continue;
    if (visit) {
      if (!visit->done.load(std::memory_order_acquire)) continue;  // still in the store: one visit at a time
      const std::shared_ptr<BoardVisit> found = std::move(visit);
      if (found->store_failed) {
        // The store's host ended or died. At the end of a run that is normal, so it is no
        // failure by itself; a collective that needs the dead rank fails on its own.
        s->store.reset();
        continue;
      }
      if (found->processes && !s->local_peers) s->local_peers = local_peers_in(*found->processes, s->process);
      if (found->failure) {
        s->failure = *found->failure;
        s->origin = Origin::kPeer;
        lock.unlock();
        spread(s.get(), *found->failure);
        lock.lock();
        continue;
      }
    }
    // The peers on this host, read as soon as all have posted, while the store's host lives: it may be
    // the peer that dies (Note [A dead peer with open connections]).
    const bool read_processes = !s->local_peers && !s->process.empty() && s->world_size > 1;
    const Clock::rep since = s->waiting_since.load();
    const Clock::time_point now = Clock::now();
    const bool waited_long = since != State::kNotWaiting &&
                             now - Clock::time_point(Clock::duration(since)) >= s->store_poll_after;
    // A posted wait that ended is taken back: a stale one would read as this rank waiting
    // (Note [Naming the lost rank]). Only waits long enough to post come to this: a healthy step never does.
    const bool take_back = since == State::kNotWaiting && posted_seq != 0;
    if (now < next_store_poll || !(waited_long || read_processes || take_back)) continue;
    next_store_poll = now + (waited_long ? FaultMonitor::kStorePollInterval : processes_read_interval);
    processes_read_interval = std::min<std::chrono::milliseconds>(2 * processes_read_interval,
                                                                  FaultMonitor::kStorePollInterval);
    const uint64_t seq = s->waiting_seq.load();
    const uint64_t post_seq = waited_long && seq != 0 && seq != posted_seq ? seq : 0;
    std::optional<std::string> posting;  // what this visit posts as the collective this rank waits for
    if (post_seq != 0) {
      posting = std::to_string(post_seq);
      if (s->waiting_for && s->waiting_for->seq == post_seq) *posting += "\n" + s->waiting_for->describe();
    }
    if (take_back) posting = "";
    if (posting) posted_seq = post_seq;
    visit = std::make_shared<BoardVisit>();
    // On a thread of its own, not waited for (a limit of zero): a store whose host froze must not stop this
    // thread's poll, which is NCCL's deadline.
    run_bounded(
        [visit, store, key = s->key, rank = s->rank, world_size = s->world_size, posting, waited_long,
         read_processes] {
          try {
            if (posting) store->set(peer_key(key, "waiting", rank), bytes(*posting));
            if (waited_long && store->check({key})) {
              const std::vector<uint8_t> value = store->get(key);
              visit->failure = std::string(value.begin(), value.end());
            }
            if (read_processes) {
              std::vector<std::string> processes = peer_values(*store, key, "process", rank, world_size);
              if (std::count(processes.begin(), processes.end(), "") == 1) visit->processes = std::move(processes);
            }
          } catch (const std::exception&) {
            visit->store_failed = true;
          }
          visit->done.store(true, std::memory_order_release);
        },
        Clock::duration::zero());
  }
  const c10::intrusive_ptr<c10d::Store> store = s->store;  // a copy, as in the loop
  post_own_failure(store);  // a failure recorded just before the monitor was destroyed
  if (own_failure_posted) {
    lock.unlock();
    const Clock::time_point until = Clock::now() + kPostLimit;
    while (!own_failure_posted->load() && Clock::now() < until) {
      std::this_thread::sleep_for(FaultMonitor::kPollInterval / 5);
    }
    lock.lock();
  }
  s->done = true;
  s->changed.notify_all();
}

bool run_bounded(std::function<void()> work, Clock::duration limit, const std::function<bool()>& give_up) {
  struct Done {
    std::mutex mutex;
    std::condition_variable changed;
    bool done = false;
  };
  auto state = std::make_shared<Done>();
  auto guarded = [work = std::move(work)] {
    try {
      work();
    } catch (...) {
    }
  };
  try {
    std::thread([guarded, state] {
      guarded();
      const std::lock_guard<std::mutex> lock(state->mutex);
      state->done = true;
      state->changed.notify_all();
    }).detach();
  } catch (const std::system_error&) {
    guarded();  // no thread to be had: unbounded, but done
    return true;
  }
  const auto deadline = Clock::now() + limit;
  std::unique_lock<std::mutex> lock(state->mutex);
  while (!state->done) {
    if (Clock::now() >= deadline || (give_up && give_up())) return false;
    state->changed.wait_for(lock, FaultMonitor::kPollInterval);
  }
  return true;
}

FaultMonitor::FaultMonitor(c10::intrusive_ptr<c10d::Store> store, std::string key, int rank, int world_size,
                           std::string backend, std::chrono::milliseconds timeout)
    : state_(std::make_shared<State>()),
      timeout_(timeout),
      creator_(getpid()) {
  TORCH_CHECK(timeout.count() > 0, "hsync: the collective timeout must be positive, got ", timeout.count(), " ms");
  state_->store = std::move(store);
  state_->key = std::move(key);
  state_->prefix = "hsync: rank " + std::to_string(rank) + " (" + backend + "): ";
  state_->rank = rank;
  state_->world_size = world_size;
  state_->process = this_process();
  state_->store_poll_after = store_poll_after();
  // Posted before the constructor returns, not by the thread: a rank may die right after its first
  // collective, before a thread of its own is scheduled on a busy machine. Note [Naming the lost rank].
  if (state_->store && !state_->process.empty()) {
    post(state_->store, peer_key(state_->key, "process", rank), state_->process, Posting::kReplace);
  }
  enroll(state_);
  thread_ = std::thread(watch, state_);
}

FaultMonitor::~FaultMonitor() {
  if (in_forked_child()) {  // Note [Forked children]: no thread here to stop, its lock perhaps held
    new std::thread(std::move(thread_));  // a handle the child never joins, left with the memory
    return;
  }
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
  bool first = false;
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    if (!state_->failure) {
      state_->failure = message;
      state_->wake.notify_all();  // the thread posts it and aborts the communicator
      first = true;
    }
  }
  if (first) spread(state_.get(), message);
  TORCH_CHECK(false, message);
}

namespace {

// Every monitor of this process, as the states their threads share (expired ones pruned as new ones come).
struct Registry {
  std::mutex mutex;
  std::vector<std::weak_ptr<void>> states;
};

// Never destroyed: a monitor's thread may outlive static destruction at exit.
Registry& registry() {
  static auto* const instance = new Registry;
  return *instance;
}

}  // namespace

void FaultMonitor::enroll(const std::shared_ptr<State>& state) {
  Registry& all = registry();
  const std::lock_guard<std::mutex> lock(all.mutex);
  const auto expired = [](const std::weak_ptr<void>& entry) { return entry.expired(); };
  all.states.erase(std::remove_if(all.states.begin(), all.states.end(), expired), all.states.end());
  all.states.emplace_back(state);
}

void FaultMonitor::spread(const State* from, const std::string& failure) {
  std::vector<std::shared_ptr<State>> others;
  {
    Registry& all = registry();
    const std::lock_guard<std::mutex> lock(all.mutex);
    for (const std::weak_ptr<void>& entry : all.states) {
      std::shared_ptr<State> state = std::static_pointer_cast<State>(entry.lock());
      if (state && state.get() != from) others.push_back(std::move(state));
    }
  }
  for (const std::shared_ptr<State>& state : others) {
    const std::lock_guard<std::mutex> lock(state->mutex);
    if (state->failure || state->stop) continue;
    state->failure = failure;
    state->origin = Origin::kSibling;
    state->wake.notify_all();  // its thread posts it to its own board and aborts its communicator
  }
}

void FaultMonitor::set_waiting_since(std::optional<Clock::time_point> since, uint64_t seq,
                                     const Collective* collective) {
  if (collective != nullptr && state_->waiting_seq.load() != seq) {  // once per collective waited for
    const std::lock_guard<std::mutex> lock(state_->mutex);
    state_->waiting_for = *collective;
  }
  state_->waiting_seq.store(seq);  // before the time, which the thread reads first
  state_->waiting_since.store(since ? since->time_since_epoch().count() : State::kNotWaiting);
}

std::string FaultMonitor::peers_without_a_board() const {
  // The store's host may be the frozen peer (rank 0 under init_process_group's env:// or tcp://, without
  // torchrun's agent): this host's stopped processes tell, and of two ranks the other is the one.
  std::vector<LocalPeer> local;
  {
    const std::lock_guard<std::mutex> lock(state_->mutex);
    if (state_->local_peers) local = *state_->local_peers;
  }
  const std::string stopped = name_exited(local, true);
  if (!stopped.empty() || state_->world_size != 2) return stopped;
  return "; rank " + std::to_string(1 - state_->rank) + " has not reached it, and the store its peers post to "
         "does not answer either";
}

std::string FaultMonitor::peers_not_there(uint64_t seq, const Collective* mine) const {
  if (seq == 0 || state_->world_size <= 1) return {};
  const c10::intrusive_ptr<c10d::Store> store = store_copy();
  if (!store) return peers_without_a_board();
  // What each peer posted: the collective it waits for now, or nothing (it waits for none, or not for long).
  // One waiting for this collective or a later one has reached it; one waiting for an earlier one is stuck
  // behind another peer, and is named only where no peer is found waiting for nothing. One waiting for
  // another collective under this one's number issued other collectives than this rank.
  std::vector<int> not_waiting, behind;
  std::vector<std::pair<int, std::string>> elsewhere;
  const auto read_board = [&] {
    const auto waiting = read_peers(store, state_->key, "waiting", state_->rank, state_->world_size);
    if (!waiting) return false;
    not_waiting.clear();
    behind.clear();
    elsewhere.clear();
    for (int peer = 0; peer < state_->world_size; ++peer) {
      if (peer == state_->rank) continue;
      const std::string& posted = (*waiting)[peer];
      char* end = nullptr;
      const unsigned long long posted_seq = std::strtoull(posted.c_str(), &end, 10);
      if (posted.empty() || (*end != '\0' && *end != '\n') || posted_seq == 0) {
        not_waiting.push_back(peer);
      } else if (posted_seq < seq) {
        behind.push_back(peer);
      } else if (posted_seq == seq && *end == '\n' && mine != nullptr) {
        const std::string theirs(end + 1);
        if (theirs.rfind(mine->describe_kind() + " (", 0) != 0) elsewhere.emplace_back(peer, theirs);
      }
    }
    return true;
  };
  if (!read_board()) return peers_without_a_board();
  // A peer posts once its own wait is half its deadline old, at most kStorePollAfter: one with a longer deadline
  // than this rank's, stuck behind the lost rank too, may not have posted yet. Where several have not, each gets
  // that long to post before the board is read for good (a lost rank alone is named at once).
  const Clock::time_point until = Clock::now() + kStorePollAfter + 2 * kPollInterval;
  while (not_waiting.size() > 1 && Clock::now() < until) {
    std::this_thread::sleep_for(2 * kPollInterval);
    if (!read_board()) return peers_without_a_board();
  }
  if (not_waiting.empty() && !elsewhere.empty()) {
    std::string text;
    for (const auto& [peer, theirs] : elsewhere) text += "; rank " + std::to_string(peer) + " waits in " + theirs;
    return text + " instead: the ranks issued different collectives (a call made on some ranks only?)";
  }
  const std::vector<int>& absent = not_waiting.empty() ? behind : not_waiting;
  if (absent.empty()) return {};
  std::string text = absent.size() == 1 ? "; rank " : "; ranks ";
  for (size_t i = 0; i < absent.size(); ++i) {
    if (i > 0) text += i + 1 == absent.size() ? " and " : ", ";
    text += std::to_string(absent[i]);
  }
  return text + (absent.size() == 1 ? " has" : " have") + " not reached it";
}

std::string FaultMonitor::peers_gone() const {
  if (state_->process.empty() || state_->world_size <= 1) return {};
  std::optional<std::vector<LocalPeer>> local;
  {
    const std::lock_guard<std::mutex> lock(state_->mutex);
    local = state_->local_peers;  // read while the store lived: its host may be the peer that died
  }
  std::vector<int> unposted;  // peers that never posted their process: they died before this communicator began
  if (!local) {  // not all had posted yet
    const c10::intrusive_ptr<c10d::Store> store = store_copy();
    if (!store) return {};
    const auto processes = read_peers(store, state_->key, "process", state_->rank, state_->world_size);
    if (!processes) return {};
    local = local_peers_in(*processes, state_->process);
    for (int peer = 0; peer < state_->world_size; ++peer) {
      if (peer != state_->rank && (*processes)[peer].empty()) unposted.push_back(peer);
    }
  }
  // A killed process closes its sockets on its way out, an instant before it shows as exited: where
  // none shows yet, look again for a moment. Only until one does: a survivor that raises and exits
  // meanwhile is no cause of this failure.
  const Clock::time_point until = Clock::now() + kExitShowsWithin;
  std::string text = name_exited(*local, true);
  while (text.empty() && !local->empty() && Clock::now() < until) {
    std::this_thread::sleep_for(kPollInterval / 5);
    text = name_exited(*local, true);
  }
  if (text.empty() && unposted.size() == 1) {
    text = "; rank " + std::to_string(unposted.front()) + " never reached this communicator (it posted no process "
           "at its start: it exited or failed before)";
  }
  return text;
}

std::string FaultMonitor::exited_peer(const std::string& waiting_for, Clock::time_point since) const {
  const Clock::duration waited = Clock::now() - since;
  if (waited < state_->store_poll_after) return {};
  std::vector<LocalPeer> local;
  {
    const std::lock_guard<std::mutex> lock(state_->mutex);
    if (!state_->local_peers) return {};
    local = *state_->local_peers;
  }
  const std::string exited = name_exited(local, false);
  if (exited.empty()) return {};
  return waiting_for + " cannot complete after " + seconds(waited) + ": a peer exited (killed, crashed or out of "
         "memory) with its connections left open (a process forked from it, such as a DataLoader worker, may hold "
         "them; NCCL's P2P and shared-memory links have none)" + exited;
}

c10::intrusive_ptr<c10d::Store> FaultMonitor::store_copy() const {
  const std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->store;
}

bool FaultMonitor::failed() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->failure.has_value();
}

void FaultMonitor::check(const Collective* waiting_for) const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  if (!state_->failure) return;
  if (state_->origin == Origin::kOwn) {
    TORCH_CHECK(false, *state_->failure);
  }
  const std::string waiting =
      waiting_for ? "stopped waiting for " + waiting_for->describe() + " after " +
                        seconds(Clock::now() - waiting_for->issued) + ": "
                  : "stopped: ";
  const char* first = state_->origin == Origin::kPeer ? "a peer failed first. "
                                                       : "another of this rank's communicators failed first. ";
  TORCH_CHECK(false, state_->prefix, waiting, first, *state_->failure);
}

}  // namespace hsync
