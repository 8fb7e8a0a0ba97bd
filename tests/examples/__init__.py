"""The example programs, run as their users run them."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

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
