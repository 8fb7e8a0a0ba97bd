"""What the example programs share (examples/apps/cli.py): a refusal is one line, written in one piece."""

import sys

import pytest

from apps.cli import refuse, say_once


class Writes:
    """A stderr that records each write: under torchrun every rank writes to the same terminal, and a line
    written in two pieces (print's text, then its end) ran into another rank's."""

    def __init__(self) -> None:
        self.pieces: list[str] = []

    def write(self, text: str) -> int:
        self.pieces.append(text)
        return len(text)

    def flush(self) -> None:
        pass


def test_a_refusal_and_a_ranks_last_line_are_each_written_in_one_piece(monkeypatch):
    stderr = Writes()
    monkeypatch.setattr(sys, "stderr", stderr)
    with pytest.raises(SystemExit) as refused:
        refuse("--batch-size must be at least 1, got 0", "bert.py")
    say_once("hsync: cannot --resume (rank 0): no checkpoint in runs/a")
    assert refused.value.code == 2
    assert stderr.pieces == ["bert.py: error: --batch-size must be at least 1, got 0 (see --help)\n",
                             "hsync: cannot --resume (rank 0): no checkpoint in runs/a\n"]
