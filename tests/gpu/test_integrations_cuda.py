"""hsync's Trainer, Accelerator and Lightning strategy with float16 on a GPU: GradScaler's scaled losses
through the weighted step, two ranks on one GPU (skipped without a GPU)."""

import pytest
import torch

from tests.gpu.test_nccl import SOCKET_ENV
from tests.integrations import assert_near_float32, test_accelerate, test_lightning
from tests.integrations import test_transformers_trainer as trainer_tests
from tests.spawn import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
pytest.importorskip("accelerate")
pytest.importorskip("transformers")

# Both ranks on the one GPU: LOCAL_RANK 0 is what Accelerate picks the device by.
ENV = {**SOCKET_ENV, **trainer_tests.ENV, "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}


def trainer_in_float16(rank: int, world_size: int, output_dir: str) -> dict:
    torch.cuda.set_device(0)
    return trainer_tests.train_with_hsync(rank, world_size, "classify", [24, 8], output_dir, None,
                                          {"fp16": True, "use_cpu": False})


def accelerate_in_float16(rank: int, world_size: int, state_dir: str) -> dict:
    torch.cuda.set_device(0)
    return test_accelerate.train(rank, world_size, [24, 8], state_dir, False, "fp16", False)


def lightning_in_float16(rank: int, world_size: int, root: str) -> dict:
    import hsync

    torch.cuda.set_device(0)
    options = {"balance": hsync.BalanceConfig(global_batch_size=32, rank_batch_sizes=[24, 8], micro_batch_limit=8)}
    return test_lightning.fit(rank, world_size, options, 1, root, None, -1, "fp16")


def check_float16_steps(ranks: list[dict], one_process, start: dict[str, torch.Tensor]) -> None:
    """Every rank ran its forwards in float16 and skipped the same steps (those whose gradient the scaler found
    non-finite); the other steps are one process's float32 updates within float16's rounding."""
    first = ranks[0]
    assert first["dtypes"] == ["torch.float16"]
    assert ranks[1]["skipped"] == first["skipped"] and not all(first["skipped"]), first["skipped"]
    torch.testing.assert_close(ranks[1]["params"], first["params"], rtol=0, atol=0)
    batches = [sorted(a + b) for a, b in zip(first["steps"], ranks[1]["steps"], strict=True)]
    taken = [batch for batch, skipped in zip(batches, first["skipped"], strict=True) if not skipped]
    expected, losses = one_process(taken)
    assert_near_float32(first["params"], expected, start)
    # The step's loss over every rank, as it would be without the loss scale.
    kept = [loss for loss, skipped in zip(first["losses"], first["skipped"], strict=True) if not skipped]
    assert kept == pytest.approx(losses, rel=1e-2)


def test_the_trainers_float16_steps_go_through_its_grad_scaler(tmp_path):
    ranks = run_ranks(trainer_in_float16, 2, str(tmp_path), backend="nccl", env=ENV, timeout=180)
    check_float16_steps(ranks, lambda batches: trainer_tests.one_process("classify", batches),
                        dict(trainer_tests.tiny_model("classify").named_parameters()))


def test_accelerates_float16_steps_go_through_its_grad_scaler(tmp_path):
    ranks = run_ranks(accelerate_in_float16, 2, str(tmp_path), backend="nccl", env=ENV, timeout=180)
    check_float16_steps(ranks, test_accelerate.one_process, dict(test_accelerate.net().named_parameters()))


def test_lightnings_float16_steps_go_through_its_grad_scaler(tmp_path):
    # Each rank a node of its own to Lightning (GROUP_RANK), with one GPU: the same one.
    pytest.importorskip("lightning")
    env = {**ENV, "GROUP_RANK": "{rank}"}
    ranks = run_ranks(lightning_in_float16, 2, str(tmp_path), backend="nccl", env=env, timeout=180)
    check_float16_steps(ranks, test_accelerate.one_process, dict(test_accelerate.net().named_parameters()))
