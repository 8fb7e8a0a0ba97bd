#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "checks.h"
#include "kernels/pack.h"
#include "kernels/pack_launch.h"

namespace hsync {
namespace {

KernelDType kernel_dtype(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return KernelDType::kFloat32;
    case at::kDouble: return KernelDType::kFloat64;
    case at::kHalf: return KernelDType::kFloat16;
    case at::kBFloat16: return KernelDType::kBFloat16;
    default: HSYNC_CHECK(false, "gradients of dtype ", type, " are not supported");
  }
  return KernelDType::kFloat32;  // unreachable
}

}  // namespace

void scale_and_pack_cuda(const at::Tensor& grad, const at::Tensor& out, const at::Tensor& scale,
                         const at::Tensor& nonfinite_flag, const at::Tensor& used_flag) {
  const c10::cuda::CUDAGuard guard(out.device());
  const at::Tensor in = grad.contiguous();
  launch_scale_and_pack(kernel_dtype(in.scalar_type()), kernel_dtype(out.scalar_type()), in.const_data_ptr(),
                        out.data_ptr(), in.numel(), scale.const_data_ptr<double>(), nonfinite_flag.data_ptr(),
                        used_flag.data_ptr(), c10::cuda::getCurrentCUDAStream(out.device().index()));
}

}  // namespace hsync
