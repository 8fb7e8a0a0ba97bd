"""Checkpoints written atomically (a temporary file, then a rename) and checked before resuming."""

from __future__ import annotations

import fcntl
import os
import pickle
import random
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from apps.bert.consensus import fail_together
from hsync.collectives import Channels

PREFIX, SUFFIX = "step-", ".pt"
KEEP = 2  # the newest complete checkpoints kept on disk


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def latest(save_dir: Path) -> Path | None:
    """The newest complete checkpoint: half-written ones only ever exist under a temporary name."""
    found = sorted(save_dir.glob(f"{PREFIX}*{SUFFIX}"))
    return found[-1] if found else None


def should_resume(save_dir: str, asked: bool) -> bool:
    """Collective: whether to load the latest checkpoint. Asked for (--resume), or a worker restarted by
    torchrun with a checkpoint to go back to; rank 0's view of the directory decides for every rank."""
    found = latest(Path(save_dir)) if _restart_count() and save_dir and not asked else None
    return Channels.of_group().broadcast_object(asked or found is not None, 0, "the decision to resume")


def earlier_run(save_dir: str, resume: bool) -> str | None:
    """Why a fresh run may not start in `save_dir`: an earlier run's checkpoints there would be pruned
    in favour of this run's, or resumed instead of them (rank 0 looks, before any work)."""
    found = latest(Path(save_dir)) if save_dir and not resume and not _restart_count() else None
    if found is None:
        return None
    return f"{save_dir} holds an earlier run's checkpoints (up to {found.name}); pass --resume to go on, or " \
           "choose another --save-dir"


LOCK = "run.lock"
_held: list[Any] = []  # the --save-dir locks this process holds, until it ends


def claim(save_dir: str) -> str | None:
    """Why this run may not write to `save_dir`: another run writing there now, whose rank 0 holds the folder's
    lock (rank 0 takes it, before any work). The kernel's record lock (lockf) is released when its process ends,
    killed too, and a process forked from it (a DataLoader worker) does not hold it: a run that crashed leaves
    none behind, and its --resume takes the folder at once."""
    if not save_dir:
        return None
    folder = Path(save_dir)
    folder.mkdir(parents=True, exist_ok=True)
    handle = open(folder / LOCK, "a")  # noqa: SIM115 - held open for as long as the run goes on
    try:
        fcntl.lockf(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        return (f"another run is writing to {save_dir} now (it holds {folder / LOCK}); wait for it to end, or give "
                "this one another --save-dir")
    _held.append(handle)
    return None


def checksum(value: Any, crc: int = 0) -> int:
    """A CRC-32 of everything `value` (a checkpoint's tensors and plain values) holds, in a fixed order: bytes
    flipped on a disk or in a copy change it, where torch.load would read them as other numbers."""
    if isinstance(value, torch.Tensor):
        flat = value.detach().cpu().contiguous().reshape(-1)
        crc = zlib.crc32(f"{flat.dtype}{tuple(value.shape)}".encode(), crc)
        return zlib.crc32(flat.view(torch.uint8).numpy(), crc)
    if isinstance(value, dict):
        for key in sorted(value, key=repr):
            crc = checksum(value[key], zlib.crc32(repr(key).encode(), crc))
        return crc
    if isinstance(value, list | tuple):  # alike: a tuple may load as a list
        crc = zlib.crc32(str(len(value)).encode(), crc)
        for item in value:
            crc = checksum(item, crc)
        return crc
    return zlib.crc32(repr(value).encode(), crc)


def _pickled_objects(path: Path) -> list[str]:
    """What in the file torch's weights-only loading refuses (empty if the file cannot even be read)."""
    try:
        return torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # noqa: BLE001 - a damaged file: its own error says more
        return []


def _restart_count() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def save(save_dir: Path, step: int, state: dict[str, Any]) -> Path | None:
    """Writes `state` plus every rank's RNG state; collective (every rank calls it), rank 0 writes. `state`
    holds tensors and plain values (numbers, strings, lists, tuples, dicts): load() refuses anything else."""
    rngs = Channels.of_group().gather_objects(rng_state(), "the ranks' RNG states for a checkpoint")
    path = save_dir / f"{PREFIX}{step:08d}{SUFFIX}"
    problem = None
    if dist.get_rank() == 0:
        try:
            save_dir.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            payload = {**state, "step": step, "rng": rngs}
            with open(tmp, "wb") as f:
                torch.save({**payload, "checksum": checksum(payload)}, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)  # atomic: a reader sees the old set of files or the new one
            stale = sorted(save_dir.glob(f"{PREFIX}*{SUFFIX}"))[:-KEEP] + list(save_dir.glob(f"{PREFIX}*{SUFFIX}.tmp"))
            for old in stale:  # and what a save killed midway left
                old.unlink()
        except OSError as error:
            problem = f"{type(error).__name__}: {error}"
    fail_together(problem, f"cannot write checkpoint {path}")
    return path


def another_run(path: Path, meta: dict[str, Any], expected: dict[str, Any]) -> str | None:
    """Why the checkpoint at `path`, written with `meta`, is of another run than `expected` (None: it is not)."""
    for key, value in expected.items():
        if meta.get(key, value) != value:  # (a key added since the checkpoint was written: not checked)
            return (f"{path} was written with {key}={meta.get(key)!r}, this run has {key}={value!r}; start a new "
                    "--save-dir or match the run")
    return None


def refuse_another_run(save_dir: Path, settings: dict[str, Any]) -> None:
    """Collective, before any work: a resume with no checkpoint, or from another run's as far as the flags alone
    tell (`settings`), stops every rank before the data is prepared (a vocabulary trained, say). Rank 0 reads only
    the file's settings (memory-mapped); load() checks the rest, and says what is wrong with a damaged file."""
    problem = None
    if dist.get_rank() == 0:
        path = latest(save_dir)
        if path is None:
            problem = f"no checkpoint in {save_dir}"
        else:
            try:
                meta = torch.load(path, map_location="cpu", weights_only=True, mmap=True).get("meta", {})
            except Exception:  # noqa: BLE001 - load() reads it again and names the problem
                meta = {}
            problem = another_run(path, meta, settings) if isinstance(meta, dict) else None
    fail_together(problem, "cannot --resume")


def load(save_dir: Path, expected: dict[str, Any], may_change: dict[str, Any], stop_at: int = 0,
         max_steps: int | None = None, holds: tuple[str, ...] = ()) -> dict[str, Any]:
    """The latest checkpoint; collective: every rank stops with the same error if any rank cannot
    read it, it was written for another run (`expected`: model, data, vocabulary, batch), or it is at
    or past `stop_at` (0: none) or past `max_steps`. It may have been written by another number of
    ranks: the run goes on with the same global batches. Settings in `may_change` (a longer run, say)
    are taken as given, and rank 0 says which changed. `holds`: the parts of the state the program reads."""
    path, state, problem = latest(save_dir), None, None
    try:
        if path is None:
            raise FileNotFoundError(f"no checkpoint in {save_dir}")
        # Tensors and plain values only: a pickled object could run code on every rank as it loads.
        state = torch.load(path, map_location="cpu", weights_only=True)
        if not (isinstance(state, dict) and {"meta", "step", "rng"} <= state.keys()):
            raise ValueError(f"{path} is not a checkpoint of this program (it has no step, settings or RNG states)")
        written = state.pop("checksum", None)  # (none in a checkpoint written before it was added: not checked)
        if written is not None and checksum(state) != written:
            raise ValueError(f"{path} is damaged: what it holds does not match the checksum written with it")
        if missing := [key for key in holds if key not in state]:
            raise ValueError(f"{path} is not a checkpoint of this program (it holds no {', '.join(missing)})")
        if mismatch := another_run(path, state["meta"], expected):
            raise ValueError(mismatch)
        if stop_at and state["step"] >= stop_at:
            raise ValueError(f"the checkpoint is at step {state['step']}, not before --stop-at {stop_at}")
        if max_steps is not None and state["step"] > max_steps:
            raise ValueError(f"the checkpoint is at step {state['step']}, after --max-steps {max_steps}")
    except Exception as error:  # a damaged file can fail in any way (EOFError, UnpicklingError, ...)
        problem = (str(error) if isinstance(error, (OSError, ValueError))
                   else f"{path} is damaged or not a checkpoint: {type(error).__name__}: {error}")
        if isinstance(error, pickle.UnpicklingError) and (objects := _pickled_objects(path)):
            problem = (f"{path} holds pickled objects ({', '.join(objects)}), which could run code as they load; "
                       "hsync resumes from checkpoints of tensors and plain values only, as it writes them")
    fail_together(problem, "cannot --resume")
    rank, world, written_by = dist.get_rank(), dist.get_world_size(), len(state["rng"])
    if written_by == world:
        set_rng_state(state["rng"][rank])
    else:  # each rank's random stream (dropout) starts anew, from the run's seed, the step and the rank
        random.seed(f"{state['meta'].get('seed')}/{state['step']}/{rank}")
        torch.manual_seed(random.getrandbits(63))
    if rank == 0:
        restart = f"restart {_restart_count()}: " if _restart_count() else ""
        ranks = f", written by {written_by} ranks, now {world}" if written_by != world else ""
        print(f"hsync: {restart}resuming from step {state['step']} ({path}{ranks})", flush=True)
        changed = [f"--{key.replace('_', '-')} {state['meta'][key]!r} -> {value!r}" for key, value in may_change.items()
                   if state["meta"].get(key, value) != value]
        if changed:
            print(f"hsync: changed since the checkpoint, and taken as given: {', '.join(changed)}", flush=True)
    return state
