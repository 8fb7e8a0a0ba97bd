"""The benchmark's compiled rows time every variant on graphs compiled for that variant."""

import pytest
import torch

from tests.distributed.workloads import COMPILE_BACKEND, Stack, compiled_backward_nodes
from tests.spawn import run_ranks

pytestmark = pytest.mark.distributed


def compiled_variants(rank: int, world_size: int) -> dict:
    from hsync.bench.result import VARIANTS
    from hsync.bench.training import time_variants
    from hsync.bench.workloads import Workload, wrap

    torch._dynamo.reset()
    cpu = torch.device("cpu")
    workload = Workload("stack-compiled", Stack, lambda g: (torch.randn(4, 512, generator=g),),
                        lambda model, batch: model(batch[0]).square().mean(), samples=4, bucket_cap_mb=2,
                        compiled=True, compile_backend=COMPILE_BACKEND)
    pieces = {}
    # The floor first: were its whole graphs reused, every wrapper's backward would be one piece too.
    for variant in ("nosync", *(v for v in VARIANTS if v != "nosync")):
        model = wrap(variant, Stack(), workload, cpu)
        loss = workload.loss(model, workload.make_batch(torch.Generator().manual_seed(rank)))
        pieces[variant] = compiled_backward_nodes(loss)
        loss.backward()
    result = time_variants(workload, rounds=1, steps=2, device=cpu)
    return {"pieces": pieces, "step_s": [result.hsync_step_s, result.hsync_plain_step_s, result.ddp_step_s,
                                         result.nosync_step_s]}


def test_each_compiled_variant_gets_graphs_of_its_own():
    for result in run_ranks(compiled_variants, 2, timeout=300):
        pieces = result["pieces"]
        assert pieces["nosync"] == 1, pieces
        assert pieces["hsync"] == pieces["hsync_plain"] == pieces["ddp"] == 3, pieces
        assert all(t > 0 for t in result["step_s"]), result
