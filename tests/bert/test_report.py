"""The BERT program's last line, when no evaluation ran."""

import dataclasses

import pytest

from apps.bert.config import TrainConfig
from apps.bert.report import Logger


@pytest.mark.parametrize(("valid_fraction", "why"), [
    (0.02, "no validation (no step ran: the run had reached --max-steps)"),
    (0.0, "no validation (--valid-fraction 0)")])
def test_the_summary_says_why_no_validation_ran(valid_fraction, why):
    # A resume of a run already at --max-steps trains no step: it was blamed on --valid-fraction 0.
    cfg = dataclasses.replace(TrainConfig(), valid_fraction=valid_fraction, log_file="")
    log = Logger(cfg, rank=1, world=2)  # not rank 0: no progress bar, no file
    assert log.summary(None) == f"the model was not kept (pass --save-dir to keep it); {why}"
