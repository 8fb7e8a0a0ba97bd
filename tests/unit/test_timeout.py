"""The collective deadline: from WeightedDDP(timeout=...), else HSYNC_TIMEOUT, else the default."""

import datetime

import pytest

from hsync import collectives


def test_the_argument_wins_then_the_environment_then_the_default(monkeypatch):
    monkeypatch.setenv("HSYNC_TIMEOUT", "12.5")
    assert collectives.resolve_timeout(datetime.timedelta(seconds=3)) == 3.0
    assert collectives.resolve_timeout(None) == 12.5
    monkeypatch.delenv("HSYNC_TIMEOUT")
    assert collectives.resolve_timeout(None) == collectives.DEFAULT_TIMEOUT.total_seconds()


@pytest.mark.parametrize(("timeout", "env", "message"), [
    (datetime.timedelta(0), None, "must be positive and finite, got 0.0 s"),
    (datetime.timedelta(seconds=-1), None, "must be positive and finite, got -1.0 s"),
    (None, "soon", "HSYNC_TIMEOUT must be a number of seconds, got 'soon'"),
    (None, "inf", "must be positive and finite, got inf s"),
    (datetime.timedelta.max, None, "must be at most 365 days"),
])
def test_bad_deadlines_are_refused_with_the_value(monkeypatch, timeout, env, message):
    if env is not None:
        monkeypatch.setenv("HSYNC_TIMEOUT", env)
    with pytest.raises(ValueError, match=message):
        collectives.resolve_timeout(timeout)


def test_a_number_is_not_taken_for_a_duration():
    with pytest.raises(TypeError, match="timeout must be a datetime.timedelta, got int 60"):
        collectives.resolve_timeout(60)
