"""examples/minimal.py as its docstring runs it: under torchrun, and as one process under plain python."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

MINIMAL = Path(__file__).parents[2] / "examples" / "minimal.py"


@pytest.mark.parametrize(("launcher", "examples"), [
    ((), 4),
    (("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"), 4 + 8),
], ids=["python", "torchrun"])
def test_minimal_trains_on_every_launch(tmp_path, launcher, examples):
    result = subprocess.run([sys.executable, *launcher, str(MINIMAL), "--steps", "12", "--device", "cpu"],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    steps = re.findall(r"step +(\d+) +global loss ([0-9.]+) +examples (\d+)", result.stdout)
    assert [int(s) for s, _, _ in steps] == [0, 10, 11]
    assert all(int(n) == examples for *_, n in steps), "every rank's examples count, once"
    assert float(steps[-1][1]) < float(steps[0][1]), "the loss falls"


@pytest.mark.parametrize(("args", "message"), [
    (("--steps", "0"), "argument --steps: must be at least 1, got 0"),
    (("--device", "tpu"), "argument --device: must be one of auto, cpu, cuda, got 'tpu'"),
], ids=["steps", "device"])
def test_a_bad_flag_is_one_line(tmp_path, args, message):
    result = subprocess.run([sys.executable, str(MINIMAL), *args], capture_output=True, text=True, timeout=60,
                            cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and message in result.stderr, result.stderr
