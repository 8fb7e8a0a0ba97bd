"""The BERT trainer's micro-steps on a GPU wait for nothing on the device (skipped without a GPU)."""

import pytest
import torch

from tests.bert.test_bert_runs import SLICE
from tests.gpu.test_nccl import SOCKET_ENV
from tests.spawn import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def sync_free_micro_steps(rank: int, world_size: int, data_dir: str, steps: int) -> int:
    import os

    import hsync
    from apps.bert import data, train
    from apps.bert.config import parse_args
    from apps.bert.model import build_model, wrap_model

    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    cfg, preset = parse_args(["--preset", "tiny", "--corpus", str(SLICE), "--data-dir", data_dir, "--device", "cuda",
                              "--global-batch-size", "24", "--update-freq", "2", "--valid-fraction", "0"],
                             world_size=world_size)
    # Set once the flags are checked: the application refuses two processes on a node's one GPU, which
    # only a test wants; the data's preparation needs to know the node's first rank (LOCAL_RANK 0).
    os.environ["LOCAL_RANK"] = str(rank)
    corpus = data.prepare_data(cfg, preset)
    model = wrap_model(build_model(preset, corpus.vocab, cfg.dropout).to(device), cfg)
    balancer = hsync.Balancer(model, len(corpus.train), train.balancing(cfg, world_size))
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    done = 0
    for batch in data.training_batches(corpus.train, corpus.vocab, balancer, cfg.seed, 2, device):
        # After the first step, whose end rebuilds the buckets in the gradients' order (one sync), any
        # wait for the device raises: the data's copy, forward, loss, backward and the step's reduction.
        torch.cuda.set_sync_debug_mode("error" if done else "default")
        try:
            stats = train.train_micro_step(model, balancer, data.to_device(batch, device), corpus.nsp_weight, 0.0)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        if stats is None:
            continue
        assert stats.finite  # the step's one wait, by design: whether every rank may step
        optimizer.step()
        optimizer.zero_grad(set_to_none=not cfg.bucket_views)
        done += 1
        if done == steps:
            break
    return done


def test_a_trainers_micro_steps_do_not_wait_for_the_device(tmp_path):
    # Two ranks on one GPU, each its micro-batches in two micro-steps, collated by DataLoader workers.
    assert run_ranks(sync_free_micro_steps, 2, str(tmp_path), 4, env=SOCKET_ENV, timeout=120) == [4, 4]
