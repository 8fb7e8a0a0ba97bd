#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "kernels/pack_launch.h"

namespace hsync {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 4096;  // grid-stride beyond this
constexpr int kVectorBytes = 16;      // one 128-bit load per thread and iteration

// The arithmetic of a pair of types: float, unless either side is double. The product is
// rounded once, into the output type (Note [Communication dtype] in pack.h).
template <typename In, typename Out>
using OpMath = std::conditional_t<std::is_same_v<In, double> || std::is_same_v<Out, double>, double, float>;

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

// From double to 16 bits through float, as torch's own casts (c10::Half has no double constructor).
template <typename T> __device__ __forceinline__ T from_op(double v);
template <> __device__ __forceinline__ __half from_op<__half>(double v) { return __float2half_rn(static_cast<float>(v)); }
template <> __device__ __forceinline__ __nv_bfloat16 from_op<__nv_bfloat16>(double v) {
  return __float2bfloat16_rn(static_cast<float>(v));
}
template <> __device__ __forceinline__ float from_op<float>(double v) { return static_cast<float>(v); }
template <> __device__ __forceinline__ double from_op<double>(double v) { return v; }

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

// Scales and casts one element; whether the value read or the value written is not finite.
template <typename In, typename Out>
__device__ __forceinline__ bool scale_one(In in, Out& out, OpMath<In, Out> s) {
  const auto v = static_cast<OpMath<In, Out>>(to_op(in));
  out = from_op<Out>(v * s);
  if constexpr (std::is_same_v<In, Out>) return !isfinite(v);
  return !isfinite(v) || !isfinite(to_op(out));
}

// `in` may be `out` (a gradient that is its bucket slot is scaled in place), so neither is
// __restrict__: each element is read and then written by the same thread.
template <typename In, typename Out, int N>
__global__ void scale_and_pack_kernel(const In* in, Out* out, int64_t numel,
                                      const double* __restrict__ scale, Out* nonfinite_flag,
                                      Out* used_flag) {
  using Op = OpMath<In, Out>;
  const Op s = static_cast<Op>(*scale);
  bool nonfinite = false;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;

  // Whole vectors first (the caller guarantees the alignment when N > 1), then the tail.
  const int64_t vectors = numel / N;
  for (int64_t i = first; i < vectors; i += stride) {
    const Pack<In, N> p = reinterpret_cast<const Pack<In, N>*>(in)[i];
    Pack<Out, N> q;
#pragma unroll
    for (int k = 0; k < N; ++k) nonfinite |= scale_one(p.v[k], q.v[k], s);
    reinterpret_cast<Pack<Out, N>*>(out)[i] = q;
  }
  for (int64_t i = vectors * N + first; i < numel; i += stride) {
    Out packed;
    nonfinite |= scale_one(in[i], packed, s);
    out[i] = packed;
  }
  // Every writer stores the same value, so plain stores need no atomics.
  if (nonfinite) *nonfinite_flag = from_op<Out>(Op(1));
  if (first == 0) *used_flag = from_op<Out>(Op(1));
}

template <typename In, typename Out>
void launch(const void* in, void* out, int64_t numel, const double* scale, void* nonfinite_flag,
            void* used_flag, cudaStream_t stream) {
  // Vectors as wide as one 128-bit load of the wider type.
  constexpr int kVec = kVectorBytes / std::max(sizeof(In), sizeof(Out));
  const bool aligned = reinterpret_cast<uintptr_t>(in) % (kVec * sizeof(In)) == 0 &&
                       reinterpret_cast<uintptr_t>(out) % (kVec * sizeof(Out)) == 0;
  const int per_thread = aligned ? kVec : 1;
  const int64_t blocks = std::clamp<int64_t>((numel + kThreads * per_thread - 1) / (kThreads * per_thread),
                                             1, kMaxBlocks);
  auto* src = static_cast<const In*>(in);
  auto* dst = static_cast<Out*>(out);
  auto* nonfinite = static_cast<Out*>(nonfinite_flag);
  auto* used = static_cast<Out*>(used_flag);
  if (aligned) {
    scale_and_pack_kernel<In, Out, kVec><<<blocks, kThreads, 0, stream>>>(src, dst, numel, scale, nonfinite, used);
  } else {
    scale_and_pack_kernel<In, Out, 1><<<blocks, kThreads, 0, stream>>>(src, dst, numel, scale, nonfinite, used);
  }
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string("hsync: scale_and_pack kernel launch failed: ") +
                             cudaGetErrorString(status));
  }
}

// Calls body(In{}) with a value of the C++ type of `dtype`, a tag for its type.
template <typename Body>
void dispatch(KernelDType dtype, const Body& body) {
  switch (dtype) {
    case KernelDType::kFloat32: return body(float{});
    case KernelDType::kFloat64: return body(double{});
    case KernelDType::kFloat16: return body(__half{});
    case KernelDType::kBFloat16: return body(__nv_bfloat16{});
  }
}

}  // namespace

void launch_scale_and_pack(KernelDType in_dtype, KernelDType out_dtype, const void* in, void* out, int64_t numel,
                           const double* scale, void* nonfinite_flag, void* used_flag,
                           cudaStream_t stream) {
  dispatch(in_dtype, [&](auto in_tag) {
    dispatch(out_dtype, [&](auto out_tag) {
      launch<decltype(in_tag), decltype(out_tag)>(in, out, numel, scale, nonfinite_flag, used_flag, stream);
    });
  });
}

}  // namespace hsync
