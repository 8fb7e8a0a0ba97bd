"""The trainer's configuration: the command line, validation, the learning-rate schedule."""

import pytest

from hsync.trainer.config import TrainConfig, parse_args
from hsync.trainer.train import lr_factor


def test_every_field_is_a_flag_with_its_docstring_as_help(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    help_text = capsys.readouterr().out
    for flag in ("--rank-batch-sizes", "--simulate-slowdown", "--update-freq", "--save-every", "--resume"):
        assert flag in help_text
    assert "RANK=FACTOR" in help_text
    cfg = parse_args(["--preset", "tiny", "--update-freq", "2", "--resume", "--save-dir", "x"])
    assert (cfg.update_freq, cfg.resume, cfg.save_dir) == (2, True, "x")


@pytest.mark.parametrize(("args", "message"), [
    ({"preset": "huge"}, "--preset must be one of"),
    ({"balance": "fast"}, "--balance must be equal, auto or manual"),
    ({"balance": "manual"}, "--balance manual needs --rank-batch-sizes"),
    ({"log_every": 0}, "--log-every must be at least 1"),
    ({"warmup_steps": -1}, "cannot be negative"),
    ({"resume": True}, "--resume needs --save-dir"),
])
def test_bad_settings_are_named(args, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**args).resolved()


def test_learning_rate_warms_up_to_the_peak_then_decays_to_zero():
    factors = [lr_factor(step, 4, 12) for step in range(12)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert factors[4] == 1.0 and factors[-1] == pytest.approx(1 / 8)
    assert all(a >= b for a, b in zip(factors[3:], factors[4:], strict=False))
    assert lr_factor(0, 0, 10) == 1.0
