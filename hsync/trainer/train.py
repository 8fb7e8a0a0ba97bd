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
from hsync import data
from hsync.balance import split_proportionally
from hsync.trainer import checkpoint
from hsync.trainer.config import ModelPreset, TrainConfig, parse_args, parse_rank_values
from hsync.trainer.consensus import agree, fail_together


def main(argv: list[str] | None = None) -> None:
    cfg, preset = parse_args(argv, description=__doc__).resolved()
    device = init_distributed(cfg.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    slowdown = parse_rank_values(cfg.simulate_slowdown, world, "--simulate-slowdown", 1.0)[rank]
    examples, vocab = prepare_data(cfg, preset)
    balance_config = balancing(cfg, world, slowdown)

    torch.manual_seed(cfg.seed)
    timeout = datetime.timedelta(seconds=cfg.collective_timeout) if cfg.collective_timeout else None
    model = hsync.WeightedDDP(build_model(preset, vocab).to(device), broadcast_buffers=False,
                              gradient_as_bucket_view=cfg.bucket_views, metric_names=("tokens",), timeout=timeout)
    torch.manual_seed(cfg.seed + rank)  # rank 0's weights everywhere, but each rank its own dropout
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg.warmup_steps, cfg.max_steps))
    balancer = hsync.Balancer(model, len(examples), balance_config)
    meta = {"preset": asdict(preset), "world_size": world, "examples": len(examples), "seed": cfg.seed,
            "vocab_sha256": hashlib.sha256("\n".join(vocab.tokens).encode()).hexdigest(),
            "global_batch_size": cfg.global_batch_size, "update_freq": cfg.update_freq}
    if checkpoint.should_resume(cfg.save_dir, cfg.resume):
        state = checkpoint.load(Path(cfg.save_dir), meta)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        balancer.load_state_dict(state["balancer"])
    log = Logger(cfg, rank, world)
    plans = PlanReport(balancer, rank)

    last_step = min(cfg.max_steps, cfg.stop_at or cfg.max_steps)
    started = time.perf_counter()
    while balancer.global_step < last_step:
        for indices in balancer:  # this rank's micro-batches, step after step, to the epoch's end
            batch = {k: v.to(device) for k, v in vocab.collate(examples, indices, cfg.seed, balancer.epoch).items()}
            stats = train_micro_step(model, balancer, batch)
            if stats is None:
                continue  # more micro-batches of this step to come
            lr = optimizer.param_groups[0]["lr"]
            if stats.finite:
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                schedule.step()
            optimizer.zero_grad(set_to_none=not cfg.bucket_views)  # bucket views stay where they are
            step = balancer.global_step
            log.step(step, stats, balancer.last_plan, time.perf_counter() - started, lr)
            plans.update(step)
            started = time.perf_counter()
            if cfg.save_dir and ((cfg.save_every and step % cfg.save_every == 0) or step == last_step):
                checkpoint.save(Path(cfg.save_dir), step, {
                    "model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "schedule": schedule.state_dict(), "balancer": balancer.state_dict(), "meta": meta})
            if step == last_step:
                break
    log.close()
    dist.destroy_process_group()


def lr_factor(step: int, warmup_steps: int, max_steps: int) -> float:
    """Linear warm-up to the peak, then linear decay to zero at max_steps."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    return max(0.0, (max_steps - step) / max(1, max_steps - warmup_steps))


def balancing(cfg: TrainConfig, world: int, slowdown: float) -> hsync.BalanceConfig:
    """The balancer's settings from the flags. --update-freq F runs an equal share in F micro-batches, so
    a rank given more examples runs more of them; a manual plan gives each rank's micro-batch."""
    if cfg.global_batch_size % cfg.update_freq:
        raise ValueError(f"--global-batch-size {cfg.global_batch_size} is not a multiple of --update-freq "
                         f"{cfg.update_freq}")
    micro_batch = cfg.global_batch_size // cfg.update_freq
    limit, fixed = None, None
    if cfg.update_freq > 1:
        limit = -(-micro_batch // world)
    if cfg.balance == "equal":
        fixed = split_proportionally(cfg.global_batch_size, [1] * world)
    elif cfg.balance == "manual":
        plan = [int(x) for x in cfg.rank_batch_sizes.split(",")]
        if len(plan) != world or sum(plan) != micro_batch or min(plan) < 0:
            raise ValueError(f"--rank-batch-sizes {cfg.rank_batch_sizes} does not add up: it needs {world} "
                             f"non-negative sizes summing to {micro_batch} (global batch {cfg.global_batch_size} / "
                             f"update freq {cfg.update_freq})")
        fixed, limit = [n * cfg.update_freq for n in plan], [max(1, n) for n in plan]
    return hsync.BalanceConfig(global_batch_size=cfg.global_batch_size, rank_batch_sizes=fixed,
                               micro_batch_limit=limit, probe_steps=cfg.probe_steps,
                               replan_every=cfg.rebalance_every, seed=cfg.seed, simulate_slowdown=slowdown)


def train_micro_step(model: hsync.WeightedDDP, balancer: hsync.Balancer,
                     batch: dict[str, torch.Tensor]) -> hsync.StepStats | None:
    """Forward, loss and backward of one micro-batch; the weight is its number of masked tokens."""
    device = batch["input_ids"].device
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        out = model(input_ids=batch["input_ids"], token_type_ids=batch["token_type_ids"],
                    attention_mask=batch["attention_mask"])
        masked = batch["labels"] != -100
        mlm = nn.functional.cross_entropy(out.prediction_logits[masked].float(), batch["labels"][masked])
        nsp = nn.functional.cross_entropy(out.seq_relationship_logits.float(), batch["next_sentence_label"])
    tokens = batch["attention_mask"].sum()
    return balancer.backward(mlm + nsp, weight=masked.sum(), metrics={"tokens": tokens})


class PlanReport:
    """Says on rank 0 when the balancer's plan changes, and what the ranks measured."""

    def __init__(self, balancer: hsync.Balancer, rank: int) -> None:
        self.balancer, self.rank = balancer, rank
        self.models = balancer.cost_models
        self.plan = balancer.planned_split()
        report(rank, f"batch plan: {balancer.config.rank_batch_sizes or 'equal, then measured'} "
                     f"examples per rank and step")

    def update(self, step: int) -> None:
        models = self.balancer.cost_models
        if models is None or models is self.models:
            return  # the plan changes only with the models: no split to compute on most steps
        self.models = models
        plan = self.balancer.planned_split()
        if plan == self.plan:
            return
        shown = ", ".join(f"rank {r}: {m.fixed_s * 1e3:.1f} ms + {1 / m.per_unit_s:.1f} ex/s"
                          for r, m in enumerate(self.balancer.fitted_costs()) if m is not None)
        report(self.rank, f"measured {shown}; batch plan {self.plan} -> {plan} after step {step}")
        self.plan = plan


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
        busy = [stats.metrics[f"hsync.balance.busy/{r}"] for r in range(self.world)]
        record = {"step": step, "loss": round(stats.loss, 5), "lr": lr, "finite": stats.finite,
                  "masked_tokens": stats.weight, "step_seconds": round(seconds, 4),
                  "tokens_per_s": round(stats.metrics["tokens"] / seconds, 1),
                  "rank_busy_seconds": [round(b, 4) for b in busy], "plan": plan}
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
