"""hsync.fault_tolerance on a GPU: three replica groups on one GPU (each process a host of its own to NCCL, as in
test_nccl.py), the engine's NCCL communicator built anew for each quorum; one group killed in its backward at
step 7 and restarted, another in the bucket reductions at step 15. The survivors redo each step and end as one
process making the same steps on the CPU does, to the GPU's rounding."""

import pytest
import torch

pytest.importorskip("torchft", reason="hsync[torchft] is not installed")

from tests.distributed.test_failover import LIMIT_S, check_failover
from tests.gpu.test_nccl import SOCKET_ENV

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


# The job's own limit ends a stuck job with the replicas named; pytest-timeout's (the GPU check's) must not come first.
@pytest.mark.timeout(LIMIT_S + 30)
def test_groups_lost_on_a_gpu_cost_one_step_each(tmp_path):
    check_failover(tmp_path, {"g1": "7:backward", "g2": "15:reduction"}, ("g1",), "many", device="cuda",
                   env=SOCKET_ENV, tolerance=1e-4)
