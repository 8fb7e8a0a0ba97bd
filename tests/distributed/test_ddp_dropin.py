"""Programs written for torch DDP run unchanged on WeightedDDP: each scenario runs with both wrappers
in the same processes, and the gradients must agree exactly (float64)."""

from __future__ import annotations

import contextlib
import copy
import inspect
import io
import pickle
import warnings
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from tests.distributed.workloads import COMPILE_BACKEND, Stack, compiled_backward_nodes, global_batch, make_net, mse
from tests.spawn import run_ranks, run_ranks_expecting_errors

pytestmark = pytest.mark.distributed


def side_by_side(rank: int, world_size: int, scenario, *args) -> dict:
    import hsync

    results = {}
    for name, wrap in (("ddp", DistributedDataParallel), ("hsync", hsync.WeightedDDP)):
        torch.manual_seed(0)
        results[name] = scenario(rank, world_size, wrap, *args)
    return results


def assert_same(results: list[dict]) -> None:
    for rank, result in enumerate(results):
        torch.testing.assert_close(result["hsync"], result["ddp"], rtol=1e-12, atol=1e-12,
                                   msg=lambda m, rank=rank: f"rank {rank}: hsync vs DDP: {m}")


def grads_of(module: nn.Module) -> dict[str, torch.Tensor | None]:
    return {name: None if p.grad is None else p.grad.detach().clone() for name, p in module.named_parameters()}


def two_forwards_batch_norm(rank, world_size, wrap):
    model = wrap(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).double())
    for step in range(3):
        x = torch.randn(6, 3, dtype=torch.float64) + rank + step
        model.zero_grad()
        (model(x).pow(2).sum() + model(2 * x).pow(2).sum()).backward()  # siamese: one backward
    return {"grads": grads_of(model.module), "buffers": dict(model.module.named_buffers())}


def steps_on_the_default_group(rank, world_size, wrap):
    model = wrap(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double())
    for step in range(2):
        x, y = global_batch(step, [3, 3])[2][rank]
        model.zero_grad()
        mse(model(x).squeeze(1), y).backward()
    return grads_of(model.module)


def test_a_process_group_made_without_a_backend_trains_as_with_ddp():
    # The README's loop: init_process_group() with no backend, whose get_backend() is 'undefined' (torch 2.14).
    assert_same(run_ranks(side_by_side, 2, steps_on_the_default_group, backend=None))


def test_two_forwards_one_backward_with_batch_norm():
    assert_same(run_ranks(side_by_side, 2, two_forwards_batch_norm))


class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2, dtype=torch.float64)
        self.register_buffer("step", torch.zeros((), dtype=torch.float64))

    def forward(self, x):
        return self.fc(x) * self.step


def buffer_reassigned_on_rank_0(rank, world_size, wrap):
    model = wrap(Counter())
    seen = []
    for _ in range(3):
        if rank == 0:
            model.module.step = model.module.step + 1  # a new tensor, not an in-place update
        model.zero_grad()
        model(torch.ones(1, 2, dtype=torch.float64)).sum().backward()
        seen.append(model.module.step.item())
    assert seen == [1.0, 2.0, 3.0], f"rank {rank} saw {seen}"
    return grads_of(model.module)


def test_a_buffer_reassigned_on_rank_0_reaches_every_rank():
    assert_same(run_ranks(side_by_side, 2, buffer_reassigned_on_rank_0))


class Rotary(nn.Module):
    """A complex buffer, as torchtitan's rotary embeddings' freqs_cis, different on each rank until wrapped."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4, dtype=torch.float64)
        self.register_buffer("freqs_cis", torch.polar(torch.ones(2, dtype=torch.float64),
                                                      torch.arange(2, dtype=torch.float64) + rank))

    def forward(self, x):
        rotated = torch.view_as_real(torch.view_as_complex(x.reshape(-1, 2, 2)) * self.freqs_cis).reshape(-1, 4)
        return self.fc(rotated)


def complex_buffer(rank, world_size, wrap, device: str = "cpu"):
    model = wrap(Rotary(rank).to(device))
    received = model.module.freqs_cis.clone()
    for step in range(2):
        model.module.freqs_cis.mul_(1j ** (rank + 1))  # changed on each rank its own way: rank 0's comes back
        model.zero_grad()
        model(torch.randn(3, 4, dtype=torch.float64, device=device) + rank + step).square().sum().backward()
    return {"wrapped": received.cpu(), "after": model.module.freqs_cis.cpu(), "grads": grads_of(model.module.cpu())}


def test_a_complex_buffer_is_broadcast_as_ddp_broadcasts_it():
    results = run_ranks(side_by_side, 2, complex_buffer)
    assert_same(results)
    for result in results:
        torch.testing.assert_close(result["hsync"]["wrapped"], results[0]["hsync"]["wrapped"], rtol=0, atol=0)


def settings_changed_on_the_wrapper(rank, world_size, wrap):
    # What loops change on a DDP after wrapping: the buffer flags, a late static graph, ignored names
    # set through the wrapper's class.
    x = torch.ones(1, 2, dtype=torch.float64)
    model = wrap(Counter())
    seen = {"will sync": [model.will_sync_module_buffers()], "step": []}

    def step(sync: bool = True) -> None:
        model.module.step.fill_(rank + 1.0)  # each rank its own; a broadcast leaves rank 0's 1.0
        with contextlib.nullcontext() if sync else model.no_sync():
            model(x).sum().backward()
        seen["step"].append(model.module.step.item())
        seen["will sync"].append(model.will_sync_module_buffers())

    step()
    model.broadcast_buffers = False
    step()
    model.broadcast_buffers = True
    step(sync=False)  # follows a synced step: broadcasts
    step()  # follows a no_sync forward: does not
    step(sync=False)
    model.require_forward_param_sync = True  # forced after a no_sync forward, as some loops do
    step()

    ignoring = Counter()
    ignoring.step.fill_(1.0)
    wrap._set_params_and_buffers_to_ignore_for_model(ignoring, ["fc.weight"])
    late_static = wrap(ignoring)
    late_static._set_static_graph()
    late_static(x * (rank + 1)).sum().backward()
    seen["static graph"] = late_static.static_graph
    return seen | {"grads": grads_of(model.module), "ignoring": grads_of(ignoring)}


def test_settings_changed_on_the_wrapper_act_as_on_a_ddp():
    results = run_ranks(side_by_side, 2, settings_changed_on_the_wrapper)
    assert_same(results)
    ours = [result["hsync"] for result in results]
    assert ours[1]["step"] == [1.0, 2.0, 1.0, 2.0, 1.0, 1.0], "broadcast only when due"
    assert ours[1]["will sync"] == [True, True, False, False, True, False, True]
    weights = [result["ignoring"]["fc.weight"] for result in ours]
    assert not torch.equal(*weights), "an ignored name stays local"


class NoGradForWeight(torch.autograd.Function):
    """y = x * w, but backward returns no gradient for w (None), as some custom kernels do."""

    @staticmethod
    def forward(ctx, x, w):
        return x * w

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class CustomNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(3, dtype=torch.float64))
        self.fc = nn.Linear(3, 1, dtype=torch.float64)

    def forward(self, x):
        return self.fc(NoGradForWeight.apply(x, self.w))


def undefined_gradient(rank, world_size, wrap):
    model = wrap(CustomNet(), find_unused_parameters=True)
    out = []
    for step in range(3):
        if step == 1:
            model.module.w.grad = torch.full((3,), float(rank + 1), dtype=torch.float64)  # a gradient kept from before
        model(torch.randn(4, 3, dtype=torch.float64)).sum().backward()
        out.append(grads_of(model.module))
        model.zero_grad(set_to_none=step != 1)
    assert out[0]["w"] is None, "a gradient no rank produced stays undefined"
    return out


def test_an_undefined_gradient_counts_as_unused():
    assert_same(run_ranks(side_by_side, 2, undefined_gradient))


def backward_outside_the_wrapper(rank, world_size, wrap):
    model = wrap(make_net(seed=0), find_unused_parameters=True)
    _, _, slices = global_batch(0, [4] * world_size)
    x, y = slices[rank]
    if rank == 0:
        # An evaluation with gradients on one rank only, through the bare module: no collective.
        mse(model.module(x), y).backward()
        local = grads_of(model.module)
        model.zero_grad()
    model.zero_grad()
    mse(model(x), y).backward()  # a normal synced step afterwards
    return grads_of(model.module) | ({"local": local["inp.weight"]} if rank == 0 else {})


def test_a_backward_that_skipped_the_wrappers_forward_stays_local():
    results = run_ranks(side_by_side, 2, backward_outside_the_wrapper, timeout=60)
    assert_same(results)


@dataclass
class Prediction:
    value: torch.Tensor


class Opaque:
    """An output type that neither DDP nor hsync looks into."""

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value


class CheckpointedHead(nn.Module):
    """Its last layer checkpointed with use_reentrant=True: backward begins in a nested graph task,
    and the first layer's gradient arrives afterwards, in the outer one."""

    def __init__(self, output_type: type) -> None:
        super().__init__()
        self.first = nn.Linear(4, 6, dtype=torch.float64)
        self.last = nn.Linear(6, 1, dtype=torch.float64)
        self.output_type = output_type

    def forward(self, x):
        return self.output_type(checkpoint(self.last, torch.tanh(self.first(x)), use_reentrant=True))


def reentrant_checkpoint_output(rank, world_size, wrap, output_type: type):
    model = wrap(CheckpointedHead(output_type))
    out = []
    for step in range(2):
        _, _, slices = global_batch(step, [3, 5])
        x, y = slices[rank]
        model.zero_grad()
        mse(model(x).value.squeeze(-1), y).backward()
        out.append(grads_of(model.module))
    return out


def test_a_dataclass_output_through_a_reentrant_checkpoint_reduces_every_gradient():
    # hsync looks for the output's tensors where DDP does; before it looked into dataclasses, the step
    # ended with the nested backward and the first layer's gradient stayed this rank's own.
    results = run_ranks(side_by_side, 2, reentrant_checkpoint_output, Prediction)
    assert_same(results)
    assert torch.equal(results[0]["hsync"][0]["first.weight"], results[1]["hsync"][0]["first.weight"])


def opaque_output_through_reentrant_checkpoint(rank, world_size):
    import hsync

    reentrant_checkpoint_output(rank, world_size, hsync.WeightedDDP, Opaque)


def test_an_output_hsync_cannot_look_into_through_a_reentrant_checkpoint_is_refused_on_every_rank():
    # The step began in the nested backward and ended with it: the outer backward's gradients would
    # have stayed local, silently (DDP, which waits for every parameter, trains here).
    for text in run_ranks_expecting_errors(opaque_output_through_reentrant_checkpoint, 2):
        assert "the gradient of 'first." in text and "arrived after its step's reduction had ended" in text, text
        assert "dataclasses" in text, text


def accumulation_by_flag(rank, world_size, wrap):
    # nanoGPT's loop: rather than no_sync(), it sets the flag that no_sync() toggles, per micro-step.
    model = wrap(make_net(seed=0), find_unused_parameters=True)
    out = []
    for step in range(2):
        for micro in range(3):
            model.require_backward_grad_sync = micro == 2
            _, _, slices = global_batch(step, [2, 5], micro)
            x, y = slices[rank]
            mse(model(x), y).backward()
            out.append(grads_of(model.module))  # local sums until the last micro-step, then reduced
        model.zero_grad()
    return out


def test_setting_require_backward_grad_sync_accumulates_as_with_ddp():
    results = run_ranks(side_by_side, 2, accumulation_by_flag)
    assert_same(results)
    first_micro_step = [result["hsync"][0]["inp.weight"] for result in results]
    assert not torch.equal(*first_micro_step), "a micro-step with the flag cleared stays local"


def gradient_penalty(rank: int, net: nn.Module) -> dict:
    """WGAN-GP style: torch.autograd.grad through the output, then the step's own backward."""
    _, _, slices = global_batch(0, [4, 4])
    x, y = slices[rank]
    x = x.clone().requires_grad_()
    out = net(x)
    (grad_x,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    (mse(out, y) + grad_x.pow(2).sum()).backward()
    return grads_of(net.module if hasattr(net, "module") else net)


def gradient_penalty_wrapped(rank, world_size):
    import hsync

    return gradient_penalty(rank, hsync.WeightedDDP(make_net(seed=0)))


def test_torch_autograd_grad_before_backward_leaves_the_step_to_backward():
    # Exact: the mean over ranks of each rank's local gradient. (torch DDP's differs here: its
    # reducer does not support a backward through a graph made with create_graph=True.)
    local = [gradient_penalty(rank, make_net(seed=0)) for rank in range(2)]
    expected = {name: None if g is None else (g + local[1][name]) / 2 for name, g in local[0].items()}
    for rank, grads in enumerate(run_ranks(gradient_penalty_wrapped, 2)):
        torch.testing.assert_close(grads, expected, rtol=1e-12, atol=1e-12, msg=lambda m, r=rank: f"rank {r}: {m}")


def pickled_copies(rank, world_size, wrap):
    model = wrap(make_net(seed=0), find_unused_parameters=True)
    _, _, slices = global_batch(0, [4] * world_size)
    x, y = slices[rank]
    mse(model(x), y).backward()
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    copied = copy.deepcopy(model)
    results = {}
    for name, m in (("loaded", loaded), ("copied", copied)):
        m.zero_grad()
        mse(m(x), y).backward()  # its own reduction, over the default group
        results[name] = grads_of(m.module)
    return results


def test_pickled_and_deep_copied_wrappers_train_like_ddps():
    assert_same(run_ranks(side_by_side, 2, pickled_copies))


def compiled_wrapper(rank, world_size, wrap):
    torch._dynamo.reset()
    net = make_net(seed=0)
    model = torch.compile(wrap(net, find_unused_parameters=True), backend=COMPILE_BACKEND)
    out = []
    for step in range(3):
        for micro in range(2 if step == 1 else 1):
            _, _, slices = global_batch(step, [3, 5], micro)
            x, y = slices[rank]
            with model.no_sync() if step == 1 and micro == 0 else contextlib.nullcontext():
                mse(model(x), y).backward()
        out.append(grads_of(net))
        model.zero_grad()
    return out


def test_a_compiled_wrapper_trains_like_a_compiled_ddp():
    # torch.compile(DDP(net)): dynamo traces the wrapper's forward, through no_sync too.
    assert_same(run_ranks(side_by_side, 2, compiled_wrapper, timeout=300))


def compiled_graph_split(rank, world_size, wrap):
    torch._dynamo.reset()  # or the second wrapper would reuse the graphs compiled under the first
    torch.manual_seed(0)
    net = Stack()
    model = wrap(torch.compile(net, backend=COMPILE_BACKEND), bucket_cap_mb=2)
    loss = model(torch.randn(4, 512)).square().mean()
    nodes = compiled_backward_nodes(loss)
    loss.backward()
    return {"backward nodes": nodes, "grads": grads_of(net)}


def test_compiled_graphs_split_at_bucket_boundaries_as_ddps_do():
    # One graph's backward is one autograd node: unsplit, every gradient would reach its bucket only
    # at its end, leaving nothing for the all-reduces to overlap.
    results = run_ranks(side_by_side, 2, compiled_graph_split, timeout=300)
    for result in results:
        assert result["hsync"]["backward nodes"] == result["ddp"]["backward nodes"] > 1, result
        torch.testing.assert_close(result["hsync"]["grads"], result["ddp"]["grads"])


class Shifted(Stack):
    """A buffer, as BERT's position ids: rank 0's is broadcast before each synchronised forward."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("shift", torch.zeros(512))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x + self.shift)


def compiled_steady_steps(rank, world_size, wrap, nested_graph_breaks):
    torch._dynamo.reset()
    torch._dynamo.config.nested_graph_breaks = nested_graph_breaks
    torch.manual_seed(0)
    net = Shifted()
    model = torch.compile(wrap(net, bucket_cap_mb=2), backend=COMPILE_BACKEND)
    g = torch.Generator().manual_seed(rank)

    def step(weighted: bool) -> None:
        with model.no_sync():
            model(torch.randn(4, 512, generator=g)).square().mean().backward()
        loss = model(torch.randn(4, 512, generator=g)).square().mean()
        if weighted:
            model.backward(loss, weight=4)  # equal weights: DDP's gradient
        else:
            loss.backward()

    kinds = [False, True] if hasattr(model, "backward") else [False, False]
    for weighted in kinds:  # the first builds the buckets, the next runs on them
        step(weighted)
    with torch.compiler.set_stance("fail_on_recompile"):
        for weighted in kinds * 2:
            step(weighted)
    return grads_of(net)


@pytest.mark.parametrize("nested_graph_breaks", [False, True], ids=["graph-breaks", "nested-graph-breaks"])
def test_a_compiled_wrapper_compiles_once_as_a_compiled_ddp_does(nested_graph_breaks):
    # Each recompile of a BERT's forward costs seconds to minutes, and after eight dynamo gives up
    # compiling the frame: step-to-step values must not reach the traced code, whether dynamo resumes
    # inside a function at a graph break (nested) or not.
    for result in run_ranks(side_by_side, 2, compiled_steady_steps, nested_graph_breaks, timeout=300):
        torch.testing.assert_close(result["hsync"], result["ddp"])


def unwrapped_by_type(rank, world_size, wrap):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    model = wrap(make_net(seed=0))
    inner = model
    while isinstance(inner, DistributedDataParallel):  # as checkpointers (fvcore, Accelerate) unwrap
        inner = inner.module
    assert inner is model.module
    state = get_model_state_dict(model)  # torch.distributed.checkpoint's names: the bare model's
    changed = {name: value + 1 for name, value in state.items()}
    set_model_state_dict(model, dict(changed))  # it empties the dict it is given
    return {"names": sorted(state), "loaded": all(torch.equal(p, changed[n]) for n, p in inner.named_parameters())}


def test_code_that_unwraps_a_ddp_by_type_unwraps_the_wrapper():
    for result in run_ranks(side_by_side, 2, unwrapped_by_type):
        assert result["hsync"] == result["ddp"], result
        assert result["hsync"]["loaded"] and "inp.weight" in result["hsync"]["names"], result


# Names of DDP's class that a WeightedDDP inherits as they are: they work on it unchanged (tested below).
INHERITED_FROM_DDP = {"__annotations__", "_active_ddp_module", "_get_active_ddp_module", "_inside_ddp_forward",
                      "_set_params_and_buffers_to_ignore_for_model", "_get_data_parallel_params", "_get_parameters",
                      "_distributed_rank", "_set_ddp_sink_clone", "train", "gather", "scatter"}


def test_every_attribute_of_ddps_class_is_hsyncs_own_inherited_on_purpose_or_absent():
    import hsync
    from hsync.compat import DDP_MACHINERY

    undecided = sorted(set(vars(DistributedDataParallel)) - set(vars(hsync.WeightedDDP)) - INHERITED_FROM_DDP)
    assert not undecided, f"torch's DDP has names hsync has not decided on: {undecided}"
    assert set(DDP_MACHINERY) <= set(vars(DistributedDataParallel)), "DDP's machinery named as it is in torch"
    for name in DDP_MACHINERY:
        assert not hasattr(hsync.WeightedDDP, name), name
        with pytest.raises(AttributeError, match=f"has no '{name}': it is DDP's own machinery"):
            getattr(hsync.WeightedDDP, name)


# DDP's public instance attributes that a WeightedDDP leaves out: its machinery (as above), the
# buffer lists its buffer hooks use (not offered), and per-bucket caps (bucket_cap_mb_list, refused).
ABSENT_INSTANCE_ATTRIBUTES = {"reducer", "logger", "modules_buffers", "named_module_buffers",
                              "bucket_bytes_cap_default", "bucket_bytes_cap_list"}


def public_instance_attributes(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    import hsync

    net = make_net(seed=0)
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(net, ["never_used.bias"])
    arguments = dict(device_mesh=init_device_mesh("cpu", (world_size,)), bucket_cap_mb=5,
                     skip_all_reduce_unused_params=True)
    ddp, ours = DistributedDataParallel(net, **arguments), hsync.WeightedDDP(net, **arguments)
    names = sorted(name for name in vars(ddp) if not name.startswith("_") and name not in ("module", "training"))
    return {"compared": names,
            "differ": {name: (getattr(ours, name, "absent"), getattr(ddp, name)) for name in names
                       if name not in ABSENT_INSTANCE_ATTRIBUTES
                       and not (hasattr(ours, name) and getattr(ours, name) == getattr(ddp, name))},
            "present though left out": [name for name in ABSENT_INSTANCE_ATTRIBUTES if hasattr(ours, name)]}


def test_ddps_public_instance_attributes_read_as_on_a_ddp():
    # Code reads them off a DDP: torch's _sync_module_states takes broadcast_bucket_size and
    # parameters_to_ignore, its device-mesh tests device_mesh. A name a new torch adds shows up here.
    for result in run_ranks(public_instance_attributes, 2):
        assert "device_mesh" in result["compared"] and "parameters_to_ignore" in result["compared"], result
        assert not result["differ"] and not result["present though left out"], result


def outcome(function, *args) -> object:
    """What the call returns, or the error it raises (type and message)."""
    try:
        return function(*args)
    except Exception as error:  # noqa: BLE001 - the error is the result
        return f"{type(error).__name__}: {error}"


def inherited_as_they_are(rank, world_size, wrap):
    model = wrap(make_net(seed=0), find_unused_parameters=True)
    x = torch.randn(2, 4, dtype=torch.float64)
    with model._inside_ddp_forward():
        active = DistributedDataParallel._get_active_ddp_module() is model
    model._set_ddp_sink_clone(False)  # no effect on either: DDP's sink clones outputs, hsync has none
    present = {name: hasattr(model, name) for name in sorted(INHERITED_FROM_DDP)}
    if type(model) is not DistributedDataParallel:
        from hsync.compat import DDP_MACHINERY

        assert not any(hasattr(model, name) for name in DDP_MACHINERY), "absent from an instance too"
    in_eval = model.train(False) is model and not model.module.training
    model.train()
    return {"present": present, "active inside forward": active, "in eval": in_eval,
            "rank": model._distributed_rank, "gathered": outcome(model.gather, [x, 2 * x], -1),
            "scattered": outcome(model.scatter, (x,), {}, [0]),  # multi-device legacy: on CPU, an error
            "to_kwargs": model.to_kwargs((x,), {"y": x}, 0),
            "parameters": [p.shape for p in model._get_data_parallel_params(model.module)],
            "own parameters": [p.shape for p in model._get_parameters(model.module)],
            "output": model(x)}


def test_ddps_methods_inherited_as_they_are_work_as_on_a_ddp():
    for result in run_ranks(side_by_side, 2, inherited_as_they_are):
        ours, theirs = result["hsync"], result["ddp"]
        assert all(ours["present"].values()), ours["present"]
        errors = {key for key, value in theirs.items() if isinstance(value, str)}
        assert {key: ours.pop(key) for key in errors} == {key: theirs.pop(key) for key in errors}
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def regrouped(rank, world_size, wrap):
    """DDP's _update_process_group: three ranks train, ranks 0 and 1 go on alone, then all three again,
    the first time with a forward from before the update (which, as in DDP, no longer synchronises)."""
    model = wrap(make_net(seed=0), find_unused_parameters=True)
    pair = dist.new_group([0, 1])
    out = []
    for step, (group, after_forward) in enumerate(((None, False), (pair, False), (dist.group.WORLD, True),
                                                   (None, False))):
        if group is pair and rank == 2:
            continue
        if group is not None and not after_forward:
            model._update_process_group(group)
        x, y = global_batch(step, [3, 5, 4])[2][rank]
        model.zero_grad()
        loss = mse(model(x), y)
        if group is not None and after_forward:
            model._update_process_group(group)
        loss.backward()
        out.append(grads_of(model.module))
    return out


def test_updating_the_process_group_regroups_as_ddp_does():
    results = run_ranks(side_by_side, 3, regrouped)
    assert_same(results)
    steps = [result["hsync"] for result in results]
    assert [len(grads) for grads in steps] == [4, 4, 3]
    steps[2].insert(1, None)  # rank 2 sat out step 1
    for step, ranks in ((0, (0, 1, 2)), (1, (0, 1)), (3, (0, 1, 2))):
        grads = [steps[rank][step]["inp.weight"] for rank in ranks]
        assert all(torch.equal(grads[0], g) for g in grads), f"step {step}: reduced over ranks {ranks}"
    assert not torch.equal(steps[0][2]["inp.weight"], steps[1][2]["inp.weight"]), "step 2 stayed local"


def refused_ddp_features(rank, world_size):
    from torch.distributed.optim import _apply_optimizer_in_backward

    import hsync

    model = hsync.WeightedDDP(make_net(seed=0))
    errors = {}
    with pytest.raises(RuntimeError) as error:
        model._register_fused_optim(torch.optim.SGD, lr=0.1)
    errors["fused optimizer"] = str(error.value)
    pair = dist.new_group([0, 1])
    if rank == 2:
        with pytest.raises(ValueError) as error:
            model._update_process_group(pair)
        errors["outside the new group"] = str(error.value)
    net = make_net(seed=0)
    if rank == 1:
        _apply_optimizer_in_backward(torch.optim.SGD, net.out.parameters(), {"lr": 0.1})
    with pytest.raises(ValueError) as error:
        hsync.WeightedDDP(net)
    errors["optimizer in backward"] = str(error.value)

    # A refused update changes nothing: the wrapper still reduces over its old group.
    if rank == 1:
        _apply_optimizer_in_backward(torch.optim.SGD, model.module.out.parameters(), {"lr": 0.1})
    with pytest.raises(ValueError):
        model._update_process_group(dist.new_group([0, 1, 2]))
    errors["still the old group after a refused update"] = model.process_group is dist.group.WORLD
    balanced = hsync.WeightedDDP(make_net(seed=0))
    hsync.Balancer(balanced, 12, hsync.BalanceConfig(global_batch_size=6))
    with pytest.raises(RuntimeError) as error:
        balanced._update_process_group(dist.group.WORLD)
    errors["under a balancer"] = str(error.value)
    return errors


def sync_batch_norm_on_the_cpu(rank, world_size, wrap) -> str:
    try:
        wrap(nn.Sequential(nn.Linear(3, 4), nn.SyncBatchNorm(4)))
    except ValueError as error:
        return str(error)
    return "no error"


def test_torchs_sync_batch_norm_on_the_cpu_is_refused_at_the_wrap_as_by_ddp():
    # It was taken, and torch's layer refused the first training forward on every rank.
    for result in run_ranks(side_by_side, 2, sync_batch_norm_on_the_cpu):
        assert result["ddp"] == "SyncBatchNorm layers only work with GPU modules", result
        assert result["hsync"] == ("hsync.WeightedDDP: SyncBatchNorm layers only work with GPU modules (torch's own "
                                   "needs a GPU)"), result


def test_ddp_features_hsync_lacks_are_refused_on_every_rank_that_asks():
    errors = run_ranks(refused_ddp_features, 3)[2]  # rank 2 is outside the pair
    assert "runs no optimizer inside backward (DDP's _register_fused_optim)" in errors["fused optimizer"]
    assert "rank 2 is not in the new process group" in errors["outside the new group"]
    assert errors["optimizer in backward"].startswith(
        "hsync: cannot wrap the model: on rank 1, parameter 'out.weight' has an optimizer applied in backward")
    assert errors["still the old group after a refused update"]
    assert "an hsync.Balancer plans this wrapper's steps for its ranks" in errors["under a balancer"]


def save_wrapper(rank, world_size, path: str) -> None:
    import hsync

    model = hsync.WeightedDDP(make_net(seed=0))
    if rank == 0:
        torch.save(model, path)
    group = dist.new_group([0, 1])
    with pytest.raises(RuntimeError, match="only when it uses the default process group"):
        pickle.dumps(hsync.WeightedDDP(make_net(seed=0), process_group=group))


def test_a_loaded_wrapper_without_a_process_group_infers_and_refuses_training(tmp_path):
    import hsync  # noqa: F401 - the class must be importable to unpickle

    path = str(tmp_path / "wrapper.pt")
    run_ranks(save_wrapper, 2, path)
    model = torch.load(path, weights_only=False)
    x = torch.randn(3, 4, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(model(x), model.module(x))
    with pytest.raises(RuntimeError, match="init_process_group"):
        model(x)


def constructor_arguments(rank, world_size):
    import hsync

    ddp_params = list(inspect.signature(DistributedDataParallel.__init__).parameters)
    ours = list(inspect.signature(hsync.WeightedDDP.__init__).parameters)
    assert ours[:len(ddp_params)] == ddp_params, "DDP's arguments, in DDP's order"

    net = make_net(seed=0)
    model = hsync.WeightedDDP(net, None, None, 0, True, True, None, 25, True, False, False, True)  # positional
    assert model.find_unused_parameters and model.static_graph and model.broadcast_buffers
    hsync.WeightedDDP(make_net(seed=0), device_ids=None, output_device=None, find_unused_parameters=False,
                      static_graph=True, gradient_as_bucket_view=True, init_sync=False,
                      skip_all_reduce_unused_params=True, batched_grad_copy=True, forward_sync_buffers=False)
    refused = {
        "device_ids on a CPU module": {"device_ids": [0]},
        "two device_ids": {"device_ids": [0, 1]},
        "output_device on a CPU module": {"output_device": 0},
        "mixed_precision": {"mixed_precision": object()},
        "bucket_cap_mb_list": {"bucket_cap_mb_list": [1, 2]},
        "delayed all-reduce": {"delay_all_reduce_named_params": [], "param_to_hook_all_reduce": object()},
        "a flag that is not a bool": {"find_unused_parameters": "yes"},
        "a negative bucket cap": {"bucket_cap_mb": -1},
        "both a group and a mesh": {"process_group": dist.group.WORLD, "device_mesh": object()},
    }
    errors = {}
    for label, kwargs in refused.items():
        for name, wrap in (("ddp", DistributedDataParallel), ("hsync", hsync.WeightedDDP)):
            try:
                wrap(make_net(seed=0), **kwargs)
                errors[label, name] = None
            except Exception as error:  # noqa: BLE001 - the error is the result
                errors[label, name] = (type(error).__name__, str(error))
    deprecated = {"broadcast_buffers": {"broadcast_buffers": False},
                  "both buffer flags": {"broadcast_buffers": True, "forward_sync_buffers": False},
                  "check_reduction": {"check_reduction": True}}
    warned = {}
    for label, kwargs in deprecated.items():
        for name, wrap in (("ddp", DistributedDataParallel), ("hsync", hsync.WeightedDDP)):
            if "forward_sync_buffers" in kwargs and "forward_sync_buffers" not in ddp_params:
                continue  # torch 2.11's DDP has no forward_sync_buffers
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                wrap(make_net(seed=0), **kwargs)
            warned[label, name] = [str(w.message) for w in caught if w.category is FutureWarning]
    with pytest.raises(TypeError, match="broadcast_buffers must be True or False"):
        model.broadcast_buffers = "yes"
    # A DDP method hsync does not offer is refused, not inherited as a silent no-op.
    with pytest.raises(RuntimeError, match="no buffer communication hooks"):
        model._register_buffer_comm_hook(None, lambda state, buffers: [])
    return {"errors": errors, "warned": warned}


def test_ddps_constructor_arguments_are_accepted_honoured_or_refused():
    result = run_ranks(constructor_arguments, 2)[0]
    errors, warned = result["errors"], result["warned"]
    for (label, name), messages in warned.items():
        # Deprecations as this torch's DDP has them: one FutureWarning each, none where DDP has none.
        assert len(messages) == len(warned[label, "ddp"]) <= 1, (label, name, messages, warned[label, "ddp"])
    ours = {label: error for (label, name), error in errors.items() if name == "hsync"}
    for label, error in ours.items():
        assert error is not None, f"hsync accepted {label}"
        theirs = errors[label, "ddp"]
        if theirs is not None and theirs[0] in ("ValueError", "RuntimeError"):
            assert error[0] == theirs[0], f"{label}: hsync raised {error}, DDP {theirs}"
    assert "device_ids can only be None or contain a single element" in ours["two device_ids"][1]
    assert "does not support DDP's mixed_precision" in ours["mixed_precision"][1]
    assert "does not support DDP's delay_all_reduce_named_params" in ours["delayed all-reduce"][1]
    assert ours["a flag that is not a bool"] == ("TypeError", "hsync.WeightedDDP: find_unused_parameters must be "
                                                              "True or False, got str 'yes'")


def assigned_attributes(rank, world_size):
    import hsync

    model = hsync.WeightedDDP(make_net(seed=0))
    model.static_graph = model.find_unused_parameters = True
    model.broadcast_buffers = False
    assigned = (model.static_graph, model.find_unused_parameters, model.forward_sync_buffers,
                model.will_sync_module_buffers())
    refusals = {name: outcome(setattr, model, name, value) for name, value in
                (("gradient_as_bucket_view", True), ("comm_dtype", torch.bfloat16), ("dim", 1),
                 ("static_graph", "yes"))}
    x = torch.randn(4, 4, dtype=torch.float64)
    model.backward(model(x).sum(), weight=4)
    return {"assigned": assigned, "refusals": refusals, "bucket_views": model.gradient_as_bucket_view,
            "comm_dtype": str(model.comm_dtype), "dim": model.dim}


def test_attributes_fixed_at_wrap_time_are_refused_and_the_assignable_ones_assigned():
    for result in run_ranks(assigned_attributes, 2):
        assert result["assigned"] == (True, True, False, False), result
        refusals = result["refusals"]
        for name in ("gradient_as_bucket_view", "comm_dtype", "dim"):
            assert refusals[name] == f"AttributeError: hsync.WeightedDDP.{name} is fixed at wrap time; pass it to " \
                                     "the constructor", refusals
        assert refusals["static_graph"].startswith("TypeError: hsync.WeightedDDP: static_graph must be True or False")
        assert (result["bucket_views"], result["comm_dtype"], result["dim"]) == (False, "None", 0), result


def join_weighted(rank, world_size, sizes_per_rank: list[list[int]], micro_steps: int):
    """Weighted steps under join(): rank r runs len(sizes_per_rank[r]) steps of that many examples
    per micro-step, accumulating all but the last micro-step under no_sync."""
    import hsync

    model = hsync.WeightedDDP(make_net(seed=0), bucket_cap_mb=1e-4, first_bucket_cap_mb=1e-4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    weights = []
    with model.join():
        for step, n in enumerate(sizes_per_rank[rank]):
            sizes = [s[step] if step < len(s) else 0 for s in sizes_per_rank]
            opt.zero_grad()
            for micro in range(micro_steps):
                x, y = global_batch(step, sizes, micro)[2][rank]
                with contextlib.nullcontext() if micro == micro_steps - 1 else model.no_sync():
                    stats = model.backward(mse(model(x), y), weight=n)
            weights.append(stats.weight)
            opt.step()
    return {name: p.detach() for name, p in model.module.named_parameters()}, weights


def reference_uneven(sizes_per_rank: list[list[int]], micro_steps: int):
    net = make_net(seed=0)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(max(len(s) for s in sizes_per_rank)):
        sizes = [s[step] if step < len(s) else 0 for s in sizes_per_rank]
        x = torch.cat([global_batch(step, sizes, micro)[0] for micro in range(micro_steps)])
        y = torch.cat([global_batch(step, sizes, micro)[1] for micro in range(micro_steps)])
        opt.zero_grad()
        mse(net(x), y).backward()  # the mean over every example still in play
        opt.step()
    return {name: p.detach() for name, p in net.named_parameters()}


@pytest.mark.parametrize("micro_steps", [1, 2], ids=["synced", "no_sync"])
def test_join_keeps_weighted_steps_exact(micro_steps):
    sizes = [[3, 5], [4, 1, 6, 2], [2, 2, 7]]
    results = run_ranks(join_weighted, 3, sizes, micro_steps)
    expected = reference_uneven(sizes, micro_steps)
    for rank, (params, weights) in enumerate(results):
        assert weights == [micro_steps * sum(s[i] for s in sizes if i < len(s)) for i in range(len(sizes[rank]))]
        for name, value in expected.items():
            # Every rank ends with the last joiner's parameters: the whole run's.
            torch.testing.assert_close(params[name], value, rtol=1e-10, atol=1e-12, msg=f"rank {rank}, {name}")


def batch_norm_under_join(rank, world_size, wrap):
    model = wrap(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).double())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with model.join():
        for step in range(2 + rank):  # uneven: rank 0 joins first
            x = torch.randn(6, 3, dtype=torch.float64) + 10 * rank + step  # each rank's statistics its own
            optimizer.zero_grad()
            model(x).pow(2).mean().backward()
            optimizer.step()
    return {name: t.detach().clone() for name, t in model.module.state_dict().items()}


def test_buffers_under_join_come_from_the_rank_ddp_takes_them_from():
    # DDP broadcasts them from the highest rank not joined, even before any rank has joined; hsync took the
    # lowest, and running statistics differed from DDP's with even inputs too.
    assert_same(run_ranks(side_by_side, 3, batch_norm_under_join))


def join_with_mismatched_no_sync(rank, world_size):
    import hsync

    model = hsync.WeightedDDP(make_net(seed=0))
    x, y = global_batch(0, [2, 2])[2][rank]
    with model.join():
        for _ in range(2):
            out = model(x)  # outside no_sync: the joined rank expects a synchronised step
            with model.no_sync():
                model.backward(mse(out, y), weight=2)


def test_join_refuses_a_backward_whose_forward_said_otherwise():
    for text in run_ranks_expecting_errors(join_with_mismatched_no_sync, 2):
        assert "under join(), run each micro-step's forward in the same no_sync() state" in text, text


def bad_weight_while_a_rank_is_joined(rank, world_size):
    import hsync

    model = hsync.WeightedDDP(make_net(seed=0))
    x, y = global_batch(0, [2, 2])[2][rank]
    with model.join():
        for step in range(1 + rank):
            model.backward(mse(model(x), y), weight=-1 if step == 1 else 2)


def test_bad_input_while_a_rank_is_joined_raises_there_too():
    texts = run_ranks_expecting_errors(bad_weight_while_a_rank_is_joined, 2)
    for text in texts:
        assert "rank 1 passed a weight that is negative, NaN, infinite or above 2**53" in text, text


def gan_steps(rank, world_size, wrap):
    """DCGAN's loop: two wrapped models on one group; the discriminator runs three forwards a step, two
    backwards in its own step and one inside the generator's backward; both hold batch norms."""
    generator = wrap(nn.Sequential(nn.Linear(2, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3)).double())
    discriminator = wrap(nn.Sequential(nn.Linear(3, 8), nn.BatchNorm1d(8), nn.LeakyReLU(0.2),
                                       nn.Linear(8, 1)).double())
    opt_g = torch.optim.Adam(generator.parameters(), lr=1e-2)
    opt_d = torch.optim.Adam(discriminator.parameters(), lr=1e-2)
    bce = nn.BCEWithLogitsLoss()
    g = torch.Generator().manual_seed(7 + rank)
    for _ in range(4):
        real = torch.randn(5, 3, generator=g, dtype=torch.float64) + 1.0
        noise = torch.randn(5, 2, generator=g, dtype=torch.float64)
        discriminator.zero_grad()
        out = discriminator(real)
        bce(out, torch.ones_like(out)).backward()
        fake = generator(noise)
        out = discriminator(fake.detach())
        bce(out, torch.zeros_like(out)).backward()
        opt_d.step()
        generator.zero_grad()
        out = discriminator(fake)
        bce(out, torch.ones_like(out)).backward()
        opt_g.step()
    return {"generator": grads_of(generator.module), "discriminator": grads_of(discriminator.module),
            "parameters": [p.detach().clone() for m in (generator, discriminator) for p in m.parameters()],
            "buffers": [b.clone() for m in (generator, discriminator) for b in m.buffers()]}


def test_a_gan_loop_with_two_wrapped_models_trains_as_with_ddp():
    assert_same(run_ranks(side_by_side, 2, gan_steps))


def gan_nets() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    return (nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 3)).double(),
            nn.Sequential(nn.Linear(3, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1)).double())


def gan_batches(rank: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each step's real examples and noise on `rank`, which holds 3 + 4 * rank of each."""
    g = torch.Generator().manual_seed(7 + rank)
    return [(torch.randn(3 + 4 * rank, 3, generator=g, dtype=torch.float64) + 1.0,
             torch.randn(3 + 4 * rank, 2, generator=g, dtype=torch.float64)) for _ in range(steps)]


def weighted_gan_steps(rank, world_size):
    """Uneven batches through both of DCGAN's steps: the discriminator's two losses in one window, then the
    generator's loss, whose backward runs through both wrapped models."""
    import hsync

    generator, discriminator = (hsync.WeightedDDP(net) for net in gan_nets())
    bce = nn.BCEWithLogitsLoss(reduction="sum")
    grads = []
    for real, noise in gan_batches(rank, 3):
        n = len(real)
        discriminator.zero_grad()
        with discriminator.no_sync():
            out = discriminator(real)
            discriminator.backward(bce(out, torch.ones_like(out)) / n, weight=n)
        fake = generator(noise)
        out = discriminator(fake.detach())
        discriminator.backward(bce(out, torch.zeros_like(out)) / n, weight=n)
        grads.append(grads_of(discriminator.module))
        generator.zero_grad()
        out = discriminator(fake)
        generator.backward(bce(out, torch.ones_like(out)) / n, weight=n)
        grads.append(grads_of(generator.module))
    return grads


def gan_steps_in_one_process(world_size: int) -> list[dict]:
    """weighted_gan_steps' gradients from one process holding every rank's examples."""
    generator, discriminator = gan_nets()
    bce = nn.BCEWithLogitsLoss(reduction="sum")
    grads = []
    for step_batches in zip(*(gan_batches(r, 3) for r in range(world_size)), strict=True):
        real = torch.cat([b[0] for b in step_batches])
        fake = generator(torch.cat([b[1] for b in step_batches]))
        discriminator.zero_grad()
        out_real, out_fake = discriminator(real), discriminator(fake.detach())
        # The window's two weighted losses: the mean over every example it saw, real and fake.
        both = bce(out_real, torch.ones_like(out_real)) + bce(out_fake, torch.zeros_like(out_fake))
        (both / (2 * len(real))).backward()
        grads.append(grads_of(discriminator))
        generator.zero_grad()
        out = discriminator(fake)
        (bce(out, torch.ones_like(out)) / len(real)).backward()
        grads.append(grads_of(generator))
    return grads


def test_a_weighted_gan_step_through_two_wrapped_models_is_exact():
    expected = gan_steps_in_one_process(2)
    for rank, grads in enumerate(run_ranks(weighted_gan_steps, 2)):
        torch.testing.assert_close(grads, expected, rtol=1e-12, atol=1e-12, msg=lambda m, r=rank: f"rank {r}: {m}")


def unfrozen_after_wrapping(rank, world_size, wrap):
    """A backbone frozen at wrap time and unfrozen later (gradual unfreezing), then the module wrapped again."""
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    net[0].requires_grad_(False)
    model = wrap(net)
    x = torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    model(x).sum().backward()
    net[0].requires_grad_(True)
    model.zero_grad()
    result = {}
    try:
        model(x).sum().backward()
        gathered = [torch.zeros(4, 3, dtype=torch.float64) for _ in range(world_size)]
        dist.all_gather(gathered, net[0].weight.grad)
        result["unfrozen"] = "ranks differ" if not torch.equal(gathered[0], gathered[1]) else "averaged"
    except RuntimeError as error:
        result["unfrozen"] = str(error)
    model = wrap(model.module)  # the remedy: wrap again
    model.zero_grad()
    model(x).sum().backward()
    result["wrapped again"] = grads_of(net)
    return result


def test_a_parameter_unfrozen_after_wrapping_is_refused_on_every_rank_where_ddp_leaves_it_unaveraged():
    results = run_ranks(side_by_side, 2, unfrozen_after_wrapping)
    for result in results:
        assert result["ddp"]["unfrozen"] == "ranks differ", result["ddp"]["unfrozen"]
        assert result["hsync"]["unfrozen"].startswith("hsync.WeightedDDP: parameter '0.weight' and 1 more did not "
                                                      "require a gradient when the model was wrapped"), result
    assert_same([{name: r[name]["wrapped again"] for name in r} for r in results])


def refreshed_after_unfreezing(rank, world_size) -> list[str]:
    """refresh_trainable_parameters() after unfreezing: new buckets, or a refusal where something was laid out
    for the old ones."""
    import hsync
    from tests.distributed.test_comm_hooks import mean_allreduce_hook

    def unfrozen_model(hooked: bool = False) -> hsync.WeightedDDP:
        net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1)).double()
        net[0].requires_grad_(False)
        model = hsync.WeightedDDP(net)
        if hooked:
            model.register_comm_hook(None, mean_allreduce_hook)
        net[0].requires_grad_(True)
        return model

    x = torch.randn(5, 3, dtype=torch.float64)
    outcomes = []
    model = unfrozen_model()
    outcomes.append(str(model.refresh_trainable_parameters()))
    outcomes.append(str(model.refresh_trainable_parameters()))  # once
    outcomes.append(outcome(unfrozen_model(hooked=True).refresh_trainable_parameters))
    model = unfrozen_model()
    with model.no_sync():
        model.backward(model(x).sum(), weight=5)
    outcomes.append(outcome(model.refresh_trainable_parameters))
    model = unfrozen_model()
    if rank == 1:
        model.module[0].requires_grad_(False)  # unfrozen on rank 0 only
    outcomes.append(outcome(model.refresh_trainable_parameters))
    return outcomes


def test_refreshing_the_trainable_parameters_takes_unfrozen_ones_or_refuses_where_the_old_buckets_are_laid_out():
    for taken, again, hooked, mid_step, one_rank in run_ranks(refreshed_after_unfreezing, 2):
        assert (taken, again) == ("True", "False")
        assert ("'0.weight' trains now but is in no bucket (unfrozen, added or replaced since the model was wrapped), "
                "and a communication hook") in hooked
        assert "a step is in progress, whose micro-steps were weighed without it; unfreeze between steps" in mid_step
        assert one_rank == ("RuntimeError: hsync.WeightedDDP.refresh_trainable_parameters: rank 0 has parameters "
                            "to take into the buckets and rank 1 has none; unfreeze, add or replace the same on every "
                            "rank")


UNFREEZING_SIZES = [[3, 5], [6, 1], [2, 4], [5, 5]]  # each step's examples on ranks 0 and 1


def unfreezing_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1), nn.Flatten(0)).double()


def changed_after_two_steps(net: nn.Module, change: str, optimizer: torch.optim.Optimizer) -> None:
    """What a loop changes in its model after two steps, alike on every rank and in one process: "unfreeze" the
    first layer (frozen at the start), or put in a "new head" (a new output layer, added to the optimizer)."""
    if change == "unfreeze":
        net[0].requires_grad_(True)
    else:
        torch.manual_seed(1)
        net[2] = nn.Linear(6, 1).double().to(next(net.parameters()).device)
        optimizer.add_param_group({"params": list(net[2].parameters())})


def unfreezing_steps(rank, world_size, device: str = "cpu", views: bool = False,
                     change: str = "unfreeze") -> dict[str, torch.Tensor]:
    """Weighted steps of uneven batches; after two, the model changed (changed_after_two_steps) and what changed
    taken into the buckets by refresh_trainable_parameters()."""
    import hsync

    if device == "cuda":
        torch.cuda.set_device(0)
    net = unfreezing_net().to(device)
    net[0].requires_grad_(change != "unfreeze")
    model = hsync.WeightedDDP(net, gradient_as_bucket_view=views)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for step, sizes in enumerate(UNFREEZING_SIZES):
        if step == 2:
            changed_after_two_steps(net, change, opt)
            assert model.refresh_trainable_parameters()
        x, y = (t.to(device) for t in global_batch(step, sizes)[2][rank])
        opt.zero_grad()
        model.backward(mse(model(x), y), weight=len(x))
        opt.step()
    return {name: p.detach().cpu() for name, p in net.named_parameters()}


def unfreezing_in_one_process(change: str = "unfreeze") -> dict[str, torch.Tensor]:
    """unfreezing_steps in one process over each step's whole global batch."""
    net = unfreezing_net()
    net[0].requires_grad_(change != "unfreeze")
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for step, sizes in enumerate(UNFREEZING_SIZES):
        if step == 2:
            changed_after_two_steps(net, change, opt)
        x, y, _ = global_batch(step, sizes)
        opt.zero_grad()
        mse(net(x), y).backward()
        opt.step()
    return dict(net.named_parameters())


@pytest.mark.parametrize("views", [False, True], ids=["copied", "views"])
def test_weighted_steps_after_refreshing_the_trainable_parameters_match_one_process(views):
    expected = unfreezing_in_one_process()
    for rank, params in enumerate(run_ranks(unfreezing_steps, 2, "cpu", views)):
        torch.testing.assert_close(params, expected, rtol=1e-10, atol=1e-12, msg=lambda m, r=rank: f"rank {r}: {m}")


def frozen_after_wrapping(rank, world_size, wrap):
    """A layer frozen after the wrap (DDP needs find_unused_parameters for it), trained on, then unfrozen again:
    it was in the buckets from the wrap, so nothing needs refreshing."""
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    model = wrap(net, find_unused_parameters=True)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    params = []
    for step in range(6):
        net[0].requires_grad_(not 2 <= step < 4)
        opt.zero_grad()
        model(torch.randn(5, 3, dtype=torch.float64, generator=g)).pow(2).mean().backward()
        opt.step()
        params.append([p.detach().clone() for p in net.parameters()])
    return params


def test_a_layer_frozen_after_wrapping_and_unfrozen_again_trains_as_with_ddp():
    assert_same(run_ranks(side_by_side, 2, frozen_after_wrapping))


def test_a_head_added_after_wrapping_is_averaged_once_the_parameters_are_refreshed():
    expected = unfreezing_in_one_process("new head")
    for rank, params in enumerate(run_ranks(unfreezing_steps, 2, "cpu", False, "new head")):
        torch.testing.assert_close(params, expected, rtol=1e-10, atol=1e-12, msg=lambda m, r=rank: f"rank {r}: {m}")
