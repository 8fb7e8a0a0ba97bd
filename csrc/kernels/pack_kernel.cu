#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "kernels/pack_launch.h"

namespace hsync {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 4096;  // grid-stride beyond this
constexpr int kVectorBytes = 16;      // one 128-bit load or store per thread and iteration

template <typename T> struct OpMath { using type = float; };
template <> struct OpMath<double> { using type = double; };

// Explicit conversions: torch builds extensions with __CUDA_NO_HALF_CONVERSIONS__ and its bf16
// counterpart, which remove the implicit ones.
__device__ __forceinline__ float to_op(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_op(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_op(float v) { return v; }
__device__ __forceinline__ double to_op(double v) { return v; }

template <typename T> __device__ __forceinline__ T from_op(float v);
template <> __device__ __forceinline__ __half from_op<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_op<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ float from_op<float>(float v) { return v; }
template <typename T> __device__ __forceinline__ T from_op(double v) { return v; }

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

// `in` may be `out` (a gradient that is its bucket slot is scaled in place), so neither is
// __restrict__: each element is read and then written by the same thread.
template <typename T, int N>
__global__ void scale_and_pack_kernel(const T* in, T* out, int64_t numel,
                                      const double* __restrict__ scale, T* nonfinite_flag,
                                      T* used_flag) {
  using Op = typename OpMath<T>::type;
  const Op s = static_cast<Op>(*scale);
  bool nonfinite = false;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;

  // Whole vectors first (the caller guarantees the alignment when N > 1), then the tail.
  const int64_t vectors = numel / N;
  for (int64_t i = first; i < vectors; i += stride) {
    Pack<T, N> p = reinterpret_cast<const Pack<T, N>*>(in)[i];
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const Op v = to_op(p.v[k]);
      nonfinite |= !isfinite(v);
      p.v[k] = from_op<T>(v * s);
    }
    reinterpret_cast<Pack<T, N>*>(out)[i] = p;
  }
  for (int64_t i = vectors * N + first; i < numel; i += stride) {
    const Op v = to_op(in[i]);
    nonfinite |= !isfinite(v);
    out[i] = from_op<T>(v * s);
  }
  // Every writer stores the same value, so plain stores need no atomics.
  if (nonfinite) *nonfinite_flag = from_op<T>(Op(1));
  if (first == 0) *used_flag = from_op<T>(Op(1));
}

template <typename T>
void launch(const void* in, void* out, int64_t numel, const double* scale, void* nonfinite_flag,
            void* used_flag, cudaStream_t stream) {
  constexpr int kVec = kVectorBytes / sizeof(T);
  const bool aligned = reinterpret_cast<uintptr_t>(in) % kVectorBytes == 0 &&
                       reinterpret_cast<uintptr_t>(out) % kVectorBytes == 0;
  const int per_thread = aligned ? kVec : 1;
  const int64_t blocks = std::clamp<int64_t>((numel + kThreads * per_thread - 1) / (kThreads * per_thread),
                                             1, kMaxBlocks);
  auto* src = static_cast<const T*>(in);
  auto* dst = static_cast<T*>(out);
  auto* nonfinite = static_cast<T*>(nonfinite_flag);
  auto* used = static_cast<T*>(used_flag);
  if (aligned) {
    scale_and_pack_kernel<T, kVec><<<blocks, kThreads, 0, stream>>>(src, dst, numel, scale, nonfinite, used);
  } else {
    scale_and_pack_kernel<T, 1><<<blocks, kThreads, 0, stream>>>(src, dst, numel, scale, nonfinite, used);
  }
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string("hsync: scale_and_pack kernel launch failed: ") +
                             cudaGetErrorString(status));
  }
}

}  // namespace

void launch_scale_and_pack(KernelDType dtype, const void* in, void* out, int64_t numel,
                           const double* scale, void* nonfinite_flag, void* used_flag,
                           cudaStream_t stream) {
  switch (dtype) {
    case KernelDType::kFloat32:
      return launch<float>(in, out, numel, scale, nonfinite_flag, used_flag, stream);
    case KernelDType::kFloat64:
      return launch<double>(in, out, numel, scale, nonfinite_flag, used_flag, stream);
    case KernelDType::kFloat16:
      return launch<__half>(in, out, numel, scale, nonfinite_flag, used_flag, stream);
    case KernelDType::kBFloat16:
      return launch<__nv_bfloat16>(in, out, numel, scale, nonfinite_flag, used_flag, stream);
  }
}

}  // namespace hsync
