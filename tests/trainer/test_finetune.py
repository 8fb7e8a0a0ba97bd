"""examples/finetune.py: a pretrained MiniLM fine-tuned across two ranks, batches split by hsync.Balancer."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).parents[2]


def test_demo_task_is_learned_across_two_ranks(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "examples" / "finetune.py"), "--epochs", "2"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    accuracy = float(re.search(r"held-out accuracy: ([0-9.]+)", result.stdout).group(1))
    assert accuracy >= 0.7, result.stdout  # chance is 0.5; unseen adjectives need the pretrained weights
    split = re.findall(r"last split \[(\d+), (\d+)\]", result.stdout)
    assert len(split) == 2 and all(int(a) + int(b) == 16 for a, b in split), result.stdout


def test_a_malformed_labelled_file_is_named(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text("1\tfine\nnot a label line\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           str(ROOT / "examples" / "finetune.py"), "--data", str(bad)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode != 0 and "bad.txt:2: expected 'label<TAB>text'" in result.stderr
