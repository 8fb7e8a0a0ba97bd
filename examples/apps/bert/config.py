"""Configuration of a pretraining run; the command line is generated from these dataclasses."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib.util
import inspect
import math
import os
import typing
from dataclasses import dataclass

from apps.cli import DEVICES, Parser, check_device, is_count


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
    """Stop after this step (with a checkpoint in --save-dir) to continue later with --resume; 0: never."""
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
    """Linear warm-up steps (default: the preset's, at most a tenth of --max-steps)."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    dropout: float = 0.1
    """Dropout of the hidden layers and the attention probabilities (BERT's 0.1). With 0, every update is a
    function of the global batch alone, the same whatever the number of ranks and the split."""
    probe_steps: int = 2
    """With --balance auto: steps of each of the three probe splits (after two warm-up steps) that
    measure every rank at two sizes before the first plan."""
    rebalance_every: int = 25
    """With --balance auto: fit the ranks' costs again every N steps, and re-plan when that predicts
    steps at least 4% shorter."""
    valid_fraction: float = 0.02
    """Fraction of the corpus's documents held out for validation (at least one); 0: no validation."""
    eval_every: int = 100
    """Evaluate on the held-out documents every N steps, and at the end; 0: at the end only."""
    save_dir: str = ""
    """Directory for checkpoints and, at the end, the trained model in D/final (loadable by from_pretrained)."""
    save_every: int = 0
    """Write a checkpoint every N steps (and at the end); 0: only at the end."""
    resume: bool = False
    """Continue from the latest checkpoint in --save-dir, which must exist. Workers that torchrun restarts
    (--max-restarts) continue from it without this flag, if there is one."""
    bucket_views: bool = True
    """Keep gradients as views into hsync's buckets (gradient_as_bucket_view): one copy of the gradients
    less in memory and no copy back after each reduction. --no-bucket-views copies them, as DDP does."""
    shard_optimizer: bool = False
    """Keep AdamW's moments sharded across the ranks in proportion to each one's memory (hsync.ShardedOptimizer:
    free GPU memory, equal shares on CPUs) instead of whole on every rank; the same updates. Checkpoints hold
    the whole state either way, so a run may resume with or without it."""
    comm_dtype: str = "fp32"
    """Dtype the gradients travel in: fp32 (the model's own), or bf16 / fp16 for half the bytes on the wire,
    each gradient rounded once to it (fp16's range is checked, before and after the sum: an overflow counts
    as a non-finite step)."""
    compile: bool = False
    """Compile the wrapped model with torch.compile (as torch advises for DDP, the wrapper): faster steps
    on a GPU once the first steps have compiled it (and again when a batch's shape first changes)."""
    fault_tolerant: bool = False
    """Run as one replica group of a fault-tolerant job on torchft (hsync.fault_tolerance; hsync[torchft]): one
    process, started with REPLICA_GROUP_ID and TORCHFT_LIGHTHOUSE set; a lost group costs the step it died in, which
    the others run again on the same examples. Checkpoints are torchft's healing from a live peer: --save-dir
    gets the final model only."""
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
    """Seed of initialisation, data order, masking and the validation documents."""
    device: str = "auto"
    """cpu, cuda or auto (cuda when available)."""
    data_workers: int | None = None
    """Processes per rank that collate batches beside the training loop; 0: in the loop (default: 2 on a
    GPU; 0 on the CPU, where they would take cores from the ranks)."""

    def resolved(self, world_size: int = 1) -> tuple[TrainConfig, ModelPreset]:
        """The config with preset defaults filled in, and the preset; a ValueError names the first bad value.
        Everything that can be checked before any work is checked here, for `world_size` ranks."""
        if self.preset not in PRESETS:
            raise ValueError(f"--preset must be one of {', '.join(PRESETS)}, got {self.preset!r}")
        preset = PRESETS[self.preset]
        if self.global_batch_size is not None and self.global_batch_size < 1:
            raise ValueError(f"--global-batch-size must be at least 1, got {self.global_batch_size}")
        if self.lr is not None and not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"--lr must be a finite number above 0, got {self.lr}")
        for flag in ("update_freq", "max_steps", "log_every", "rebalance_every", "probe_steps"):
            if getattr(self, flag) < 1:
                raise ValueError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(self, flag)}")
        for flag in ("warmup_steps", "save_every", "stop_at", "eval_every", "weight_decay", "collective_timeout"):
            value = getattr(self, flag)
            if value is not None and not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"--{flag.replace('_', '-')} must be a finite number, not negative, got {value}")
        if self.collective_timeout and not _MIN_TIMEOUT_S <= self.collective_timeout <= _MAX_TIMEOUT_S:
            raise ValueError(f"--collective-timeout must be 0 (none) or between {_MIN_TIMEOUT_S:g} and "
                             f"{_MAX_TIMEOUT_S:.0f} seconds, got {self.collective_timeout}")
        if not self.collective_timeout and os.environ.get("HSYNC_TIMEOUT"):  # the deadline without the flag
            from hsync.collectives import resolve_timeout

            if not _MIN_TIMEOUT_S <= resolve_timeout(None) <= _MAX_TIMEOUT_S:
                raise ValueError(f"HSYNC_TIMEOUT must be between {_MIN_TIMEOUT_S:g} and {_MAX_TIMEOUT_S:.0f} seconds, "
                                 f"got {os.environ['HSYNC_TIMEOUT']}")
        if self.data_workers is not None and not 0 <= self.data_workers <= _MAX_DATA_WORKERS:
            raise ValueError(f"--data-workers must be between 0 and {_MAX_DATA_WORKERS}, got {self.data_workers}")
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"--seed must be between 0 and 2**32 - 1, got {self.seed}")
        if self.warmup_steps is not None and self.warmup_steps > self.max_steps:
            raise ValueError(f"--warmup-steps {self.warmup_steps} is longer than the run "
                             f"(--max-steps {self.max_steps})")
        filled = dataclasses.replace(
            self,
            global_batch_size=self.global_batch_size or preset.global_batch_size,
            lr=self.lr if self.lr is not None else preset.lr,
            warmup_steps=(self.warmup_steps if self.warmup_steps is not None
                          else min(preset.warmup_steps, self.max_steps // 10)),
        )
        if filled.global_batch_size % filled.update_freq:
            raise ValueError(f"--global-batch-size {filled.global_batch_size} is not a multiple of --update-freq "
                             f"{filled.update_freq}")
        for flag, choices in CHOICES.items():
            if getattr(filled, flag) not in choices:
                raise ValueError(f"--{flag.replace('_', '-')} must be one of {', '.join(choices)}, "
                                 f"got {getattr(filled, flag)!r}")
        if filled.balance == "manual":
            if not filled.rank_batch_sizes:
                raise ValueError("--balance manual needs --rank-batch-sizes")
            filled.rank_plan(world_size)
        elif filled.rank_batch_sizes:
            raise ValueError("--rank-batch-sizes is only used with --balance manual")
        factors = parse_rank_values(filled.simulate_slowdown, world_size, "--simulate-slowdown", 1.0)
        if not all(1 <= f <= _MAX_SLOWDOWN for f in factors):
            raise ValueError(f"--simulate-slowdown factors must be between 1 (a slower rank) and {_MAX_SLOWDOWN}, "
                             f"got {filled.simulate_slowdown!r}")
        if not 0 <= filled.dropout < 1:
            raise ValueError(f"--dropout must be in [0, 1), got {filled.dropout}")
        if not 0 <= filled.valid_fraction <= 0.5:
            raise ValueError(f"--valid-fraction must be between 0 and 0.5, got {filled.valid_fraction}")
        for flag in ("save_every", "stop_at", "resume"):
            if getattr(filled, flag) and not filled.save_dir:
                raise ValueError(f"--{flag.replace('_', '-')} needs --save-dir")
        if filled.stop_at > filled.max_steps:
            raise ValueError(f"--stop-at {filled.stop_at} is after the last step (--max-steps {filled.max_steps})")
        if filled.fault_tolerant:
            filled.check_fault_tolerant(world_size)
        check_device(filled.device)
        return filled, preset

    def check_fault_tolerant(self, world_size: int) -> None:
        """What --fault-tolerant needs and does not combine with (docs/bert.md, Fault tolerance)."""
        if world_size != 1:
            raise ValueError(f"--fault-tolerant runs one process per replica group (torchrun --nproc_per_node 1), "
                             f"not {world_size}")
        missing = [name for name in ("REPLICA_GROUP_ID", "TORCHFT_LIGHTHOUSE") if not os.environ.get(name)]
        if missing:
            raise ValueError(f"--fault-tolerant needs {' and '.join(missing)} set (scripts/fault_tolerant_local.sh "
                             "sets both)")
        if importlib.util.find_spec("torchft") is None:
            raise ValueError("--fault-tolerant needs torchft: pip install hsync[torchft]")
        unsupported = {"--shard-optimizer": self.shard_optimizer, "--compile": self.compile,
                       "--balance equal/manual": self.balance != "auto", "--update-freq": self.update_freq > 1,
                       "--simulate-slowdown": bool(self.simulate_slowdown), "--resume": self.resume,
                       "--save-every": bool(self.save_every), "--stop-at": bool(self.stop_at)}
        given = [flag for flag, used in unsupported.items() if used]
        if given:
            raise ValueError(f"--fault-tolerant does not combine with {', '.join(given)}")

    def rank_plan(self, world_size: int) -> list[int]:
        """--rank-batch-sizes as one micro-batch size per rank, checked against the world and the batch."""
        try:
            plan = [int(part) for part in self.rank_batch_sizes.split(",")]
        except ValueError:
            raise ValueError(f"--rank-batch-sizes must be integers separated by commas, got "
                             f"{self.rank_batch_sizes!r}") from None
        micro_batch = self.global_batch_size // self.update_freq
        if len(plan) != world_size or sum(plan) != micro_batch or min(plan) < 0:
            raise ValueError(f"--rank-batch-sizes {self.rank_batch_sizes} does not add up: it needs {world_size} "
                             f"non-negative sizes summing to {micro_batch} (global batch {self.global_batch_size} / "
                             f"update freq {self.update_freq})")
        return plan


# --collective-timeout: at least what the run's first collectives take to set up, at most what gloo takes.
_MIN_TIMEOUT_S, _MAX_TIMEOUT_S = 1.0, 30 * 86400.0
_MAX_SLOWDOWN = 100.0  # --simulate-slowdown: a rank 100 times slower is far beyond any mixed cluster
_MAX_DATA_WORKERS = 64  # --data-workers: more processes per rank than any machine has cores for

CHOICES = {"preset": tuple(PRESETS), "balance": ("auto", "equal", "manual"), "device": DEVICES,
           "comm_dtype": ("fp32", "bf16", "fp16")}


def parse_rank_values(text: str, world_size: int, what: str, default: float) -> list[float]:
    """'1=2.0,3=1.5' as a list of one value per rank (the others get `default`)."""
    values = [default] * world_size
    given: set[int] = set()
    for item in filter(None, (part.strip() for part in text.split(","))):
        rank, sep, value = item.partition("=")
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not sep or not is_count(rank.strip()) or int(rank) >= world_size or not math.isfinite(number):
            raise ValueError(f"{what}: '{item}' is not RANK=VALUE with a rank below {world_size}")
        if int(rank) in given:
            raise ValueError(f"{what}: rank {int(rank)} is given twice")
        given.add(int(rank))
        values[int(rank)] = number
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


def parse_args(argv: list[str] | None = None, description: str = "",
               world_size: int = 1) -> tuple[TrainConfig, ModelPreset]:
    """The resolved TrainConfig from the command line (one --flag per field, its help the field's docstring)
    and its preset; a bad flag exits with one line naming it."""
    parser = Parser(description=description)
    docs = field_docs(TrainConfig)
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                                help=docs[f.name].replace("%", "%%"))
            continue
        base = next((t for t in typing.get_args(kind) if t is not type(None)), kind)
        doc = docs[f.name].replace("%", "%%")  # argparse formats help with %: a "4%" would swallow the text
        if f.default is None and "(default" not in doc:
            doc += " (default: the preset's)"
        parser.add_argument(flag, type=base, default=f.default, choices=CHOICES.get(f.name), help=doc)
    return parser.parse_checked(argv, lambda args: TrainConfig(**vars(args)).resolved(world_size))
