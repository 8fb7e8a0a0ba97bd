"""The models the benchmark trains, each variant's wrapping, and one training step of a variant."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

import hsync


@dataclass
class Workload:
    name: str
    make_model: Callable[[], nn.Module]
    make_batch: Callable[[torch.Generator], tuple]
    loss: Callable[[nn.Module, tuple], torch.Tensor]
    samples: int
    bucket_cap_mb: float = 25.0
    bucket_views: bool = False
    """Gradients as views into the buckets (gradient_as_bucket_view), for hsync and DDP alike. Gradients
    are then zeroed in place rather than dropped after each step, as loops that keep them do: the buckets
    are the gradients, so keeping them costs nothing more."""
    comm_dtype: torch.dtype | None = None
    """Gradients travel in this dtype: hsync's comm_dtype against DDP with torch's matching compression
    hook (bf16_compress_hook / fp16_compress_hook)."""
    powersgd: bool = False
    """hsync and DDP each with torch's PowerSGD hook (rank 4, from the third step, error feedback), a state of
    their own: a hook of the user's, through hsync's hook path against DDP's."""
    compiled: bool = False
    """Every variant under torch.compile, the wrapper compiled as torch advises (the floor: the bare model).
    dynamo splits the graphs of hsync and DDP at bucket boundaries, so that reductions start during the
    compiled backward; the floor's stay whole."""
    compile_backend: str = "inductor"
    """torch.compile's backend for a compiled workload: inductor, as users compile; a test of which graphs each
    variant gets takes aot_eager (the same graphs, no code generation)."""


# BERT-base as the GPU rows run it: a batch large enough that the device, not the host's kernel launches, sets
# the step's pace (at 32 sequences an H200 waited for launches; a row's floor_host_share says which).
GPU_BERT_BASE = dict(hidden=768, layers=12, batch=512, seq=128)


def bert_workload(name: str, hidden: int, layers: int, batch: int, seq: int, device: torch.device,
                  bucket_cap_mb: float = 25.0, bucket_views: bool = False,
                  comm_dtype: torch.dtype | None = None, compiled: bool = False, powersgd: bool = False,
                  vocab: int = 8000) -> Workload:

    def make_model() -> nn.Module:
        # transformers is imported by the ranks that build a BERT, not by the command that plans the rows (3 s).
        from transformers import BertConfig, BertForPreTraining

        config = BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                            num_attention_heads=max(1, hidden // 64), intermediate_size=4 * hidden,
                            max_position_embeddings=seq)
        return BertForPreTraining(config).to(device)

    def make_batch(g: torch.Generator) -> tuple:
        return masked_batch(g, batch, seq, vocab, device)

    def loss(model: nn.Module, b: tuple) -> torch.Tensor:
        # Masked LM + next-sentence prediction, as in pretraining: every parameter gets a gradient.
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out = model(input_ids=b[0])
        mlm = nn.functional.cross_entropy(out.prediction_logits.float().flatten(0, 1), b[1].flatten())
        return mlm + nn.functional.cross_entropy(out.seq_relationship_logits.float(), b[2])

    return Workload(name, make_model, make_batch, loss, batch, bucket_cap_mb,
                    bucket_views, comm_dtype, powersgd, compiled)


def masked_batch(g: torch.Generator, batch: int, seq: int, vocab: int, device: torch.device) -> tuple:
    """Random token ids, 15% of them to predict, and random next-sentence labels."""
    ids = torch.randint(vocab, (batch, seq), generator=g)
    labels = torch.where(torch.rand(batch, seq, generator=g) < 0.15, ids, -100)
    nsp = torch.randint(2, (batch,), generator=g)
    return ids.to(device), labels.to(device), nsp.to(device)


class GradientMover(nn.Module):
    """Many parameter tensors of mixed sizes and little compute: per-gradient overhead dominates."""

    def __init__(self, count: int = 600) -> None:
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(torch.randn(4 + (i * 37) % 250) * 0.01) for i in range(count))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum((w.sum() for w in self.weights), x.sum())


def mover_workload(device: torch.device, count: int) -> Workload:
    return Workload(f"gradient-mover-{count}", lambda: GradientMover(count).to(device),
                    lambda g: (torch.randn(8, generator=g).to(device),), lambda m, b: m(b[0]), 8)


def finish_step(net: nn.Module, loss: torch.Tensor, weight: int | None, opt: torch.optim.Optimizer,
                keep_grads: bool = False) -> None:
    """Backward (weighted through hsync when a weight is given) and optimizer step, queued: on a GPU the
    caller waits for the device."""
    if weight is None:
        loss.backward()
    else:
        net.backward(loss, weight=weight)
    opt.step()
    opt.zero_grad(set_to_none=not keep_grads)


def wrap(variant: str, net: nn.Module, workload: Workload, device: torch.device) -> nn.Module:
    """`net` as `variant` runs it: in hsync's wrapper, DDP's, or bare (the floor); compiled if the workload is.

    Compiled, `net` itself changes class (see variant_class): a benchmark's model, never saved."""
    if not workload.compiled:
        return sync_wrapper(variant, net, workload, device)
    # dynamo's guards check a module's class, not which instance it is: with one class for all, every
    # variant would run the graphs compiled for the first, split for DDP's buckets or whole.
    net.__class__ = variant_class(type(net), variant)
    return torch.compile(sync_wrapper(variant, net, workload, device), backend=workload.compile_backend)


@cache
def variant_class(cls: type[nn.Module], variant: str) -> type[nn.Module]:
    """A subclass of `cls` for one variant alone (the same one for every model of that variant, so that a
    fresh model reuses the variant's graphs)."""
    return type(f"{cls.__name__}For{variant.title().replace('_', '')}", (cls,), {})


def sync_wrapper(variant: str, net: nn.Module, workload: Workload, device: torch.device) -> nn.Module:
    if variant in ("hsync", "hsync_plain"):
        wrapped = hsync.WeightedDDP(net, bucket_cap_mb=workload.bucket_cap_mb,
                                    gradient_as_bucket_view=workload.bucket_views, comm_dtype=workload.comm_dtype)
    elif variant == "ddp":
        wrapped = ddp_with_hook(DistributedDataParallel(net, bucket_cap_mb=workload.bucket_cap_mb,
                                                        device_ids=[device.index] if device.type == "cuda" else None,
                                                        gradient_as_bucket_view=workload.bucket_views),
                                workload.comm_dtype)
    else:
        return net
    if workload.powersgd:
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2,
                                            random_seed=0)
        wrapped.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return wrapped


def ddp_with_hook(model: DistributedDataParallel, comm_dtype: torch.dtype | None) -> DistributedDataParallel:
    """DDP communicating in `comm_dtype` through torch's own compression hook (None: no hook)."""
    if comm_dtype is not None:
        hooks = {torch.bfloat16: default_hooks.bf16_compress_hook, torch.float16: default_hooks.fp16_compress_hook}
        model.register_comm_hook(None, hooks[comm_dtype])
    return model


def train_step(variant: str, workload: Workload, net: nn.Module, opt: torch.optim.Optimizer, batch: tuple) -> None:
    """One step of `variant`, queued (on a GPU the device may still be running it)."""
    loss = workload.loss(net, batch)
    finish_step(net, loss, workload.samples if variant == "hsync" else None, opt, workload.bucket_views)


def dtype_suffix(comm_dtype: torch.dtype | None) -> str:
    return {None: "", torch.bfloat16: "-bf16", torch.float16: "-fp16"}[comm_dtype]
