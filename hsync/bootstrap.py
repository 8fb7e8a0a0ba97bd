"""What wrapping a model takes across its ranks: the check that every rank wraps the same model with the
same settings, and the key of the engine's communicator."""

from __future__ import annotations

import collections

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.nn.parameter import is_lazy

from hsync.collectives import Channels
from hsync.compat import ignored_names, reduced_parameters

# Per group, the index of the next engine built over it: with the group's name, names an engine's store
# keys. The ranks agree on it as they build one (the largest any proposes), so a rank outside a group,
# which skips that group's engines, or a process that replaced a failed one, uses the same keys.
_engines_built: collections.defaultdict[str, int] = collections.defaultdict(int)


def wrapper_kind(module: nn.Module) -> str | None:
    """The data-parallel wrapper `module` is, if any: torch's DistributedDataParallel (hsync's own included),
    DataParallel, or FSDP (FSDP1's class, or FSDP2's fully_shard, which changes the module's class)."""
    if isinstance(module, DistributedDataParallel):
        return f"a {type(module).__name__}"
    if isinstance(module, nn.DataParallel):
        return "a torch DataParallel"
    for cls in type(module).__mro__:
        if cls.__name__ in ("FullyShardedDataParallel", "FSDPModule"):
            return f"torch's {cls.__name__} (FSDP)"
    return None


def _model_signature(module: nn.Module) -> tuple[list[tuple], list[str]]:
    """What must match across ranks, and this rank's problems that no rank could work with."""
    ignored = ignored_names(module)
    buffers = [(name, b) for name, b in module.named_buffers() if name not in ignored]
    # What DDP ignores it does not check either (a sparse or lazy layer the user reduces, or fills, alone).
    lazy = [name for name, t in [*reduced_parameters(module, named=True), *buffers] if is_lazy(t)]
    if lazy:  # no shape to compare yet
        return [], [f"'{lazy[0]}' is not initialized yet (a lazy module): run a dummy forward pass before wrapping, "
                    "as for DDP"]
    # A parameter's strides too: its gradient is summed as laid out in memory (a bucket slot takes the
    # parameter's layout), so channels_last on one rank only would add mismatched elements. A dimension of
    # size 1 has any stride without changing the layout.
    signature = [("parameter", name, tuple(p.shape), str(p.dtype), p.requires_grad,
                  tuple(stride if size > 1 else 0 for size, stride in zip(p.shape, p.stride(), strict=True)))
                 for name, p in reduced_parameters(module, named=True)]
    signature += [("buffer", name, tuple(b.shape), str(b.dtype), False, None) for name, b in buffers]
    problems = []
    wrapping = wrapper_kind(module)
    if wrapping:
        problems.append(f"it is already wrapped in {wrapping}, whose own collectives would run beside hsync's; "
                        "pass the module inside it (its .module)")
    devices = sorted({str(p.device) for p in reduced_parameters(module)})
    if len(devices) > 1:
        problems.append(f"parameters on several devices ({', '.join(devices)}); wrap a single-device module")
    trained = {id(p) for p in reduced_parameters(module) if p.requires_grad}
    meta = [name for name, t in [*reduced_parameters(module, named=True), *buffers] if t.is_meta]
    if meta:
        problems.append(f"'{meta[0]}' is on the meta device (no values yet): materialise the model before wrapping "
                        "(model.to_empty(device=...) and its initialisation)")
    for name, sub in module.named_modules():
        if isinstance(sub, nn.Embedding | nn.EmbeddingBag) and sub.sparse and id(sub.weight) in trained:
            problems.append(f"'{name or type(sub).__name__}' produces sparse gradients (sparse=True); hsync "
                            "reduces dense gradients only")
    for name, p in reduced_parameters(module, named=True):
        if hasattr(p, "_in_backward_optimizers"):
            # Its optimizer would step on the local gradient, before any reduction: ranks would drift apart.
            problems.append(f"parameter '{name}' has an optimizer applied in backward (torch's "
                            "_apply_optimizer_in_backward), which hsync does not run; step the optimizer "
                            "after backward")
            break
    return signature, problems


def engine_key(group: dist.ProcessGroup, device: torch.device, module: nn.Module, settings: dict[str, object],
               refusal: Exception | None, timeout_s: float) -> str:
    """Checks the model across the group's ranks (verify_same_model); returns the key of the new engine's
    store entries: the same on every rank of the group, and used by no other engine over it."""
    name = dist.distributed_c10d._get_process_group_name(group)
    index = verify_same_model(group, device, module, settings, refusal, _engines_built[name], timeout_s)
    _engines_built[name] = index + 1
    return f"{name}/{index}"


def verify_same_model(group: dist.ProcessGroup, device: torch.device, module: nn.Module,
                       settings: dict[str, object], refusal: Exception | None, engine_index: int,
                       timeout_s: float) -> int:
    """Raises the same error on every rank if a rank refused (its `refusal`, naming the rank), the ranks'
    models or `settings` differ (RuntimeError, as DDP's) or one cannot be wrapped (ValueError); else
    returns the engine index the ranks agree on (the largest `engine_index` proposed)."""
    channel = Channels.of_group(group, device, timeout_s)
    gathered = channel.gather_objects((*_model_signature(module), settings, refusal, engine_index),
                                      "the model check at wrap time")
    for rank, (*_, theirs, _) in enumerate(gathered):
        if theirs is not None:
            raise type(theirs)(f"{theirs} (on rank {rank})")
    for rank, (_, problems, *_) in enumerate(gathered):
        if problems:
            raise ValueError(f"hsync: cannot wrap the model: on rank {rank}, {problems[0]}")
    for rank, (_, _, theirs, *_) in enumerate(gathered[1:], start=1):
        for name, value in gathered[0][2].items():
            if theirs[name] != value:
                raise RuntimeError(f"hsync.WeightedDDP: {name} differs across ranks: {value} on rank 0, "
                                   f"{theirs[name]} on rank {rank}")
    reference = gathered[0][0]
    for rank, (signature, *_) in enumerate(gathered[1:], start=1):
        difference = _first_difference(reference, signature, rank)
        if difference:
            raise RuntimeError(f"hsync: the model differs across ranks: {difference}")
    return max(proposed for *_, proposed in gathered)


def _first_difference(reference: list[tuple], other: list[tuple], rank: int) -> str | None:
    def show(entry: tuple) -> str:
        kind, name, shape, dtype, requires_grad, _ = entry
        frozen = "" if requires_grad or kind == "buffer" else ", frozen"
        return f"{kind} '{name}' of shape {list(shape)}, {dtype}{frozen}"

    for index, (mine, theirs) in enumerate(zip(reference, other, strict=False)):
        if mine[:-1] != theirs[:-1]:
            return f"entry #{index}: rank 0 has {show(mine)}, rank {rank} has {show(theirs)}"
        if mine != theirs:
            return (f"parameter '{mine[1]}' is laid out with strides {mine[-1]} on rank 0 and {theirs[-1]} on rank "
                    f"{rank} (a memory format such as channels_last on some ranks only); give it the same layout on "
                    "every rank, as DDP requires")
    if len(reference) != len(other):
        longer, which = (reference, 0) if len(reference) > len(other) else (other, rank)
        return (f"rank 0 has {len(reference)} parameters and buffers, rank {rank} has {len(other)} "
                f"(first extra on rank {which}: {show(longer[min(len(reference), len(other))])})")
    return None
