// The reducer: owns the buckets of one wrapped model and reduces its gradients once per step.
//
// Note [Weighted reduction]
// Rank r holds n_r examples and a local mean loss with gradient g_r; the gradient of the global
// mean is g = sum_r (n_r / N) g_r with N = sum_r n_r. A weighted step starts with one fused
// all-reduce of the per-step scalars (slot 0 is n_r; the others are the caller's, see
// hsync/stats.py), which gives N before any gradient is packed. It is waited for only when the
// first gradient is ready, so its latency hides behind the start of backward. Each gradient is then packed
// scaled by ref_r / N (Note [Fused scale-and-pack]), where ref_r is the weight the local
// gradient is expressed in (the caller divides micro-step losses by it under no_sync), and the
// buckets are SUM-reduced. A plain loss.backward() uses the scale 1 / world_size: torch DDP.
//
// Note [Deferred normalisation]
// On the CPU, waiting for N blocks the host: backward cannot go on until gloo has carried the
// scalars to every rank and back. There, weighted steps pack ref_r * g_r instead, launch the
// scalars' all-reduce and the buckets' without waiting, and divide by N in the write-back, by
// which time every collective has completed anyway: g = (sum_r ref_r g_r) * (1 / N). As N is
// not needed sooner, the scalars' all-reduce is issued right before the first bucket's rather
// than at the start of backward: gloo's threads then wake once for both, which on a busy host
// makes the weighted step about 8% faster on a model of many small gradients. The result
// depends only on this step's inputs, as before, so resumed runs stay bit-identical. Values in
// the bucket grow by ref_r rather than staying near g: harmless in float32, float64 and
// bfloat16, so only models with float16 gradients keep scaling before the sum. With gradients
// as bucket views the division would be a second pass over every gradient, after the last
// all-reduce, where waiting for N costs nothing in practice (the first gradient of a real
// model takes longer to compute than the scalars take to travel): measured on BERT, waiting was
// about 1% faster, so views scale before the sum too. On GPU the wait is the device's, not the
// host's (the pack kernel waits on the scalars' all-reduce on the stream), so GPU steps scale
// before the sum as described above. A bucket of float16 scales before the sum whatever the
// gradients' own dtype (a comm_dtype: Note [Communication dtype] in kernels/pack.h).
//
// Note [Step lifecycle]
// A step begins when backward reaches an output of the wrapper's forward (begin_backward), with
// the first gradient hook that fires while syncing, or with begin_weighted_step. Each hook packs
// its gradient and launches every bucket that is complete,
// in bucket order, so all ranks issue the same collectives in the same order. At the end of
// backward, finalize() packs what no hook delivered (parameters unused on this rank: their
// accumulated gradient if they have one, zeros otherwise), launches the remaining buckets,
// then waits for each bucket in turn and writes it back while later buckets are still being
// reduced (as c10d's reducer does). A parameter with no gradient on any rank keeps
// no gradient, as with DDP's find_unused_parameters. finalize() runs as an autograd callback at
// the end of a plain loss.backward(); a weighted step is finalized by its caller after
// backward returns. Which graph tasks may feed a step: Note [Nested backwards].
//
// Note [A backward that fails]
// A backward that raises on one rank (out of memory, say) still completes the step's collectives
// (its peers are waiting in them), but what it packs is a partial gradient. The buckets not
// launched yet then carry a raised non-finite flag, so every rank's step reads as not finite and
// is skipped everywhere, as after an overflow, instead of peers stepping on it unawares. (If
// every bucket had already gone, the reduced gradient is whole.) A micro-step under no_sync that
// fails marks its window's loss as not finite instead (hsync/ddp.py): the same outcome, at the
// window's synchronising backward.
// Not so when backward passes exchange gradients between ranks (cross_rank_backward: a
// SyncBatchNorm): the peers may be waiting in the backward's own collectives, which this rank will
// not run, and the step's collectives would meet those (on the CPU, in the same process group: a
// gloo abort, or sums of the wrong tensors). The rank then gives up instead (abandon_step): it
// posts its failure, so peers waiting in hsync's collectives stop at once and those in the
// backward's fail when it exits, and its communicator refuses any further collective.
//
// Note [Gradients as bucket views]
// With grads_as_views, each parameter's .grad *is* its slot in the bucket (as DDP's
// gradient_as_bucket_view): autograd accumulates into the slot, pack scales it in place, the
// all-reduce leaves the reduced gradient where the optimizer reads it, and there is no
// write-back copy and no second copy of the gradients in memory. A gradient that is not its
// slot (the first backward, or any after zero_grad(set_to_none=True)) is packed by copy and the
// parameter's .grad is then pointed at the slot, so the fresh tensor is freed at once. When the
// buckets are rebuilt the gradients move to their new slots. A slot of another dtype than its
// gradient (a comm_dtype) cannot be the .grad: that .grad stays a tensor of the parameter's dtype
// and receives the reduced values by a cast, as without views.
//
// Note [Which backward synchronises]
// As with DDP, a plain backward reduces gradients only after the wrapper's own forward ran with
// gradients enabled outside no_sync (DDP's prepare_for_backward): hooks are armed there and
// disarmed when the step completes. A backward through the bare module (an evaluation on one
// rank, a second use of a sub-module) then accumulates locally instead of starting a collective
// that no peer joins. A weighted step arms the hooks itself. A gradient that autograd leaves
// undefined (a custom Function returning None for a parameter) counts as unused on this rank,
// as in DDP: it contributes zeros and, used nowhere, leaves .grad untouched.
//
// Note [Nested backwards]
// Reentrant activation checkpointing runs a nested backward, a graph task of its own, inside the
// outer one, and its hooks feed the same step. A plain step must then end with the outermost
// backward, so the wrapper hooks the autograd nodes of its forward's outputs (begin_backward),
// which run first in the outermost task: the step begins there and its finalize callback waits for
// that task, while hooks of any task feed it. A weighted step ends when its caller's backward
// returns, so nested tasks may feed it too. Only a plain step begun by a gradient hook (the
// wrapper saw no output tensor) keeps to the hook's own graph task; a hook of another task then
// means an earlier backward never finished. If that task was nested, hooks of the outer one fire
// after the step ended: they are refused (a task older than the step's still running encloses
// it), not left local. A second nested task inside the same outer one is newer than the step's and
// cannot be told from a later backward through the bare module; its gradients stay local. The
// wrapper looks for output tensors where DDP does, so only an output of another type meets this.
//
// Note [Join]
// Under torch's Join context a rank whose data ran out shadows every synchronised step of the
// others with a weighted step of weight 0 (hsync/ddp.py). For that it must issue the same
// collectives, so under Join a plain loss.backward() all-reduces step scalars too (weight 1 per
// rank): its gradients are either scaled by 1 / world_size as always (DDP's
// divide_by_initial_world_size, the default) or by 1 / (ranks not joined), read from those scalars.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/autograd/variable.h>

#include <c10/core/Event.h>

#include <atomic>
#include <memory>
#include <optional>
#include <mutex>
#include <string>
#include <vector>

#include "bucket.h"
#include "busy_clock.h"
#include "comm/communicator.h"

namespace hsync {

// One flat buffer of gradients of one dtype, reduced by one collective.
//
// Layout: [slot of param 0 | slot of param 1 | ... | nonfinite flag | used flag per param].
// Slots start at 16-byte boundaries for vectorised packing; padding stays zero.
struct Bucket {
  at::Tensor buffer;               // of the communication dtype
  std::vector<int64_t> params;     // indices into Engine::params_
  std::vector<at::Tensor> slots;   // per param: its slot, viewed in the parameter's shape
  at::Tensor nonfinite_flag;       // one element
  std::vector<at::Tensor> used;    // per param: its one-element used flag
  at::Tensor tail;                 // nonfinite flag and used flags, zeroed at each step
  int64_t tail_offset = 0;         // where the tail starts among all buckets' tails, in bucket order
  size_t pending = 0;              // params not packed yet in this step
  uint64_t seq = 0;                // its all-reduce's sequence number in this step
};

class Engine {
 public:
  // `comm_dtype`: the dtype gradients travel in (Note [Communication dtype]); none: each their own.
  Engine(std::vector<at::Tensor> params, std::vector<std::string> names,
         std::shared_ptr<Communicator> comm, int64_t bucket_bytes_cap,
         int64_t first_bucket_bytes_cap, bool grads_as_views,
         std::optional<at::ScalarType> comm_dtype);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Starts a weighted step: all-reduces `scalars` (float64, 1-D, slot 0 = this rank's weight)
  // in place and packs gradients with the scale ref_weight / scalars[0].
  void begin_weighted_step(const at::Tensor& scalars, const at::Tensor& ref_weight);

  // The reduced scalars of the last weighted step, on the host. On GPU this waits for their
  // copy, which was queued right after their all-reduce, not for the rest of the step.
  at::Tensor step_scalars();

  // Completes the current step if autograd did not (no hook fired in this backward).
  void finalize_if_pending();

  // This rank's backward raised midway: Note [A backward that fails].
  void mark_step_failed();
  // The same, with cross_rank_backward: gives up the communicator, posting `why` to the peers.
  void abandon_step(const std::string& why);

  // Whether gradient hooks feed a synchronised step: Note [Which backward synchronises].
  void expect_gradients(bool expected) { expect_gradients_.store(expected); }

  // Called when backward reaches an output of the wrapper's forward: Note [Nested backwards].
  void begin_backward();

  // Under Join, plain steps all-reduce `scalars` (this rank's, weight 1) as weighted steps do;
  // an undefined tensor turns that off. Note [Join].
  void set_join_plain_step(const std::optional<at::Tensor>& scalars, bool divide_by_world_size);

  // Broadcasts `tensors` in place from `root`, one collective per dtype; their autograd versions stay.
  void broadcast_coalesced(const std::vector<at::Tensor>& tensors, int root);

  // Number of non-finite flags raised in the last completed step, summed over ranks and buckets
  // (a 0-dim float64 tensor on the engine's device; reading it is the caller's choice).
  at::Tensor last_grad_nonfinite() const { return last_grad_nonfinite_; }

  std::vector<std::vector<int64_t>> bucket_params() const;

  // Times this rank's own work, without its waits for peers: Note [Busy time].
  BusyClock& clock() { return clock_; }

  // Throws if a collective failed here or on a peer. On GPU a bucket's failure is known only once
  // the host has waited for the step (StepStats.finite does): call this after such a wait.
  void check() const { comm_->check(); }

 private:
  at::ScalarType bucket_dtype(size_t index) const;
  bool grad_is_slot(size_t index) const;   // Note [Gradients as bucket views]
  void build_buckets(const std::vector<int64_t>& order);
  void move_grads_into_slots();  // Note [Gradients as bucket views]
  void on_gradient_ready(size_t index);
  void start_step();                       // caller holds mutex_
  void start_plain_step(int task);
  void start_weighted_step(const at::Tensor& scalars, const at::Tensor& ref_weight, bool scale_by_world_size);
  void skip_unused(size_t index);          // Note [Step lifecycle]
  void refuse_a_late_gradient(size_t index);  // Note [Nested backwards]
  void resolve_pack_scale();               // caller holds mutex_
  void pack(size_t index, const at::Tensor& grad);
  void launch_complete_buckets();
  void finalize();
  // 1 if a float16 bucket's all-reduce overflowed; a one-element float64 tensor on the device.
  static at::Tensor sum_overflowed(const Bucket& bucket);
  void write_back(const Bucket& bucket);
  // Whether a parameter with no gradient on this rank got one elsewhere (its reduced used flag),
  // which decides whether it gets a .grad here.
  bool used_on_some_rank(const Bucket& bucket, size_t k);
  void rebuild_from_ready_order();

  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  std::shared_ptr<Communicator> comm_;
  at::Device device_;
  int64_t bucket_bytes_cap_;
  int64_t first_bucket_bytes_cap_;
  bool grads_as_views_;
  std::optional<at::ScalarType> comm_dtype_;
  bool defer_normalisation_ = false;       // Note [Deferred normalisation]

  // The AccumulateGrad node of each parameter, kept alive as long as its hook is registered.
  std::vector<decltype(torch::autograd::impl::grad_accumulator(at::Tensor()))> accumulators_;
  std::vector<uintptr_t> hook_keys_;

  std::vector<Bucket> buckets_;
  std::vector<std::pair<size_t, size_t>> locator_;  // param -> (bucket, position in bucket)

  std::mutex mutex_;
  std::atomic<bool> expect_gradients_{false};  // written by Python, read by autograd's threads
  at::Tensor join_scalars_;                 // Note [Join]; undefined outside Join
  bool join_divide_by_world_size_ = true;
  bool in_step_ = false;
  bool plain_step_ = false;                // begun by backward itself: finalize runs as an autograd callback
  int step_task_id_ = -1;                  // the autograd graph task that began a plain step
  bool any_task_ = false;                  // hooks of nested graph tasks feed it: Note [Nested backwards]
  std::atomic<int> nested_step_task_{-1};  // the last step's task, if a gradient hook began it
  size_t next_bucket_ = 0;                  // next bucket to launch, Note [Step lifecycle]
  std::vector<bool> ready_;
  std::vector<int64_t> ready_order_;        // recorded until the buckets are rebuilt
  bool rebuilt_ = false;
  at::Tensor pack_scale_;                   // 0-dim float64 on device_
  bool pack_scale_resolved_ = true;         // false from begin_weighted_step until N is known
  bool normalise_at_write_back_ = false;    // this step's, Note [Deferred normalisation]
  double write_back_scale_ = 1.0;           // 1 / N once resolved, when normalising at write-back
  at::Tensor tails_on_host_;                // this step's reduced bucket tails, copied once (GPU)
  at::Tensor step_scalars_;                 // the weighted step's scalars, reduced in place
  uint64_t step_scalars_seq_ = 0;           // their all-reduce's sequence number
  bool scalars_due_ = false;                // their all-reduce waits for the first bucket's
  at::Tensor step_scalars_host_;            // their copy on the host (GPU only)
  std::optional<c10::Event> step_scalars_copied_;
  at::Tensor ref_weight_;
  at::Tensor plain_scale_;                  // 1 / world_size
  at::Tensor last_grad_nonfinite_;
  BusyClock clock_;
};

}  // namespace hsync
