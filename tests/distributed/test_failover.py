"""A lost replica costs the step it died in, not the job (hsync.fault_tolerance, on torchft): three replica groups
under a real torchft Lighthouse, each a process of its own (tests/distributed/failover_replica.py); two are
killed (SIGKILL) at different points of a step, one of them restarted. The survivors redo the step on the same
examples, every example is used once per epoch, and the parameters at the end are those of one process that
made the same steps uninterrupted."""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("torchft", reason="hsync[torchft] is not installed")

from hsync.fault_tolerance import lighthouse_command
from tests.distributed import failover_replica as job
from tests.spawn import free_port

pytestmark = pytest.mark.distributed

REPLICAS = ("g0", "g1", "g2")
LIMIT_S = 150


def run_job(out: Path, kills: dict[str, str], restart: tuple[str, ...], buckets: str, device: str = "cpu",
            env: dict[str, str] | None = None) -> dict[str, list[int]]:
    """Runs a Lighthouse and the replicas; a killed replica named in `restart` is started again (without a kill).
    `env`: variables for the replicas, {rank} in a value standing for the replica's name (as in tests.spawn's for
    a rank). Returns each replica's exit codes, in the order its processes ended."""
    port = free_port()
    # With a restart, a step needs two replicas: the last survivor waits for the restarted one, which so takes part
    # whatever its start-up takes here (else a short job could end before it is back, and it would start anew).
    min_replicas = 2 if restart else 1
    lighthouse = subprocess.Popen(lighthouse_command(port, min_replicas), stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)

    def start(replica: str, kill: str | None, wait_for: int = 0) -> subprocess.Popen:
        command = [sys.executable, job.__file__, "--lighthouse", f"http://localhost:{port}", "--replica-id", replica,
                   "--out", str(out), "--buckets", buckets, "--wait-for", str(wait_for), "--device", device] + (
                      ["--kill", kill] if kill else [])
        replica_env = {**os.environ, **{key: value.format(rank=replica) for key, value in (env or {}).items()}}
        return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=(out / f"{replica}.err").open("a"),
                                env=replica_env)

    running = {replica: start(replica, kills.get(replica), wait_for=len(REPLICAS)) for replica in REPLICAS}
    codes: dict[str, list[int]] = collections.defaultdict(list)
    deadline = time.monotonic() + LIMIT_S
    try:
        while running:
            if time.monotonic() > deadline:
                raise AssertionError(f"replicas {sorted(running)} still running after {LIMIT_S} s")
            for replica, process in list(running.items()):
                if process.poll() is None:
                    continue
                codes[replica].append(process.returncode)
                del running[replica]
                if process.returncode == -signal.SIGKILL and replica in restart and len(codes[replica]) == 1:
                    running[replica] = start(replica, None)
            time.sleep(0.05)
    finally:
        for process in [*running.values(), lighthouse]:
            process.kill()
            process.wait()
    return dict(codes)


def committed_steps(out: Path) -> dict[int, list[dict]]:
    """Per committed step, what each replica that took part logged."""
    steps: dict[int, list[dict]] = collections.defaultdict(list)
    for log in out.glob("*.jsonl"):
        for line in log.read_text().splitlines():
            steps[json.loads(line)["step"]].append(json.loads(line))
    return steps


def uninterrupted(steps: dict[int, list[dict]]) -> dict[str, torch.Tensor]:
    """One process making the same updates: each step's mean loss over all of the step's examples."""
    x, y = job.data()
    model = job.make_model()
    optimizer = job.make_optimizer(model)
    schedule = job.make_schedule(optimizer)
    for step in sorted(steps):
        examples = [i for record in steps[step] for i in record["examples"]]
        # Each replica stepped with the schedule's rate: one that joined took its count from a live peer.
        assert {record["lr"] for record in steps[step]} == {optimizer.param_groups[0]["lr"]}, (step, steps[step])
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x[examples]), y[examples]).backward()
        optimizer.step()
        schedule.step()
    return model.state_dict()


@pytest.mark.parametrize("kills, restart, buckets", [
    ({"g1": "7:forward", "g2": "15:reduction"}, (), "many"),
    ({"g1": "7:backward", "g2": "15:optimizer"}, ("g1",), "one"),
], ids=["forward-then-reduction", "backward-restarted-then-optimizer"])
def test_survivors_redo_the_lost_step_and_end_as_an_uninterrupted_run(tmp_path, kills, restart, buckets):
    check_failover(tmp_path, kills, restart, buckets)


def check_failover(tmp_path: Path, kills: dict[str, str], restart: tuple[str, ...], buckets: str, device: str = "cpu",
                   env: dict[str, str] | None = None, tolerance: float = 1e-6) -> None:
    """Runs the job and checks it: the exit codes, every example once per epoch, each step's quorum, and the
    survivors' parameters against one process making the same steps (to `tolerance`, absolute)."""
    codes = run_job(tmp_path, kills, restart, buckets, device, env)

    expected = {replica: ([-signal.SIGKILL] + ([0] if replica in restart else [])) if replica in kills else [0]
                for replica in REPLICAS}
    errors = {replica: (tmp_path / f"{replica}.err").read_text()[-2000:] for replica in REPLICAS}
    assert codes == expected, errors
    steps = committed_steps(tmp_path)
    steps_per_epoch = job.EXAMPLES // job.GLOBAL_BATCH
    assert sorted(steps) == list(range(job.EPOCHS * steps_per_epoch))
    for epoch in range(job.EPOCHS):
        used = [i for s in range(epoch * steps_per_epoch, (epoch + 1) * steps_per_epoch)
                for record in steps[s] for i in record["examples"]]
        assert sorted(used) == list(range(job.EXAMPLES)), f"epoch {epoch}: an example lost or repeated"
    # Each step's replicas were its quorum: the lost ones were there before they died, not after.
    for step, records in steps.items():
        assert {r["replicas"] for r in records} == {len(records)}, (step, records)
    assert max(len(steps[s]) for s in range(7)) == 3
    assert len(steps[job.EPOCHS * steps_per_epoch - 1]) == 1 + len(restart)

    reference = uninterrupted(steps)
    survivors = [replica for replica in REPLICAS if codes[replica][-1] == 0]
    for replica in survivors:
        trained = torch.load(tmp_path / f"{replica}.pt")
        for name, value in reference.items():
            torch.testing.assert_close(trained[name], value, rtol=1e-5, atol=tolerance, msg=f"{replica}: {name}")


def test_a_job_resumed_from_its_checkpoint_goes_on_exactly_and_refuses_a_joiner_given_other_settings_alone(tmp_path):
    # The job stops whole after step 10 (each replica writes FaultTolerantSteps.state_dict()); g0 resumes from its
    # checkpoint, g1 starts without one and takes it from g0; g2 joins with another global batch. A Balancer refused
    # it on every replica, which all ended: the job was lost.
    port = free_port()
    lighthouse = subprocess.Popen(lighthouse_command(port, 2), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def start(replica: str, *flags: str) -> subprocess.Popen:
        command = [sys.executable, job.__file__, "--lighthouse", f"http://localhost:{port}", "--replica-id", replica,
                   "--out", str(tmp_path), *flags]
        return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=(tmp_path / f"{replica}.err").open("a"))

    def wait(processes: list[subprocess.Popen], until: float) -> list[int]:
        for process in processes:
            process.wait(timeout=max(1.0, until - time.monotonic()))
        return [process.returncode for process in processes]

    deadline = time.monotonic() + LIMIT_S
    try:
        assert wait([start("g0", "--stop-at", "10"), start("g1", "--stop-at", "10")], deadline) == [0, 0]
        assert sorted(committed_steps(tmp_path)) == list(range(10))
        # g0 and g1 wait for g2 to be up (each replica's .up file) after step 11, so that it joins the running job.
        going_on = [start(replica, *flags, "--wait-for", "3", "--wait-at", "12") for replica, *flags in (
            ("g0", "--resume"), ("g1",))]
        while max(committed_steps(tmp_path)) < 11 and time.monotonic() < deadline:
            time.sleep(0.05)
        joiner = start("g2", "--global-batch", "24")
        codes = wait([joiner, *going_on], deadline)
    finally:
        lighthouse.kill()
        lighthouse.wait()
    errors = {replica: (tmp_path / f"{replica}.err").read_text() for replica in ("g0", "g1", "g2")}
    assert codes == [1, 0, 0], {replica: text[-2000:] for replica, text in errors.items()}
    assert ("replica g2 cannot join the job: its Balancer was given other data or settings than the replicas running "
            "it: global_batch_size 12 on rank 0, 24 on rank") in errors["g2"], errors["g2"][-2000:]
    steps = committed_steps(tmp_path)
    per_epoch = job.EXAMPLES // job.GLOBAL_BATCH
    assert sorted(steps) == list(range(job.EPOCHS * per_epoch)), "a step repeated or lost across the resume"
    for epoch in range(job.EPOCHS):
        used = sorted(i for s in range(epoch * per_epoch, (epoch + 1) * per_epoch) for r in steps[s]
                      for i in r["examples"])
        assert used == list(range(job.EXAMPLES)), f"epoch {epoch}: an example lost or repeated"
    assert all(len(steps[s]) == 2 for s in steps), "a step the joiner committed"
    reference = uninterrupted(steps)
    for replica in ("g0", "g1"):
        trained = torch.load(tmp_path / f"{replica}.pt")
        for name, value in reference.items():
            torch.testing.assert_close(trained[name], value, rtol=1e-5, atol=1e-6, msg=f"{replica}: {name}")
