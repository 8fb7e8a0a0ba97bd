"""The trainer's configuration: the command line, validation, the learning-rate schedule."""

import pytest
import torch

from apps.bert.config import TrainConfig, field_docs, parse_args
from apps.bert.train import lr_factor


def test_every_flag_shows_its_default_and_choices(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for flag in ("--rank-batch-sizes", "--simulate-slowdown", "--update-freq", "--save-every", "--resume",
                 "--valid-fraction", "--eval-every"):
        assert flag in help_text
    assert "RANK=FACTOR" in help_text and "{tiny,base}" in help_text and "{auto,equal,manual}" in help_text
    assert "(default: 200)" in help_text and "(default: the preset's)" in help_text and "(default: tiny)" in help_text
    unwrapped = "".join(help_text.split())  # argparse wraps lines at spaces and hyphens
    for doc in field_docs(TrainConfig).values():  # each as written, "4%" included
        assert "".join(doc.split()) in unwrapped, doc
    cfg, preset = parse_args(["--preset", "tiny", "--update-freq", "2", "--resume", "--save-dir", "x"])
    assert (cfg.update_freq, cfg.resume, cfg.save_dir) == (2, True, "x")
    assert cfg.global_batch_size == preset.global_batch_size


def test_the_presets_warm_up_is_cut_to_a_tenth_of_a_short_run():
    assert parse_args(["--max-steps", "50"])[0].warmup_steps == 5
    assert parse_args([])[0].warmup_steps == 20


@pytest.mark.parametrize(("argv", "message"), [
    (["--update-freq", "3"], "--global-batch-size 32 is not a multiple of --update-freq 3"),
    (["--balance", "manual", "--rank-batch-sizes", "eight,24"], "--rank-batch-sizes must be integers"),
    (["--balance", "manual", "--rank-batch-sizes", "8,8"], "--rank-batch-sizes 8,8 does not add up"),
    (["--balance", "manual"], "--balance manual needs --rank-batch-sizes"),
    (["--rank-batch-sizes", "8,24"], "--rank-batch-sizes is only used with --balance manual"),
    (["--global-batch-size", "-4"], "--global-batch-size must be at least 1, got -4"),
    (["--global-batch-size", "0"], "--global-batch-size must be at least 1, got 0"),
    (["--lr", "-1"], "--lr must be a finite number above 0, got -1.0"),
    (["--lr", "nan"], "--lr must be a finite number above 0"),
    (["--device", "cuda"], "--device cuda, but torch sees no GPU here"),
    (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    (["--preset", "huge"], "argument --preset: invalid choice: 'huge'"),
    (["--balance", "fast"], "argument --balance: invalid choice: 'fast'"),
    (["--comm-dtype", "fp8"], "argument --comm-dtype: invalid choice: 'fp8'"),
    (["--save-every", "5"], "--save-every needs --save-dir"),
    (["--stop-at", "5"], "--stop-at needs --save-dir"),
    (["--resume"], "--resume needs --save-dir"),
    (["--warmup-steps", "300"], "--warmup-steps 300 is longer than the run (--max-steps 200)"),
    (["--warmup-steps", "-1"], "--warmup-steps must be a finite number, not negative"),
    (["--weight-decay", "inf"], "--weight-decay must be a finite number, not negative, got inf"),
    (["--collective-timeout", "inf"], "--collective-timeout must be a finite number"),
    (["--collective-timeout", "1e-9"], "--collective-timeout must be 0 (none) or between 1 and 2592000"),
    # A deadline no collective's setup fits in: the run failed at its first one, in a traceback.
    (["--collective-timeout", "0.001"], "--collective-timeout must be 0 (none) or between 1 and 2592000"),
    (["--seed", "100000000000000"], "--seed must be between 0 and 2**32 - 1"),
    (["--log-every", "0"], "--log-every must be at least 1"),
    (["--max-steps", "ten"], "argument --max-steps: invalid int value: 'ten'"),
    (["--valid-fraction", "0.9"], "--valid-fraction must be between 0 and 0.5"),
    (["--simulate-slowdown", "1=0.5"], "--simulate-slowdown factors must be between 1 (a slower rank) and 100"),
    (["--simulate-slowdown", "1=1e300"], "--simulate-slowdown factors must be between 1 (a slower rank) and 100"),
    (["--simulate-slowdown", "1=2,1=3"], "--simulate-slowdown: rank 1 is given twice"),
    (["--simulate-slowdown", "2=3"], "'2=3' is not RANK=VALUE with a rank below 2"),
    (["--simulate-slowdown", "\u00b2=3"], "'\u00b2=3' is not RANK=VALUE with a rank below 2"),  # int() refused '²'
    (["--data-workers", "-1"], "--data-workers must be between 0 and 64, got -1"),
    (["--data-workers", "1000"], "--data-workers must be between 0 and 64, got 1000"),
])
def test_a_bad_flag_is_one_line_naming_it(argv, message, capsys):
    if "cuda" in argv and torch.cuda.is_available():
        pytest.skip("this machine has a GPU: --device cuda is valid here")
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv, world_size=2)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize(("value", "message"), [
    ("abc", "HSYNC_TIMEOUT must be a number of seconds, got 'abc'"),
    ("-1", "the collective timeout must be positive and finite, got -1.0 s"),
    ("0.001", "HSYNC_TIMEOUT must be between 1 and 2592000 seconds, got 0.001")])
def test_a_bad_hsync_timeout_is_one_line_before_any_work(value, message, capsys, monkeypatch):
    # Was a traceback out of the run's first collective.
    monkeypatch.setenv("HSYNC_TIMEOUT", value)
    with pytest.raises(SystemExit) as exit_:
        parse_args([], world_size=2)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_learning_rate_warms_up_to_the_peak_then_decays_to_zero():
    factors = [lr_factor(step, 4, 12) for step in range(12)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert factors[4] == 1.0 and factors[-1] == pytest.approx(1 / 8)
    assert all(a >= b for a, b in zip(factors[3:], factors[4:], strict=False))
    assert lr_factor(0, 0, 10) == 1.0
