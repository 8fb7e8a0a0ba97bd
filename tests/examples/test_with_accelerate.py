"""examples/with_accelerate.py: a pretrained MiniLM fine-tuned in an Accelerate loop through hsync, two ranks
started by `accelerate launch`."""

import re

import pytest

from tests.examples import launch

pytestmark = pytest.mark.distributed


def test_the_demo_task_is_learned_and_saved(tmp_path):
    result = launch("with_accelerate.py", tmp_path, "--epochs", "1", "--device", "cpu", "--save-dir",
                      str(tmp_path / "tuned"), launcher="accelerate")
    # Printed by the main process only; gather_for_metrics counts each of the 80 held-out texts once.
    found = re.findall(r"epoch 1: train loss [0-9.]+, held-out accuracy ([0-9.]+) on 80 examples, last split "
                       r"\[(\d+), (\d+)\]", result.stdout)
    assert len(found) == 1, result.stdout[-3000:]
    accuracy, a, b = found[0]
    assert float(accuracy) >= 0.7 and int(a) + int(b) == 16, result.stdout[-3000:]
    from transformers import AutoModelForSequenceClassification

    assert AutoModelForSequenceClassification.from_pretrained(tmp_path / "tuned").config.num_labels == 2
