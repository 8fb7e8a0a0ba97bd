"""BERT pretraining (masked LM + next-sentence prediction) across mixed GPUs.

    torchrun --nproc_per_node 4 examples/bert.py --preset tiny --max-steps 200
    torchrun --nnodes 2 --node-rank 0 --rdzv-endpoint HOST:PORT --nproc_per_node 4 examples/bert.py --preset base

Each rank's micro-batch size follows its measured speed (--balance auto), and each rank's
gradient is weighted by its number of masked tokens. The loss of a global batch is its summed
masked-LM loss plus c times its summed next-sentence loss, over its masked tokens, with c the
corpus's expected number of masked tokens per example: the masked-LM mean plus (nearly) the
next-sentence mean, as BERT's loss, and a function of the global batch alone. Every update is
therefore the one a single GPU would make on the whole global batch, however the batch is split
and over however many ranks (up to the order of floating-point sums).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import hsync
from apps.bert import checkpoint
from apps.bert.config import TrainConfig, parse_args, parse_rank_values
from apps.bert.consensus import fail_together
from apps.bert.data import prepare_data, to_device, training_batches
from apps.bert.interrupt import StopRequest
from apps.bert.model import (
    build_model,
    evaluate,
    import_transformers,
    pretraining_logits,
    pretraining_losses,
    save_final_model,
    wrap_model,
)
from apps.bert.report import Logger, PlanReport
from apps.cli import init_distributed, report, unwritable_folder, world_size_from_env
from hsync.balance import split_proportionally
from hsync.balance.simulate import SimulatedSlowdown


def main(argv: list[str] | None = None) -> None:
    cfg, preset = parse_args(argv, description=__doc__, world_size=world_size_from_env())
    if cfg.collective_timeout:  # every collective's deadline: the model's, and those of the run's decisions
        os.environ["HSYNC_TIMEOUT"] = str(cfg.collective_timeout)
    if cfg.fault_tolerant:
        from apps.bert import fault_tolerant

        fault_tolerant.run(cfg, preset)
        return
    device = init_distributed(cfg.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    fail_together(unwritable_outputs(cfg) if rank == 0 else None, "cannot write the run's outputs")
    fail_together(checkpoint.claim(cfg.save_dir) if rank == 0 else None, "cannot start")
    fail_together(checkpoint.earlier_run(cfg.save_dir, cfg.resume) if rank == 0 else None, "cannot start")
    import_transformers()
    slowdown = parse_rank_values(cfg.simulate_slowdown, world, "--simulate-slowdown", 1.0)[rank]
    # What makes the updates: not the world size, nor how each rank's share is cut into micro-batches.
    # The optimizer's settings too: its saved state would silently override other flags.
    settings = {"preset": asdict(preset), "seed": cfg.seed, "global_batch_size": cfg.global_batch_size,
                "lr": cfg.lr, "weight_decay": cfg.weight_decay, "valid_fraction": cfg.valid_fraction}
    resuming = checkpoint.should_resume(cfg.save_dir, cfg.resume)
    if resuming:
        checkpoint.refuse_another_run(Path(cfg.save_dir), settings)
    corpus = prepare_data(cfg, preset)
    examples, vocab = corpus.train, corpus.vocab

    torch.manual_seed(cfg.seed)
    wrapper = wrap_model(build_model(preset, vocab, cfg.dropout).to(device), cfg)
    net = wrapper.module
    model = torch.compile(wrapper) if cfg.compile else wrapper
    torch.manual_seed(cfg.seed + rank)  # rank 0's weights everywhere, but each rank its own dropout
    if cfg.shard_optimizer:
        optimizer = hsync.ShardedOptimizer(wrapper, torch.optim.AdamW, lr=cfg.lr, weight_decay=cfg.weight_decay)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg.warmup_steps, cfg.max_steps))
    balancer = hsync.Balancer(model, len(examples), balancing(cfg, world),
                              clock=SimulatedSlowdown(slowdown, device) if slowdown > 1 else None)
    meta = {**settings, "examples": len(examples), "vocab_sha256": vocab.digest}
    # What a resumed run may change (extend the run, say), with a word.
    may_change = {"max_steps": cfg.max_steps, "warmup_steps": cfg.warmup_steps, "dropout": cfg.dropout,
                  "comm_dtype": cfg.comm_dtype, "shard_optimizer": cfg.shard_optimizer}
    if resuming:
        state = checkpoint.load(Path(cfg.save_dir), meta, may_change, stop_at=cfg.stop_at, max_steps=cfg.max_steps,
                                holds=("model", "optimizer", "schedule", "balancer"))
        net.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        balancer.load_state_dict(state["balancer"])
    log = Logger(cfg, rank, world)
    plans = PlanReport(balancer, rank)

    last_step = min(cfg.max_steps, cfg.stop_at or cfg.max_steps)
    eval_batch = -(-cfg.global_batch_size // world)
    workers = cfg.data_workers if cfg.data_workers is not None else (2 if device.type == "cuda" else 0)
    stop, stopping, saved = StopRequest(), False, None
    started = time.perf_counter()
    while balancer.global_step < last_step and not stopping:
        # This rank's micro-batches, step after step, to the epoch's end.
        for batch in training_batches(examples, vocab, balancer, cfg.seed, workers, device):
            stats = train_micro_step(model, balancer, to_device(batch, device), corpus.nsp_weight, stop.requested)
            if stats is None:
                continue  # more micro-batches of this step to come
            lr = optimizer.param_groups[0]["lr"]
            if stats.finite:
                if cfg.shard_optimizer:
                    optimizer.clip_grad_norm_(1.0)  # over every rank's shard
                else:
                    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                schedule.step()
            optimizer.zero_grad(set_to_none=not cfg.bucket_views)  # bucket views stay where they are
            step = balancer.global_step
            # The same on every rank. A signal in the last step changes nothing: the run is complete.
            stopping = stats.metrics[StopRequest.METRIC] > 0 and step < last_step
            log.step(step, stats, balancer, time.perf_counter() - started, lr)
            plans.update(step)
            if corpus.valid is not None and not stopping and (
                    (cfg.eval_every and step % cfg.eval_every == 0) or step == last_step):
                log.evaluation(step, evaluate(net, corpus.valid, vocab, cfg.seed, eval_batch))
            saved = None
            if cfg.save_dir and (stopping or (cfg.save_every and step % cfg.save_every == 0) or step == last_step):
                saved = checkpoint.save(Path(cfg.save_dir), step, {
                    "model": net.state_dict(), "optimizer": whole_state(optimizer),
                    "schedule": schedule.state_dict(), "balancer": balancer.state_dict(),
                    "meta": meta | may_change})
            started = time.perf_counter()
            if stopping:
                report(rank, stop.summary(step, saved))
                break
            if step == last_step:
                break
    if balancer.global_step == cfg.max_steps and not stopping:
        final = save_final_model(net, vocab, preset, Path(cfg.save_dir) / "final") if cfg.save_dir else None
        report(rank, log.summary(final))
    elif balancer.global_step == last_step and not stopping:  # --stop-at, before --max-steps
        report(rank, f"stopped at step {last_step} (--stop-at); checkpoint {saved} written, continue to step "
                     f"{cfg.max_steps} with --resume")
    log.close()
    dist.destroy_process_group()
    if stopping:
        sys.exit(stop.exit_code)


def whole_state(optimizer: torch.optim.Optimizer) -> dict | None:
    """The optimizer's whole state in AdamW's own format (on rank 0, which writes checkpoints): a sharded one's
    gathered there (collective), so that any later run, sharded or not, on any ranks, loads it."""
    if isinstance(optimizer, hsync.ShardedOptimizer):
        optimizer.consolidate_state_dict(to=0)
        return optimizer.state_dict() if dist.get_rank() == 0 else None
    return optimizer.state_dict()


def unwritable_outputs(cfg: TrainConfig) -> str | None:
    """Why --save-dir or --log-file cannot be written (rank 0 writes them), found before any work."""
    if cfg.save_dir and (why := unwritable_folder(Path(cfg.save_dir))):
        return why
    try:
        if cfg.log_file:
            with open(cfg.log_file, "a"):
                pass
    except OSError as error:
        return f"{type(error).__name__}: {error}"
    return None


def lr_factor(step: int, warmup_steps: int, max_steps: int) -> float:
    """Linear warm-up to the peak, then linear decay to zero at max_steps."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    return max(0.0, (max_steps - step) / max(1, max_steps - warmup_steps))


def balancing(cfg: TrainConfig, world: int) -> hsync.BalanceConfig:
    """The balancer's settings from the flags. --update-freq F runs an equal share in F micro-batches, so
    a rank given more examples runs more of them; a manual plan gives each rank's micro-batch."""
    micro_batch = cfg.global_batch_size // cfg.update_freq
    limit, fixed = None, None
    if cfg.update_freq > 1:
        limit = -(-micro_batch // world)
    if cfg.balance == "equal":
        fixed = split_proportionally(cfg.global_batch_size, [1] * world)
    elif cfg.balance == "manual":
        plan = cfg.rank_plan(world)
        fixed, limit = [n * cfg.update_freq for n in plan], [max(1, n) for n in plan]
    return hsync.BalanceConfig(global_batch_size=cfg.global_batch_size, rank_batch_sizes=fixed,
                               micro_batch_limit=limit, probe_steps=cfg.probe_steps,
                               replan_every=cfg.rebalance_every, seed=cfg.seed)


def train_micro_step(model: nn.Module, balancer: hsync.Balancer, batch: dict[str, torch.Tensor],
                     nsp_weight: float, stop_requested: float) -> hsync.StepStats | None:
    """Forward, loss and backward of one micro-batch; the weight is its number of masked tokens (module
    docstring). The sums of both losses ride in the step's scalars, for the log. Nothing here waits for
    the device (no host sync): sizes that depend on the data (the masked tokens) stay on the device. A
    micro-batch of a size not run before that runs out of GPU memory runs again in halves (Note [Out of
    memory] in hsync/balance/balancer.py)."""

    def loss_of(part: dict[str, torch.Tensor]):
        return pretraining_loss(model, part, nsp_weight, balancer.filler, stop_requested)

    return balancer.forward_backward(batch, loss_of)


def pretraining_loss(model: nn.Module, batch: dict[str, torch.Tensor], nsp_weight: float, filler: bool,
                     stop_requested: float) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """A micro-batch's loss over its masked tokens, its weight (their number) and the metrics of the step's
    scalars, as Balancer.forward_backward takes them (module docstring). A filler's example is another rank's,
    counted there."""
    mlm_logits, nsp_logits = pretraining_logits(model, batch)
    mlm, nsp = pretraining_losses(mlm_logits, nsp_logits, batch)
    weight = (batch["labels"] != -100).sum()  # never 0: collate masks a token of every example
    metrics = {"tokens": batch["attention_mask"].sum(), "examples": len(nsp_logits), "mlm": mlm.detach(),
               "nsp": nsp.detach()}
    if filler:
        metrics = dict.fromkeys(metrics, 0.0)
    metrics[StopRequest.METRIC] = stop_requested
    return (mlm + nsp_weight * nsp) / weight, weight, metrics


if __name__ == "__main__":
    main()
