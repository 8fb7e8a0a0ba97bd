"""--fault-tolerant: the application as one replica group of a job on torchft (hsync.fault_tolerance).

    scripts/fault_tolerant_local.sh 3 examples/bert.py --fault-tolerant --preset tiny --device cpu

Each group is one process; the groups in a quorum split each global batch as the Balancer plans, and a group that
dies costs the step it died in, which the others run again on the same examples. The updates are the ones of the
plain run, as its are whatever the split (up to the order of floating-point sums), with two differences that a
redo brings: dropout is drawn per micro-batch, from the seed, the step and the micro-batch's first example, so a
step run again over other groups draws other masks (but no attempt before it changes them: the same failures
give the same run); and the learning rate follows the committed steps, not a schedule's own count.
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import hsync
from apps.bert import train
from apps.bert.config import ModelPreset, TrainConfig
from apps.bert.data import Corpus, mix_seed, prepare_data, to_device
from apps.bert.model import (
    build_model,
    collective_timeout,
    evaluate,
    import_transformers,
    save_final_model,
    wrap_options,
)
from apps.cli import report


def run(cfg: TrainConfig, preset: ModelPreset) -> None:
    from hsync.fault_tolerance import FaultToleranceConfig, FaultTolerantSteps

    import_transformers()
    device, corpus = _prepared_alone(cfg, preset)
    examples, vocab = corpus.train, corpus.vocab
    torch.manual_seed(cfg.seed)
    net = build_model(preset, vocab, cfg.dropout).to(device)
    optimizer = torch.optim.AdamW(net.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    # Each example's length as its cost: the groups' settings check compares their digest, so groups whose data
    # or vocabulary differ (a --data-dir not shared between machines) stop at their first quorum.
    lengths = [float(len(ids)) for ids in examples.input_ids]
    balance = hsync.BalanceConfig(global_batch_size=cfg.global_batch_size, probe_steps=cfg.probe_steps,
                                  replan_every=cfg.rebalance_every, seed=cfg.seed)
    steps = FaultTolerantSteps(net, optimizer, lengths, balance, FaultToleranceConfig(timeout=collective_timeout(cfg)),
                               wrap_options=wrap_options(cfg))

    def loss_of(indices: list[int]):
        return micro_batch_loss(steps, indices, corpus, cfg, device)

    writer = False
    with steps:
        while steps.global_step < cfg.max_steps:
            steps.set_epoch(steps.epoch)  # the next epoch once one ends (or the job's, once healed)
            while steps.global_step < cfg.max_steps and (stats := steps.step(loss_of)) is not None:
                step = steps.global_step  # committed, counted from 1 as the plain run logs them
                lr = cfg.lr * train.lr_factor(step - 1, cfg.warmup_steps, cfg.max_steps)
                if stats.finite:
                    for group in optimizer.param_groups:
                        group["lr"] = lr
                    nn.utils.clip_grad_norm_(net.parameters(), 1.0)
                    optimizer.step()
                writer = steps.model.rank == 0  # the last quorum's first group writes the model
                if writer and (step % cfg.log_every == 0 or step == cfg.max_steps):
                    mlm = stats.metrics["mlm"] / max(stats.weight, 1.0)
                    nsp = stats.metrics["nsp"] / max(stats.metrics["examples"], 1.0)
                    report(0, f"step {step}  groups {steps.model.world_size}  loss {mlm + nsp:.4f}  lr {lr:.2e}")
    # Every group holds the same parameters: each evaluates alone, the last quorum's first saves.
    with _alone(device):
        if corpus.valid is not None:
            result = evaluate(net, corpus.valid, vocab, cfg.seed, cfg.global_batch_size)
            report(0, f"held-out loss {result['valid_loss']:.4f}")
        if writer and cfg.save_dir:
            report(0, f"the model: {save_final_model(net, vocab, preset, Path(cfg.save_dir) / 'final')}")


def micro_batch_loss(steps, indices: list[int], corpus: Corpus, cfg: TrainConfig, device: torch.device):
    """train.pretraining_loss on these examples, with dropout drawn from the step and the first example (module
    docstring)."""
    torch.manual_seed(mix_seed(cfg.seed, steps.global_step, indices[0]))
    batch = to_device(corpus.vocab.collate(corpus.train, indices, cfg.seed, steps.epoch), device)
    return train.pretraining_loss(steps.model, batch, corpus.nsp_weight, steps.balancer.filler, 0.0)


def _prepared_alone(cfg: TrainConfig, preset: ModelPreset) -> tuple[torch.device, Corpus]:
    """The data, as a plain run of one process prepares it, under a lock on --data-dir: the groups of a machine
    take turns, so one trains the vocabulary and the others read it (WordPiece's training breaks ties differently
    from run to run)."""
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    with _locked(Path(cfg.data_dir) / ".prepare.lock"), _alone(device):
        return device, prepare_data(cfg, preset)


@contextlib.contextmanager
def _alone(device: torch.device) -> Iterator[None]:
    """A world of this process alone, for the application's collectives outside the job's steps (each quorum's
    group is hsync.fault_tolerance's)."""
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
