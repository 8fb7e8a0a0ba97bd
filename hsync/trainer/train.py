"""BERT pretraining (masked LM + next-sentence prediction) across mixed GPUs.

    torchrun --nproc_per_node 4 examples/bert.py --preset tiny --max-steps 200
    torchrun --nnodes 2 --node-rank 0 --rdzv-endpoint HOST:PORT --nproc_per_node 4 examples/bert.py --preset base

Each rank's micro-batch size follows its measured speed (--balance auto), and each rank's
gradient is weighted by its number of masked tokens, so the masked-LM part of every update is
exactly the one a single GPU would make on the whole global batch. (The next-sentence term, a
mean over examples, rides on the same weights: exact when ranks mask alike per example, which
BERT's 15% masking makes nearly so.)
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

# Imported at module level, so before init_process_group: imported after it, transformers leaves
# destroy_process_group unable to free gloo's threads (torch 2.14.1), and a gloo worker still releasing
# a collective while the interpreter shuts down aborts the process (about one exit in 35).
from transformers import BertConfig, BertForPreTraining

import hsync
from hsync import balance, data
from hsync.trainer import checkpoint
from hsync.trainer.config import ModelPreset, TrainConfig, parse_args
from hsync.trainer.consensus import agree, fail_together

MEMORY_FRACTION = 0.9  # of a GPU's memory that a batch plan may fill


def main(argv: list[str] | None = None) -> None:
    cfg, preset = parse_args(argv, description=__doc__).resolved()
    device = init_distributed(cfg.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    slowdown = balance.parse_rank_values(cfg.simulate_slowdown, world, "--simulate-slowdown", 1.0)[rank]
    examples, vocab = prepare_data(cfg, preset)
    micro_batch = cfg.global_batch_size // cfg.update_freq
    plan = initial_plan(cfg, micro_batch, world)

    torch.manual_seed(cfg.seed)
    timeout = datetime.timedelta(seconds=cfg.collective_timeout) if cfg.collective_timeout else None
    model = hsync.WeightedDDP(build_model(preset, vocab).to(device), broadcast_buffers=False,
                              gradient_as_bucket_view=cfg.bucket_views, metric_names=per_rank_metrics(world),
                              timeout=timeout)
    torch.manual_seed(cfg.seed + rank)  # rank 0's weights everywhere, but each rank its own dropout
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg.warmup_steps, cfg.max_steps))
    sampler = data.UnevenDistributedSampler(len(examples), seed=cfg.seed)
    meta = {"preset": asdict(preset), "world_size": world, "examples": len(examples), "seed": cfg.seed,
            "vocab_sha256": hashlib.sha256("\n".join(vocab.tokens).encode()).hexdigest(),
            "global_batch_size": cfg.global_batch_size, "update_freq": cfg.update_freq}
    step = 0
    if checkpoint.should_resume(cfg.save_dir, cfg.resume):
        state = checkpoint.load(Path(cfg.save_dir), meta)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        sampler.load_state_dict(state["sampler"])
        plan, step = state["plan"], state["step"]
    log = Logger(cfg, rank, world)
    window = balance.SpeedWindow()
    capacity = 0.0  # examples this rank's memory could hold per micro-batch, from the last step (0: unknown)
    report(rank, f"batch plan (micro-batch per rank): {plan} x {cfg.update_freq} micro-steps")

    last_step = min(cfg.max_steps, cfg.stop_at or cfg.max_steps)
    while step < last_step:
        started = time.perf_counter()
        for micro in range(cfg.update_freq):
            indices, epoch = sampler.next_step(plan, rank)
            batch = {k: v.to(device) for k, v in vocab.collate(examples, indices or [0], cfg.seed, epoch).items()}
            with contextlib.nullcontext() if micro == cfg.update_freq - 1 else model.no_sync():
                stats, capacity = train_micro_step(model, batch, len(indices), slowdown, device, rank, capacity)
        lr = optimizer.param_groups[0]["lr"]
        if stats.finite:
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
        optimizer.zero_grad(set_to_none=not cfg.bucket_views)  # bucket views stay where they are
        step += 1
        if step > 1 or cfg.measure_steps == 1:  # step 1 pays one-off costs (allocation, GPU warm-up)
            window.add(*rank_speeds(stats, world))
        log.step(step, stats, plan, time.perf_counter() - started, lr)
        measured = step == cfg.measure_steps or step % cfg.rebalance_every == 0
        if cfg.balance == "auto" and measured and step < last_step:
            plan = replan(plan, window, capacities(stats, world, cfg.update_freq), rank)
            window = balance.SpeedWindow()
        if cfg.save_dir and ((cfg.save_every and step % cfg.save_every == 0) or step == last_step):
            checkpoint.save(Path(cfg.save_dir), step, {
                "model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                "schedule": schedule.state_dict(), "sampler": sampler.state_dict(), "plan": plan, "meta": meta})
    log.close()
    dist.destroy_process_group()


def lr_factor(step: int, warmup_steps: int, max_steps: int) -> float:
    """Linear warm-up to the peak, then linear decay to zero at max_steps."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    return max(0.0, (max_steps - step) / max(1, max_steps - warmup_steps))


def train_micro_step(model: hsync.WeightedDDP, batch: dict[str, torch.Tensor], examples: int, slowdown: float,
                     device: torch.device, rank: int, capacity: float) -> tuple[hsync.StepStats | None, float]:
    """Forward, loss and backward of one micro-batch; the weight is its number of masked tokens.

    Also returns how many examples this rank's GPU could take per micro-batch, from this step's peak
    memory; it travels to the other ranks with the next step's scalars (0 on CPU: no limit known)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # time this forward alone, not queued work before it
        torch.cuda.reset_peak_memory_stats(device)
        resident = torch.cuda.memory_allocated(device)
    started = time.perf_counter()
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        out = model(input_ids=batch["input_ids"], token_type_ids=batch["token_type_ids"],
                    attention_mask=batch["attention_mask"])
        masked = batch["labels"] != -100
        mlm = nn.functional.cross_entropy(out.prediction_logits[masked].float(), batch["labels"][masked])
        nsp = nn.functional.cross_entropy(out.seq_relationship_logits.float(), batch["next_sentence_label"])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    forward = time.perf_counter() - started
    # Compute time estimated from the forward pass, the only part free of waiting for other ranks.
    compute = forward * (1 + balance.BACKWARD_TO_FORWARD)
    if slowdown > 1:
        time.sleep((slowdown - 1) * compute)
        compute *= slowdown
    masked_tokens = int(masked.sum()) if examples else 0
    tokens = float(batch["attention_mask"].sum()) if examples else 0.0
    metrics = {f"examples/{rank}": examples, f"seconds/{rank}": compute, f"tokens/{rank}": tokens,
               f"capacity/{rank}": capacity}
    stats = model.backward(mlm + nsp, weight=masked_tokens, metrics=metrics)
    if device.type == "cuda" and examples:
        per_example = (torch.cuda.max_memory_allocated(device) - resident) / examples
        total = torch.cuda.get_device_properties(device).total_memory
        capacity = max(1.0, (MEMORY_FRACTION * total - resident) / per_example) if per_example > 0 else capacity
    return stats, capacity


def per_rank_metrics(world: int) -> tuple[str, ...]:
    return tuple(f"{name}/{r}" for name in ("examples", "seconds", "tokens", "capacity") for r in range(world))


def capacities(stats: hsync.StepStats, world: int, micro_steps: int) -> list[int] | None:
    """Each rank's largest micro-batch by memory, when every rank measured one (GPUs). Every
    micro-step of the step reported it, and metrics add up over micro-steps."""
    caps = [int(stats.metrics[f"capacity/{r}"] / micro_steps) for r in range(world)]
    return caps if all(c > 0 for c in caps) else None


def rank_speeds(stats: hsync.StepStats, world: int) -> tuple[list[float], list[float]]:
    m = stats.metrics
    return [m[f"examples/{r}"] for r in range(world)], [m[f"seconds/{r}"] for r in range(world)]


def initial_plan(cfg: TrainConfig, micro_batch: int, world: int) -> list[int]:
    if cfg.global_batch_size % cfg.update_freq:
        raise ValueError(f"--global-batch-size {cfg.global_batch_size} is not a multiple of --update-freq "
                         f"{cfg.update_freq}")
    if cfg.balance != "manual":
        return data.split_proportionally(micro_batch, [1] * world)
    plan = [int(x) for x in cfg.rank_batch_sizes.split(",")]
    if len(plan) != world or sum(plan) != micro_batch or min(plan) < 0:
        raise ValueError(f"--rank-batch-sizes {cfg.rank_batch_sizes} does not add up: it needs {world} "
                         f"non-negative sizes summing to {micro_batch} (global batch {cfg.global_batch_size} / "
                         f"update freq {cfg.update_freq})")
    return plan


def replan(plan: list[int], window: balance.SpeedWindow, max_sizes: list[int] | None, rank: int) -> list[int]:
    """A plan from the window's speeds within each rank's memory (see balance.rebalance)."""
    speeds = window.speeds()
    if max_sizes and sum(max_sizes) < sum(plan):
        max_sizes = None  # the current plan runs, so the estimate is too cautious: speed alone decides
    new = balance.rebalance(plan, speeds, max_sizes)
    if rank == 0:
        shown = ", ".join(f"rank {r}: {s:.1f} ex/s" for r, s in enumerate(speeds))
        room = f", memory for at most {max_sizes}" if max_sizes else ""
        report(rank, f"measured {shown}{room}; batch plan {plan} -> {new}")
    return new


class Logger:
    """tqdm progress and JSON lines on rank 0; numbers come from the step's fused stats."""

    def __init__(self, cfg: TrainConfig, rank: int, world: int) -> None:
        self.every, self.world, self.enabled = cfg.log_every, world, rank == 0
        self.file, problem = None, None
        if cfg.log_file and self.enabled:
            try:
                self.file = open(cfg.log_file, "a")  # noqa: SIM115 - open for the whole run
            except OSError as error:
                problem = str(error)
        fail_together(problem, "cannot open --log-file")
        self.bar = None
        if self.enabled:
            from tqdm import tqdm

            # A bar only on a terminal: in a log file its redraws would bury the JSON lines.
            self.bar = tqdm(total=cfg.max_steps, dynamic_ncols=True, file=sys.stderr, disable=not sys.stderr.isatty())

    def step(self, step: int, stats: hsync.StepStats, plan: list[int], seconds: float, lr: float) -> None:
        if not self.enabled:
            return
        self.bar.update(step - self.bar.n)
        self.bar.set_postfix(loss=f"{stats.loss:.3f}", refresh=False)
        if step % self.every and step != self.bar.total:
            return
        tokens = [stats.metrics[f"tokens/{r}"] for r in range(self.world)]
        compute = [stats.metrics[f"seconds/{r}"] for r in range(self.world)]
        record = {"step": step, "loss": round(stats.loss, 5), "lr": lr, "finite": stats.finite,
                  "masked_tokens": stats.weight, "step_seconds": round(seconds, 4),
                  "tokens_per_s": round(sum(tokens) / seconds, 1),
                  "rank_tokens_per_s": [round(t / c, 1) if c else 0.0 for t, c in zip(tokens, compute, strict=True)],
                  "plan": plan}
        tqdm_write = self.bar.write if not self.bar.disable else print
        tqdm_write(json.dumps(record))
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.bar:
            self.bar.close()
        if self.file:
            self.file.close()


def report(rank: int, message: str) -> None:
    if rank == 0:
        print(message, file=sys.stderr, flush=True)


def init_distributed(device_choice: str) -> torch.device:
    """torchrun's environment (RANK, WORLD_SIZE, ...), or a world of one for a plain `python` run."""
    use_cuda = device_choice == "cuda" or (device_choice == "auto" and torch.cuda.is_available())
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    # torchrun's agent keeps one store across restarts, so workers of a new attempt could read the
    # addresses that the dead workers of the last one posted (seen with gloo: connecting to a dead
    # port, or hanging). Each attempt gets keys of its own.
    store, rank, world_size = next(dist.rendezvous("env://"))
    attempt = dist.PrefixStore(f"attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    dist.init_process_group("nccl" if use_cuda else "gloo", store=attempt, rank=rank, world_size=world_size)
    return torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")


class Vocabulary:
    """The trained WordPiece vocabulary and what collating needs of it."""

    def __init__(self, tokens: list[str]) -> None:
        self.tokens, self.size = tokens, len(tokens)
        ids = {t: i for i, t in enumerate(tokens)}
        self.pad, self.mask = ids["[PAD]"], ids["[MASK]"]
        self.special = {ids[t] for t in ("[PAD]", "[CLS]", "[SEP]", "[MASK]", "[UNK]")}

    def collate(self, examples: data.PretrainingExamples, indices: list[int], seed: int, epoch: int):
        return data.collate(examples, indices, self.size, self.special, self.mask, self.pad, seed, epoch)


def prepare_data(cfg: TrainConfig, preset: ModelPreset) -> tuple[data.PretrainingExamples, Vocabulary]:
    """The corpus, prepared once per machine (by its local rank 0: nodes need not share a disk), and
    rank 0's vocabulary, sent to every rank. Any rank's problem stops every rank before training."""
    data_dir = Path(cfg.data_dir)
    corpus = Path(cfg.corpus) if cfg.corpus else data_dir / "kjv.txt"
    problem, tokens = None, None
    if int(os.environ.get("LOCAL_RANK", 0)) == 0 and not cfg.corpus:
        try:
            data.prepare_bible_corpus(corpus)
        except (OSError, RuntimeError, subprocess.CalledProcessError) as error:
            problem = f"{type(error).__name__}: {error}"
    fail_together(problem, "cannot prepare the data")  # also waits for every machine's corpus
    try:
        documents = data.read_documents(corpus)  # a missing or empty corpus fails here, before any work
        if dist.get_rank() == 0:
            vocab_dir = data_dir / f"vocab-{corpus.stem}-{preset.vocab_size}"
            tokens = data.train_wordpiece_vocab(corpus, preset.vocab_size, vocab_dir).read_text("utf-8").splitlines()
    except (OSError, ValueError, RuntimeError) as error:
        problem = f"{type(error).__name__}: {error}"
    fail_together(problem, "cannot prepare the data")
    # The same text everywhere, or ranks would train on different data without knowing it.
    fail_together(None if agree(hashlib.sha256(corpus.read_bytes()).hexdigest()) else
                  f"the corpus {corpus} differs between machines", "cannot prepare the data")
    # WordPiece training breaks ties differently from run to run: every rank takes rank 0's.
    shared = [tokens]
    dist.broadcast_object_list(shared, src=0)
    vocab = Vocabulary(shared[0])
    return data.build_examples(documents, vocab.tokens, preset.max_seq_len, cfg.seed), vocab


def build_model(preset: ModelPreset, vocab: Vocabulary) -> nn.Module:
    config = BertConfig(vocab_size=vocab.size, hidden_size=preset.hidden_size,
                        num_hidden_layers=preset.num_layers, num_attention_heads=preset.num_heads,
                        intermediate_size=preset.intermediate_size, max_position_embeddings=preset.max_seq_len,
                        pad_token_id=vocab.pad)
    return BertForPreTraining(config)


if __name__ == "__main__":
    main()
