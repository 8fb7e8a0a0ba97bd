"""examples/trainer.py: a pretrained MiniLM fine-tuned by transformers.Trainer through hsync on two ranks."""

import re
import subprocess
import sys

import pytest

from tests.examples import EXAMPLES, output_on_ranks

pytestmark = pytest.mark.distributed

TRAINER = EXAMPLES / "trainer.py"


def test_the_demo_task_is_learned_and_saved(tmp_path):
    printed = output_on_ranks("trainer.py", tmp_path, "--epochs", "1", "--device", "cpu", "--output-dir",
                              str(tmp_path / "run"))
    # Printed once, by rank 0: accuracy over both ranks' shards of the 80 held-out texts.
    found = re.findall(r"held-out accuracy ([0-9.]+) on 80 examples; last split \[(\d+), (\d+)\]", printed)
    assert len(found) == 1, printed[-3000:]
    accuracy, a, b = found[0]
    assert float(accuracy) >= 0.7 and int(a) + int(b) == 16, printed[-3000:]
    from transformers import AutoModelForSequenceClassification

    tuned = AutoModelForSequenceClassification.from_pretrained(tmp_path / "run" / "final")
    assert tuned.config.num_labels == 2


def test_a_bad_flag_is_one_line_before_any_work(tmp_path):
    result = subprocess.run([sys.executable, str(TRAINER), "--accumulation", "0"], capture_output=True, text=True,
                            timeout=120, cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "argument --accumulation: must be at least 1, got 0" in result.stderr
