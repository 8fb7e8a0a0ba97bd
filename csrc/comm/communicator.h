// The communicator interface the engine talks to. One implementation per backend, in its own file
// (as in Horovod's horovod/common/ops): the engine itself never names gloo or NCCL.
#pragma once

#include <ATen/ATen.h>

#include <string>

namespace hsync {

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual std::string backend() const = 0;

  // Enqueues an in-place SUM all-reduce of `tensor`. Returns at once; collectives run in the
  // order they were issued, overlapping the caller's work. `tensor` must stay untouched until
  // synchronize() returns.
  virtual void all_reduce_sum(const at::Tensor& tensor) = 0;

  // Enqueues an in-place broadcast of `tensor` from `root`.
  virtual void broadcast(const at::Tensor& tensor, int root) = 0;

  // Orders the caller after every collective issued so far: blocks the calling thread on CPU,
  // makes the current CUDA stream wait on GPU (no host synchronisation).
  virtual void synchronize() = 0;
};

}  // namespace hsync
