"""A WeightedDDP under torch's Join (uneven inputs): what it keeps between forwards and its part in the protocol.

Note [Join] (csrc/engine.h) says what a joined rank shadows and why weighted steps stay exact; Note [Sharded
steps under Join] (hsync/sharding/optimizer.py) what a ShardedOptimizer adds. The wrapper calls this module at
three points only: before each forward's collectives (before_forward), before a backward (check_backward), and
through the join hook torch's Join runs on a joined rank (ShadowSteps). torch's Join itself reduces over the
model's JoinGroup, so its collectives have hsync's deadline too.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch.distributed.algorithms.join import Join, JoinHook

from hsync.collectives import BUFFERS_BEFORE_A_FORWARD, Channels
from hsync.compat import reduced_parameters
from hsync.stats import BAD_RANKS, WEIGHT, bad_input_message, step_is_finite

if TYPE_CHECKING:
    from hsync.ddp import WeightedDDP


class JoinState:
    """One wrapper's Join state: how plain steps divide, what its last forward announced, and what a sharded
    optimizer's step owes the protocol."""

    def __init__(self, model: WeightedDDP) -> None:
        # The wrapper owns this state: a strong reference back would keep a dropped wrapper, and its buckets' memory,
        # alive until a garbage collection (torch's DDP is freed at once).
        self._model = weakref.ref(model)
        self.divide_by_initial_world_size = True  # the join() argument, for plain loss.backward() steps
        self.plain_steps: bool | None = None  # what the engine was told of plain steps under Join (None: outside)
        self.announced = False  # whether this rank's last forward under Join told the joined ranks it synchronises
        self.root = 0  # the highest rank not joined at the last forward under Join (DDP's buffer root there)
        # With a ShardedOptimizer, what this rank owes Note [Sharded steps under Join]: "announce" or "step"
        # (active), "shadow" (joined), or nothing.
        self.sharded_step: str | None = None
        self._group: JoinGroup | None = None  # what torch's Join reduces over: the model's join_process_group

    @property
    def model(self) -> WeightedDDP:
        return self._model()

    def engine_rebuilt(self) -> None:
        """A new engine has not been told how plain steps divide (and may have a new group)."""
        self.plain_steps = None
        self._group = None

    def process_group(self) -> JoinGroup | None:
        """The group torch's Join is given for the model's process group (None once that was destroyed)."""
        group = self.model.process_group
        if group is None:
            return None
        if self._group is None or not self._group.stands_for(group):
            self._group = JoinGroup(self.model, group)
        return self._group

    def before_forward(self, synced: bool, buffers_due: bool) -> int:
        """An active rank's share of the protocol before its forward's collectives: the engine told how plain steps
        divide (outside Join too, once, to undo it), the joined ranks told what follows. Returns the rank whose
        buffers are broadcast (rank 0 may have joined)."""
        model, joining = self.model, self.model._join_config.enable
        plain_steps = self.divide_by_initial_world_size if joining else None
        if plain_steps != self.plain_steps:
            # Under Join plain steps carry step scalars too, so joined ranks can shadow them: Note [Join].
            plain = model._open_window().local
            plain[WEIGHT] = 1.0
            model._ensure_engine().set_join_plain_step(plain if joining else None, self.divide_by_initial_world_size)
            self.plain_steps = plain_steps
        if not joining:
            return 0
        self._settle_sharded_step()
        Join.notify_join_context(model)
        _, _, root = self._exchange(synced, buffers_due, joined=False)
        self.announced = synced
        return root

    def check_backward(self) -> None:
        """A backward under Join must be in the no_sync() state its forward announced."""
        model = self.model
        if model._join_config.enable and self.announced != model.require_backward_grad_sync:
            raise RuntimeError("hsync: under join(), run each micro-step's forward in the same no_sync() "
                               "state as its backward: the joined ranks were told at the forward whether "
                               "this step synchronises")

    def last_step_finite(self) -> bool:
        """Whether the last synchronised step's loss and gradients were finite on every rank (StepStats.finite,
        for steps with no StepStats too)."""
        engine = self.model._ensure_engine()
        return step_is_finite(engine.step_scalars(), float(engine.last_grad_nonfinite()))

    def _exchange(self, synced: bool, buffers_due: bool, joined: bool) -> tuple[bool, bool, int]:
        """One all-reduce per forward under Join: whether a synced step and a buffer broadcast follow, and the
        highest rank not joined, whose buffers are broadcast (as DDP's are under Join, even while no rank has
        joined). Also notes whether a sharded optimizer's step is shadowed (Note [Sharded steps under Join])."""
        model = self.model
        info = [0.0] * (2 + model.world_size)
        if not joined:
            info[0], info[1], info[2 + model.rank] = float(synced), float(buffers_due), 1.0
        values = model._sum_waiting_for_peers(torch.tensor(info, dtype=torch.float64),
                                              "the Join state of a forward").tolist()
        active = [r for r in range(model.world_size) if values[2 + r] > 0]
        self.root = active[-1] if active else 0
        if values[0] > 0 and len(active) < model.world_size and model._attached.param_owners is not None:
            self.sharded_step = "shadow" if joined else "announce"
        return values[0] > 0, values[1] > 0, self.root

    def _settle_sharded_step(self) -> None:
        """Before an iteration under Join, before its collectives: a ShardedOptimizer joined after the model, and
        the last synchronised step's optimizer step shadowed if it was finite (Note [Sharded steps under
        Join])."""
        model = self.model
        optimizer = model._sharded_optimizer()
        if optimizer is not None and not (optimizer._join_config.enable and model._join_config.is_first_joinable):
            raise RuntimeError("hsync.WeightedDDP under Join with an hsync.ShardedOptimizer: a joined rank steps its "
                               "share of the parameters with the others' steps, so the optimizer joins too, after "
                               "the model: use model.join(), or Join([model, optimizer])")
        owed, self.sharded_step = self.sharded_step, None
        if owed is None or owed == "shadow" or not self.last_step_finite():
            return
        raise RuntimeError("hsync.ShardedOptimizer under Join: the last synchronised step's gradients were finite "
                           "but optimizer.step() did not follow; the joined ranks step their share of the "
                           "parameters with it, so call it after each such step (skip it only when stats.finite "
                           "is False)")

    def shadow_iteration(self) -> None:
        """A joined rank's side of one iteration of the others (Note [Join] in csrc/engine.h)."""
        model = self.model
        engine = model._ensure_engine()
        self._settle_sharded_step()  # this rank's last step, had it just joined
        synced, buffers_due, root = self._exchange(False, False, joined=True)
        if buffers_due:
            engine.broadcast_coalesced(model._synced_buffers(), root, BUFFERS_BEFORE_A_FORWARD)
        model.require_forward_param_sync = synced
        if not synced:
            return
        # The step's collectives with nothing of this rank's in them, and its gradients left as they are, as
        # DDP leaves a joined rank's (a loop that joined with gradients still to use, say for a
        # ZeroRedundancyOptimizer's last step, reads its own): set aside, copied where they are bucket views.
        # With a ShardedOptimizer they are instead the reduced ones this rank steps its share with, each
        # step's own (Note [Sharded steps under Join]).
        kept = [] if model._sharded_optimizer() is not None else \
            [(p, p.grad if p.grad is None or not model.gradient_as_bucket_view else p.grad.clone())
             for p in model.module.parameters()]
        for p in model.module.parameters():
            p.grad = None
        try:
            window = model._open_window()
            engine.begin_weighted_step(window.local, window.ref)
            engine.finalize_if_pending()
        finally:
            for p, grad in kept:
                p.grad = grad
        host = engine.step_scalars()
        if host[BAD_RANKS] > 0:
            raise ValueError(bad_input_message(host, None, model.rank))

    def sync_final_model(self, is_last_joiner: bool) -> None:
        """After Join: every rank takes the model of the highest-ranked last joiner."""
        model = self.model
        last_joiners = Channels.of_model(model).gather(torch.tensor([float(is_last_joiner)], dtype=torch.float64),
                                                       "the last joiners after Join")
        root = max((r for r in range(model.world_size) if last_joiners[r, 0] > 0), default=0)
        tensors = [p.detach() for p in reduced_parameters(model.module)]
        tensors += model._synced_buffers() if model.forward_sync_buffers else []
        model._ensure_engine().broadcast_coalesced(tensors, root)


class JoinGroup(dist.ProcessGroup):
    """The process group a WeightedDDP gives torch's Join (join_process_group). Join's own all-reduces (an active
    rank's "not joined yet" at each forward, the joined ranks' count of those, the early-termination flag) go
    through the model's channel, under hsync's deadline and with its error naming the peer, instead of over the
    process group, where a stopped peer holds them to the group's timeout, and on NCCL for ever (a kernel that
    never ends on the device). Each is synchronous (Join waits for all but the forward's flag, which hsync's own
    exchange follows at once). A torch joinable over the model's process group (a ZeroRedundancyOptimizer) may join
    beside the model: the two groups do not differ for Join."""

    def __init__(self, model: WeightedDDP, group: dist.ProcessGroup) -> None:
        super().__init__(model.rank, model.world_size)
        self._model = weakref.ref(model)  # torch.distributed's registry holds this group until the world ends
        self._group = weakref.ref(group)
        # Known to torch.distributed as `group` is (its ranks, backend and store), for what Join and
        # torch's collective functions ask of a group: its rank, and its backend when a collective fails.
        world = dist.distributed_c10d._world
        world.pg_group_ranks[self] = {r: i for i, r in enumerate(dist.get_process_group_ranks(group))}
        if group in world.pg_map:
            world.pg_map[self] = world.pg_map[group]

    def stands_for(self, group: dist.ProcessGroup) -> bool:
        return self._group() is group

    def __ne__(self, other: object) -> bool:
        # Join refuses joinables whose groups differ (`!=`); a torch joinable over the model's group is alike.
        return not (other is self or self.stands_for(other))

    def allreduce(self, tensors: list[torch.Tensor], opts: dist.AllreduceOptions | None = None) -> dist.Work:
        model = self._model()
        if model is None or len(tensors) != 1 or (opts is not None and opts.reduceOp != dist.ReduceOp.SUM):
            raise RuntimeError("hsync: a WeightedDDP's join_process_group carries torch's Join flags only (one "
                               "tensor, summed, while the model lives): reduce other tensors over "
                               "model.process_group")
        (flags,) = tensors
        flags.copy_(model._sum_waiting_for_peers(flags, "torch's Join flags"))
        done = torch.futures.Future()
        done.set_result(tensors)
        return _create_work_from_future(done)

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return "hsync"


class ShadowSteps(JoinHook):
    """How a WeightedDDP takes part in torch's Join once its rank has run out of inputs."""

    def __init__(self, state: JoinState, divide_by_initial_world_size: bool) -> None:
        self.state = state
        state.divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        self.state.shadow_iteration()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.state.sync_final_model(is_last_joiner)
