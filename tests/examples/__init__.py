"""The example programs, run as their users run them."""

import os
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).parents[2] / "examples"


def torchrun(script: str, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """examples/`script` on two CPU ranks under torchrun; fails the test with the output's end if it fails."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(EXAMPLES / script),
           *args]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=cwd,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return result
