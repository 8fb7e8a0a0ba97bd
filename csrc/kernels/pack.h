// Host API of the fused scale-and-pack kernel, dispatched to the CPU or CUDA version by device.
//
// Note [Fused scale-and-pack]
// Each gradient is written into its bucket already multiplied by this rank's share of the global
// weight (w_r / N), so the bucket can be SUM-reduced as it is: the division costs no extra pass
// (c10d's reducer fuses its division by world size into the same copy). The same pass reports
// whether the *unscaled* gradient held a non-finite value, so a NaN on a rank whose weight is 0
// is still seen, and marks the parameter as used on this rank. Both flags live in the bucket's
// tail and travel with the bucket's own all-reduce: no extra collective.
//
// Note [Communication dtype]
// The bucket may hold a narrower dtype than the gradient (WeightedDDP's comm_dtype): the cast
// rides in the same pass as the scaling, so bfloat16 or float16 communication halves the bytes on
// the wire at no extra pass over the gradients (DDP's compression hooks cast into a new tensor
// before the all-reduce, and cast and divide again after it). The product is computed in the
// wider of the two types and rounded once. The non-finite flag is raised by a non-finite value
// read or written, so a float32 gradient that overflows float16 is reported, not silently summed
// as inf; a float16 sum that overflows is flagged after the all-reduce (Engine::sum_overflowed).
#pragma once

#include <ATen/ATen.h>

namespace hsync {

// out = grad * scale, elementwise, cast to out's dtype; grad may be out itself (then of one dtype).
// `scale` is a 0-dim float64 tensor on the same device.
// Sets *nonfinite_flag to 1 if `grad` holds an inf or NaN, and *used_flag to 1. Both flags are
// one-element views of the bucket (same dtype as `out`).
void scale_and_pack(const at::Tensor& grad, const at::Tensor& out, const at::Tensor& scale,
                    const at::Tensor& nonfinite_flag, const at::Tensor& used_flag);

void scale_and_pack_cpu(const at::Tensor& grad, const at::Tensor& out, double scale,
                        const at::Tensor& nonfinite_flag, const at::Tensor& used_flag);

// out = in * scale on the CPU, cast to out's dtype (out contiguous): the write-back of
// Note [Deferred normalisation]. Returns whether a value of out is an inf or NaN.
bool scale_cpu(const at::Tensor& in, const at::Tensor& out, double scale);

#ifdef HSYNC_WITH_CUDA
void scale_and_pack_cuda(const at::Tensor& grad, const at::Tensor& out, const at::Tensor& scale,
                         const at::Tensor& nonfinite_flag, const at::Tensor& used_flag);
#endif

}  // namespace hsync
