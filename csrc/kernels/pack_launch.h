// Launchers of the CUDA kernels, on raw pointers: the .cu files include no ATen headers, which
// keeps nvcc fast enough to compile for several architectures on every build.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace hsync {

enum class KernelDType { kFloat32, kFloat64, kFloat16, kBFloat16 };

// See Notes [Fused scale-and-pack] and [Communication dtype] in pack.h. `scale` points to one
// float64 on the device; the flags are of out_dtype.
void launch_scale_and_pack(KernelDType in_dtype, KernelDType out_dtype, const void* in, void* out, int64_t numel,
                           const double* scale, void* nonfinite_flag, void* used_flag,
                           cudaStream_t stream);

}  // namespace hsync
