#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>

#include "checks.h"
#include "kernels/pack.h"

namespace hsync {
namespace {

// Large enough that thread start-up is amortised; small gradients run on the calling thread.
constexpr int64_t kPackGrainSize = 1 << 16;

// The wider of the two types' arithmetic, so that neither side loses precision in the product.
template <typename In, typename Out>
using OpMath = std::conditional_t<(sizeof(at::opmath_type<In>) >= sizeof(at::opmath_type<Out>)),
                                  at::opmath_type<In>, at::opmath_type<Out>>;

template <typename In, typename Out>
bool scale_range(const In* in, Out* out, int64_t begin, int64_t end, double scale) {
  using Op = OpMath<In, Out>;
  const Op s = static_cast<Op>(scale);
  const Op max = std::numeric_limits<Op>::max();
  // An integer AND keeps the loop vectorisable (a float reduction would not be, without
  // reassociation): |v| <= max is false exactly for inf and NaN.
  int all_finite = 1;
  for (int64_t i = begin; i < end; ++i) {
    const Op v = static_cast<Op>(in[i]);
    const Out packed = static_cast<Out>(v * s);
    out[i] = packed;
    all_finite &= static_cast<int>(std::abs(v) <= max);
    // A narrowing cast can overflow (a float32 gradient above float16's 65504 packed as float16).
    if constexpr (!std::is_same_v<In, Out>) {
      all_finite &= static_cast<int>(std::abs(static_cast<Op>(packed)) <= max);
    }
  }
  return all_finite == 0;
}

template <typename T>
constexpr bool kIs16Bit = std::is_same_v<T, c10::Half> || std::is_same_v<T, c10::BFloat16>;

// Note [Staged cast]
// This file is compiled for the baseline ISA, where a float -> float16 conversion is a scalar bit
// manipulation, many times slower than the float32 pack (benchmarks/README.md has the figures; float32 ->
// bfloat16 has a loop of its own, Note [Branchless bfloat16]). torch's own cast is vectorised for the machine's ISA, so a large range is scaled in
// the wider precision into a chunk that stays in cache, then cast by torch; the written halves are
// checked for inf/NaN by their exponent bits, which vectorises too. Below kStagedMinimum elements
// the per-chunk call costs more than the scalar loop saves.
constexpr int64_t kStagedMinimum = 4096;

// Note [Branchless bfloat16]
// float -> bfloat16 as c10::BFloat16 rounds it (to nearest, ties to even; a NaN becomes 0x7FC0), written as
// integer arithmetic with a select instead of c10's branch on isnan: the compiler vectorises the loop even for
// the baseline ISA, a single pass where the staged cast (Note [Staged cast]) takes three. The flag is the
// written value's: a NaN or infinity read, or a finite value that rounds to infinity, all end with the
// exponent's bits set (the scale is finite, so a value read is non-finite exactly when its product is).
// With the baseline's 128-bit vectors the loop is compute-bound (16 MiB in 1.6 ms on the development VM's
// EPYC, a copy of the same floats 1.2 ms); an AVX2 clone, chosen at load time where the CPU has it, halves
// that (0.9 ms), below the copy. The float32 pack gains nothing from it: it is memory-bound already.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx2", "default")))
#endif
bool scale_to_bfloat16(const float* in, c10::BFloat16* out, int64_t begin, int64_t end, float scale) {
  uint32_t nonfinite = 0;
  for (int64_t i = begin; i < end; ++i) {
    const float value = in[i] * scale;
    uint32_t bits = 0;
    std::memcpy(&bits, &value, sizeof bits);
    const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    const uint32_t half = (bits & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : rounded;
    out[i].x = static_cast<uint16_t>(half);
    nonfinite |= static_cast<uint32_t>((half & 0x7F80u) == 0x7F80u);
  }
  return nonfinite != 0;
}

template <typename In, typename Out>
bool scale_range_staged(const In* in, Out* out, int64_t numel, double scale) {
  using Op = OpMath<In, Out>;
  constexpr uint16_t kExponentBits = std::is_same_v<Out, c10::Half> ? 0x7C00 : 0x7F80;
  const int64_t chunk = std::min<int64_t>(numel, kPackGrainSize);
  const std::unique_ptr<Op[]> staged(new Op[chunk]);  // uninitialised: every element is written first
  const auto options = at::TensorOptions().dtype(c10::CppTypeToScalarType<Op>::value);
  const auto out_options = at::TensorOptions().dtype(c10::CppTypeToScalarType<Out>::value);
  bool nonfinite = false;
  for (int64_t begin = 0; begin < numel; begin += chunk) {
    const int64_t n = std::min(chunk, numel - begin);
    nonfinite |= scale_range(in + begin, staged.get(), 0, n, scale);
    // Inside at::parallel_for this copy runs on the calling worker: ATen does not nest parallel regions.
    at::from_blob(out + begin, {n}, out_options).copy_(at::from_blob(staged.get(), {n}, options));
    int all_finite = 1;
    for (int64_t i = begin; i < begin + n; ++i) {
      all_finite &= static_cast<int>((out[i].x & kExponentBits) != kExponentBits);
    }
    nonfinite |= all_finite == 0;
  }
  return nonfinite;
}

// out = in * scale over contiguous tensors (in may be out); whether a value read or written was
// an inf or NaN.
template <typename In, typename Out>
bool scale_contiguous(const at::Tensor& in, const at::Tensor& out, double scale) {
  const In* src = in.const_data_ptr<In>();
  Out* dst = out.data_ptr<Out>();
  std::atomic<bool> nonfinite{false};
  at::parallel_for(0, in.numel(), kPackGrainSize, [&](int64_t begin, int64_t end) {
    bool found = false;
    if constexpr (std::is_same_v<In, float> && std::is_same_v<Out, c10::BFloat16>) {
      found = scale_to_bfloat16(src, dst, begin, end, static_cast<float>(scale));
    } else if constexpr (kIs16Bit<Out> && !std::is_same_v<In, Out>) {
      found = end - begin >= kStagedMinimum ? scale_range_staged(src + begin, dst + begin, end - begin, scale)
                                            : scale_range(src, dst, begin, end, scale);
    } else {
      found = scale_range(src, dst, begin, end, scale);
    }
    if (found) nonfinite.store(true, std::memory_order_relaxed);
  });
  return nonfinite.load();
}

template <typename T>
struct Type {
  using type = T;
};

// Calls body(Type<In>{}, Type<Out>{}) for the two tensors' dtypes: one dispatch per gradient, as
// this runs in every gradient hook. (Tags, not a template lambda: the sources stay C++17.)
template <typename Body>
void dispatch_pair(const at::Tensor& in, const at::Tensor& out, const Body& body) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, in.scalar_type(), "hsync_pack_in", [&] {
    using In = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "hsync_pack_out", [&] {
      body(Type<In>{}, Type<scalar_t>{});
    });
  });
}

}  // namespace

bool scale_cpu(const at::Tensor& in, const at::Tensor& out, double scale) {
  HSYNC_CHECK(out.is_contiguous() && in.numel() == out.numel(),
              "scale_cpu: the output must be contiguous and of the input's size");
  const at::Tensor contiguous_in = in.contiguous();
  bool nonfinite = false;
  dispatch_pair(contiguous_in, out, [&](auto in_type, auto out_type) {
    nonfinite = scale_contiguous<typename decltype(in_type)::type, typename decltype(out_type)::type>(contiguous_in,
                                                                                                      out, scale);
  });
  return nonfinite;
}

void scale_and_pack_cpu(const at::Tensor& grad, const at::Tensor& out, double scale,
                        const at::Tensor& nonfinite_flag, const at::Tensor& used_flag) {
  const at::Tensor in = grad.contiguous();
  dispatch_pair(in, out, [&](auto in_type, auto out_type) {
    using Out = typename decltype(out_type)::type;
    if (scale_contiguous<typename decltype(in_type)::type, Out>(in, out, scale)) {
      *nonfinite_flag.data_ptr<Out>() = Out(1);
    }
    *used_flag.data_ptr<Out>() = Out(1);
  });
}

void scale_and_pack(const at::Tensor& grad, const at::Tensor& out, const at::Tensor& scale,
                    const at::Tensor& nonfinite_flag, const at::Tensor& used_flag) {
  HSYNC_CHECK(grad.layout() == at::kStrided, "sparse gradients are not supported");
  HSYNC_CHECK(grad.numel() == out.numel(), "pack: gradient (", grad.numel(), " ", grad.scalar_type(),
              ") does not fit its slot (", out.numel(), " ", out.scalar_type(), ")");
  HSYNC_CHECK(grad.device() == out.device(), "pack: gradient on ", grad.device(),
              " but its bucket is on ", out.device());
  if (!out.is_contiguous()) {
    // A slot laid out as its channels_last or transposed parameter (Engine::allocate): dense, so the gradient,
    // put in the same layout if it is not, is packed as the flat memory both occupy.
    HSYNC_CHECK(out.is_non_overlapping_and_dense(), "pack: the bucket slot must be dense");
    const at::Tensor in = grad.strides() == out.strides()
                              ? grad
                              : at::empty_strided(out.sizes(), out.strides(), grad.options()).copy_(grad);
    const auto flat = [](const at::Tensor& t) { return t.as_strided({t.numel()}, {1}); };
    scale_and_pack(flat(in), flat(out), scale, nonfinite_flag, used_flag);
    return;
  }
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
