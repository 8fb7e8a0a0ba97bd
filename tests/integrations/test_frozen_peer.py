"""A peer that freezes (SIGSTOP) while the other rank is inside one of the framework's own collectives, not one
of hsync's: Accelerate's gather_for_metrics, the Trainer's evaluation (through it), Lightning's SIGTERM broadcast
before every training batch. They run on torch's process group, under its timeout (30 minutes by default); the
integrations give it hsync's deadline, so the survivor's run ends with an error within seconds of it."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable

import pytest
import torch

from tests.distributed.test_deadlines import seconds_to_notice
from tests.integrations import LAUNCH_ENV
from tests.spawn import run_ranks_with_victim

pytestmark = pytest.mark.distributed

DEADLINE_S = 3.0
GRACE_S = 1.0  # what hsync gives gloo past its deadline (kBackendGrace), the framework's collectives with it
VICTIM = 1
ENV = {**LAUNCH_ENV, "GROUP_RANK": "0", "HSYNC_TIMEOUT": str(DEADLINE_S)}


def frozen_inside(rank: int, collective: Callable[[], object]) -> None:
    """The victim stops; the survivor runs `collective`, which raises, with the seconds it took."""
    if rank == VICTIM:
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(0.2)  # the victim is stopped
    started = time.monotonic()
    try:
        collective()
    except RuntimeError as error:
        raise RuntimeError(f"noticed after {time.monotonic() - started:.2f} s: {error}") from None
    raise AssertionError(f"rank {rank} went on although rank {VICTIM} was stopped")


def accelerate_gather(rank: int, world_size: int, output_dir: str) -> None:
    from hsync.integrations.accelerate import Accelerator
    from tests.integrations.test_accelerate import net

    accelerator = Accelerator(cpu=True)
    accelerator.prepare(net())
    accelerator.gather_for_metrics(torch.ones(2))  # every rank there: the connections are made
    frozen_inside(rank, lambda: accelerator.gather_for_metrics(torch.ones(2)))


def trainer_evaluation(rank: int, world_size: int, output_dir: str) -> None:
    from hsync.integrations.transformers import Trainer
    from tests.integrations.test_transformers_trainer import Texts, collate, tiny_model, training_args

    trainer = Trainer(model=tiny_model("classify"), args=training_args(output_dir, max_steps=2),
                      train_dataset=Texts("classify"), eval_dataset=Texts("classify"), data_collator=collate)
    trainer.train()
    frozen_inside(rank, trainer.evaluate)


def lightning_sigterm_broadcast(rank: int, world_size: int, output_dir: str) -> None:
    """The victim stops inside its third broadcast of Lightning's SIGTERM flag (an instant before it, as a
    frozen peer would); the survivor's fit raises. Timed from the survivor's last finished batch."""
    import lightning as L
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    import hsync.integrations.lightning  # noqa: F401 (registers strategy="hsync")
    from tests.integrations.test_lightning import module_class

    if rank == VICTIM:
        broadcast, calls = _TrainingEpochLoop._broadcast_sigterm_tensor, []

        def stopping(loop: _TrainingEpochLoop) -> None:
            calls.append(1)
            if len(calls) == 3:
                os.kill(os.getpid(), signal.SIGSTOP)
            broadcast(loop)

        _TrainingEpochLoop._broadcast_sigterm_tensor = stopping
    finished = [time.monotonic()]

    class LastBatch(L.Callback):
        def on_train_batch_end(self, *args: object) -> None:
            finished[0] = time.monotonic()

    trainer = L.Trainer(strategy="hsync", accelerator="cpu", devices=world_size, max_epochs=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        default_root_dir=output_dir, num_sanity_val_steps=0, callbacks=[LastBatch()])
    try:
        trainer.fit(module_class()())
    except RuntimeError as error:
        raise RuntimeError(f"noticed after {time.monotonic() - finished[0]:.2f} s: {error}") from None
    raise AssertionError(f"rank {rank} went on although rank {VICTIM} was stopped")


def torch_ddp_in_the_benchmark(rank: int, world_size: int, output_dir: str) -> None:
    """torch DDP's step, which the benchmark times beside hsync's on the same group: the benchmark puts that group
    under hsync's deadline as it starts (hsync.bench.run.run_jobs_in_a_group), as here."""
    from torch.nn.parallel import DistributedDataParallel

    from hsync.collectives import put_torch_groups_under_the_deadline
    from tests.integrations.test_accelerate import net

    put_torch_groups_under_the_deadline([torch.distributed.group.WORLD])
    model = DistributedDataParallel(net())
    x = torch.randn(4, 6)
    model(x).square().mean().backward()  # every rank there: the connections are made
    frozen_inside(rank, lambda: model(x).square().mean().backward())


FRAMEWORKS = {"accelerate": ("accelerate", accelerate_gather), "transformers": ("transformers", trainer_evaluation),
              "lightning": ("lightning", lightning_sigterm_broadcast),
              "torch-ddp": ("torch", torch_ddp_in_the_benchmark)}


@pytest.mark.parametrize("framework", list(FRAMEWORKS))
def test_a_frozen_peer_ends_the_frameworks_own_collectives_within_the_deadline(framework, tmp_path):
    module, program = FRAMEWORKS[framework]
    pytest.importorskip(module)
    survivor = run_ranks_with_victim(program, 2, VICTIM, str(tmp_path), env=ENV, timeout=90)[0]
    assert survivor.error is not None, f"the survivor raised nothing: {survivor}"
    noticed = seconds_to_notice(survivor.error)
    assert DEADLINE_S - 0.5 < noticed < DEADLINE_S + GRACE_S + 2.0, survivor.error
    if framework == "lightning":  # Lightning swallows its broadcast's error; hsync's next collective names it
        assert "hsync: rank 0 (gloo): " in survivor.error, survivor.error
        assert re.search("timed out: a peer is stopped or hung|did not complete within", survivor.error), \
            survivor.error
        assert re.search(f"rank {VICTIM} (\\(process [0-9]+, on this host\\) is stopped|has not reached it)",
                         survivor.error), survivor.error
    else:  # gloo's, raised in the framework's own call
        assert f"Timed out waiting {int((DEADLINE_S + GRACE_S) * 1000)}ms" in survivor.error, survivor.error
