"""A checkpoint write killed midway never leaves a file that --resume would load, and the next
save clears what it left."""

import os
import signal
from pathlib import Path

import pytest
import torch

from hsync.collectives import Channels
from tests.spawn import run_ranks, run_ranks_with_victim

pytestmark = pytest.mark.distributed


class KilledWhileSaved:
    """Kills its process when torch.save reaches it: after the file was opened, before it was complete."""

    def __reduce__(self):
        os.kill(os.getpid(), signal.SIGKILL)


def save_then_die_saving(rank: int, world_size: int, save_dir: str) -> None:
    from apps.bert import checkpoint

    checkpoint.save(Path(save_dir), 1, {"model": {"w": torch.arange(1000.0)}})
    checkpoint.save(Path(save_dir), 2, {"model": {"w": torch.arange(1000.0) + 1}, "half": KilledWhileSaved()})


def save_once_more(rank: int, world_size: int, save_dir: str) -> list[str]:
    from apps.bert import checkpoint

    checkpoint.save(Path(save_dir), 3, {"model": {"w": torch.zeros(1)}})
    return sorted(p.name for p in Path(save_dir).iterdir())


def test_a_save_killed_midway_leaves_the_previous_checkpoint_as_the_latest(tmp_path):
    from apps.bert import checkpoint

    survivors = run_ranks_with_victim(save_then_die_saving, 2, 0, str(tmp_path), timeout=60)
    assert survivors[1].error is not None, "rank 1 did not notice that rank 0 died while saving"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001.pt", "step-00000002.pt.tmp"]
    latest = checkpoint.latest(tmp_path)
    assert latest is not None and latest.name == "step-00000001.pt"
    assert torch.equal(torch.load(latest, weights_only=True)["model"]["w"], torch.arange(1000.0))

    files = run_ranks(save_once_more, 1, str(tmp_path), timeout=60)[0]
    assert files == ["step-00000001.pt", "step-00000003.pt"]


class RunsCode:
    """Creates a file when unpickled: what a checkpoint from elsewhere could do on every rank."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


def resume_from(rank: int, world_size: int, save_dir: str) -> str:
    from apps.bert import checkpoint

    with pytest.raises(SystemExit) as stopped:
        checkpoint.load(Path(save_dir), {}, {})
    return str(stopped.value)


def test_a_checkpoint_holding_pickled_objects_is_refused_unloaded(tmp_path):
    marker = tmp_path / "code-ran"
    torch.save({"model": {"w": torch.zeros(1)}, "meta": {}, "step": 1, "rng": [], "x": RunsCode(marker)},
               tmp_path / "step-00000001.pt")
    for message in run_ranks(resume_from, 2, str(tmp_path), timeout=60):
        assert "holds pickled objects (" in message and "pathlib" in message, message
    assert not marker.exists(), "the checkpoint's code ran"


def refusals(rank: int, world_size: int, save_dir: str) -> dict[str, str]:
    from apps.bert import checkpoint

    meta = {"preset": {"name": "tiny"}, "lr": 0.002}
    checkpoint.save(Path(save_dir), 3, {"model": {"w": torch.zeros(1)}, "meta": meta})
    refused = {}
    for case, expected, steps in (("another model", {**meta, "preset": {"name": "base"}}, {}),
                                  ("another lr", {**meta, "lr": 1e-4}, {}),
                                  ("at the stop", meta, {"stop_at": 3}),
                                  ("past the end", meta, {"max_steps": 2})):
        with pytest.raises(SystemExit) as stopped:
            checkpoint.load(Path(save_dir), expected, {}, **steps)
        refused[case] = str(stopped.value)
    checkpoint.load(Path(save_dir), meta, {}, stop_at=4, max_steps=3)  # the same run, going on: taken
    refused["a fresh run"] = checkpoint.earlier_run(save_dir, resume=False)
    assert checkpoint.earlier_run(save_dir, resume=True) is None
    return refused


def test_a_resume_of_another_run_or_past_its_end_is_refused_naming_why(tmp_path):
    # On every rank alike (a collective); examples/bert.py prints the one line, before any work.
    for refused in run_ranks(refusals, 2, str(tmp_path), timeout=60):
        assert "was written with preset={'name': 'tiny'}, this run has preset={'name': 'base'}" in refused[
            "another model"]
        assert "was written with lr=0.002, this run has lr=0.0001" in refused["another lr"]
        assert "the checkpoint is at step 3, not before --stop-at 3" in refused["at the stop"]
        assert "the checkpoint is at step 3, after --max-steps 2" in refused["past the end"]
        # Its pruning would delete the checkpoints, and a later --resume would pick up theirs.
        assert "holds an earlier run's checkpoints (up to step-00000003.pt); pass --resume" in refused["a fresh run"]


def damaged_or_foreign(rank: int, world_size: int, save_dir: str) -> dict[str, str]:
    from apps.bert import checkpoint

    path = Path(save_dir) / "step-00000001.pt"
    refused = {}
    checkpoint.save(Path(save_dir), 1, {"model": {"w": torch.full((1000,), 1234.5)}, "meta": {}})
    if rank == 0:  # a disk's or a copy's flipped bytes, inside a tensor: torch.load reads them as other numbers
        data = bytearray(path.read_bytes())
        at = data.index(torch.tensor([1234.5] * 4).numpy().tobytes())
        data[at:at + 16] = bytes(b ^ 0x5A for b in data[at:at + 16])
        path.write_bytes(bytes(data))
    partial = {"meta": {}, "step": 1, "rng": [], "model": {}}  # another program's, or another version's
    for case, content in (("damaged", None), ("text", b"not a checkpoint\n"), ("foreign", {"a": 1}),
                          ("partial", partial)):
        if rank == 0 and isinstance(content, bytes):
            path.write_bytes(content)
        elif rank == 0 and content is not None:
            torch.save(content, path)
        Channels.of_group().barrier("the file written")
        with pytest.raises(SystemExit) as stopped:
            checkpoint.load(Path(save_dir), {}, {}, holds=("model", "optimizer", "balancer"))
        refused[case] = str(stopped.value)
    return refused


def test_a_damaged_or_foreign_checkpoint_is_refused_saying_so(tmp_path):
    # The damaged one loaded: a resume from it trained to a loss of 3.6e27 and exited 0.
    for refused in run_ranks(damaged_or_foreign, 2, str(tmp_path), timeout=60):
        assert "is damaged: what it holds does not match the checksum written with it" in refused["damaged"]
        assert "step-00000001.pt is damaged or not a checkpoint: " in refused["text"], refused["text"]
        assert "is not a checkpoint of this program (it has no step, settings or RNG states)" in refused["foreign"]
        assert "is not a checkpoint of this program (it holds no optimizer, balancer)" in refused["partial"]


def test_a_second_run_into_a_folder_in_use_is_refused_until_the_first_ends_even_killed(tmp_path):
    # Two runs into one --save-dir deleted each other's files in progress, and mixed their checkpoints.
    import subprocess
    import sys

    from apps.bert import checkpoint

    first = subprocess.Popen([sys.executable, "-c", "import sys, time; from apps.bert import checkpoint; "
                              f"print(checkpoint.claim({str(tmp_path)!r}), flush=True); time.sleep(60)"],
                             stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2] / "examples")
    try:
        assert first.stdout.readline().strip() == "None"  # it holds the folder
        refused = checkpoint.claim(str(tmp_path))
        assert refused == (f"another run is writing to {tmp_path} now (it holds {tmp_path / 'run.lock'}); wait "
                           "for it to end, or give this one another --save-dir"), refused
    finally:
        first.kill()
        first.wait()
    assert checkpoint.claim(str(tmp_path)) is None  # a killed run leaves no lock behind
    checkpoint._held.pop().close()
