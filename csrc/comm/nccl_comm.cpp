#include "comm/nccl_comm.h"

#include <ATen/record_function.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <thread>
#include <utility>

#include "checks.h"

namespace hsync {

std::string nccl_unique_id() {
  ncclUniqueId id;
  HSYNC_NCCL_CHECK(ncclGetUniqueId(&id));
  return std::string(id.internal, sizeof(id.internal));
}

std::string nccl_version() {
  int version = 0;
  HSYNC_NCCL_CHECK(ncclGetVersion(&version));
  return std::to_string(version / 10000) + "." + std::to_string(version / 100 % 100) + "." +
         std::to_string(version % 100);
}

namespace {

// cudaErrorNotReady from a query is an answer, not a failure, but the runtime keeps it as the
// thread's last error, where a later, unrelated launch check would report it: cleared, as torch's
// CUDAStream::query does.
cudaError_t answered(cudaError_t state) {
  if (state == cudaErrorNotReady) (void)cudaGetLastError();
  return state;
}

ncclDataType_t nccl_dtype(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return ncclFloat32;
    case at::kDouble: return ncclFloat64;
    case at::kHalf: return ncclFloat16;
    case at::kBFloat16: return ncclBfloat16;
    case at::kLong: return ncclInt64;
    case at::kInt: return ncclInt32;
    case at::kByte: return ncclUint8;
    case at::kChar: return ncclInt8;
    case at::kBool: return ncclUint8;
    default: HSYNC_CHECK(false, "NCCL cannot reduce tensors of dtype ", type);
  }
  return ncclFloat32;  // unreachable
}

cudaStream_t new_stream(int device_index) {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index));
  int least = 0;
  int greatest = 0;
  HSYNC_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  cudaStream_t stream = nullptr;
  // High priority, as torch's pool would give: the buckets' reductions go before compute kernels.
  HSYNC_CUDA_CHECK(cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking, greatest));
  return stream;
}

}  // namespace

OwnStream::OwnStream(int device_index)
    : stream_(c10::cuda::getStreamFromExternal(new_stream(device_index),
                                               static_cast<c10::DeviceIndex>(device_index))) {}

StreamEvent::StreamEvent(int device_index) {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index));
  HSYNC_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
}

StreamEvent::~StreamEvent() {
  if (event_ != nullptr) cudaEventDestroy(event_);  // destructors must not throw
}

void StreamEvent::order(cudaStream_t signaller, cudaStream_t waiter) {
  HSYNC_CUDA_CHECK(cudaEventRecord(event_, signaller));
  HSYNC_CUDA_CHECK(cudaStreamWaitEvent(waiter, event_, 0));
}

NcclComm::NcclComm(const std::string& unique_id, int rank, int world_size, int device_index,
                   const FaultOptions& options)
    : Communicator(rank, world_size, "nccl", options),
      device_index_(device_index),
      setup_allowance_(std::max<std::chrono::milliseconds>(options.timeout, kSetupAllowance)),
      stream_(device_index),
      enter_event_(device_index) {
  comm_ = create(unique_id);
  monitor().set_hooks([this] { return poll(); }, [this] { abort(); });
}

ncclComm_t NcclComm::create(const std::string& unique_id) {
  ncclUniqueId id;
  HSYNC_CHECK(unique_id.size() == sizeof(id.internal), "NCCL unique id has ", unique_id.size(),
              " bytes, expected ", sizeof(id.internal));
  std::copy(unique_id.begin(), unique_id.end(), id.internal);
  const char* blocking = std::getenv("NCCL_COMM_BLOCKING");  // it would override the config below
  HSYNC_CHECK(blocking == nullptr || std::string(blocking) != "0",
              "NCCL_COMM_BLOCKING=0 is set, but hsync needs a blocking NCCL communicator (Note [NCCL failures] "
              "in csrc/comm/nccl_comm.h); unset it");
  struct Setup {
    std::mutex mutex;
    ncclComm_t comm = nullptr;
    ncclResult_t result = ncclInProgress;
    std::string error;
    bool abandoned = false;
  };
  auto setup = std::make_shared<Setup>();
  const auto make = [setup, id, world = world_size(), rank = rank(), device = device_index_] {
    cudaSetDevice(device);  // the current device is per thread
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 1;
    ncclComm_t comm = nullptr;
    const ncclResult_t result = ncclCommInitRankConfig(&comm, world, id, rank, &config);
    bool abandoned = false;
    {
      const std::lock_guard<std::mutex> lock(setup->mutex);
      if (result != ncclSuccess) setup->error = ncclGetLastError(comm);
      setup->comm = comm;
      setup->result = result;
      abandoned = setup->abandoned;
    }
    if (abandoned && comm != nullptr) ncclCommAbort(comm);  // on this thread, which nobody waits for
  };
  const WaitingScope waiting(monitor(), Clock::now());  // peers' posted failures end the wait
  const bool finished = run_bounded(make, setup_allowance_, [this] { return monitor().failed(); });
  ncclComm_t comm = nullptr;
  ncclResult_t result = ncclInProgress;
  std::string error;
  {
    const std::lock_guard<std::mutex> lock(setup->mutex);
    setup->abandoned = !finished;
    comm = setup->comm;  // set only if it finished after all, just now
    result = setup->result;
    error = setup->error;
  }
  if (!finished) {
    if (comm != nullptr) tear_down_within_limit(comm, /*destroy=*/false);
    monitor().check();  // a peer failed first
    monitor().fail("NCCL communicator setup (ncclCommInitRankConfig) did not finish within the " +
                   seconds(setup_allowance_) + " allowance: a rank did not join, or the ranks cannot reach "
                   "each other (NCCL_SOCKET_IFNAME, firewalls; NCCL_DEBUG=INFO tells more)");
  }
  if (result != ncclSuccess) {
    if (comm != nullptr) tear_down_within_limit(comm, /*destroy=*/false);
    monitor().fail("NCCL communicator setup (ncclCommInitRankConfig) failed: NCCL " +
                   std::string(ncclGetErrorString(result)) + " (" + error + ")");
  }
  return comm;
}

void NcclComm::tear_down_within_limit(ncclComm_t comm, bool destroy) const {
  const bool finished = run_bounded(
      [comm, destroy, device = device_index_] {
        cudaSetDevice(device);
        if (destroy && ncclCommFinalize(comm) == ncclSuccess) {
          ncclCommDestroy(comm);
        } else {
          ncclCommAbort(comm);
        }
      },
      kTeardownLimit);
  if (!finished) {
    std::fprintf(stderr, "hsync: rank %d (nccl): %s the NCCL communicator took over %s; left to finish on its "
                 "own thread\n", rank(), destroy ? "destroying" : "aborting", seconds(kTeardownLimit).c_str());
  }
}

NcclComm::~NcclComm() {
  if (monitor().in_forked_child()) return;  // the communicator is the parent's: Note [Forked children]
  monitor().clear_hooks();
  // The process is exiting and CUDA is already gone: the operating system reclaims everything.
  if (answered(cudaStreamQuery(stream_.stream())) == cudaErrorCudartUnloading) return;
  // Destructors must not throw: errors here only choose between destroy and abort.
  if (!aborted_ && !monitor().failed() && drain()) {
    tear_down_within_limit(comm_, /*destroy=*/true);
  } else {
    abort();
  }
  const std::lock_guard<std::mutex> lock(mutex_);
  for (const InFlight& f : in_flight_) {
    if (f.done != nullptr) cudaEventDestroy(f.done);
  }
  for (cudaEvent_t event : spare_events_) cudaEventDestroy(event);
}

bool NcclComm::drain() {
  const auto deadline = Clock::now() + kTeardownLimit;
  while (Clock::now() < deadline) {
    const cudaError_t state = answered(cudaStreamQuery(stream_.stream()));
    if (state == cudaSuccess) return true;
    ncclResult_t async = ncclSuccess;
    if (state != cudaErrorNotReady || ncclCommGetAsyncError(comm_, &async) != ncclSuccess || async != ncclSuccess) {
      return false;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return false;
}

void NcclComm::enter(const at::Tensor& tensor) {
  HSYNC_CHECK(tensor.is_cuda() && tensor.device().index() == device_index_ && tensor.is_contiguous(),
              "NCCL collectives need a contiguous tensor on cuda:", device_index_, ", got ",
              tensor.device());
  const cudaStream_t caller = c10::cuda::getCurrentCUDAStream(device_index_).stream();
  enter_event_.order(caller, stream_.stream());
  c10::cuda::CUDACachingAllocator::recordStream(tensor.storage().data_ptr(), stream_.get());
}

cudaEvent_t NcclComm::take_event() {
  {
    const std::lock_guard<std::mutex> lock(mutex_);
    if (!spare_events_.empty()) {
      cudaEvent_t event = spare_events_.back();
      spare_events_.pop_back();
      return event;
    }
  }
  cudaEvent_t event = nullptr;
  HSYNC_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  return event;
}

void NcclComm::launch(const at::Tensor& tensor, const Collective& collective) {
  // Named as torch's NCCL group names its own, so that a torch.profiler trace shows where each was issued
  // (on the CPU, the process group's own events do: ProcessGroupComm). Free while no profiler runs.
  const char* name = collective.op == Op::kBroadcast ? "nccl:broadcast"
                     : collective.op == Op::kReduce  ? "nccl:reduce"
                                                     : "nccl:all_reduce";
  RECORD_FUNCTION(name, std::vector<c10::IValue>({tensor}));  // declares `guard`
  const c10::cuda::CUDAGuard device_guard(static_cast<c10::DeviceIndex>(device_index_));
  enter(tensor);
  const ncclDataType_t dtype = nccl_dtype(tensor.scalar_type());
  cudaEvent_t done = take_event();
  {
    const std::lock_guard<std::mutex> lock(call_mutex_);
    if (aborted_) {
      const std::lock_guard<std::mutex> spare_lock(mutex_);
      spare_events_.push_back(done);
      monitor().check();  // aborted since issue() checked: raise the reason
    }
    ++calls_in_progress_;
  }
  {
    const std::lock_guard<std::mutex> lock(mutex_);
    in_flight_.push_back({collective, nullptr});  // its deadline runs while NCCL connects
  }
  // The monitor's thread may end this call if it blocks (Note [NCCL failures]).
  void* data = tensor.data_ptr();
  const size_t count = static_cast<size_t>(tensor.numel());
  const cudaStream_t stream = stream_.stream();
  ncclResult_t issued = ncclInvalidArgument;
  switch (collective.op) {
    case Op::kAllReduce: issued = ncclAllReduce(data, data, count, dtype, ncclSum, comm_, stream); break;
    case Op::kBroadcast: issued = ncclBroadcast(data, data, count, dtype, collective.root, comm_, stream); break;
    case Op::kReduce: issued = ncclReduce(data, data, count, dtype, ncclSum, collective.root, comm_, stream); break;
  }
  const std::string last_error = issued == ncclSuccess || aborted_ ? "" : ncclGetLastError(comm_);
  {
    const std::lock_guard<std::mutex> lock(call_mutex_);
    --calls_in_progress_;
    calls_changed_.notify_all();
  }
  const cudaError_t recorded = issued == ncclSuccess ? cudaEventRecord(done, stream_.stream()) : cudaSuccess;
  const std::lock_guard<std::mutex> lock(mutex_);
  if (issued != ncclSuccess || recorded != cudaSuccess) {
    spare_events_.push_back(done);
    if (aborted_) monitor().check();  // the abort ended the call: raise what caused it
    monitor().fail(collective.describe() + (issued != ncclSuccess
        ? " could not be issued: NCCL " + std::string(ncclGetErrorString(issued)) + " (" + last_error + ")"
        : ": CUDA " + std::string(cudaGetErrorString(recorded))));
  }
  in_flight_.back().done = done;  // only this thread adds entries: the back is this collective
}

void NcclComm::synchronize_through(uint64_t seq) {
  monitor().check();
  const cudaStream_t caller = c10::cuda::getCurrentCUDAStream(device_index_).stream();
  const std::lock_guard<std::mutex> lock(mutex_);  // the monitor's thread retires completed events
  // Collectives complete in stream order, so the last one in flight up to `seq` (a fingerprint's
  // check shares its collective's number and goes first) stands for all; completed ones have left.
  const auto last = std::find_if(in_flight_.rbegin(), in_flight_.rend(),
                                 [seq](const InFlight& f) { return f.collective.seq <= seq; });
  if (last != in_flight_.rend()) HSYNC_CUDA_CHECK(cudaStreamWaitEvent(caller, last->done, 0));
}

std::optional<std::string> NcclComm::poll() {
  if (aborted_) return std::nullopt;
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index_));
  std::optional<Collective> oldest;
  bool first_of_its_size = false;  // the oldest's size never completed: Note [NCCL setup allowance]
  {
    const std::lock_guard<std::mutex> lock(mutex_);
    while (!in_flight_.empty() && in_flight_.front().done != nullptr) {
      const InFlight& front = in_flight_.front();
      const cudaError_t state = answered(cudaEventQuery(front.done));
      if (state == cudaErrorNotReady || state == cudaErrorCudartUnloading) break;  // the latter: exiting
      if (state != cudaSuccess) return front.collective.describe() + " failed: CUDA " + cudaGetErrorString(state);
      completed_sizes_.emplace(front.collective.numel, static_cast<int>(front.collective.dtype));
      spare_events_.push_back(front.done);
      in_flight_.pop_front();
    }
    if (!in_flight_.empty()) {
      oldest = in_flight_.front().collective;
      first_of_its_size = completed_sizes_.count({oldest->numel, static_cast<int>(oldest->dtype)}) == 0;
    }
  }
  monitor().set_waiting_since(oldest ? std::optional<Clock::time_point>(oldest->issued) : std::nullopt,
                              oldest ? oldest->seq : 0, oldest ? &*oldest : nullptr);
  ncclResult_t state = ncclSuccess;
  const ncclResult_t queried = ncclCommGetAsyncError(comm_, &state);
  if (queried != ncclSuccess || (state != ncclSuccess && state != ncclInProgress)) {
    const std::string during = oldest ? " during " + oldest->describe() : "";
    return "NCCL reported " + std::string(ncclGetErrorString(queried != ncclSuccess ? queried : state)) + " (" +
           ncclGetLastError(comm_) + ")" + during + ". A peer probably exited (killed, crashed or out of memory)" +
           monitor().peers_gone();
  }
  if (!oldest) return std::nullopt;
  const auto waited = Clock::now() - oldest->issued;
  const std::string exited = monitor().exited_peer(oldest->describe(), oldest->issued);
  if (!exited.empty()) return exited;
  if (first_of_its_size && waited > setup_allowance_) {
    return oldest->describe() + " did not complete within the " + seconds(setup_allowance_) + " allowance of a "
           "collective's first use of its size (when NCCL connects to peers): a peer is stopped or hung, or the "
           "ranks cannot reach each other";
  }
  if (!first_of_its_size && waited > timeout()) {
    return oldest->describe() + " did not complete within the " + seconds(timeout()) + " deadline (" +
           seconds(waited) + " since it was issued): a peer is stopped, hung, or far slower than this rank" +
           monitor().peers_not_there(oldest->seq, &*oldest) + ". If steps legitimately differ this much, raise "
           "WeightedDDP(timeout=...) or HSYNC_TIMEOUT";
  }
  return std::nullopt;
}

void NcclComm::abort() {
  bool in_call = false;
  {
    const std::lock_guard<std::mutex> lock(call_mutex_);
    if (aborted_ || comm_ == nullptr) return;
    aborted_ = true;  // no NCCL call starts after this
    in_call = calls_in_progress_ > 0;
  }
  if (in_call) {
#if HSYNC_NCCL_HAS_REVOKE
    // A call blocked (connecting to a dead peer, say) is ended by revoking, which does not free
    // the communicator under it; the abort then waits, within the limit, until it has returned.
    const bool revoked = run_bounded(
        [comm = comm_, device = device_index_] {
          cudaSetDevice(device);
          ncclCommRevoke(comm, NCCL_REVOKE_DEFAULT);
        },
        kTeardownLimit);
    if (!revoked) {
      // Aborting now would free the communicator under the revoke: both are left to the process's end.
      std::fprintf(stderr, "hsync: rank %d (nccl): revoking the NCCL communicator took over %s; left to finish "
                   "on its own thread, not aborted\n", rank(), seconds(kTeardownLimit).c_str());
      return;
    }
    const auto wait_limit = std::chrono::milliseconds(kTeardownLimit);
#else
    // Older NCCL has no revoke. A call that is only queueing work returns within microseconds:
    // wait that out rather than free the communicator under it. One still blocked after that is
    // ended by the abort itself, as torch's watchdog relies on.
    const auto wait_limit = kEnqueueGrace;
#endif
    std::unique_lock<std::mutex> lock(call_mutex_);
    calls_changed_.wait_for(lock, wait_limit, [this] { return calls_in_progress_ == 0; });
  }
  tear_down_within_limit(comm_, /*destroy=*/false);
}

}  // namespace hsync
