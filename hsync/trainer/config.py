"""Configuration of a pretraining run; the command line is generated from these dataclasses."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import typing
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelPreset:
    """A BERT size with the data and optimisation settings that suit it."""

    hidden_size: int
    """Width of every layer."""
    num_layers: int
    """Number of transformer layers."""
    num_heads: int
    """Attention heads per layer."""
    intermediate_size: int
    """Width of the feed-forward block."""
    vocab_size: int
    """Size of the WordPiece vocabulary trained on the corpus."""
    max_seq_len: int
    """Tokens per example ([CLS] A [SEP] B [SEP])."""
    global_batch_size: int
    """Examples per optimizer step, over all ranks and micro-steps."""
    lr: float
    """Peak learning rate of AdamW."""
    warmup_steps: int
    """Linear warm-up steps before the linear decay."""


PRESETS = {
    # Two CPU cores, a couple of minutes, and a loss that visibly falls.
    "tiny": ModelPreset(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=256, vocab_size=2000,
                        max_seq_len=64, global_batch_size=32, lr=2e-3, warmup_steps=20),
    # BERT-base, for real GPUs.
    "base": ModelPreset(hidden_size=768, num_layers=12, num_heads=12, intermediate_size=3072, vocab_size=16000,
                        max_seq_len=128, global_batch_size=256, lr=1e-4, warmup_steps=1000),
}


@dataclass
class TrainConfig:
    """A pretraining run. Fields left at None take the preset's value."""

    preset: str = "tiny"
    """Model size and defaults: tiny (CPU, minutes) or base (BERT-base, GPUs)."""
    corpus: str = ""
    """Text file, one sentence a line, a blank line between documents (default: the King James Bible, fetched once)."""
    data_dir: str = "data"
    """Where the prepared corpus and the trained vocabulary are cached."""
    max_steps: int = 200
    """Optimizer steps of the whole run, counting those before a resume; the LR schedule spans them."""
    stop_at: int = 0
    """Stop after this step (with a checkpoint, if --save-dir is set) to continue later with --resume; 0: never."""
    global_batch_size: int | None = None
    """Examples per optimizer step over all ranks and micro-steps."""
    balance: str = "auto"
    """How the global batch is split: equal (DDP), auto (measured speed), manual (--rank-batch-sizes)."""
    rank_batch_sizes: str = ""
    """Micro-batch size of each rank for --balance manual, e.g. 8,16,16."""
    update_freq: int = 1
    """Micro-steps per optimizer step (gradient accumulation)."""
    lr: float | None = None
    """Peak learning rate."""
    warmup_steps: int | None = None
    """Linear warm-up steps."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    probe_steps: int = 2
    """With --balance auto: steps of each of the three probe splits (after two warm-up steps) that
    measure every rank at two sizes before the first plan."""
    rebalance_every: int = 25
    """With --balance auto: fit the ranks' costs again every N steps, and re-plan when that predicts
    steps at least 4% shorter."""
    save_dir: str = ""
    """Directory for checkpoints (none are written without it)."""
    save_every: int = 0
    """Write a checkpoint every N steps (and at the end); 0: only at the end."""
    resume: bool = False
    """Continue from the latest checkpoint in --save-dir, which must exist. Workers that torchrun restarts
    (--max-restarts) continue from it without this flag, if there is one."""
    bucket_views: bool = True
    """Keep gradients as views into hsync's buckets (gradient_as_bucket_view): one copy of the gradients
    less in memory and no copy back after each reduction. --no-bucket-views copies them, as DDP does."""
    collective_timeout: float = 0.0
    """Seconds any one gradient collective may take before every rank stops with an error naming it;
    0: hsync's default (HSYNC_TIMEOUT, else 300)."""
    log_file: str = ""
    """JSON lines, one per logged step (rank 0)."""
    log_every: int = 10
    """Log every N steps."""
    simulate_slowdown: str = ""
    """RANK=FACTOR[,...]: make ranks behave like GPUs FACTOR times slower, to try balancing on identical hardware."""
    seed: int = 0
    """Seed of initialisation, data order and masking."""
    device: str = "auto"
    """cpu, cuda or auto (cuda when available)."""

    def resolved(self) -> tuple[TrainConfig, ModelPreset]:
        """The config with preset defaults filled in, and the preset; raises on bad values."""
        if self.preset not in PRESETS:
            raise ValueError(f"--preset must be one of {sorted(PRESETS)}, got {self.preset!r}")
        preset = PRESETS[self.preset]
        filled = dataclasses.replace(
            self,
            global_batch_size=self.global_batch_size or preset.global_batch_size,
            lr=self.lr if self.lr is not None else preset.lr,
            warmup_steps=self.warmup_steps if self.warmup_steps is not None else preset.warmup_steps,
        )
        if filled.balance not in ("equal", "auto", "manual"):
            raise ValueError(f"--balance must be equal, auto or manual, got {filled.balance!r}")
        if filled.balance == "manual" and not filled.rank_batch_sizes:
            raise ValueError("--balance manual needs --rank-batch-sizes")
        for flag in ("update_freq", "max_steps", "log_every", "rebalance_every", "probe_steps"):
            if getattr(filled, flag) < 1:
                raise ValueError(f"--{flag.replace('_', '-')} must be at least 1")
        if filled.collective_timeout < 0:
            raise ValueError(f"--collective-timeout cannot be negative, got {filled.collective_timeout}")
        if filled.warmup_steps < 0 or filled.save_every < 0 or filled.stop_at < 0:
            raise ValueError("--warmup-steps, --save-every and --stop-at cannot be negative")
        if filled.resume and not filled.save_dir:
            raise ValueError("--resume needs --save-dir")
        return filled, preset


def parse_rank_values(text: str, world_size: int, what: str, default: float) -> list[float]:
    """'1=2.0,3=1.5' as a list of one value per rank (the others get `default`)."""
    values = [default] * world_size
    for item in filter(None, (part.strip() for part in text.split(","))):
        rank, sep, value = item.partition("=")
        if not sep or not rank.strip().isdigit() or int(rank) >= world_size:
            raise ValueError(f"{what}: '{item}' is not RANK=VALUE with a rank below {world_size}")
        values[int(rank)] = float(value)
    return values


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass, read from its source."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, following in zip(body, body[1:], strict=False):
        if (isinstance(node, ast.AnnAssign) and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)):
            docs[node.target.id] = following.value.value
    return docs


def parse_args(argv: list[str] | None = None, description: str = "") -> TrainConfig:
    """TrainConfig from the command line: one --flag per field, its help the field's docstring."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    docs = field_docs(TrainConfig)
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=docs[f.name])
            continue
        base = next((t for t in typing.get_args(kind) if t is not type(None)), kind)
        doc = docs[f.name]
        if "default" not in doc:
            doc += f" (default: {'preset' if f.default is None else repr(f.default)})"
        parser.add_argument(flag, type=base, default=f.default, help=doc)
    return TrainConfig(**vars(parser.parse_args(argv)))
