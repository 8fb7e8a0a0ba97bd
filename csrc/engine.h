// The reducer: owns the buckets of one wrapped model and reduces its gradients once per step.
//
// Note [Weighted reduction]
// Rank r holds n_r examples and a local mean loss with gradient g_r; the gradient of the global
// mean is g = sum_r (n_r / N) g_r with N = sum_r n_r. A weighted step starts with one fused
// all-reduce of the per-step scalars (slot 0 is n_r; the others are the caller's, see
// hsync/stats.py), which gives N before any gradient is packed. It is waited for only when the
// first gradient is ready, so its latency hides behind the start of backward. Each gradient is
// then packed scaled by ref_r / N (Note [Fused scale-and-pack]), where ref_r is the weight the local
// gradient is expressed in (the caller divides micro-step losses by it under no_sync), and the
// buckets are SUM-reduced. A plain loss.backward() uses the scale 1 / world_size: torch DDP.
//
// Note [Step lifecycle]
// A step begins when backward reaches an output of the wrapper's forward (begin_backward), with
// the first gradient hook that fires while syncing, or with begin_weighted_step; its state is one
// Step, reset whole as it begins. Each hook packs its gradient and launches every bucket that is
// complete, in bucket order, so all ranks issue the same collectives in the same order. At the end of
// backward, finalize() packs what no hook delivered (parameters unused on this rank: their
// accumulated gradient if they have one, zeros otherwise), launches the remaining buckets,
// then waits for each bucket in turn and writes it back while later buckets are still being
// reduced (as c10d's reducer does). A parameter with no gradient on any rank keeps
// no gradient, as with DDP's find_unused_parameters. finalize() runs as an autograd callback at
// the end of a plain loss.backward(); a weighted step is finalized by its caller after
// backward returns. Which graph tasks may feed a step: Note [Nested backwards]. The other Notes
// of the engine stand in engine.cpp beside the code they explain: [Deferred normalisation],
// [Gradients as bucket views], [Which backward synchronises], [Nested backwards],
// [A second backward through one forward], [A backward that fails], [Join], [Communication hooks],
// [Bucket memory], [Owned buckets].
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/comm.hpp>

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
#include "hook_chain.h"

namespace hsync {

// One flat buffer of gradients of one dtype, reduced by one collective.
//
// Layout: [slot of param 0 | slot of param 1 | ... | nonfinite flag | used flag per param].
// Slots start at 16-byte boundaries for vectorised packing (padding stays zero), except under a
// communication hook, which reads the buffer as DDP lays it out: the gradients end to end.
struct Bucket {
  at::Tensor buffer;               // of the communication dtype; undefined while released
  std::vector<int64_t> params;     // indices into Engine::params_
  std::vector<int64_t> offsets;    // per param: where its slot starts in the buffer
  int64_t values_numel = 0;        // the slots and their padding: the tail starts here
  std::vector<at::Tensor> slots;   // per param: its slot, viewed in the parameter's shape
  at::Tensor nonfinite_flag;       // one element
  std::vector<at::Tensor> used;    // per param: its one-element used flag
  at::Tensor tail;                 // nonfinite flag and used flags, zeroed at each step
  int64_t tail_offset = 0;         // where the tail starts among all buckets' tails, in bucket order
  int owner = -1;                  // the rank it is reduced to: Note [Owned buckets]; -1: all-reduced
  bool transient = false;          // another rank's: its buffer lives from its first gradient to its launch
  int in_flight_buffer = -1;       // a transient one's in-flight buffer while it fills: Note [Owned buckets]
  size_t pending = 0;              // params not packed yet in this step
  uint64_t seq = 0;                // its all-reduce's sequence number in this step (none with a hook)

  int64_t tail_numel() const { return 1 + static_cast<int64_t>(params.size()); }
};

// The state of the step in progress, or of the last one until the next begins (its scalars are read
// after it ends): reset whole when a step starts. Note [Step lifecycle].
struct Step {
  bool active = false;                 // begun and not finalized
  bool plain = false;                  // begun by backward itself: finalize runs as an autograd callback
  int task_id = -1;                    // the autograd graph task that began a plain step
  bool any_task = false;               // hooks of nested graph tasks feed it: Note [Nested backwards]
  size_t next_bucket = 0;              // the next bucket to launch
  std::vector<bool> ready;             // per parameter: its gradient was delivered
  std::vector<bool> unused;            // per parameter: it had no gradient here (zeros were sent)
  int64_t forward = -1;                // the synchronised forward whose outputs its backward reached
  at::Tensor pack_scale;               // 0-dim float64 on the engine's device
  bool pack_scale_resolved = true;     // false from a weighted step's start until N is known
  bool normalise_at_write_back = false;  // Note [Deferred normalisation]
  double write_back_scale = 1.0;       // 1 / N once resolved, when normalising at write-back
  at::Tensor tails_on_host;            // the reduced bucket tails, copied once (GPU)
  at::Tensor scalars;                  // a weighted step's scalars, reduced in place
  uint64_t scalars_seq = 0;            // their all-reduce's sequence number
  bool scalars_due = false;            // their all-reduce is not issued yet
  at::Tensor scalars_host;             // their copy on the host (GPU only)
  std::optional<c10::Event> scalars_copied;
  at::Tensor ref_weight;               // the weight local gradients are expressed in
  bool failed = false;                 // this rank's backward raised: Note [A backward that fails]
};

// Memory that transient buckets (another rank's gradients, Note [Owned buckets]) borrow from their first
// gradient to their reduce's launch, then hand to the next one once that reduce is done.
struct InFlightBuffer {
  at::Tensor bytes;               // uint8, the largest transient bucket's size
  std::optional<uint64_t> reduce; // the last reduce sent from it; none: free at once
  bool filling = false;           // a bucket not launched yet holds it
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

  // Called when backward reaches an output of the wrapper's `forward`-th synchronised forward:
  // Notes [Nested backwards], [A second backward through one forward].
  void begin_backward(int64_t forward);

  // Each bucket's values go through `hook` instead of hsync's all-reduce: Note [Communication hooks].
  // Before the first step only.
  void set_comm_hook(std::shared_ptr<c10d::CommHookInterface> hook);

  // Each parameter's owner, the one rank its gradient is reduced to (Note [Owned buckets]); between steps,
  // the same on every rank, without a communication hook. `witness`: a parameter of owner -1 whose gradient
  // carries a non-finite step's NaN on a rank that owns none (Note [A non-finite step on every rank]); -1: none.
  void set_owners(const std::vector<int64_t>& owners, int64_t witness = -1);

  // Under Join, plain steps all-reduce `scalars` (this rank's, weight 1) as weighted steps do;
  // an undefined tensor turns that off. Note [Join].
  void set_join_plain_step(const std::optional<at::Tensor>& scalars, bool divide_by_world_size);

  // Broadcasts `tensors` in place from `root`, in collectives of at most a bucket's bytes; their autograd
  // versions stay. `label` names what they are in errors (default: parameters and buffers).
  void broadcast_coalesced(const std::vector<at::Tensor>& tensors, int root, const std::string& label = {});

  // Number of non-finite flags raised in the last completed step, summed over ranks and buckets
  // (a 0-dim float64 tensor on the engine's device; reading it is the caller's choice).
  at::Tensor last_grad_nonfinite() const { return last_grad_nonfinite_; }

  // Synchronised steps completed, weighted and plain (a Balancer tells its own from a loop's).
  uint64_t steps_completed() const { return steps_completed_.load(); }

  std::vector<std::vector<int64_t>> bucket_params() const;
  // The bytes of the bucket buffers allocated now: Note [Bucket memory].
  int64_t allocated_bucket_bytes() const;

  // Times this rank's own work, without its waits for peers: Note [Busy time].
  BusyClock& clock() { return clock_; }

  // Throws if a collective failed here or on a peer. On GPU a bucket's failure is known only once
  // the host has waited for the step (StepStats.finite does): call this after such a wait.
  void check() const { comm_->check(); }

  // The communicator, for the wrapper's own collectives between steps (hsync/collectives.py).
  const std::shared_ptr<Communicator>& comm() const { return comm_; }

 private:
  at::ScalarType bucket_dtype(size_t index) const;
  bool grad_is_slot(size_t index) const;   // Note [Gradients as bucket views]
  void build_buckets(const std::vector<int64_t>& order);
  void rebuild_in_current_order();  // the buckets built anew (after a change of layout), gradients moved along
  // One collective, of non-empty tensors.
  void broadcast_flat(const std::vector<at::Tensor>& tensors, int root, const std::string& label);
  void allocate(Bucket& bucket);            // a zeroed buffer and its views
  void release(Bucket& bucket);             // Note [Owned buckets]
  int take_in_flight_buffer();              // Note [Owned buckets]
  void move_grads_into_slots();  // Note [Gradients as bucket views]
  void on_gradient_ready(size_t index);
  void start_step();                       // resets step_; caller holds mutex_
  void start_plain_step(int task);
  void start_weighted_step(const at::Tensor& scalars, const at::Tensor& ref_weight, bool scale_by_world_size);
  void skip_unused(size_t index);          // Note [Step lifecycle]
  void refuse_a_late_gradient(size_t index);  // Note [Nested backwards]
  void resolve_pack_scale();               // caller holds mutex_
  void issue_due_step_scalars();           // caller holds mutex_
  void queue_scalars_copy();               // GPU: the step scalars to the host, after the stream; caller holds mutex_
  void pack(size_t index, const at::Tensor& grad);
  void launch_complete_buckets();
  void set_hooked_buckets();               // Note [Hook order]
  void take_hook_result(size_t index);     // Note [Communication hooks]
  void finalize();
  // 1 if a float16 bucket's all-reduce overflowed; a one-element float64 tensor on the device.
  static at::Tensor sum_overflowed(const Bucket& bucket);
  // The reduced values into the gradients; returns whether a sum normalised there is not finite
  // (Note [Deferred normalisation]).
  bool write_back(const Bucket& bucket);
  // With owners: every bucket's reduced flags (and a float16 bucket's overflow, or a sum the write-back
  // found not finite: `sum_not_finite`, by bucket) to every rank, in one all-reduce after the buckets'
  // reduces; returns the flags that count as non-finite. Note [Owned buckets].
  at::Tensor share_owned_flags(const std::vector<bool>& sum_not_finite);
  // With owners, after share_owned_flags: Note [A non-finite step on every rank].
  void spread_nonfinite_to_owned_gradients();
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
  std::vector<int64_t> owners_;             // per param, Note [Owned buckets]; empty: every bucket all-reduced
  int64_t witness_ = -1;                    // Note [A non-finite step on every rank]
  static constexpr size_t kInFlightBuffers = 2;  // double buffering: one reduces while the next fills
  std::vector<InFlightBuffer> in_flight_buffers_;  // during a step; more only while gradients come out of order
  int64_t in_flight_buffer_bytes_ = 0;

  std::mutex mutex_;
  std::atomic<bool> expect_gradients_{false};  // written by Python, read by autograd's threads
  at::Tensor join_scalars_;                 // Note [Join]; undefined outside Join
  bool join_divide_by_world_size_ = true;
  Step step_;                               // Note [Step lifecycle]
  std::atomic<int> nested_step_task_{-1};  // the last step's task, if a gradient hook began it
  std::atomic<int> second_backward_task_{-1};  // Note [A second backward through one forward]
  std::vector<int64_t> ready_order_;        // recorded until the buckets are rebuilt
  bool rebuilt_ = false;
  at::Tensor plain_scale_;                  // 1 / world_size (1 with a communication hook)
  std::shared_ptr<HookChain> hook_chain_;   // with a hook: Notes [Communication hooks], [Hook order]
  double hook_factor_ = 1.0;                // world_size with a hook: it divides by the world size
  at::Tensor last_grad_nonfinite_;
  std::atomic<uint64_t> steps_completed_{0};  // written by autograd's threads (plain steps), read by Python
  BusyClock clock_;
};

}  // namespace hsync
