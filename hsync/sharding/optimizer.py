"""ShardedOptimizer: a WeightedDDP's optimizer state split across its ranks in proportion to their memory.

Modelled on torch's ZeroRedundancyOptimizer, so that code written for it carries over: each rank runs the
user's optimizer class on the parameters it owns (their state exists nowhere else), then every owner
broadcasts its updated parameters. The gradients it steps with are WeightedDDP's exact weighted mean, so
the parameters after each step are those of the unsharded optimizer. Every collective goes through the
wrapper's communicator, under its deadline. Which rank owns what: Note [Memory shares] (shares.py).

Note [Sharded steps under Join]
Under Join (uneven inputs), a rank that has run out of data still owns its share of the parameters: the
others' steps need its optimizer step and broadcast, and it must step with the exact reduced gradient. So a
ShardedOptimizer is a Joinable (model.join() brings it, as Join([model, optimizer]) does), and a joined
rank, after shadowing a synchronised step (WeightedDDP's Note [Join]), keeps the reduced gradients of the
parameters it owns (DDP's joined rank keeps its own stale ones) and shadows the optimizer: clip_grad_norm_
if the others clip, then step(), with the others' group settings (an LR scheduler runs on them only). What
they do is not known to it in advance, so the first of clip_grad_norm_ and step after such a step tells it,
in one broadcast from the highest active rank (Join's root): whether to clip and with what, and every group's
settings. As ZeroRedundancyOptimizer's join hook assumes, each synchronised step whose loss and gradients are finite is
followed by one step(); a non-finite one by none, on every rank alike (clip_grad_norm_ then returns the
non-finite norm without a collective, as the joined ranks, which know the flags too, do nothing). A finite
step left without step() is refused at the next forward.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch.distributed.algorithms.join import Joinable, JoinHook

from hsync.balance.memory import StateBytes
from hsync.collectives import Channels
from hsync.compat import reduced_parameters
from hsync.ddp import WeightedDDP
from hsync.errors import describe
from hsync.sharding.shares import Layout, MemoryBudget, plan_layout, this_ranks_budget


def _arguments(optimizer_class: type, defaults: Mapping[str, Any], groups: list[dict]) -> str:
    """The optimizer's class and arguments, the groups' own included, as text that ranks compare: a tensor by its
    values (each rank's is on its own device), an object without its address (which a default repr shows)."""
    def shown(settings: Mapping[str, Any]) -> str:
        return ", ".join(f"{key}={value.tolist() if isinstance(value, torch.Tensor) else value!r}"
                         for key, value in sorted(settings.items()) if key != "params")

    own = [shown(group) for group in groups]
    text = f"{optimizer_class.__module__}.{optimizer_class.__qualname__}({shown(defaults)})" + (
        f" with groups {own}" if any(own) else "")
    return re.sub(r" at 0x[0-9a-f]+", "", text)


def _different_groups() -> ValueError:
    return ValueError("hsync.ShardedOptimizer: the ranks' parameter groups hold different parameters; every rank "
                      "passes the same groups of the model's parameters")


class ShardedOptimizer(torch.optim.Optimizer, Joinable):
    """`optimizer_class` over a WeightedDDP's parameters, its state sharded across the ranks by memory.

        model = hsync.WeightedDDP(model)
        optimizer = hsync.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-4)
        stats = model.backward(loss, weight=n)
        if stats.finite:
            optimizer.step()
        optimizer.zero_grad()

    `memory_budget`: what this rank can give to the model's parameters, gradients and optimizer state (bytes,
    or a size such as "6GiB"), or one per rank in rank order; None: measured on a GPU (its free memory), equal
    shares on the CPU. `params`: parameter groups over the model's parameters, as an optimizer takes them
    (default: every trainable parameter the model reduces, in one group). `defaults`: the optimizer's
    arguments. Every method that changes state is collective: every rank calls it, in the same order. Under
    model.join(), ranks that ran out of data shadow the others' steps (Note [Sharded steps under Join])."""

    def __init__(self, model: WeightedDDP, optimizer_class: type[torch.optim.Optimizer], *,
                 memory_budget: MemoryBudget = None, params: Iterable | None = None, **defaults: Any) -> None:
        if not isinstance(model, WeightedDDP):
            raise TypeError(f"hsync.ShardedOptimizer shards a hsync.WeightedDDP's state, got {describe(model)}")
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError("hsync.ShardedOptimizer: optimizer_class must be a torch.optim.Optimizer subclass, "
                            f"got {describe(optimizer_class)}")
        self._model = model
        self._channel = Channels.of_model(model)
        self._all = [p for p in reduced_parameters(model.module) if p.requires_grad]
        self._index = {p: i for i, p in enumerate(self._all)}
        # What the model holds now that its state will be made of: the parameters, and gradient buckets (if a
        # backward ran already) that the owners will replace.
        held = sum(p.numel() * p.element_size() for p in self._all) + model._ensure_engine().allocated_bucket_bytes()
        groups = list(params) if params is not None else [{"params": self._all}]
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        groups = self._checked(groups)
        grouped = {p for group in groups for p in group["params"]}
        outside = [i for i, p in enumerate(self._all) if p not in grouped]
        try:
            budget: int | str | None = this_ranks_budget(memory_budget, model.rank, model.world_size, model.device,
                                                         held)
        except (TypeError, ValueError) as error:  # raised on every rank below, not on this one alone
            budget = str(error)
        # Each owner steps its parameters with its own arguments: ranks given others would update their shares of
        # one model differently, silently (a learning rate read from a rank's own configuration, say).
        arguments = _arguments(optimizer_class, defaults, groups)
        # One gather: the budgets, the parameters outside the groups (which shape the layout too), the arguments.
        everyone = self._channel.gather_objects((budget, outside, arguments), "the memory budgets")
        budgets = [theirs for theirs, _, _ in everyone]
        refused = [r for r, theirs in enumerate(budgets) if isinstance(theirs, str)]
        if refused:
            raise ValueError(f"{budgets[refused[0]]} (rank {refused[0]}; refused on ranks {refused})")
        if any(theirs != outside for _, theirs, _ in everyone):
            raise _different_groups()
        for rank, (_, _, theirs) in enumerate(everyone):
            if theirs != everyone[0][2]:
                raise ValueError(f"hsync.ShardedOptimizer: the optimizer's arguments differ across ranks: "
                                 f"{everyone[0][2]} on rank 0, {theirs} on rank {rank}; every rank passes the same")
        state_bytes = StateBytes(model, optimizer_class, defaults)
        # What plans each layout: this one, and each after add_param_group or the model's refresh.
        self._budgets, self._state_bytes = budgets, state_bytes
        self._owned_per_byte = state_bytes.owned_per_parameter_byte()
        self._gradient_per_byte = state_bytes.gradient_per_parameter_byte()
        self.layout: Layout = self._plan_layout(self._all, outside=set(outside))
        """Which parameters each rank owns (their indices among the model's trainable parameters)."""
        self._owned = set(self._all[i] for i in self.layout.owned[model.rank])
        # The optimizer this rank runs: the same groups, each holding only the parameters it owns.
        self._local = optimizer_class([self._owned_part(group) for group in groups], **defaults)
        # The groups given, not copies, as torch's optimizers keep them: an LR scheduler built on an optimizer whose
        # groups these are (Accelerate's prepare() replaces it by this one) still sets what this one steps with.
        super().__init__(groups, self._local.defaults)
        self._sync_hyperparameters(self.param_groups, self._local.param_groups)
        self.state = self._local.state  # the owned parameters' state, as the local optimizer keeps it
        self._consolidated: dict | None = None
        self._consolidated_to: int | None = None  # the rank consolidate_state_dict gathered the state to
        self._consolidated_went_stale = False
        Joinable.__init__(self)
        self._built = True
        self._give_owners()

    def _plan_layout(self, params: list[torch.Tensor], **where: Any) -> Layout:
        """The layout of `params` (the model's trainable parameters, in order) under the budgets of the ranks, for
        plan_layout's `outside` and `kept`."""
        sizes = [p.numel() * p.element_size() for p in params]
        return plan_layout(sizes, self._budgets, self._owned_per_byte, self._state_bytes.in_flight(sizes),
                           outside_per_byte=self._gradient_per_byte, **where)

    def _kept(self, index: Mapping[torch.Tensor, int]) -> list[list[int]]:
        """What each rank owns of the groups' parameters (their state is there), as indices of `index`."""
        stepped = set(self._stepped())
        return [[index[self._all[i]] for i in owned if self._all[i] in stepped] for owned in self.layout.owned]

    def _give_owners(self) -> None:
        """Once set, the gradients of the groups' parameters go to their owners only, which only this optimizer
        steps. The model's other parameters keep their gradients whole on every rank (owner -1), for an optimizer
        of their own, as with DDP and ZeroRedundancyOptimizer; add_param_group gives them owners. Where a rank
        owns none of the groups' parameters, the smallest of them is all-reduced too and its gradient kept on
        every rank (still stepped by its owner alone): a GradScaler on that rank checks it (Note [A non-finite
        step on every rank] in csrc/engine.cpp)."""
        stepped = set(self._stepped())
        owners = [-1] * len(self._all)
        for owner, owned in enumerate(self.layout.owned):
            for i in owned:
                owners[i] = owner if self._all[i] in stepped else -1
        idle = [r for r, owned in enumerate(self.layout.owned) if not any(self._all[i] in stepped for i in owned)]
        witness = min((i for i, p in enumerate(self._all) if p in stepped),
                      key=lambda i: self._all[i].numel() * self._all[i].element_size(), default=-1) if idle else -1
        if witness >= 0:
            owners[witness] = -1
        self._same_on_every_rank(owners + [witness], "the sharded parameters")  # they cut the buckets
        self._model._set_param_owners(owners, self, witness)

    def _same_on_every_rank(self, indices: list[int], label: str) -> None:
        """Refuses, on every rank, parameter groups that differ between ranks: what they decide (the layout, the
        owners that cut the buckets) would differ too, and so would the ranks' collectives."""
        if any(theirs != indices for theirs in self._channel.gather_objects(indices, label)):
            raise _different_groups()

    # --- the parameters -------------------------------------------------------------------------------------

    def _stepped(self) -> list[torch.Tensor]:
        """The parameters of this optimizer's groups, in order (the model may have others)."""
        return [p for group in self.param_groups for p in group["params"]]

    def _checked(self, groups: list[dict]) -> list[dict]:
        for group in groups:
            if not isinstance(group, dict) or "params" not in group:
                raise TypeError(f"hsync.ShardedOptimizer: a parameter group is a dict with 'params', got "
                                f"{describe(group)}")
            group["params"] = _as_list(group["params"])
            strangers = [p for p in group["params"] if p not in self._index]
            if strangers:
                raise ValueError(f"hsync.ShardedOptimizer: {len(strangers)} parameter(s) of a group are not among "
                                 "the wrapped model's trainable parameters that it reduces; optimize them with an "
                                 "optimizer of their own")
        return groups

    def _owned_part(self, group: dict) -> dict:
        return dict(group, params=[p for p in group["params"] if p in self._owned])

    def add_param_group(self, param_group: dict) -> None:
        """Adds a group of the model's parameters (not in any group yet), as torch.optim.Optimizer's does (a
        backbone unfrozen for fine-tuning, say): collective. The parameters owned so far stay with their owners
        (their state is there); the group's are split among the ranks by what each lacks of its share of the
        memory, as ZeroRedundancyOptimizer places a new group's without moving the others'."""
        if not getattr(self, "_built", False):  # torch.optim.Optimizer's constructor adds the first groups
            super().add_param_group(param_group)
            return
        param_group = dict(param_group)
        if "params" in param_group:
            param_group["params"] = _as_list(param_group["params"])  # once, if a generator
            if any(p not in self._index for p in param_group["params"]):
                # Unfrozen since the model was wrapped (Lightning's BackboneFinetuning adds them so): the buckets
                # first, where they are outside the groups, then the group as any other.
                self._model.refresh_trainable_parameters()
        added = [self._index[p] for p in self._checked([dict(param_group)])[0]["params"]]
        self._same_on_every_rank(added, "the added parameter group")
        stepped = set(self._stepped())
        layout = self._plan_layout(
            self._all, outside={i for i, p in enumerate(self._all) if p not in stepped and i not in added},
            kept=self._kept(self._index))
        super().add_param_group(param_group)
        self.layout = layout
        self._owned = set(self._all[i] for i in layout.owned[self._model.rank])
        self._local.add_param_group(self._owned_part(self.param_groups[-1]))
        self._sync_hyperparameters(self.param_groups[-1:], self._local.param_groups[-1:])
        self._give_owners()

    # --- the model's trainable parameters refreshed (WeightedDDP.refresh_trainable_parameters) ----------------

    def _frozen_in_groups(self) -> str | None:
        """The name of a parameter of the groups that no longer trains, if any: a refresh would leave it out of
        the buckets while its state stays."""
        names = {p: name for name, p in self._model.module.named_parameters()}
        return next((names.get(p, "?") for p in self._stepped() if not p.requires_grad), None)

    def _layout_after_refresh(self, trainable: list[torch.Tensor]) -> Layout:
        """The layout over the model's `trainable` parameters once refreshed: what each rank owns stays, the new
        ones are outside the groups (whole gradients on every rank) until add_param_group takes them. Refuses,
        on every rank alike, a state that no longer fits the budgets."""
        stepped = set(self._stepped())
        return self._plan_layout(trainable, outside={i for i, p in enumerate(trainable) if p not in stepped},
                                 kept=self._kept({p: i for i, p in enumerate(trainable)}))

    def _adopt_refreshed(self, trainable: list[torch.Tensor], layout: Layout) -> None:
        """The model's new engine reduces `trainable`: owners for its buckets (collective)."""
        self._all, self._index, self.layout = trainable, {p: i for i, p in enumerate(trainable)}, layout
        self._give_owners()

    @staticmethod
    def _sync_hyperparameters(source: list[dict], target: list[dict]) -> None:
        """Copies every setting but the parameters (an LR scheduler changes the global groups' "lr")."""
        for ours, theirs in zip(source, target, strict=True):
            for key, value in ours.items():
                if key != "params":
                    theirs[key] = value

    # --- a step ----------------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Steps the owned parameters with the optimizer class, then every owner broadcasts its own. A closure
        runs once, on every rank, before the step (it may run a backward: a collective)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._refuse_a_partial_sum("step")
        if not self._tell_joined_ranks(clip=None):
            raise RuntimeError("hsync.ShardedOptimizer.step under Join: the last step's loss or gradients were not "
                               "finite, and the joined ranks skip it; skip step() when stats.finite is False")
        self._sync_hyperparameters(self.param_groups, self._local.param_groups)
        try:
            self._local.step()
        except BaseException as error:
            # Its peers wait in the broadcasts of the parameters that follow: told at once why, and by whom, not at
            # the deadline (a state loaded from another model fails here, on the ranks that own a part).
            self._model._ensure_engine().abandon_step(
                f"its optimizer step raised {type(error).__name__}: {error}; the ranks' parameters are no longer "
                "the same, so every rank stops")
            raise
        self._share_parameters()
        self._forget_consolidated()
        return loss

    def _share_parameters(self) -> None:
        """Each owner's parameters to every rank (in broadcasts of at most a bucket's bytes each)."""
        engine = self._model._ensure_engine()
        stepped = set(self._stepped())
        for owner, owned in enumerate(self.layout.owned):
            engine.broadcast_coalesced([self._all[i].detach() for i in owned if self._all[i] in stepped], owner,
                                       "the parameters a ShardedOptimizer's step updated")

    def _refuse_a_partial_sum(self, what: str) -> None:
        """Refuses, before any collective of this rank's, to `what` in the middle of a step: the peers wait in their
        own step's collectives, which these would meet out of order."""
        if self._model._holds_a_partial_step():
            raise RuntimeError(f"hsync.ShardedOptimizer.{what}: the model holds micro-batches accumulated under "
                               "no_sync that no synchronised backward has reduced yet (this rank's partial sum, not "
                               "the step's gradient); call it after the step's last backward (under Accelerate, "
                               "when accelerator.sync_gradients)")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Every parameter's gradient, owned or not, as torch.optim.Optimizer's."""
        super().zero_grad(set_to_none)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scales the gradients so that their total norm is at most `max_norm`, and returns that norm before
        clipping, as torch.nn.utils.clip_grad_norm_ over the unsharded gradients: each owner's norms in one
        reduction over the ranks."""
        norm_type = float(norm_type)
        if not (norm_type > 0):
            raise ValueError(f"hsync.ShardedOptimizer.clip_grad_norm_: norm_type must be positive, got {norm_type}")
        self._refuse_a_partial_sum("clip_grad_norm_")
        if not self._tell_joined_ranks(clip=(float(max_norm), norm_type)):
            return torch.tensor(math.nan, device=self._model.device)  # Note [Sharded steps under Join]
        with_grad = [p for p in self._stepped() if p.grad is not None]
        grads = [p.grad for p in with_grad]
        mine = [p.grad for p in with_grad if p in self._owned]
        device = self._model.device
        norms = torch.stack([torch.linalg.vector_norm(g, norm_type).to(torch.float64) for g in mine]) if mine \
            else torch.zeros(1, dtype=torch.float64, device=device)
        # Reduced on the device: the host does not wait for the backward's end here, as torch's own clip does not.
        if math.isinf(norm_type):
            table = torch.zeros(self._channel.world_size, dtype=torch.float64, device=device)
            table[self._channel.rank] = norms.amax()
            total = self._channel.all_reduce_sum_on_device(table, "the gradient norm").amax()
        else:
            local = norms.pow(norm_type).sum().reshape(1)
            total = self._channel.all_reduce_sum_on_device(local, "the gradient norm")[0].pow(1.0 / norm_type)
        total = total.to(torch.float32)
        coefficient = (float(max_norm) / (total + 1e-6)).clamp(max=1.0)
        for grad in grads:
            grad.mul_(coefficient.to(grad.device, grad.dtype))
        return total

    # --- under Join: Note [Sharded steps under Join] -------------------------------------------------------

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return _ShadowSteps(self)

    @property
    def join_device(self) -> torch.device:
        return self._model.device

    @property
    def join_process_group(self) -> Any:
        return self._model.join_process_group

    def _tell_joined_ranks(self, clip: tuple[float, float] | None) -> bool:
        """On a rank still active under Join, at clip_grad_norm_ or step: tells the joined ranks, once per step,
        what to shadow. False if the step is not finite (and so skipped everywhere)."""
        join = self._model._join
        owed = join.sharded_step
        if owed not in ("announce", "step"):
            return True
        if owed == "step":  # after the clip that announced it, whose step was finite
            if clip is not None:
                raise RuntimeError("hsync.ShardedOptimizer.clip_grad_norm_ under Join: once per step, before "
                                   "step(); the joined ranks shadow one clip and one step")
            join.sharded_step = None
            return True
        if not join.last_step_finite():
            join.sharded_step = None
            return False
        settings = [{k: v for k, v in group.items() if k != "params"} for group in self.param_groups]
        self._channel.broadcast_object({"clip": clip, "groups": settings}, join.root,
                                       "what the joined ranks' optimizer shadows")
        join.sharded_step = "step" if clip is not None else None
        return True

    def _shadow_step(self) -> None:
        """On a joined rank, after the model shadowed a synchronised step: the active ranks' clip and step."""
        join = self._model._join
        if join.sharded_step != "shadow":
            return
        join.sharded_step = None
        if not join.last_step_finite():
            return
        told = self._channel.broadcast_object(None, join.root, "what the joined ranks' optimizer shadows")
        for ours, theirs in zip(self.param_groups, told["groups"], strict=True):
            ours.update(theirs)
        if told["clip"] is not None:
            self.clip_grad_norm_(*told["clip"])
        self.step()

    # --- checkpoints -----------------------------------------------------------------------------------------

    def state_dict_shard(self) -> dict:
        """This rank's part of the state, keyed by each parameter's index in the whole optimizer (on the CPU):
        what each rank saves for a state too large to gather on one. load_state_dict_shards reads them back."""
        local = self._local.state_dict()
        owned_order = [p for group in self._local.param_groups for p in group["params"]]
        numbering = self._numbering()
        state = {numbering[owned_order[i]]: _to_cpu(s) for i, s in local["state"].items()}
        return {"state": state, "param_groups": self._global_groups()}

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gathers the whole state on rank `to`, for its state_dict() (collective, as ZeroRedundancyOptimizer's)."""
        shards = self._channel.gather_objects(self.state_dict_shard(), "the optimizer state")
        self._consolidated = merge_shards(shards) if self._model.rank == to else None
        self._consolidated_to = to
        self._consolidated_went_stale = False

    def _forget_consolidated(self) -> None:
        """A step or a load changed the state: a consolidated copy is outdated (and a whole state's memory)."""
        if self._consolidated_to is not None:
            self._consolidated, self._consolidated_to, self._consolidated_went_stale = None, None, True

    def state_dict(self) -> dict:
        """The whole state, in the format of `optimizer_class` over the same parameter groups (loadable by it),
        on the rank consolidate_state_dict gathered it to."""
        if self._consolidated_went_stale:  # ZeroRedundancyOptimizer returns the older state: a checkpoint behind
            raise RuntimeError("hsync.ShardedOptimizer.state_dict: the state was consolidated before the last step() "
                               "or load_state_dict(); call consolidate_state_dict(to=rank) on every rank again")
        if self._consolidated is None and self._consolidated_to is not None:
            raise RuntimeError(f"hsync.ShardedOptimizer.state_dict: the state was consolidated on rank "
                               f"{self._consolidated_to}, not on this rank ({self._model.rank}): call state_dict() "
                               "there, or consolidate_state_dict(to=rank) on every rank for another")
        if self._consolidated is None:
            raise RuntimeError("hsync.ShardedOptimizer.state_dict: call consolidate_state_dict(to=rank) on every "
                               "rank first; the state is then on that rank, as with ZeroRedundancyOptimizer")
        return self._consolidated

    def load_state_dict(self, state_dict: Mapping) -> None:
        """Loads a whole state (from state_dict(), or the plain optimizer's over the same groups) on every rank;
        each keeps its own part. Any number of ranks and any budgets may have written it."""
        groups = state_dict["param_groups"]
        sizes = [len(group["params"]) for group in groups]
        if sizes != [len(group["params"]) for group in self.param_groups]:
            raise ValueError("hsync.ShardedOptimizer.load_state_dict: the state's parameter groups do not match "
                             "this optimizer's (as many groups, as many parameters in each)")
        numbering = self._numbering()
        owned_order = [p for group in self.param_groups for p in group["params"] if p in self._owned]
        local_state = {i: state_dict["state"][numbering[p]] for i, p in enumerate(owned_order)
                       if numbering[p] in state_dict["state"]}
        local_groups, start = [], 0
        for saved, ours in zip(groups, self.param_groups, strict=True):
            count = sum(p in self._owned for p in ours["params"])
            local_groups.append(dict(saved, params=list(range(start, start + count))))
            start += count
        self._local.load_state_dict({"state": local_state, "param_groups": local_groups})
        for saved, ours in zip(groups, self.param_groups, strict=True):
            ours.update({k: v for k, v in saved.items() if k != "params"})
        self._forget_consolidated()

    def load_state_dict_shards(self, shards: Iterable[Mapping]) -> None:
        """Loads the shards that state_dict_shard() wrote on each rank of a run (any number of ranks)."""
        self.load_state_dict(merge_shards(list(shards)))

    def _numbering(self) -> dict[torch.Tensor, int]:
        """Each parameter's index in the whole optimizer's state_dict: across groups, in order."""
        return {p: i for i, p in enumerate(self._stepped())}

    def _global_groups(self) -> list[dict]:
        numbering = self._numbering()
        return [dict({k: v for k, v in group.items() if k != "params"}, params=[numbering[p] for p in group["params"]])
                for group in self.param_groups]


class _ShadowSteps(JoinHook):
    """How a ShardedOptimizer takes part in torch's Join once its rank has run out of inputs."""

    def __init__(self, optimizer: ShardedOptimizer) -> None:
        self.optimizer = optimizer

    def main_hook(self) -> None:
        self.optimizer._shadow_step()


def _as_list(params: torch.Tensor | Iterable) -> list:
    """A group's "params", as torch.optim.Optimizer reads them: one tensor, or any iterable of them."""
    return [params] if isinstance(params, torch.Tensor) else list(params)


def merge_shards(shards: list[Mapping]) -> dict:
    """The whole state from every rank's state_dict_shard()."""
    state: dict[int, Any] = {}
    for shard in shards:
        state.update(shard["state"])
    return {"state": dict(sorted(state.items())), "param_groups": shards[0]["param_groups"]}


def _to_cpu(state: dict) -> dict:
    return {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
