#include "comm/nccl_comm.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <thread>
#include <utility>

#include "checks.h"

namespace hsync {
namespace {

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

}  // namespace

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
      stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device_index)),
      enter_event_(device_index) {
  ncclUniqueId id;
  HSYNC_CHECK(unique_id.size() == sizeof(id.internal), "NCCL unique id has ", unique_id.size(),
              " bytes, expected ", sizeof(id.internal));
  std::copy(unique_id.begin(), unique_id.end(), id.internal);
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  HSYNC_NCCL_CHECK_ASYNC(ncclCommInitRankConfig(&comm_, world_size, id, rank, &config));
  try {
    wait_ready(nullptr, "NCCL communicator initialisation (ncclCommInitRankConfig)");
  } catch (...) {
    ncclCommAbort(comm_);  // no destructor runs for a constructor that throws
    throw;
  }
  monitor().set_hooks([this] { return poll(); }, [this] { abort(); });
}

NcclComm::~NcclComm() {
  monitor().clear_hooks();
  if (comm_ == nullptr) return;
  // Destructors must not throw: errors here only choose between destroy and abort.
  bool clean = !aborted_ && !monitor().failed();
  const auto deadline = Clock::now() + kDrainTimeout;
  ncclResult_t state = ncclSuccess;
  const auto healthy = [&] {
    return ncclCommGetAsyncError(comm_, &state) == ncclSuccess && (state == ncclSuccess || state == ncclInProgress);
  };
  if (clean) {
    cudaError_t drained = cudaStreamQuery(stream_.stream());
    while (drained == cudaErrorNotReady && Clock::now() < deadline && healthy()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      drained = cudaStreamQuery(stream_.stream());
    }
    if (drained == cudaSuccess) {
      const ncclResult_t finalized = ncclCommFinalize(comm_);  // non-blocking: completes in the background
      clean = finalized == ncclSuccess || finalized == ncclInProgress;
    } else {
      clean = false;
    }
    while (clean && healthy() && state == ncclInProgress && Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    clean = clean && state == ncclSuccess;
  }
  if (clean) {
    ncclCommDestroy(comm_);
  } else if (!aborted_) {
    ncclCommAbort(comm_);
  }
  for (InFlight& f : in_flight_) cudaEventDestroy(f.done);
}

void NcclComm::wait_ready(const Collective* collective, const std::string& what) {
  const auto started = collective ? collective->issued : Clock::now();
  auto pause = std::chrono::microseconds(10);
  ncclResult_t state = ncclInProgress;
  while (true) {
    const ncclResult_t queried = ncclCommGetAsyncError(comm_, &state);
    if (queried != ncclSuccess) state = queried;
    if (state != ncclInProgress) break;
    if (collective) monitor().check(collective);  // a peer gave up: stop waiting for it
    if (Clock::now() - started > timeout()) {
      monitor().fail(what + " did not finish within the " + seconds(timeout()) + " deadline");
    }
    std::this_thread::sleep_for(pause);  // connecting to a slow peer can take long: do not spin
    pause = std::min(pause * 2, std::chrono::microseconds(1000));
  }
  if (state != ncclSuccess) {
    monitor().fail(what + " failed: NCCL " + ncclGetErrorString(state) + " (" + ncclGetLastError(comm_) + ")");
  }
}

void NcclComm::enter(const at::Tensor& tensor) {
  HSYNC_CHECK(tensor.is_cuda() && tensor.device().index() == device_index_ && tensor.is_contiguous(),
              "NCCL collectives need a contiguous tensor on cuda:", device_index_, ", got ",
              tensor.device());
  const cudaStream_t caller = c10::cuda::getCurrentCUDAStream(device_index_).stream();
  enter_event_.order(caller, stream_.stream());
  c10::cuda::CUDACachingAllocator::recordStream(tensor.storage().data_ptr(), stream_);
}

void NcclComm::launch(const at::Tensor& tensor, const Collective& collective) {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index_));
  enter(tensor);
  const std::lock_guard<std::mutex> lock(mutex_);
  if (aborted_) monitor().check();  // aborted since issue() checked: raise the reason
  const ncclDataType_t dtype = nccl_dtype(tensor.scalar_type());
  // A communicator with an async error refuses new work: report it as this collective's failure.
  const ncclResult_t issued =
      collective.root < 0
          ? ncclAllReduce(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), dtype, ncclSum, comm_, stream_.stream())
          : ncclBroadcast(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), dtype, collective.root, comm_,
                          stream_.stream());
  if (issued != ncclSuccess && issued != ncclInProgress) {
    monitor().fail(collective.describe() + " could not be issued: NCCL " + ncclGetErrorString(issued) + " (" +
                   ncclGetLastError(comm_) + ")");
  }
  wait_ready(&collective, collective.describe());
  cudaEvent_t done = nullptr;
  cudaError_t recorded = cudaEventCreateWithFlags(&done, cudaEventDisableTiming);
  if (recorded == cudaSuccess) {
    in_flight_.push_back({collective, done});
    monitor().add_waiting(1);
    recorded = cudaEventRecord(done, stream_.stream());
  }
  if (recorded != cudaSuccess) {
    monitor().fail(collective.describe() + ": CUDA " + cudaGetErrorString(recorded));
  }
}

void NcclComm::synchronize_through(uint64_t seq) {
  monitor().check();
  const cudaStream_t caller = c10::cuda::getCurrentCUDAStream(device_index_).stream();
  const std::lock_guard<std::mutex> lock(mutex_);  // the monitor's thread destroys completed events
  // Collectives complete in stream order, so the last one in flight up to `seq` (a fingerprint's
  // check shares its collective's number and goes first) stands for all; completed ones have left.
  const auto last = std::find_if(in_flight_.rbegin(), in_flight_.rend(),
                                 [seq](const InFlight& f) { return f.collective.seq <= seq; });
  if (last != in_flight_.rend()) HSYNC_CUDA_CHECK(cudaStreamWaitEvent(caller, last->done, 0));
}

std::optional<std::string> NcclComm::poll() {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index_));
  // The caller may hold the lock while NCCL connects to a slow peer; look again at the next poll.
  const std::unique_lock<std::mutex> lock(mutex_, std::try_to_lock);
  if (!lock.owns_lock() || aborted_) return std::nullopt;
  while (!in_flight_.empty()) {
    const cudaError_t state = cudaEventQuery(in_flight_.front().done);
    if (state == cudaErrorNotReady) break;
    if (state != cudaSuccess) {
      return in_flight_.front().collective.describe() + " failed: CUDA " + cudaGetErrorString(state);
    }
    cudaEventDestroy(in_flight_.front().done);
    in_flight_.pop_front();
    monitor().add_waiting(-1);
  }
  ncclResult_t state = ncclSuccess;
  const ncclResult_t queried = ncclCommGetAsyncError(comm_, &state);
  if (queried != ncclSuccess || (state != ncclSuccess && state != ncclInProgress)) {
    const std::string during = in_flight_.empty() ? "" : " during " + in_flight_.front().collective.describe();
    return "NCCL reported " + std::string(ncclGetErrorString(queried != ncclSuccess ? queried : state)) + " (" +
           ncclGetLastError(comm_) + ")" + during + ". A peer probably exited (killed, crashed or out of memory)";
  }
  if (!in_flight_.empty()) {
    const Collective& oldest = in_flight_.front().collective;
    const auto waited = Clock::now() - oldest.issued;
    if (waited > timeout()) {
      return oldest.describe() + " did not complete within the " + seconds(timeout()) + " deadline (" +
             seconds(waited) + " since it was issued): a peer is stopped, hung, or far slower than this rank. "
             "If steps legitimately differ this much, raise WeightedDDP(timeout=...)";
    }
  }
  return std::nullopt;
}

void NcclComm::abort() {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index_));
  const std::lock_guard<std::mutex> lock(mutex_);
  if (aborted_) return;
  aborted_ = true;
  ncclCommAbort(comm_);  // ends kernels that wait on dead peers; their events then complete
}

}  // namespace hsync
