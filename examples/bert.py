"""BERT pretraining across mixed GPUs: see examples/apps/bert/train.py, or run with --help."""

import torch.distributed as dist

from apps.bert.train import main
from apps.cli import say_once

if __name__ == "__main__":
    try:
        main()
    except SystemExit as stopped:
        # The ranks agreed to stop (apps.bert.consensus.fail_together): the group ends cleanly first, since a
        # process that exits with a gloo group alive may abort in its teardown (pytorch/pytorch#190489), a
        # SIGABRT after the one-line error.
        if dist.is_initialized():
            dist.destroy_process_group()
        if isinstance(stopped.code, str):
            say_once(stopped.code)
            raise SystemExit(1) from None
        raise
