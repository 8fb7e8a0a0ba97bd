// Check macros used at the boundary of the extension. Each failure names what was wrong and where,
// so an error raised on any rank can be acted on without a debugger.
#pragma once

#include <c10/util/Exception.h>

// Argument checks: a TORCH_CHECK that prefixes the message with "hsync: ".
#define HSYNC_CHECK(cond, ...) TORCH_CHECK((cond), "hsync: ", __VA_ARGS__)

// hsync's own invariants: a failure is a bug in hsync, whatever the caller passed.
#define HSYNC_ASSERT(cond, ...) TORCH_INTERNAL_ASSERT((cond), "hsync: internal error: ", __VA_ARGS__)

#ifdef HSYNC_WITH_CUDA
#include <cuda_runtime.h>
#include <nccl.h>

#define HSYNC_CUDA_CHECK(expr)                                                        \
  do {                                                                                \
    cudaError_t status_ = (expr);                                                     \
    TORCH_CHECK(status_ == cudaSuccess, "hsync: CUDA error at ", __FILE__, ":",       \
                __LINE__, " in ", #expr, ": ", cudaGetErrorString(status_));          \
  } while (0)

#define HSYNC_NCCL_CHECK(expr)                                                        \
  do {                                                                                \
    ncclResult_t result_ = (expr);                                                    \
    TORCH_CHECK(result_ == ncclSuccess, "hsync: NCCL error at ", __FILE__, ":",       \
                __LINE__, " in ", #expr, ": ", ncclGetErrorString(result_),           \
                " (", ncclGetLastError(nullptr), ")");                                \
  } while (0)
#endif
