// Host API of the fused scale-and-pack kernel, dispatched to the CPU or CUDA version by device.
//
// Note [Fused scale-and-pack]
// Each gradient is written into its bucket already multiplied by this rank's share of the global
// weight (w_r / N), so the bucket can be SUM-reduced as it is: the division costs no extra pass
// (c10d's reducer fuses its division by world size into the same copy). The same pass reports
// whether the *unscaled* gradient held a non-finite value, so a NaN on a rank whose weight is 0
// is still seen, and marks the parameter as used on this rank. Both flags live in the bucket's
// tail and travel with the bucket's own all-reduce: no extra collective.
#pragma once

#include <ATen/ATen.h>

namespace hsync {

// out = grad * scale, elementwise; grad may be out itself. `scale` is a 0-dim float64 tensor on
// the same device.
// Sets *nonfinite_flag to 1 if `grad` holds an inf or NaN, and *used_flag to 1. Both flags are
// one-element views of the bucket (same dtype as `out`).
void scale_and_pack(const at::Tensor& grad, const at::Tensor& out, const at::Tensor& scale,
                    const at::Tensor& nonfinite_flag, const at::Tensor& used_flag);

void scale_and_pack_cpu(const at::Tensor& grad, const at::Tensor& out, double scale,
                        const at::Tensor& nonfinite_flag, const at::Tensor& used_flag);

// out = in * scale on the CPU (out contiguous): the write-back of Note [Deferred normalisation].
void scale_cpu(const at::Tensor& in, const at::Tensor& out, double scale);

#ifdef HSYNC_WITH_CUDA
void scale_and_pack_cuda(const at::Tensor& grad, const at::Tensor& out, const at::Tensor& scale,
                         const at::Tensor& nonfinite_flag, const at::Tensor& used_flag);
#endif

}  // namespace hsync
