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

import datetime
import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

import hsync
from hsync import data
from hsync.balance import split_proportionally
from hsync.trainer import checkpoint
from hsync.trainer.cli import init_distributed, report, world_size_from_env
from hsync.trainer.config import ModelPreset, TrainConfig, parse_args, parse_rank_values
from hsync.trainer.consensus import agree, fail_together
from hsync.trainer.interrupt import StopRequest

COMM_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}  # --comm-dtype: WeightedDDP's comm_dtype


def main(argv: list[str] | None = None) -> None:
    cfg, preset = parse_args(argv, description=__doc__, world_size=world_size_from_env())
    import_transformers()
    device = init_distributed(cfg.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    fail_together(unwritable_outputs(cfg) if rank == 0 else None, "cannot write the run's outputs")
    fail_together(checkpoint.earlier_run(cfg.save_dir, cfg.resume) if rank == 0 else None, "cannot start")
    slowdown = parse_rank_values(cfg.simulate_slowdown, world, "--simulate-slowdown", 1.0)[rank]
    corpus = prepare_data(cfg, preset)
    examples, vocab = corpus.train, corpus.vocab

    torch.manual_seed(cfg.seed)
    wrapper = wrap_model(build_model(preset, vocab, cfg.dropout).to(device), cfg)
    net = wrapper.module
    model = torch.compile(wrapper) if cfg.compile else wrapper
    torch.manual_seed(cfg.seed + rank)  # rank 0's weights everywhere, but each rank its own dropout
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg.warmup_steps, cfg.max_steps))
    balancer = hsync.Balancer(model, len(examples), balancing(cfg, world, slowdown))
    # What makes the updates: not the world size, nor how each rank's share is cut into micro-batches.
    # The optimizer's settings too: its saved state would silently override other flags.
    meta = {"preset": asdict(preset), "examples": len(examples), "seed": cfg.seed,
            "vocab_sha256": vocab.digest, "global_batch_size": cfg.global_batch_size,
            "lr": cfg.lr, "weight_decay": cfg.weight_decay}
    # What a resumed run may change (extend the run, say), with a word.
    may_change = {"max_steps": cfg.max_steps, "warmup_steps": cfg.warmup_steps, "dropout": cfg.dropout,
                  "comm_dtype": cfg.comm_dtype}
    if checkpoint.should_resume(cfg.save_dir, cfg.resume):
        state = checkpoint.load(Path(cfg.save_dir), meta, may_change)
        # The same on every rank, which all read the same checkpoint.
        if cfg.stop_at and state["step"] >= cfg.stop_at:
            raise SystemExit(f"hsync: cannot --resume: the checkpoint is at step {state['step']}, not before "
                             f"--stop-at {cfg.stop_at}")
        if state["step"] > cfg.max_steps:
            raise SystemExit(f"hsync: cannot --resume: the checkpoint is at step {state['step']}, after --max-steps "
                             f"{cfg.max_steps}")
        net.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        balancer.load_state_dict(state["balancer"])
    log = Logger(cfg, rank, world)
    plans = PlanReport(balancer, rank)

    last_step = min(cfg.max_steps, cfg.stop_at or cfg.max_steps)
    eval_batch = -(-cfg.global_batch_size // world)
    workers = cfg.data_workers if cfg.data_workers is not None else (2 if device.type == "cuda" else 0)
    stop, stopping = StopRequest(), False
    started = time.perf_counter()
    while balancer.global_step < last_step and not stopping:
        # This rank's micro-batches, step after step, to the epoch's end.
        for batch in training_batches(examples, vocab, balancer, cfg.seed, workers, device):
            stats = train_micro_step(model, balancer, to_device(batch, device), corpus.nsp_weight, stop.requested)
            if stats is None:
                continue  # more micro-batches of this step to come
            lr = optimizer.param_groups[0]["lr"]
            if stats.finite:
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                schedule.step()
            optimizer.zero_grad(set_to_none=not cfg.bucket_views)  # bucket views stay where they are
            step = balancer.global_step
            # The same on every rank. A signal in the last step changes nothing: the run is complete.
            stopping = stats.metrics[StopRequest.METRIC] > 0 and step < last_step
            log.step(step, stats, balancer.last_plan, time.perf_counter() - started, lr)
            plans.update(step)
            if corpus.valid is not None and not stopping and (
                    (cfg.eval_every and step % cfg.eval_every == 0) or step == last_step):
                log.evaluation(step, evaluate(net, corpus.valid, vocab, cfg.seed, eval_batch))
            saved = None
            if cfg.save_dir and (stopping or (cfg.save_every and step % cfg.save_every == 0) or step == last_step):
                saved = checkpoint.save(Path(cfg.save_dir), step, {
                    "model": net.state_dict(), "optimizer": optimizer.state_dict(),
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
    log.close()
    dist.destroy_process_group()
    if stopping:
        sys.exit(stop.exit_code)


def import_transformers() -> None:
    """Loads what this trainer uses of transformers: after the flags are checked (a bad one is refused in
    a second, not six), and before the work starts: transformers loads its model code lazily, at first use,
    which should not be rank 0's final save while its peers wait."""
    import transformers
    from transformers import BertConfig, BertForPreTraining, BertTokenizerFast  # noqa: F401 - loaded, used later

    transformers.utils.logging.disable_progress_bar()  # no bar per saved shard in the run's log


def unwritable_outputs(cfg: TrainConfig) -> str | None:
    """Why --save-dir or --log-file cannot be written (rank 0 writes them), found before any work."""
    try:
        if cfg.save_dir:
            save_dir = Path(cfg.save_dir)
            save_dir.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=save_dir):
                pass
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


def balancing(cfg: TrainConfig, world: int, slowdown: float) -> hsync.BalanceConfig:
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
                               replan_every=cfg.rebalance_every, seed=cfg.seed, simulate_slowdown=slowdown)


def wrap_model(net: nn.Module, cfg: TrainConfig) -> hsync.WeightedDDP:
    """The model in hsync's wrapper, as the flags set it, with the metrics train_micro_step reports."""
    timeout = datetime.timedelta(seconds=cfg.collective_timeout) if cfg.collective_timeout else None
    return hsync.WeightedDDP(net, forward_sync_buffers=False, gradient_as_bucket_view=cfg.bucket_views,
                             metric_names=("tokens", "examples", "mlm", "nsp", StopRequest.METRIC),
                             timeout=timeout, comm_dtype=COMM_DTYPES[cfg.comm_dtype])


def training_batches(examples: data.PretrainingExamples, vocab: Vocabulary, balancer: hsync.Balancer, seed: int,
                     workers: int, device: torch.device) -> DataLoader:
    """This rank's micro-batches of the balancer's current epoch, collated by `workers` processes beside
    the loop (0: in it), into pinned memory on a GPU so that they travel without a host sync."""
    collate = functools.partial(vocab.collate, examples, seed=seed, epoch=balancer.epoch)
    # A generator of its own: each loader draws its workers' seed from it, which from torch's global one
    # would shift every later dropout mask (and a resumed run, whose loaders start elsewhere, would differ).
    return DataLoader(range(len(examples)), batch_sampler=balancer, collate_fn=collate, num_workers=workers,
                      pin_memory=device.type == "cuda", generator=torch.Generator().manual_seed(seed))


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """The batch on `device`; from pinned memory the copies are queued, and the host goes on."""
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def train_micro_step(model: nn.Module, balancer: hsync.Balancer, batch: dict[str, torch.Tensor],
                     nsp_weight: float, stop_requested: float) -> hsync.StepStats | None:
    """Forward, loss and backward of one micro-batch; the weight is its number of masked tokens (module
    docstring). The sums of both losses ride in the step's scalars, for the log. Nothing here waits for
    the device (no host sync): sizes that depend on the data (the masked tokens) stay on the device. A
    micro-batch of a size not run before that runs out of GPU memory runs again in halves (Note [Out of
    memory] in hsync/balance/balancer.py)."""

    def loss_of(part: dict[str, torch.Tensor]):
        mlm_logits, nsp_logits = pretraining_logits(model, part)
        mlm, nsp = pretraining_losses(mlm_logits, nsp_logits, part)
        weight = (part["labels"] != -100).sum()  # never 0: data.collate masks a token of every example
        metrics = {"tokens": part["attention_mask"].sum(), "examples": len(nsp_logits), "mlm": mlm.detach(),
                   "nsp": nsp.detach()}
        if balancer.filler:  # its example is another rank's, counted there
            metrics = dict.fromkeys(metrics, 0.0)
        metrics[StopRequest.METRIC] = stop_requested
        return (mlm + nsp_weight * nsp) / weight, weight, metrics

    return balancer.forward_backward(batch, loss_of)


def pretraining_logits(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The masked-LM logits of every position and the next-sentence logits, from bf16 autocast on a GPU.
    The padding mask goes in as torch's attention kernel (sdpa) takes it, boolean and 4-D: given in 2-D,
    transformers would check on the host whether it masks anything, a host sync per forward."""
    device = batch["input_ids"].device
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        out = model(input_ids=batch["input_ids"], token_type_ids=batch["token_type_ids"],
                    attention_mask=batch["attention_mask"].bool()[:, None, None, :])
    return out.prediction_logits, out.seq_relationship_logits


def pretraining_losses(mlm_logits: torch.Tensor, nsp_logits: torch.Tensor,
                       batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed masked-LM loss over the masked tokens (the others' labels are -100) and the summed
    next-sentence loss, in float32."""
    mlm = nn.functional.cross_entropy(mlm_logits.flatten(0, 1).float(), batch["labels"].flatten(),
                                      ignore_index=-100, reduction="sum")
    nsp = nn.functional.cross_entropy(nsp_logits.float(), batch["next_sentence_label"], reduction="sum")
    return mlm, nsp


def evaluate(net: nn.Module, examples: data.PretrainingExamples, vocab: Vocabulary, seed: int,
             batch_size: int) -> dict[str, float]:
    """Masked-LM and next-sentence loss and accuracy on held-out examples, exact over every rank: each
    rank evaluates its shard, and only the sums are collective. The masks are drawn for epoch 0 at
    every evaluation, so evaluations compare."""
    device = next(net.parameters()).device
    sums = dict.fromkeys(("mlm_loss", "mlm_right", "mlm_count", "nsp_loss", "nsp_right", "nsp_count"), 0.0)
    net.eval()
    with torch.no_grad():
        for indices in hsync.ShardSampler(len(examples), batch_size):
            batch = to_device(vocab.collate(examples, indices, seed, 0), device)
            mlm_logits, nsp_logits = pretraining_logits(net, batch)
            mlm_loss, nsp_loss = pretraining_losses(mlm_logits, nsp_logits, batch)
            labels, nsp_labels = batch["labels"], batch["next_sentence_label"]
            for key, value in (
                ("mlm_loss", mlm_loss),
                ("mlm_right", (mlm_logits.argmax(-1) == labels).sum()),  # never -100
                ("mlm_count", (labels != -100).sum()),
                ("nsp_loss", nsp_loss),
                ("nsp_right", (nsp_logits.argmax(-1) == nsp_labels).sum()),
                ("nsp_count", len(indices)),
            ):
                sums[key] += value  # tensors stay on the device: one read, by the reduction, not one per batch
    net.train()
    total = hsync.sum_over_ranks(sums)
    return {"valid_loss": total["mlm_loss"] / total["mlm_count"] + total["nsp_loss"] / total["nsp_count"],
            "valid_mlm_loss": total["mlm_loss"] / total["mlm_count"],
            "valid_mlm_accuracy": total["mlm_right"] / total["mlm_count"],
            "valid_nsp_loss": total["nsp_loss"] / total["nsp_count"],
            "valid_nsp_accuracy": total["nsp_right"] / total["nsp_count"],
            "valid_examples": int(total["nsp_count"])}


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
    """tqdm progress and JSON lines on rank 0; numbers come from the step's fused stats and the evaluations."""

    def __init__(self, cfg: TrainConfig, rank: int, world: int) -> None:
        self.every, self.world, self.enabled = cfg.log_every, world, rank == 0
        self.last_evaluation: dict[str, float] | None = None
        # unwritable_outputs() has opened the file once already, before any work.
        self.file = open(cfg.log_file, "a") if cfg.log_file and self.enabled else None  # noqa: SIM115
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
        mlm = stats.metrics["mlm"] / max(stats.weight, 1.0)  # means over the global batch
        nsp = stats.metrics["nsp"] / max(stats.metrics["examples"], 1.0)
        self.write({"step": step, "loss": round(mlm + nsp, 5), "mlm_loss": round(mlm, 5), "nsp_loss": round(nsp, 5),
                    "objective": round(stats.loss, 5), "lr": lr, "finite": stats.finite,
                    "masked_tokens": stats.weight, "step_seconds": round(seconds, 4),
                    "tokens_per_s": round(stats.metrics["tokens"] / seconds, 1),
                    "rank_busy_seconds": [round(b, 4) for b in busy], "plan": plan})

    def evaluation(self, step: int, metrics: dict[str, float]) -> None:
        self.last_evaluation = metrics
        if self.enabled:
            self.write({"step": step, **{k: round(v, 5) for k, v in metrics.items()}})

    def write(self, record: dict) -> None:
        (self.bar.write if not self.bar.disable else print)(json.dumps(record))
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def summary(self, final: Path | None) -> str:
        """The run's last line: where the usable model is, and how it does on held-out text."""
        where = (f"trained model in {final} (BertForPreTraining.from_pretrained)" if final else
                 "the model was not kept (pass --save-dir to keep it)")
        v = self.last_evaluation
        if v is None:
            return f"{where}; no validation (--valid-fraction 0)"
        return (f"{where}; validation loss {v['valid_loss']:.3f} on {v['valid_examples']} held-out examples "
                f"(masked LM {v['valid_mlm_loss']:.3f}, accuracy {v['valid_mlm_accuracy']:.3f}; "
                f"next sentence {v['valid_nsp_loss']:.3f}, accuracy {v['valid_nsp_accuracy']:.3f})")

    def close(self) -> None:
        if self.bar:
            self.bar.close()
        if self.file:
            self.file.close()


class Vocabulary:
    """The trained WordPiece vocabulary and what collating needs of it."""

    def __init__(self, tokens: list[str]) -> None:
        self.tokens, self.size = tokens, len(tokens)
        self.digest = hashlib.sha256("\n".join(tokens).encode()).hexdigest()
        ids = {t: i for i, t in enumerate(tokens)}
        self.pad, self.mask = ids["[PAD]"], ids["[MASK]"]
        self.special = {ids[t] for t in ("[PAD]", "[CLS]", "[SEP]", "[MASK]", "[UNK]")}

    def collate(self, examples: data.PretrainingExamples, indices: list[int], seed: int, epoch: int):
        return data.collate(examples, indices, self.size, self.special, self.mask, self.pad, seed, epoch)


@dataclass
class Corpus:
    """The examples of a run and its vocabulary."""

    train: data.PretrainingExamples
    """Examples of the training documents."""
    nsp_weight: float
    """Masked tokens per training example, expected: the next-sentence loss's weight (module docstring)."""
    valid: data.PretrainingExamples | None
    """Examples of the held-out documents (None with --valid-fraction 0)."""
    vocab: Vocabulary
    """The WordPiece vocabulary, rank 0's on every rank."""


def prepare_data(cfg: TrainConfig, preset: ModelPreset) -> Corpus:
    """The corpus, its vocabulary (rank 0's, sent to every rank) and its examples. The corpus and the
    examples are prepared once per machine, by its local rank 0 (nodes need not share a disk), and
    cached under --data-dir by content; the machine's other ranks load them. Any rank's problem
    stops every rank before training."""
    data_dir = Path(cfg.data_dir)
    corpus = Path(cfg.corpus) if cfg.corpus else data_dir / "kjv.txt"
    local_leader = int(os.environ.get("LOCAL_RANK", 0)) == 0
    problem, tokens, digest = None, None, None
    if local_leader and not cfg.corpus:
        try:
            data.prepare_bible_corpus(corpus)
        except (OSError, RuntimeError, subprocess.CalledProcessError) as error:
            problem = f"{type(error).__name__}: {error}"
    fail_together(problem, "cannot prepare the data")  # also waits for every machine's corpus
    try:
        if not corpus.is_file():
            raise FileNotFoundError(f"corpus {corpus} does not exist")
        digest = hashlib.sha256(corpus.read_bytes()).hexdigest()
        if dist.get_rank() == 0:
            # Keyed by the text, not the file's name: an edited corpus gets a vocabulary of its own.
            vocab_dir = data_dir / f"vocab-{digest[:16]}-{preset.vocab_size}"
            reused = (vocab_dir / "vocab.txt").exists()
            tokens = data.train_wordpiece_vocab(corpus, preset.vocab_size, vocab_dir).read_text("utf-8").splitlines()
            report(0, f"vocabulary: {'reused' if reused else 'trained'} {vocab_dir} ({corpus}, sha256 {digest[:16]})")
    except (OSError, ValueError, RuntimeError) as error:
        problem = f"{type(error).__name__}: {error}"
    fail_together(problem, "cannot prepare the data")
    # The same text everywhere, or ranks would train on different data without knowing it.
    fail_together(None if agree(digest) else f"the corpus {corpus} differs between machines",
                  "cannot prepare the data")
    # WordPiece training breaks ties differently from run to run: every rank takes rank 0's.
    shared = [tokens]
    dist.broadcast_object_list(shared, src=0)
    vocab = Vocabulary(shared[0])

    made_of = f"{digest} {vocab.digest} {preset.max_seq_len} {cfg.seed} {cfg.valid_fraction}"
    cache = data_dir / f"examples-{hashlib.sha256(made_of.encode()).hexdigest()[:16]}.pt"
    if local_leader:
        try:
            reused = cache.exists()
            if not reused:
                train_docs, valid_docs = data.hold_out(data.read_documents(corpus), cfg.valid_fraction, cfg.seed)
                data.save_examples(cache, data.build_examples(train_docs, vocab.tokens, preset.max_seq_len, cfg.seed),
                                   data.build_examples(valid_docs, vocab.tokens, preset.max_seq_len, cfg.seed)
                                   if valid_docs else None)
            report(dist.get_rank(), f"examples: {'reused' if reused else 'built'} {cache}")
        except (OSError, ValueError) as error:
            problem = f"corpus {corpus}: {error}"
    fail_together(problem, "cannot prepare the data")
    train, valid = data.load_examples(cache)
    return Corpus(train, data.expected_masked_tokens(train), valid, vocab)


def save_final_model(net: nn.Module, vocab: Vocabulary, preset: ModelPreset, final: Path) -> Path:
    """Collective: rank 0 writes the model and its tokenizer in Hugging Face's format (loadable by
    from_pretrained), replacing an earlier `final` whole only once the new one is complete."""
    problem = None
    if dist.get_rank() == 0:
        from transformers import BertTokenizerFast

        staging = final.with_name(final.name + ".tmp")
        try:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
            net.save_pretrained(staging)
            (staging / "vocab.txt").write_text("\n".join(vocab.tokens) + "\n", encoding="utf-8")
            # Read back from the folder, which every transformers version's constructor agrees on.
            tokenizer = BertTokenizerFast.from_pretrained(staging, do_lower_case=True,
                                                          model_max_length=preset.max_seq_len)
            tokenizer.save_pretrained(staging)
            # The old model is set aside, not deleted, until the new one is in place: a crash leaves one.
            retired = final.with_name(final.name + ".old")
            shutil.rmtree(retired, ignore_errors=True)
            if final.exists():
                final.replace(retired)
            staging.replace(final)
            shutil.rmtree(retired, ignore_errors=True)
        except OSError as error:
            problem = f"{type(error).__name__}: {error}"
    fail_together(problem, f"cannot save the model to {final}")
    return final


def build_model(preset: ModelPreset, vocab: Vocabulary, dropout: float) -> nn.Module:
    from transformers import BertConfig, BertForPreTraining

    config = BertConfig(vocab_size=vocab.size, hidden_size=preset.hidden_size, hidden_dropout_prob=dropout,
                        attention_probs_dropout_prob=dropout,
                        num_hidden_layers=preset.num_layers, num_attention_heads=preset.num_heads,
                        intermediate_size=preset.intermediate_size, max_position_embeddings=preset.max_seq_len,
                        pad_token_id=vocab.pad, attn_implementation="sdpa")  # its mask: pretraining_logits
    return BertForPreTraining(config)


if __name__ == "__main__":
    main()
