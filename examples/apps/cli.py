"""What the example programs share: flag parsing with one-line errors, checks of flag values, and the
launch environment (torchrun's, or a world of one under plain `python`)."""

from __future__ import annotations

import argparse
import errno
import math
import os
import re
import socket
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn, TypeVar

import torch
import torch.distributed as dist

DEVICES = ("auto", "cpu", "cuda")
T = TypeVar("T")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's layout and shows each flag's default (unless its help already says it)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default" in text or action.default in (None, argparse.SUPPRESS) or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (no usage block): under torchrun every rank prints it."""

    def __init__(self, description: str = "", **kwargs) -> None:
        super().__init__(description=description, formatter_class=HelpFormatter, **kwargs)

    def error(self, message: str) -> NoReturn:
        refuse(message, self.prog)

    def parse_checked(self, argv: list[str] | None, check: Callable[[argparse.Namespace], T]) -> T:
        """Parses, then returns `check(args)`: a ValueError it raises becomes the same one-line error."""
        args = self.parse_args(argv)
        try:
            return check(args)
        except ValueError as error:
            self.error(str(error))


def refuse(message: str, prog: str | None = None) -> NoReturn:
    """Ends the program with a flag's or file's error in one line (exit status 2, as argparse's), before any work:
    for one found after parsing (a --model folder that does not load)."""
    say_once(f"{prog or Path(sys.argv[0]).name}: error: {message} (see --help)")
    sys.exit(2)


def say_once(line: str) -> None:
    """`line` on stderr in one write: under torchrun every rank writes its own to the same terminal, and print()
    (or a SystemExit's message) writes a line and its end apart, so that ranks' lines ran together."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def unwritable_folder(path: Path) -> str | None:
    """Why the folder `path` cannot be made or written in (None if it can): checked before any work, since the
    programs write there only at the end; nothing is made here (a run refused later leaves no empty folder)."""
    try:
        there = path.absolute()
        while not there.exists():  # where the folders to make would start
            there = there.parent
        if not there.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(there))
        with tempfile.TemporaryFile(dir=there):
            pass
    except OSError as error:
        return f"{type(error).__name__}: {error}"
    return None


def is_count(text: str) -> bool:
    """Whether `text` is a whole number in ASCII digits (str.isdigit() takes '²', which int() refuses)."""
    return re.fullmatch(r"[0-9]+", text) is not None


def at_least(least: int):
    """An argparse type: an integer >= least, refused with the flag's name otherwise."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
        return value

    parse.__name__ = f"integer >= {least}"
    return parse


def path_flag(text: str) -> Path:
    """An argparse type: a path, not an empty one (which Path takes for the current folder)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a path, got an empty one")
    return Path(text)


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text}")
    return value


def probability(text: str) -> float:
    """An argparse type: a number in [0, 1), as a dropout probability."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= value < 1:  # (NaN too)
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def check_device(choice: str) -> None:
    """Refuses a --device this process cannot use (before any work, on every rank)."""
    if choice not in DEVICES:
        raise ValueError(f"--device must be one of {', '.join(DEVICES)}, got {choice!r}")
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda, but torch sees no GPU here (torch.cuda.is_available() is False)")
    # Every rank of the node refuses (torchrun's LOCAL_WORLD_SIZE): one with a GPU would wait for the others.
    local_ranks = max(int(os.environ.get("LOCAL_WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0)) + 1)
    if choice != "cpu" and torch.cuda.is_available() and local_ranks > torch.cuda.device_count():
        raise ValueError(f"--device {choice}: {local_ranks} processes on this node, {torch.cuda.device_count()} "
                         "GPUs visible; start one process per GPU (or --device cpu)")


def device_flag(text: str) -> str:
    """An argparse type for --device: one of DEVICES, usable here."""
    try:
        check_device(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error).removeprefix("--device ")) from None
    return text


def init_distributed(device_choice: str) -> torch.device:
    """torchrun's environment (RANK, WORLD_SIZE, ...), or a world of one for a plain `python` run."""
    use_cuda = device_choice == "cuda" or (device_choice == "auto" and torch.cuda.is_available())
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    # torchrun's agent keeps one store across restarts, so workers of a new attempt could read the
    # addresses that the dead workers of the last one posted (seen with gloo: connecting to a dead
    # port, or hanging). Each attempt gets keys of its own.
    store, rank, world_size = next(dist.rendezvous("env://"))
    attempt = dist.PrefixStore(f"attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    dist.init_process_group("nccl" if use_cuda else "gloo", store=attempt, rank=rank, world_size=world_size)
    return torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")


def world_size_from_env() -> int:
    """The world size the launcher announces, known before the process group exists."""
    return int(os.environ.get("WORLD_SIZE", 1))


def report(rank: int, message: str) -> None:
    """A line on rank 0's stderr."""
    if rank == 0:
        print(message, file=sys.stderr, flush=True)
