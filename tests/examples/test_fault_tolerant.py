"""examples/fault_tolerant.py as the README launches it: scripts/fault_tolerant_local.sh, a Lighthouse and three
replica groups under torchrun, one of which kills itself and is restarted. The survivors going on without it
are tests/distributed/test_failover.py's."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchft", reason="hsync[torchft] is not installed")
pytestmark = pytest.mark.distributed

ROOT = Path(__file__).parents[2]
LAUNCH = ROOT / "scripts" / "fault_tolerant_local.sh"
PROGRAM = ROOT / "examples" / "fault_tolerant.py"


def test_a_group_killed_mid_run_is_restarted_and_every_group_ends_with_the_same_parameters():
    # Every step on all three groups: the others wait for the lost one to be restarted, so it takes part again
    # however long that takes here (with fewer, a short job may end before it is back).
    result = subprocess.run([str(LAUNCH), "--min-replicas", "3", "3", str(PROGRAM), "--device", "cpu",
                             "--examples", "256", "--global-batch-size", "16", "--epochs", "2", "--crash", "group1:10"],
                            capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "[group1] killing myself in step 10" in output
    redone = re.findall(r"\[(group\d)\] hsync: replica group\d: step 10 not committed, running it again", output)
    assert sorted(redone) == ["group0", "group2"], output[-4000:]
    done = dict(re.findall(r"\[(group\d)\] done: 32 steps, parameters ([0-9a-f]+)", output))
    assert sorted(done) == ["group0", "group1", "group2"] and len(set(done.values())) == 1, output[-4000:]


@pytest.mark.parametrize(("command", "message"), [
    ((str(LAUNCH), "0", str(PROGRAM)), "N must be a number of replica groups from 1 to 999, got '0'"),
    # Wrapped around by bash's arithmetic, this one started groups without end.
    ((str(LAUNCH), "99999999999999999999", str(PROGRAM)),
     "N must be a number of replica groups from 1 to 999, got '99999999999999999999'"),
    ((str(LAUNCH), "--min-replicas", "3", "2", str(PROGRAM)),
     "--min-replicas must be a number from 1 to N (2), got '3'"),
    ((str(LAUNCH), "2", "nowhere.py"), "no program 'nowhere.py'"),
    # Checked once before the groups start: under torchrun, each group printed it at each of its restarts.
    ((str(LAUNCH), "3", str(PROGRAM), "--epochs", "0"), "argument --epochs: must be at least 1, got 0"),
    ((str(LAUNCH), "2", str(ROOT / "examples" / "bert.py"), "--fault-tolerant", "--preset", "tiny", "--max-steps", "0"),
     "--max-steps must be at least 1, got 0"),
    ((sys.executable, str(PROGRAM), "--crash", "group1"),
     "argument --crash: expected GROUP:STEP (group1:40), got 'group1'"),
    ((sys.executable, str(PROGRAM), "--crash", "group1:\u00b2"),  # a digit to str.isdigit(), not to int()
     "argument --crash: expected GROUP:STEP (group1:40), got 'group1:\u00b2'"),
    # A step the run never reaches crashed nothing, silently; a huge data set ended in an allocation's traceback.
    ((sys.executable, str(PROGRAM), "--examples", "256", "--global-batch-size", "16", "--epochs", "2", "--crash",
      "group1:32"), "argument --crash: the run's steps are 0 to 31 (2 epochs of 16), got step 32"),
    ((sys.executable, str(PROGRAM), "--examples", "10000000000000"),
     "argument --examples: at most 16777216 (the data is made in memory, 68 bytes an example), got 10000000000000"),
], ids=["groups", "huge-groups", "min-replicas", "program", "program-flag", "bert-flag", "crash",
        "crash-superscript", "crash-past-the-end", "huge-data"])
def test_a_bad_argument_is_one_line(tmp_path, command, message):
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and message in result.stderr, result.stderr
