#include "engine.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>

#include <algorithm>
#include <limits>
#include <map>

#include "checks.h"
#include "kernels/pack.h"

namespace hsync {
namespace {

constexpr int64_t kSlotAlignBytes = 16;
// Bucket groups (bucket.h): a dtype, and with owners one group per owner and dtype.
constexpr int64_t kDtypeGroups = static_cast<int64_t>(at::ScalarType::NumOptions);

int64_t round_up(int64_t value, int64_t multiple) { return (value + multiple - 1) / multiple * multiple; }

// The bucket's gradients, flat, without its tail of flags.
at::Tensor values_of(const Bucket& bucket) {
  return bucket.buffer.narrow(0, 0, bucket.values_numel);
}

bool supported_dtype(at::ScalarType type) {
  return type == at::kFloat || type == at::kDouble || type == at::kHalf || type == at::kBFloat16;
}

}  // namespace

Engine::Engine(std::vector<at::Tensor> params, std::vector<std::string> names,
               std::shared_ptr<Communicator> comm, int64_t bucket_bytes_cap,
               int64_t first_bucket_bytes_cap, bool grads_as_views,
               std::optional<at::ScalarType> comm_dtype)
    : params_(std::move(params)),
      names_(std::move(names)),
      comm_(std::move(comm)),
      device_(params_.empty() ? at::Device(at::kCPU) : params_.front().device()),
      bucket_bytes_cap_(bucket_bytes_cap),
      first_bucket_bytes_cap_(first_bucket_bytes_cap),
      grads_as_views_(grads_as_views),
      comm_dtype_(comm_dtype),
      clock_(device_) {
  HSYNC_CHECK(!params_.empty(), "the model has no parameters that require a gradient");
  HSYNC_CHECK(names_.size() == params_.size(), "got ", names_.size(), " names for ",
              params_.size(), " parameters");
  HSYNC_CHECK(comm_ != nullptr, "no communicator");
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& p = params_[i];
    HSYNC_CHECK(p.device() == device_, "parameters on several devices are not supported: '",
                names_[0], "' is on ", device_, " but '", names_[i], "' is on ", p.device());
    HSYNC_CHECK(p.layout() == at::kStrided, "parameter '", names_[i], "' is not a dense tensor");
    HSYNC_CHECK(supported_dtype(p.scalar_type()), "parameter '", names_[i], "' has dtype ",
                p.scalar_type(), "; supported: float32, float64, float16, bfloat16");
    HSYNC_CHECK(p.requires_grad(), "parameter '", names_[i], "' does not require a gradient");
  }
  HSYNC_CHECK(!comm_dtype_ || supported_dtype(*comm_dtype_), "communication dtype ", *comm_dtype_,
              " is not supported; supported: float32, float64, float16, bfloat16");
  defer_normalisation_ = !device_.is_cuda();
  for (size_t i = 0; i < params_.size(); ++i) {
    if (bucket_dtype(i) == at::kHalf || grad_is_slot(i)) defer_normalisation_ = false;
  }
  const auto options = at::TensorOptions().dtype(at::kDouble).device(device_);
  plain_scale_ = at::full({}, 1.0 / comm_->world_size(), options);
  last_grad_nonfinite_ = at::zeros({}, options);

  std::vector<int64_t> order(params_.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(order.size() - 1 - i);
  build_buckets(order);

  for (size_t i = 0; i < params_.size(); ++i) {
    auto accumulator = torch::autograd::impl::grad_accumulator(params_[i]);
    hook_keys_.push_back(accumulator->add_post_hook(
        std::make_unique<torch::autograd::utils::LambdaPostHook>(
            [this, i](const torch::autograd::variable_list& outputs,
                      const torch::autograd::variable_list& /*inputs*/) {
              on_gradient_ready(i);
              return outputs;
            })));
    accumulators_.push_back(std::move(accumulator));
  }
  comm_->bracket_waits_on(&clock_);
}

Engine::~Engine() {
  comm_->bracket_waits_on(nullptr);
  if (hook_chain_) hook_chain_->abandon();
  for (size_t i = 0; i < accumulators_.size(); ++i) {
    accumulators_[i]->del_post_hook(hook_keys_[i]);
  }
}

at::ScalarType Engine::bucket_dtype(size_t index) const {
  return comm_dtype_.value_or(params_[index].scalar_type());
}

// Note [Gradients as bucket views]
// With grads_as_views, each parameter's .grad *is* its slot in the bucket (as DDP's
// gradient_as_bucket_view): autograd accumulates into the slot, pack scales it in place, the
// all-reduce leaves the reduced gradient where the optimizer reads it, and there is no
// write-back copy and no second copy of the gradients in memory. A gradient that is not its
// slot (the first backward, or any after zero_grad(set_to_none=True)) is packed by copy and the
// parameter's .grad is then pointed at the slot, so the fresh tensor is freed at once. When the
// buckets are rebuilt the gradients move to their new slots. A slot of another dtype than its
// gradient (a comm_dtype) cannot be the .grad: that .grad stays a tensor of the parameter's dtype
// and receives the reduced values by a cast, as without views. Each slot has its parameter's strides
// where the parameter is dense (channels_last, a transposed weight), as DDP's views do, since
// fused optimizers read .grad with the parameter's strides; the pack treats such a slot as the
// flat memory it occupies.
bool Engine::grad_is_slot(size_t index) const {
  return grads_as_views_ && bucket_dtype(index) == params_[index].scalar_type();
}

void Engine::build_buckets(const std::vector<int64_t>& order) {
  std::vector<ParamInfo> infos;
  infos.reserve(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::ScalarType dtype = bucket_dtype(i);
    // One bucket holds one dtype and, with owners, one owner's parameters.
    const int64_t owner = owners_.empty() ? -1 : owners_[i];
    infos.push_back({static_cast<int64_t>(params_[i].numel() * at::elementSize(dtype)),
                     static_cast<int64_t>(dtype) + kDtypeGroups * (owner + 1)});
  }
  const auto assignment =
      compute_bucket_assignment(infos, order, bucket_bytes_cap_, first_bucket_bytes_cap_);

  buckets_.clear();
  buckets_.reserve(assignment.size());
  in_flight_buffers_.clear();
  in_flight_buffer_bytes_ = 0;
  locator_.assign(params_.size(), {0, 0});
  for (const auto& indices : assignment) {
    const at::ScalarType dtype = bucket_dtype(indices.front());
    // A communication hook reads bucket.buffer() as DDP lays it out: the gradients end to end, no padding.
    const int64_t align =
        hook_chain_ ? 1 : std::max<int64_t>(1, kSlotAlignBytes / static_cast<int64_t>(c10::elementSize(dtype)));
    std::vector<int64_t> offsets;
    int64_t numel = 0;
    for (int64_t index : indices) {
      offsets.push_back(numel);
      numel = round_up(numel + params_[index].numel(), align);
    }
    Bucket bucket;
    bucket.params = indices;
    bucket.offsets = std::move(offsets);
    bucket.values_numel = numel;
    bucket.owner = owners_.empty() ? -1 : static_cast<int>(owners_[indices.front()]);
    bucket.transient = bucket.owner >= 0 && bucket.owner != comm_->rank();
    if (bucket.transient) {
      const int64_t bytes = (numel + bucket.tail_numel()) * static_cast<int64_t>(c10::elementSize(dtype));
      in_flight_buffer_bytes_ = std::max(in_flight_buffer_bytes_, bytes);
    }
    for (size_t k = 0; k < indices.size(); ++k) locator_[indices[k]] = {buckets_.size(), k};
    bucket.tail_offset = buckets_.empty() ? 0 : buckets_.back().tail_offset + buckets_.back().tail_numel();
    buckets_.push_back(std::move(bucket));  // its buffer comes with its first gradient: Note [Bucket memory]
  }
  if (hook_chain_) set_hooked_buckets();
}

// Note [Bucket memory]
// A bucket's buffer is allocated (its padding and flags zeroed) when its first gradient of a step arrives (or a hook, or a
// gradient moved into its slot, needs it), not when the buckets are built: wrapping a model takes no
// gradient memory, and a ShardedOptimizer built before the first backward measures a rank's memory
// without gradients that are not its own. Its own buckets then stay; another rank's borrow one of the
// step's two in-flight buffers until sent (Note [Owned buckets]).
void Engine::allocate(Bucket& bucket) {
  const int64_t first = bucket.params.front();
  const auto options = params_[first].options().dtype(bucket_dtype(first)).requires_grad(false);
  const int64_t numel = bucket.values_numel + bucket.tail_numel();
  if (bucket.transient) {  // Note [Owned buckets]
    bucket.in_flight_buffer = take_in_flight_buffer();
    const at::Tensor& bytes = in_flight_buffers_[bucket.in_flight_buffer].bytes;
    bucket.buffer = bytes.narrow(0, 0, numel * static_cast<int64_t>(c10::elementSize(options.dtype().toScalarType())))
                        .view(options.dtype().toScalarType());
  } else {
    bucket.buffer = at::empty({numel}, options);
  }
  bucket.slots.clear();
  bucket.used.clear();
  // Every slot is written by its pack (or zeroed as unused) before the bucket is sent: only the padding
  // between slots and the tail are zeroed here, not the whole buffer once a step for another rank's.
  for (size_t k = 0; k < bucket.params.size(); ++k) {
    const at::Tensor& param = params_[bucket.params[k]];
    const int64_t end = bucket.offsets[k] + param.numel();
    const int64_t next = k + 1 < bucket.params.size() ? bucket.offsets[k + 1] : bucket.values_numel;
    if (next > end) bucket.buffer.narrow(0, end, next - end).zero_();
    // Laid out as its parameter where that is dense (channels_last, a transposed weight), as DDP's bucket views
    // are: a fused optimizer reads .grad with its parameter's strides.
    const at::Tensor flat = bucket.buffer.narrow(0, bucket.offsets[k], param.numel());
    bucket.slots.push_back(param.is_non_overlapping_and_dense() ? flat.as_strided(param.sizes(), param.strides())
                                                                : flat.view(param.sizes()));
    bucket.used.push_back(bucket.buffer.narrow(0, bucket.values_numel + 1 + static_cast<int64_t>(k), 1));
  }
  bucket.nonfinite_flag = bucket.buffer.narrow(0, bucket.values_numel, 1);
  bucket.tail = bucket.buffer.narrow(0, bucket.values_numel, bucket.tail_numel());
  bucket.tail.zero_();
}

void Engine::release(Bucket& bucket) {
  if (bucket.in_flight_buffer >= 0) {
    InFlightBuffer& in_flight = in_flight_buffers_[bucket.in_flight_buffer];
    in_flight.filling = false;
    in_flight.reduce = bucket.seq;
  }
  bucket.in_flight_buffer = -1;
  bucket.buffer = at::Tensor();
  bucket.slots.clear();
  bucket.used.clear();
  bucket.nonfinite_flag = at::Tensor();
  bucket.tail = at::Tensor();
}

int Engine::take_in_flight_buffer() {
  // The one whose reduce went first, unless fewer than kInFlightBuffers exist: a reduce then overlaps
  // the next bucket's filling. One still filling (gradients came out of bucket order) is never waited
  // for, as its launch may need gradients this very wait would hold back: a buffer is added instead.
  int chosen = -1;
  for (size_t i = 0; i < in_flight_buffers_.size(); ++i) {
    const InFlightBuffer& b = in_flight_buffers_[i];
    if (!b.filling && (chosen < 0 || b.reduce < in_flight_buffers_[chosen].reduce)) chosen = static_cast<int>(i);
  }
  const bool busy = chosen < 0 || in_flight_buffers_[chosen].reduce.has_value();
  if (busy && (chosen < 0 || in_flight_buffers_.size() < kInFlightBuffers)) {
    const auto options = at::TensorOptions().dtype(at::kByte).device(device_);
    in_flight_buffers_.push_back({at::empty({in_flight_buffer_bytes_}, options), std::nullopt, false});
    chosen = static_cast<int>(in_flight_buffers_.size()) - 1;
  } else if (busy) {
    // Launched on every rank in bucket order, so it completes without this rank going further. On a GPU
    // the current stream waits for it, not the host; the caller's packs follow on that stream. Until every
    // rank has reached that reduce, this is a wait for the slowest of them: Note [Busy time].
    const PeerWait wait(clock_);
    comm_->synchronize_through(*in_flight_buffers_[chosen].reduce);
  }
  in_flight_buffers_[chosen].filling = true;
  in_flight_buffers_[chosen].reduce.reset();
  return chosen;
}

int64_t Engine::allocated_bucket_bytes() const {
  int64_t bytes = 0;
  for (const Bucket& bucket : buckets_) {
    if (bucket.buffer.defined() && !bucket.transient) bytes += bucket.buffer.nbytes();
  }
  for (const InFlightBuffer& b : in_flight_buffers_) bytes += b.bytes.nbytes();
  return bytes;
}

std::vector<std::vector<int64_t>> Engine::bucket_params() const {
  std::vector<std::vector<int64_t>> result;
  for (const Bucket& bucket : buckets_) result.push_back(bucket.params);
  return result;
}

void Engine::start_step() {
  step_ = Step{};
  step_.active = true;
  step_.ready.assign(params_.size(), false);
  step_.unused.assign(params_.size(), false);
  second_backward_task_.store(-1);
  step_.pack_scale = plain_scale_;
  for (Bucket& bucket : buckets_) {
    bucket.pending = bucket.params.size();
    if (bucket.transient) {
      bucket.in_flight_buffer = -1;
      release(bucket);  // left by a step that failed: allocated anew by its first gradient
    } else if (bucket.buffer.defined()) {
      bucket.tail.zero_();
    }
  }
  in_flight_buffers_.clear();
}

void Engine::begin_weighted_step(const at::Tensor& scalars, const at::Tensor& ref_weight) {
  std::lock_guard<std::mutex> lock(mutex_);
  comm_->check();  // after a failed collective, say so rather than that a step was interrupted
  HSYNC_CHECK(!step_.active, "a new backward started before the previous gradient reduction "
              "finished (an earlier backward was interrupted); wrap the module anew, after "
              "model._remove_autograd_hooks() on this wrapper (as with DDP) or once it is gone");
  HSYNC_CHECK(scalars.dim() == 1 && scalars.numel() >= 1 && scalars.scalar_type() == at::kDouble &&
                  scalars.device() == device_ && scalars.is_contiguous(),
              "step scalars must be a contiguous 1-D float64 tensor on ", device_);
  HSYNC_CHECK(ref_weight.numel() == 1 && ref_weight.scalar_type() == at::kDouble &&
                  ref_weight.device() == device_,
              "the reference weight must be a float64 scalar on ", device_);
  start_weighted_step(scalars, ref_weight.reshape({}), /*scale_by_world_size=*/false);
  step_.plain = false;
  step_.any_task = true;  // finalized by the caller once backward returns: Note [Nested backwards]
  expect_gradients_.store(true);
}

// Note [Join]
// Under torch's Join context a rank whose data ran out shadows every synchronised step of the
// others with a weighted step of weight 0 (hsync/ddp.py). For that it must issue the same
// collectives, so under Join a plain loss.backward() all-reduces step scalars too (weight 1 per
// rank): its gradients are either scaled by 1 / world_size as always (DDP's
// divide_by_initial_world_size, the default) or by 1 / (ranks not joined), read from those scalars.
void Engine::set_join_plain_step(const std::optional<at::Tensor>& scalars, bool divide_by_world_size) {
  std::lock_guard<std::mutex> lock(mutex_);
  HSYNC_CHECK(!scalars || (scalars->dim() == 1 && scalars->scalar_type() == at::kDouble &&
                           scalars->device() == device_),
              "join step scalars must be a 1-D float64 tensor on ", device_);
  join_scalars_ = scalars.value_or(at::Tensor());
  join_divide_by_world_size_ = divide_by_world_size;
}

// Note [Deferred normalisation]
// On the CPU, waiting for N blocks the host: backward cannot go on until gloo has carried the
// scalars to every rank and back. There, weighted steps pack ref_r * g_r instead, launch the
// scalars' all-reduce and the buckets' without waiting, and divide by N in the write-back, by
// which time every collective has completed anyway: g = (sum_r ref_r g_r) * (1 / N). As N is
// not needed sooner, the scalars' all-reduce is issued right before the first bucket's rather
// than at the start of backward, so that gloo's threads wake once for both. The result depends
// only on this step's inputs, as before, so resumed runs stay bit-identical. Values in the
// bucket grow by ref_r rather than staying near g: harmless in float32, float64 and bfloat16
// (a sum that overflows where every term was finite, gradients within a factor of the world's
// weight of the largest float, is seen by the write-back's pass, which flags the step as not
// finite, as the all-reduce of a normalised sum never overflows), so only float16 buckets keep
// scaling before the sum (whatever the gradients' own dtype: a
// comm_dtype, Note [Communication dtype] in kernels/pack.h). With gradients as bucket views the
// division would be a second pass over every gradient after the last all-reduce, while the
// wait for N hides behind the first gradient's computation: views scale before the sum too. On
// GPU the wait is the device's, not the host's (the compute stream waits for the scalars'
// all-reduce), so GPU steps scale before the sum as described above, and issue the scalars'
// all-reduce at the first gradient, right before the stream waits for it:
// Note [A host that blocks] in busy_clock.h.
void Engine::start_weighted_step(const at::Tensor& scalars, const at::Tensor& ref_weight,
                                 bool scale_by_world_size) {
  start_step();
  step_.scalars = scalars;
  step_.ref_weight = ref_weight;
  // A plain step under Join keeps DDP's scale and needs no total: Note [Join].
  step_.pack_scale_resolved = scale_by_world_size;
  step_.normalise_at_write_back = defer_normalisation_ && !scale_by_world_size;
  if (step_.normalise_at_write_back) step_.pack_scale = step_.ref_weight;
  step_.scalars_due = true;
  // On the CPU, without deferring, gloo's threads carry the scalars while the backward computes.
  if (!defer_normalisation_ && !device_.is_cuda()) issue_due_step_scalars();
}

void Engine::issue_due_step_scalars() {
  if (!step_.scalars_due) return;
  step_.scalars_seq = comm_->all_reduce_sum(step_.scalars, Purpose::kStepScalars);
  step_.scalars_due = false;
}

void Engine::resolve_pack_scale() {
  if (step_.pack_scale_resolved) return;
  issue_due_step_scalars();
  {
    const PeerWait wait(clock_);  // for the slowest rank's forward: Note [Busy time]
    comm_->synchronize_through(step_.scalars_seq);
  }
  const at::Tensor total = step_.scalars.select(0, 0);
  if (step_.normalise_at_write_back) {
    const double n = *total.const_data_ptr<double>();  // on the host: Note [Deferred normalisation]
    step_.write_back_scale = n > 0 ? hook_factor_ / n : 0.0;
  } else {
    const at::Tensor ref = hook_chain_ ? step_.ref_weight * hook_factor_ : step_.ref_weight;
    step_.pack_scale = at::where(total > 0, ref / total, at::zeros_like(total));
  }
  if (device_.is_cuda()) queue_scalars_copy();
  step_.pack_scale_resolved = true;
}

void Engine::queue_scalars_copy() {
  step_.scalars_host = at::empty(step_.scalars.sizes(), step_.scalars.options().device(at::kCPU).pinned_memory(true));
  step_.scalars_host.copy_(step_.scalars, /*non_blocking=*/true);
  step_.scalars_copied.emplace(device_.type());
  step_.scalars_copied->record(c10::impl::VirtualGuardImpl(device_.type()).getStream(device_));
}

at::Tensor Engine::step_scalars() {
  std::lock_guard<std::mutex> lock(mutex_);
  HSYNC_CHECK(step_.scalars.defined(), "no weighted step has run yet");
  resolve_pack_scale();
  if (!device_.is_cuda()) return step_.scalars;
  if (!step_.scalars_copied) {
    // A plain step under Join keeps DDP's scale and never resolves a total, which queues the copy to the
    // host: its scalars' all-reduce went before its first bucket; the copy waits for it here, a wait for the
    // peers like resolve_pack_scale's (Note [Busy time]).
    issue_due_step_scalars();
    {
      const PeerWait wait(clock_);
      comm_->synchronize_through(step_.scalars_seq);
    }
    queue_scalars_copy();
  }
  step_.scalars_copied->synchronize();
  comm_->check();  // a failure after the copy was queued: the values may be garbage (Note [NCCL failures])
  return step_.scalars_host;
}

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
void Engine::begin_backward(int64_t forward) {
  // torch.autograd.grad (a gradient penalty, say) computes gradients without filling .grad: not the step.
  const auto* only_some_nodes = torch::autograd::get_current_graph_task_exec_info();
  if (only_some_nodes != nullptr && !only_some_nodes->empty()) return;
  const int task = torch::autograd::get_current_graph_task_id();
  if (!expect_gradients_.load()) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!step_.active && forward == step_.forward) second_backward_task_.store(task);
    return;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (step_.active && (!step_.plain || task == step_.task_id)) {  // weighted, or another output's hook
    step_.forward = forward;
    return;
  }
  if (step_.active) comm_->check();  // the likelier reason, if it holds
  HSYNC_CHECK(!step_.active, "a new backward started before the previous gradient reduction finished (an earlier "
              "backward was interrupted); wrap the module anew, after model._remove_autograd_hooks() on this "
              "wrapper (as with DDP) or once it is gone");
  start_plain_step(task);
  step_.any_task = true;  // Note [Nested backwards]
  step_.forward = forward;
}

void Engine::start_plain_step(int task) {
  if (join_scalars_.defined()) {
    start_weighted_step(join_scalars_.clone(), at::ones({}, join_scalars_.options()), join_divide_by_world_size_);
  } else {
    start_step();
  }
  step_.plain = true;
  step_.task_id = task;
  // Runs when this backward completes (as c10d's reducer does), so a plain loss.backward()
  // finishes the reduction with no call from the user.
  torch::autograd::Engine::get_default_engine().queue_callback([this] { finalize(); });
}

// Note [Which backward synchronises]
// As with DDP, a plain backward reduces gradients only after the wrapper's own forward ran with
// gradients enabled outside no_sync (DDP's prepare_for_backward): hooks are armed there and
// disarmed when the step completes. A backward through the bare module (an evaluation on one
// rank, a second use of a sub-module) then accumulates locally instead of starting a collective
// that no peer joins. A weighted step arms the hooks itself. A gradient that autograd leaves
// undefined (a custom Function returning None for a parameter) counts as unused on this rank,
// as in DDP: it contributes zeros and, used nowhere, leaves .grad untouched.
void Engine::on_gradient_ready(size_t index) {
  if (!expect_gradients_.load()) {  // Note [Which backward synchronises]
    refuse_a_late_gradient(index);
    return;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  const int task = torch::autograd::get_current_graph_task_id();
  if (!step_.active) start_plain_step(task);
  if (!step_.any_task && task != step_.task_id) comm_->check();  // the likelier reason, if it holds
  HSYNC_CHECK(step_.any_task || task == step_.task_id,
              "a new backward started before the previous gradient reduction finished (an earlier backward "
              "was interrupted, or a nested backward such as reentrant activation checkpointing reached "
              "the wrapped parameters of a model whose output the wrapper did not see); wrap the module "
              "anew, after model._remove_autograd_hooks() on this wrapper (as with DDP) or once it is gone");
  HSYNC_CHECK(!step_.ready[index], "the gradient of '", names_[index],
              "' became ready twice in one backward; hsync reduces each gradient once per step (a wrapper of "
              "the same module whose backward raised sees it too: call its _remove_autograd_hooks())");
  step_.ready[index] = true;
  if (!rebuilt_) ready_order_.push_back(static_cast<int64_t>(index));
  if (!step_.normalise_at_write_back) resolve_pack_scale();
  const at::Tensor& grad = params_[index].grad();
  if (grad.defined()) {
    pack(index, grad);
  } else {
    skip_unused(index);  // Note [Which backward synchronises]
  }
  launch_complete_buckets();
}

// Note [A second backward through one forward]
// A forward with two outputs, each with its own loss and backward (loss1.backward(); loss2.backward()),
// where the first reaches only some parameters: DDP waits for every parameter its forward could reach,
// so the second backward completes its reduction. hsync's step ends with the first backward (unused
// parameters need no flag), so the parameters only the second reaches would keep local gradients and the
// ranks' models drift apart, silently. Their gradients are refused instead: a backward through the
// outputs of the last step's forward (begin_backward sees their nodes) that delivers a gradient the
// step went without. Gradients the step had are not refused: a second backward that DDP too leaves
// local (a GAN's generator loss through the discriminator's output, after its own loss's backward).
void Engine::refuse_a_late_gradient(size_t index) {
  const int task = torch::autograd::get_current_graph_task_id();
  if (task >= 0 && task == second_backward_task_.load()) {
    std::lock_guard<std::mutex> lock(mutex_);
    HSYNC_CHECK(!step_.unused[index], "the gradient of '", names_[index], "' arrived in a second backward "
                "through the outputs of one forward, after the first had reduced that forward's gradients "
                "without it. hsync reduces each forward's gradients with one backward, where DDP waits for "
                "every parameter: add the losses and call backward once ((loss1 + loss2).backward()), or run a "
                "forward before each backward");
  }
  const int ended_task = nested_step_task_.load();
  if (ended_task < 0) return;
  // Graph tasks are numbered as they start, so one older than the step's, still running after the
  // step ended, is a backward the step's task was nested in: Note [Nested backwards].
  HSYNC_CHECK(task < 0 || task >= ended_task, "the gradient of '", names_[index],
              "' arrived after its step's reduction had ended: a nested backward (reentrant activation "
              "checkpointing) began the step and ended it, because the wrapper found no tensor in its "
              "forward's output. Return tensors, or lists, tuples, dicts or dataclasses of them, "
              "from the wrapped module");
}

void Engine::skip_unused(size_t index) {
  step_.unused[index] = true;
  const auto [b, k] = locator_[index];
  if (!buckets_[b].buffer.defined()) allocate(buckets_[b]);
  buckets_[b].slots[k].zero_();
  HSYNC_ASSERT(buckets_[b].pending > 0, "bucket ", b, " received more gradients than it holds");
  --buckets_[b].pending;
}

void Engine::pack(size_t index, const at::Tensor& grad) {
  const auto [b, k] = locator_[index];
  Bucket& bucket = buckets_[b];
  if (!bucket.buffer.defined()) allocate(bucket);
  const at::Tensor& slot = bucket.slots[k];
  HSYNC_CHECK(grad.layout() == at::kStrided, "parameter '", names_[index],
              "' has a sparse gradient; hsync reduces dense gradients only (use sparse=False)");
  HSYNC_CHECK(grad.scalar_type() == params_[index].scalar_type() && grad.numel() == slot.numel(),
              "the gradient of '", names_[index], "' (", grad.scalar_type(), ", ", grad.numel(),
              " elements) does not match its parameter");
  // In place when the gradient already is its slot: Note [Gradients as bucket views].
  scale_and_pack(grad, slot, step_.pack_scale, bucket.nonfinite_flag, bucket.used[k]);
  if (bucket.transient) {
    params_[index].mutable_grad() = at::Tensor();  // its owner's now: Note [Owned buckets]
  } else if (grad_is_slot(index) && !grad.is_same(slot)) {
    params_[index].mutable_grad() = slot;
  }
  HSYNC_ASSERT(bucket.pending > 0, "bucket ", b, " received more gradients than it holds");
  --bucket.pending;
}

void Engine::launch_complete_buckets() {
  while (step_.next_bucket < buckets_.size() && buckets_[step_.next_bucket].pending == 0) {
    issue_due_step_scalars();  // before every bucket's, on every rank
    Bucket& bucket = buckets_[step_.next_bucket];
    if (step_.failed) bucket.nonfinite_flag.fill_(1);  // Note [A backward that fails]
    if (hook_chain_) {  // the flags and used marks stay hsync's, the values go to the hook: Note [Hook order]
      hook_chain_->submit(step_.next_bucket);
    } else {
      const auto index = static_cast<int64_t>(step_.next_bucket);
      bucket.seq = bucket.owner >= 0 ? comm_->reduce_sum(bucket.buffer, bucket.owner, Purpose::kBucket, index)
                                     : comm_->all_reduce_sum(bucket.buffer, Purpose::kBucket, index);
      if (bucket.transient) release(bucket);  // sent: its buffer goes to a later bucket once the reduce is done
    }
    ++step_.next_bucket;
  }
}

// Note [Communication hooks]
// DDP's register_comm_hook contract: each bucket, once complete, goes to the hook as a
// c10d::GradBucket (its values: every gradient of the bucket, flat; index, is_last, parameters,
// gradients as views), the hook returns a Future of the reduced values, and those are written back
// into the gradients. hsync keeps its own part of each bucket, the tail of non-finite and used
// flags, and all-reduces it itself just before calling the hook, one bucket after another (Note
// [Hook order] in hook_chain.h), so every rank issues the same collectives in the same order. DDP's
// hooks divide by the world size (allreduce_hook sums tensor / world_size): so that such a hook yields sum_r n_r g_r / N, every scale is multiplied by
// the world size here (hook_factor_): a weighted step packs world_size * n_r / N * g_r (or, when
// normalising at write-back, ref_r * g_r, with world_size / N applied on the way out), and a plain
// step packs the raw gradient, as DDP hands it to its hooks. The hook's result is checked to have
// the bucket's size on every rank, before anything is written back. A hook runs Python: the GIL is
// taken by c10d's PythonCommHook, and every caller of launch and finalize has released it.
void Engine::set_comm_hook(std::shared_ptr<c10d::CommHookInterface> hook) {
  std::lock_guard<std::mutex> lock(mutex_);
  HSYNC_CHECK(!step_.active && !hook_chain_, "a communication hook is registered once, before the first step");
  HSYNC_CHECK(owners_.empty(), "a communication hook hands every bucket to every rank, but this model's "
              "buckets are each reduced to the rank that owns their parameters (hsync.ShardedOptimizer)");
  hook_chain_ = std::make_shared<HookChain>(comm_, std::move(hook));
  rebuild_in_current_order();  // without padding between the slots; hands the buckets to the chain
  hook_factor_ = static_cast<double>(comm_->world_size());
  plain_scale_ = at::ones_like(plain_scale_);
}

void Engine::set_hooked_buckets() {
  std::vector<HookedBucket> hooked;
  for (Bucket& bucket : buckets_) {
    if (!bucket.buffer.defined()) allocate(bucket);  // the hook is handed its values once
    HookedBucket h;
    h.values = values_of(bucket);
    h.tail = bucket.tail;
    for (size_t k = 0; k < bucket.params.size(); ++k) {
      const at::Tensor& slot = bucket.slots[k];
      h.offsets.push_back(static_cast<size_t>(slot.storage_offset() - bucket.buffer.storage_offset()));
      h.lengths.push_back(static_cast<size_t>(slot.numel()));
      h.params.push_back(params_[bucket.params[k]]);
    }
    hooked.push_back(std::move(h));
  }
  hook_chain_->set_buckets(std::move(hooked));
}

void Engine::take_hook_result(size_t index) {
  const auto& future = hook_chain_->result(index);
  future->wait();  // complete already (HookChain::wait); on a GPU this orders the current stream after it
  HSYNC_CHECK(!future->hasError(), "the communication hook failed on bucket ", index, ": ",
              future->tryRetrieveErrorMessage());
  const at::Tensor result = hook_chain_->parse(future->value());
  const at::Tensor values = values_of(buckets_[index]);
  HSYNC_CHECK(result.numel() == values.numel(), "the communication hook returned ", result.numel(),
              " values for bucket ", index, " of ", values.numel(),
              ": a hook's future must hold its bucket's buffer, reduced (as DDP's do)");
  if (!result.is_same(values)) values.copy_(result.reshape({-1}));
}

void Engine::finalize_if_pending() {
  if (step_.active) finalize();
}

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
void Engine::mark_step_failed() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (step_.active) step_.failed = true;  // the buckets not launched yet raise their flag as they go
}

void Engine::abandon_step(const std::string& why) {
  std::lock_guard<std::mutex> lock(mutex_);
  comm_->give_up(why);
}

void Engine::finalize() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!step_.active) return;
  const at::NoGradGuard no_grad;
  if (!step_.normalise_at_write_back) resolve_pack_scale();
  // Parameters no hook delivered in this backward: see Note [Step lifecycle].
  for (size_t i = 0; i < params_.size(); ++i) {
    if (step_.ready[i]) continue;
    const at::Tensor& grad = params_[i].grad();
    if (grad.defined()) {
      pack(i, grad);
    } else {
      skip_unused(i);
    }
  }
  launch_complete_buckets();
  HSYNC_ASSERT(step_.next_bucket == buckets_.size(), "bucket ", step_.next_bucket, " of ", buckets_.size(),
               " was not launched with every gradient packed");
  if (hook_chain_) hook_chain_->wait();  // the communicator is the chain's until then: Note [Hook order]
  resolve_pack_scale();  // when normalising at write-back: N's all-reduce went before every bucket's
  step_.tails_on_host = at::Tensor();
  std::vector<bool> sum_not_finite(buckets_.size(), false);  // seen by the write-back's normalisation
  for (size_t b = 0; b < buckets_.size(); ++b) {
    comm_->synchronize_through(hook_chain_ ? hook_chain_->seq(b) : buckets_[b].seq);
    if (hook_chain_) take_hook_result(b);
    sum_not_finite[b] = write_back(buckets_[b]);
  }
  in_flight_buffers_.clear();  // every reduce is done (on a GPU the stream is ordered after them)

  if (owners_.empty()) {
    std::vector<at::Tensor> flags;
    for (size_t b = 0; b < buckets_.size(); ++b) {
      const Bucket& bucket = buckets_[b];
      if (bucket.buffer.scalar_type() == at::kHalf) flags.push_back(sum_overflowed(bucket));
      if (sum_not_finite[b]) flags.push_back(at::ones({1}, bucket.nonfinite_flag.options().dtype(at::kDouble)));
      flags.push_back(bucket.nonfinite_flag.to(at::kDouble));
    }
    last_grad_nonfinite_ = at::cat(flags).sum();
  } else {
    last_grad_nonfinite_ = share_owned_flags(sum_not_finite);
    spread_nonfinite_to_owned_gradients();
  }

  if (!rebuilt_) {
    rebuild_from_ready_order();
    if (grads_as_views_) move_grads_into_slots();
  }
  // A plain step begun by a gradient hook ends with the hook's graph task, which may be nested.
  nested_step_task_.store(step_.plain && !step_.any_task ? step_.task_id : -1);
  step_.active = false;
  step_.plain = false;
  expect_gradients_.store(false);
  steps_completed_.fetch_add(1);
}

bool Engine::used_on_some_rank(const Bucket& bucket, size_t k) {
  if (!device_.is_cuda()) return bucket.used[k].item<double>() > 0;  // host memory, reduced already
  if (!step_.tails_on_host.defined()) {
    // Every bucket's tail in one copy: one wait for the device per step, however many parameters
    // went without a gradient. synchronize() orders it after every collective, without a host wait.
    comm_->synchronize();
    std::vector<at::Tensor> tails;
    for (const Bucket& b : buckets_) {  // another rank's bucket was released once sent: its flags are not read
      tails.push_back(b.tail.defined() ? b.tail.to(at::kDouble)
                                       : at::zeros({b.tail_numel()}, at::TensorOptions(at::kDouble).device(device_)));
    }
    step_.tails_on_host = at::cat(tails).to(at::kCPU);
    comm_->check();  // a collective that failed meanwhile left garbage in the tails
  }
  return step_.tails_on_host.const_data_ptr<double>()[bucket.tail_offset + 1 + static_cast<int64_t>(k)] > 0;
}

at::Tensor Engine::sum_overflowed(const Bucket& bucket) {
  // Each rank's term fits float16 (pack raises the flag otherwise), but their sum may not. Summed in
  // float32, a float16 bucket is finite exactly when all its values are: one pass, on the device.
  const at::Tensor values = values_of(bucket);
  return at::isfinite(values.sum(at::kFloat)).logical_not().to(at::kDouble).reshape({1});
}

// Note [Owned buckets]
// With owners (set by hsync.ShardedOptimizer), each parameter's gradient is needed on one rank only, the
// one whose optimizer steps it. Buckets then hold one owner's parameters each (one more key of the bucket
// assignment, beside the dtype) and each is reduced to its owner instead of all-reduced: half a ring
// all-reduce's bytes, and the owner's broadcast of the updated parameters is the other half. The other
// ranks keep nothing of another rank's bucket (ZeRO-2): it borrows one of two in-flight buffers of the
// largest such bucket's size from its first gradient, each gradient is dropped once packed (autograd's
// fresh tensor is freed at once), and the buffer goes back as soon as the reduce is launched. The next
// bucket then fills the other buffer while this one's reduce runs, and the one after waits for this reduce
// before it reuses its buffer (double buffering, as DeepSpeed's ZeRO-2 does). Without that bound, a rank's
// peak would depend on how fast its peers complete reduces: every bucket launched and not yet reduced would
// hold memory. On a GPU the wait is the current stream's, not the host's (synchronize_through): the host
// goes on queueing the backward, whose kernels after it wait as a slow network makes them; on the CPU it
// blocks the backward thread. Only a launched bucket's buffer is waited for: one still filling (gradients
// that come out of bucket order, as before the first rebuild) may need gradients the wait would hold back,
// so a third buffer is added instead. The buffers go at the end of the step, so the optimizer's step has
// that memory. So a rank holds its own buckets and two of others', not every gradient. Every rank must
// still learn every bucket's flags (a non-finite gradient anywhere skips the step everywhere; a float16
// sum's overflow is seen only by its owner), so after the buckets' reduces one all-reduce carries each
// owner's reduced flags, zeros from the others. Owner -1 marks a parameter that no owner steps (one outside
// the sharded optimizer's groups, which another optimizer may step on every rank): its buckets are all-reduced
// as without owners, and rank 0 brings their flags. Owners are fixed between steps; a communication hook,
// which hands every bucket to every rank, is refused.
void Engine::set_owners(const std::vector<int64_t>& owners, int64_t witness) {
  std::lock_guard<std::mutex> lock(mutex_);
  HSYNC_CHECK(!step_.active, "parameter owners are set between steps");
  HSYNC_CHECK(!hook_chain_, "a communication hook hands every bucket to every rank; parameters with owners "
              "(hsync.ShardedOptimizer) are reduced to their owner instead");
  HSYNC_CHECK(owners.empty() || owners.size() == params_.size(), "owners for ", owners.size(), " of ",
              params_.size(), " parameters");
  for (int64_t owner : owners) {
    HSYNC_CHECK(owner >= -1 && owner < comm_->world_size(), "owner ", owner, " is outside world size ",
                comm_->world_size(), " (-1: every rank)");
  }
  HSYNC_CHECK(witness == -1 || (witness >= 0 && static_cast<size_t>(witness) < owners.size() &&
                                 owners[witness] == -1),
              "the witness of a non-finite step (", witness, ") is a parameter of owner -1");
  owners_ = owners;
  witness_ = witness;
  rebuild_in_current_order();  // cut anew at the owners' boundaries
}

void Engine::rebuild_in_current_order() {
  std::vector<int64_t> order;
  for (const Bucket& bucket : buckets_) order.insert(order.end(), bucket.params.begin(), bucket.params.end());
  build_buckets(order);
  if (grads_as_views_) move_grads_into_slots();
}

at::Tensor Engine::share_owned_flags(const std::vector<bool>& sum_not_finite) {
  const int rank = comm_->rank();
  const auto options = at::TensorOptions().dtype(at::kDouble).device(device_);
  std::vector<at::Tensor> tails;      // each bucket's, its owner's reduced one, in bucket order
  std::vector<at::Tensor> overflows;  // each float16 bucket's sum, seen by its owner
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const Bucket& bucket = buckets_[b];
    const bool owned = bucket.owner == rank || (bucket.owner < 0 && rank == 0);  // all-reduced: alike everywhere
    tails.push_back(owned ? bucket.tail.to(at::kDouble) : at::zeros({bucket.tail_numel()}, options));
    overflows.push_back(owned && bucket.buffer.scalar_type() == at::kHalf ? sum_overflowed(bucket)
                        : at::full({1}, owned && sum_not_finite[b] ? 1.0 : 0.0, options));
  }
  const int64_t tails_numel = buckets_.back().tail_offset + buckets_.back().tail_numel();
  tails.insert(tails.end(), overflows.begin(), overflows.end());
  const at::Tensor shared = at::cat(tails);
  comm_->synchronize_through(comm_->all_reduce_sum(shared, Purpose::kBucketFlags));
  std::vector<at::Tensor> counted;
  for (const Bucket& bucket : buckets_) counted.push_back(shared.narrow(0, bucket.tail_offset, 1));
  counted.push_back(shared.narrow(0, tails_numel, static_cast<int64_t>(buckets_.size())));
  return at::cat(counted).sum();
}

// Note [A non-finite step on every rank]
// All-reduced, a non-finite gradient of any rank is in every rank's reduced gradients, so what checks
// them locally (a GradScaler's unscale_, a user's isfinite) decides alike everywhere. Reduced to its
// owner, it is on the owner only: another rank's own gradients are finite, and a GradScaler there
// would step and grow its scale while the owner skips and backs off; the ranks would then issue
// different collectives (the step's broadcasts on some, the next step's scalars on others) until the
// deadline, and their scales would part. So on a step whose flags say non-finite, every rank writes
// a NaN into the first element of the first gradient it owns: a GradScaler (or any local check)
// over a ShardedOptimizer's parameters then sees what it sees without sharding. A rank that owns no
// parameter (a budget too small for any, fewer parameters than ranks) would have no gradient for its
// GradScaler to check at all (torch's asserts "No inf checks were recorded"): there the ShardedOptimizer
// names a witness, one small parameter all-reduced instead of reduced to its owner (owner -1, its owner
// still the one that steps it), whose gradient every rank keeps, and such a rank writes its NaN there.
// One masked fill on the stream, ordered after the flags' all-reduce; no host wait.
void Engine::spread_nonfinite_to_owned_gradients() {
  const auto poison = [this](const at::Tensor& grad) {
    if (!grad.defined() || grad.numel() == 0) return false;
    at::Tensor first = grad;
    while (first.dim() > 0) first = first.select(0, 0);
    first.masked_fill_(last_grad_nonfinite_.gt(0), std::numeric_limits<double>::quiet_NaN());
    return true;
  };
  for (const Bucket& bucket : buckets_) {
    if (bucket.owner != comm_->rank()) continue;
    for (int64_t index : bucket.params) {
      if (poison(params_[index].grad())) return;
    }
  }
  if (witness_ >= 0) poison(params_[witness_].grad());
}

bool Engine::write_back(const Bucket& bucket) {
  if (bucket.owner >= 0 && bucket.owner != comm_->rank()) {  // Note [Owned buckets]
    for (int64_t index : bucket.params) params_[index].mutable_grad() = at::Tensor();
    return false;
  }
  // Cast back to the gradient's dtype (Note [Communication dtype]) and normalised on the way out
  // when deferred (Note [Deferred normalisation]), which sees whether the sum is finite.
  bool not_finite = false;
  const auto unpack = [this, &not_finite](const at::Tensor& reduced, const at::Tensor& grad) {
    if (!step_.normalise_at_write_back) {
      grad.copy_(reduced);
    } else if (grad.is_contiguous()) {
      not_finite = scale_cpu(reduced, grad, step_.write_back_scale) || not_finite;
    } else {  // scaled before the cast: an unnormalised sum may not fit a float16 gradient
      const auto wide = at::promote_types(reduced.scalar_type(), at::kFloat);
      const at::Tensor normalised =
          reduced.to(wide, /*non_blocking=*/false, /*copy=*/true).mul_(step_.write_back_scale);
      grad.copy_(normalised);
      not_finite = not_finite || !at::isfinite(normalised).all().item<bool>();
    }
  };
  for (size_t k = 0; k < bucket.params.size(); ++k) {
    const size_t index = bucket.params[k];
    at::Tensor& grad = params_[index].mutable_grad();
    const at::Tensor& reduced = bucket.slots[k];
    if (grad.defined()) {
      if (!grad.is_same(reduced)) unpack(reduced, grad);
    } else if (used_on_some_rank(bucket, k)) {  // unused here but used elsewhere
      const auto own_dtype = reduced.options().dtype(params_[index].scalar_type());
      grad = grad_is_slot(index) ? reduced : at::empty_like(reduced, own_dtype, at::MemoryFormat::Contiguous);
      if (!grad.is_same(reduced)) unpack(reduced, grad);
    }
  }
  return not_finite;
}

void Engine::move_grads_into_slots() {
  for (size_t i = 0; i < params_.size(); ++i) {
    at::Tensor& grad = params_[i].mutable_grad();
    const auto [b, k] = locator_[i];
    if (!grad.defined() || !grad_is_slot(i) || buckets_[b].transient) continue;
    if (!buckets_[b].buffer.defined()) allocate(buckets_[b]);
    const at::Tensor& slot = buckets_[b].slots[k];
    slot.copy_(grad);
    grad = slot;
  }
}

void Engine::rebuild_from_ready_order() {
  // Rank 0's order, so every rank builds the same buckets. Parameters no hook delivered come
  // last, in reverse registration order.
  std::vector<int64_t> order = ready_order_;
  std::vector<bool> listed(params_.size(), false);
  for (int64_t index : order) listed[index] = true;
  for (size_t i = params_.size(); i-- > 0;) {
    if (!listed[i]) order.push_back(static_cast<int64_t>(i));
  }
  at::Tensor shared = at::tensor(order, at::kLong).to(device_);
  comm_->broadcast(shared, 0, Purpose::kBucketOrder);
  comm_->synchronize();
  shared = shared.cpu();
  order.assign(shared.const_data_ptr<int64_t>(), shared.const_data_ptr<int64_t>() + shared.numel());
  build_buckets(order);
  ready_order_.clear();
  rebuilt_ = true;
}

void Engine::broadcast_coalesced(const std::vector<at::Tensor>& tensors, int root, const std::string& label) {
  // In chunks of at most a bucket's bytes (a larger tensor alone): each travels as one flat copy, and
  // a flat copy of a whole model would double its memory while it is broadcast (at wrap time, on the
  // smallest card too).
  std::vector<at::Tensor> chunk;
  int64_t bytes = 0;
  for (const at::Tensor& t : tensors) {
    HSYNC_CHECK(t.device() == device_, "broadcast: tensor on ", t.device(), ", expected ", device_);
    if (t.numel() == 0) continue;
    const int64_t size = t.numel() * static_cast<int64_t>(t.element_size());
    if (!chunk.empty() && bytes + size > bucket_bytes_cap_) {
      broadcast_flat(chunk, root, label);
      chunk.clear();
      bytes = 0;
    }
    chunk.push_back(t);
    bytes += size;
  }
  if (!chunk.empty()) broadcast_flat(chunk, root, label);
}

void Engine::broadcast_flat(const std::vector<at::Tensor>& tensors, int root, const std::string& label) {
  // A broadcast copies bytes, whatever they mean: every tensor travels in one flat byte buffer, so
  // one collective carries them all, including dtypes NCCL has no type for (int16, uint16/32/64,
  // float8, complex).
  std::vector<at::Tensor> parts;
  for (const at::Tensor& t : tensors) parts.push_back(t.contiguous().view({-1}).view(at::kByte));
  const at::NoGradGuard no_grad;
  const at::Tensor flat = at::cat(parts);
  {
    const PeerWait wait(clock_);  // for `root`: Note [Busy time]
    comm_->broadcast(flat, root, Purpose::kBroadcast, label);
    comm_->synchronize();
  }
  int64_t offset = 0;
  for (const at::Tensor& t : tensors) {
    const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
    // New values, not a new version: a buffer saved for backward by an earlier forward (BatchNorm's
    // running statistics, two forwards before one backward) must not fail autograd's version
    // check, as DDP's buffer broadcast does not.
    auto version = torch::autograd::impl::version_counter(t);  // shares the counter
    const auto saved_version = version.current_version();
    at::Tensor landing = t.is_contiguous() ? t : at::empty_like(t, at::MemoryFormat::Contiguous);
    landing.view({-1}).view(at::kByte).copy_(flat.narrow(0, offset, bytes));
    if (!landing.is_same(t)) t.copy_(landing);
    version.set_version(saved_version);
    offset += bytes;
  }
}

}  // namespace hsync
