"""examples/with_lightning.py: a pretrained MiniLM fine-tuned by a LightningModule under strategy="hsync", two
ranks."""

import re

import pytest

from tests.examples import output_on_ranks

pytestmark = pytest.mark.distributed
pytest.importorskip("lightning")


def test_the_demo_task_is_learned_and_saved(tmp_path):
    printed = output_on_ranks("with_lightning.py", tmp_path, "--epochs", "1", "--device", "cpu", "--save-dir",
                              str(tmp_path / "tuned"))
    # Printed by rank 0: accuracy over both ranks' shares of the 80 held-out texts (40 each: none repeated).
    found = re.findall(r"held-out accuracy ([0-9.]+) on (\d+) examples; last split \[(\d+), (\d+)\]", printed)
    assert len(found) == 1, printed[-3000:]
    accuracy, examples, a, b = found[0]
    assert float(accuracy) >= 0.7 and int(examples) == 80 and int(a) + int(b) == 16, printed[-3000:]
    from transformers import AutoModelForSequenceClassification

    assert AutoModelForSequenceClassification.from_pretrained(tmp_path / "tuned").config.num_labels == 2
