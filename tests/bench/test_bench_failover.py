"""The `failover` row at its smallest: three replica groups, one killed and restarted, through hsync on torchft,
torchft's own DDP and torchrun's restart from a checkpoint. What it costs is the benchmark's to measure; here,
that every job ran to its end and the row's accounting holds: hsync lost and repeated no example and ended where
an uninterrupted run does, torchft's DDP lost the examples of the groups that were down."""

import json
import subprocess
import sys

import pytest

pytest.importorskip("torchft", reason="hsync[torchft] is not installed")
pytestmark = pytest.mark.distributed


def test_the_failover_row_counts_examples_and_recoveries(tmp_path):
    out = tmp_path / "results.json"
    cmd = [sys.executable, "-m", "hsync.bench", "--device", "cpu", "--quick", "--only", "^failover$", "--json",
           str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    [row] = json.loads(out.read_text())["results"]
    extra = row["extra"]
    assert row["workload"] == "failover" and row["world_size"] == 1
    assert extra["failures"] == 1 and extra["steps"] == 20, extra
    assert extra["examples_lost"] == 0 and extra["examples_repeated"] == 0, extra
    assert extra["max_param_diff_vs_uninterrupted"] < 1e-5, extra
    assert extra["torchft_ddp_examples_lost"] > 0, extra  # its failed steps drop the lost group's part
    for key in ("goodput_vs_torchft_ddp", "goodput_vs_checkpoint_restart", "goodput_vs_no_failure",
                "seconds_to_recover", "torchft_ddp_seconds_to_recover", "checkpoint_restart_seconds_to_recover"):
        assert extra[key] > 0, (key, extra)
    assert row["hsync_step_s"] > 0 and row["ddp_step_s"] > 0 and row["nosync_step_s"] > 0, row
