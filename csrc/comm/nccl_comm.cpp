#include "comm/nccl_comm.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>

#include <thread>

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

NcclComm::NcclComm(const std::string& unique_id, int rank, int world_size, int device_index)
    : rank_(rank),
      world_size_(world_size),
      device_index_(device_index),
      stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device_index)),
      enter_event_(device_index),
      exit_event_(device_index) {
  ncclUniqueId id;
  HSYNC_CHECK(unique_id.size() == sizeof(id.internal), "NCCL unique id has ", unique_id.size(),
              " bytes, expected ", sizeof(id.internal));
  HSYNC_CHECK(rank >= 0 && rank < world_size, "rank ", rank, " is outside world size ", world_size);
  std::copy(unique_id.begin(), unique_id.end(), id.internal);
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index));
  HSYNC_NCCL_CHECK(ncclCommInitRank(&comm_, world_size, id, rank));
}

NcclComm::~NcclComm() {
  if (comm_ == nullptr) return;
  // Destructors must not throw: errors here only choose between destroy and abort.
  const auto deadline = std::chrono::steady_clock::now() + kDrainTimeout;
  cudaError_t state = cudaStreamQuery(stream_.stream());
  ncclResult_t peer = ncclSuccess;
  while (state == cudaErrorNotReady && std::chrono::steady_clock::now() < deadline &&
         ncclCommGetAsyncError(comm_, &peer) == ncclSuccess && (peer == ncclSuccess || peer == ncclInProgress)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    state = cudaStreamQuery(stream_.stream());
  }
  if (state == cudaSuccess) {
    ncclCommDestroy(comm_);
  } else {
    ncclCommAbort(comm_);
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

void NcclComm::all_reduce_sum(const at::Tensor& tensor) {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index_));
  enter(tensor);
  HSYNC_NCCL_CHECK(ncclAllReduce(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(),
                                 nccl_dtype(tensor.scalar_type()), ncclSum, comm_, stream_.stream()));
}

void NcclComm::broadcast(const at::Tensor& tensor, int root) {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index_));
  enter(tensor);
  HSYNC_NCCL_CHECK(ncclBroadcast(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(),
                                 nccl_dtype(tensor.scalar_type()), root, comm_, stream_.stream()));
}

void NcclComm::synchronize() {
  const cudaStream_t caller = c10::cuda::getCurrentCUDAStream(device_index_).stream();
  exit_event_.order(stream_.stream(), caller);
}

}  // namespace hsync
