#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <atomic>
#include <cmath>
#include <limits>

#include "checks.h"
#include "kernels/pack.h"

namespace hsync {
namespace {

// Large enough that thread start-up is amortised; small gradients run on the calling thread.
constexpr int64_t kPackGrainSize = 1 << 16;

template <typename T>
bool scale_range(const T* in, T* out, int64_t begin, int64_t end, double scale) {
  using opmath_t = at::opmath_type<T>;
  const opmath_t s = static_cast<opmath_t>(scale);
  const opmath_t max = std::numeric_limits<opmath_t>::max();
  // An integer AND keeps the loop vectorisable (a float reduction would not be, without
  // reassociation): |v| <= max is false exactly for inf and NaN.
  int all_finite = 1;
  for (int64_t i = begin; i < end; ++i) {
    const opmath_t v = static_cast<opmath_t>(in[i]);
    out[i] = static_cast<T>(v * s);
    all_finite &= static_cast<int>(std::abs(v) <= max);
  }
  return all_finite == 0;
}

// out = in * scale over contiguous tensors (in may be out); whether `in` held an inf or NaN.
template <typename T>
bool scale_contiguous(const at::Tensor& in, const at::Tensor& out, double scale) {
  const T* src = in.const_data_ptr<T>();
  T* dst = out.data_ptr<T>();
  std::atomic<bool> nonfinite{false};
  at::parallel_for(0, in.numel(), kPackGrainSize, [&](int64_t begin, int64_t end) {
    if (scale_range(src, dst, begin, end, scale)) nonfinite.store(true, std::memory_order_relaxed);
  });
  return nonfinite.load();
}

}  // namespace

void scale_cpu(const at::Tensor& in, const at::Tensor& out, double scale) {
  HSYNC_CHECK(out.is_contiguous(), "scale_cpu: the output must be contiguous");
  const at::Tensor contiguous_in = in.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "scale_cpu", [&] {
    scale_contiguous<scalar_t>(contiguous_in, out, scale);
  });
}

void scale_and_pack_cpu(const at::Tensor& grad, const at::Tensor& out, double scale,
                        const at::Tensor& nonfinite_flag, const at::Tensor& used_flag) {
  const at::Tensor in = grad.contiguous();
  // One dispatch per gradient: this runs in every gradient hook.
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "scale_and_pack_cpu", [&] {
    if (scale_contiguous<scalar_t>(in, out, scale)) *nonfinite_flag.data_ptr<scalar_t>() = scalar_t(1);
    *used_flag.data_ptr<scalar_t>() = scalar_t(1);
  });
}

void scale_and_pack(const at::Tensor& grad, const at::Tensor& out, const at::Tensor& scale,
                    const at::Tensor& nonfinite_flag, const at::Tensor& used_flag) {
  HSYNC_CHECK(grad.layout() == at::kStrided, "sparse gradients are not supported");
  HSYNC_CHECK(grad.numel() == out.numel() && grad.scalar_type() == out.scalar_type(),
              "pack: gradient (", grad.numel(), " ", grad.scalar_type(), ") does not fit its slot (",
              out.numel(), " ", out.scalar_type(), ")");
  HSYNC_CHECK(grad.device() == out.device(), "pack: gradient on ", grad.device(),
              " but its bucket is on ", out.device());
  for (const at::Tensor* flag : {&nonfinite_flag, &used_flag}) {
    HSYNC_CHECK(flag->numel() == 1 && flag->scalar_type() == out.scalar_type() && flag->device() == out.device(),
                "pack: flags must be one-element tensors of the bucket's dtype and device");
  }
  HSYNC_CHECK(scale.numel() == 1 && scale.scalar_type() == at::kDouble && scale.device() == out.device(),
              "pack: the scale must be a float64 scalar on ", out.device());
#ifdef HSYNC_WITH_CUDA
  if (out.is_cuda()) {
    scale_and_pack_cuda(grad, out, scale, nonfinite_flag, used_flag);
    return;
  }
#endif
  HSYNC_CHECK(out.is_cpu(), "pack: this build of hsync has no CUDA support, got a ", out.device(),
              " bucket");
  // A raw read, not item(): this runs once per gradient and must stay cheap.
  scale_and_pack_cpu(grad, out, *scale.const_data_ptr<double>(), nonfinite_flag, used_flag);
}

}  // namespace hsync
