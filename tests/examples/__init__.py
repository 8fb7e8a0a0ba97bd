"""The example programs: launched as their users launch them, or their main run on spawned ranks."""

import contextlib
import importlib.util
import io
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from tests.spawn import run_ranks, served_store

EXAMPLES = Path(__file__).parents[2] / "examples"
LAUNCHERS = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"],
    # Accelerate starts CPU ranks through torchrun only when told "multi_gpu"; each rank then runs on the CPU.
    "accelerate": [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes=2",
                   "--num_machines=1", "--mixed_precision=no", "--dynamo_backend=no"],
}


def launch(script: str, cwd: Path, *args: str, launcher: str = "torchrun") -> subprocess.CompletedProcess:
    """examples/`script` on two CPU ranks under torchrun (or `accelerate launch`); fails the test with the output's
    end if it fails."""
    cmd = [*LAUNCHERS[launcher], str(EXAMPLES / script), *args]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=cwd,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return result


def load(script: Path) -> ModuleType:
    """An example program as a module (its main() not run), for a test of one of its functions."""
    spec = importlib.util.spec_from_file_location(f"examples.{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main_on_ranks(script: str, cwd: Path, argv: list[str], nproc: int = 2,
                  entry: Callable[..., tuple] | None = None) -> list[tuple]:
    """examples/`script`'s main(argv) on `nproc` ranks in torchrun's environment, forked from tests.spawn's server
    (which has imported torch and the frameworks the session uses: seconds less per process than a launch), for
    the tests of what a program does rather than of its launcher. Each rank's output (stdout and stderr), and
    the line it exited with if it refused the run. `entry`: run_main, or a function of the test's that calls it
    and adds to its result what the rank holds when main has returned."""
    store = served_store()  # the program's own, torchrun's agent's: its ranks start a process group of their own
    return run_ranks(entry or run_main, nproc, str(EXAMPLES / script), argv, store.port, cwd, timeout=180)


def output_on_ranks(script: str, cwd: Path, *args: str) -> str:
    """As main_on_ranks, on two ranks, for a run that no rank refuses: every rank's output, in rank order."""
    ranks = main_on_ranks(script, cwd, list(args))
    assert not any(refusal for _, refusal in ranks), ranks
    return "".join(output for output, _ in ranks)


def run_main(rank: int, world_size: int, script: str, argv: list[str], port: int, cwd: Path) -> tuple[str, str | None]:
    import torch.distributed as dist

    dist.destroy_process_group()  # main starts its own, from the launcher's environment
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), GROUP_RANK="0",
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TORCHELASTIC_USE_AGENT_STORE="True")
    os.chdir(cwd)
    with contextlib.redirect_stdout(io.StringIO()) as printed, contextlib.redirect_stderr(printed):
        try:
            load(Path(script)).main(argv)
        except SystemExit as refused:
            if isinstance(refused.code, str):
                return printed.getvalue(), refused.code
            raise RuntimeError(f"rank {rank} exited with {refused.code}: {printed.getvalue()[-3000:]}") from None
        except BaseException as error:  # noqa: BLE001 - with what it printed
            raise RuntimeError(f"rank {rank}: {printed.getvalue()[-3000:]}") from error
    return printed.getvalue(), None
