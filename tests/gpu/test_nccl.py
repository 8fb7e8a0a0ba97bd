"""The NCCL path: several ranks on one GPU (skipped without a GPU).

NCCL refuses two ranks of one communicator on the same GPU; giving each rank its own NCCL_HOSTID
makes them look like separate hosts that talk over sockets. Good for correctness, not for timings.
torch's process group is gloo (hsync needs only its store, and a torch NCCL group on ranks that
share a GPU could fail the survivors' teardown when a peer dies), but in the test of the two side by
side.
"""

import copy
import re

import pytest
import torch

from tests.distributed import (
    test_bucket_views,
    test_buffers,
    test_busy_time,
    test_cross_rank_backward,
    test_ddp_dropin,
    test_deadlines,
    test_nonfinite,
    test_sharded_optimizer,
)
from tests.distributed.test_comm_dtype import check_within_rounding, weighted_steps
from tests.distributed.test_faults import DEADLINE_S, VICTIM, noticed_after, train_until_victim_strikes
from tests.distributed.workloads import TINY_BUCKET_MB, reference_training, train_weighted
from tests.gpu import note
from tests.spawn import run_ranks, run_ranks_with_victim

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# Each rank a host of its own (run_ranks fills in {rank}), talking over loopback sockets; NCCL's
# warnings say why, should a rank fail.
SOCKET_ENV = {"NCCL_HOSTID": "hsync-test-host-{rank}", "NCCL_NET": "Socket", "NCCL_SOCKET_IFNAME": "lo",
              "NCCL_SHM_DISABLE": "1", "NCCL_P2P_DISABLE": "1", "NCCL_DEBUG": "WARN"}


def on_gpu(rank: int, world_size: int, steps, branch_ranks, grads: str):
    torch.cuda.set_device(0)
    return train_weighted(rank, world_size, steps, branch_ranks, device="cuda", grads=grads)


@pytest.mark.parametrize(("world_size", "grads"), [(2, "copied"), (3, "copied"), (2, "views"), (2, "views-zeroed")])
def test_nccl_ranks_on_one_gpu_match_one_process(world_size, grads):
    steps = [[[3, 7, 2][:world_size]], [[0, 5, 1][:world_size]], [[2, 3, 4][:world_size], [4, 1, 1][:world_size]]]
    results = run_ranks(on_gpu, world_size, steps, {1}, grads, env=SOCKET_ENV, timeout=120)
    ref_params, ref_grads, ref_losses = reference_training(steps, {1})
    for rank, (params, grads, stats, _) in enumerate(results):
        assert stats[0][2] and stats[-1][2]
        for name, value in ref_params.items():
            torch.testing.assert_close(params[name], value, rtol=1e-10, atol=1e-12, msg=f"rank {rank}, {name}")
        assert grads["never_used.weight"] is None
        assert [s[0] for s in stats] == pytest.approx(ref_losses, rel=1e-10)


@pytest.mark.parametrize("views", [True, False], ids=["views", "copied"])
def test_nccl_channels_last_and_transposed_gradients_keep_their_parameters_layout(views):
    # A fused AdamW (CUDA's) reads .grad with its parameter's strides: bucket views must have them.
    results = run_ranks(test_bucket_views.strided_steps, 2, "hsync", views, False, "cuda", env=SOCKET_ENV,
                        timeout=120)
    reference = test_bucket_views.strided_reference()
    for rank, (params, strides) in enumerate(results):
        assert all(grad == param for grad, param in strides.values()), f"rank {rank}: (grad, param) strides {strides}"
        for name, value in reference.items():
            torch.testing.assert_close(params[name], value, rtol=1e-4, atol=1e-5, msg=f"rank {rank}, {name}")


def comm_dtype_on_gpu(rank: int, world_size: int, low: torch.dtype, views: bool):
    torch.cuda.set_device(0)
    return weighted_steps(rank, world_size, low, views, "cuda")


@pytest.mark.parametrize(("low", "views"), [(torch.bfloat16, False), (torch.float16, True)], ids=str)
def test_nccl_carries_16_bit_buckets_within_their_rounding(low, views):
    check_within_rounding(run_ranks(comm_dtype_on_gpu, 3, low, views, env=SOCKET_ENV, timeout=120), low)


@pytest.mark.parametrize(("how", "store_on_victim"),
                         [("kill", False), ("kill-leaving-a-child", False), ("stop", False),
                          ("kill-leaving-a-child", True), ("stop", True)],
                         ids=["kill", "kill-leaving-a-child", "stop", "kill-leaving-a-child-its-store",
                              "stop-its-store"])
def test_nccl_survivors_of_a_lost_peer_abort_and_raise(how, store_on_victim):
    # On GPU the failure surfaces at the next call into hsync after the watchdog saw it (Note [NCCL failures]).
    # A child of the victim's that holds its sockets (as a DataLoader worker) leaves NCCL no close to see: the
    # survivors name the exited process instead (Note [A dead peer with open connections]). Where the victim
    # serves the group's store, the survivors' calls to it get no answer: the monitor's poll, NCCL's deadline,
    # must not wait for them (Note [Failing fast]).
    survivors = run_ranks_with_victim(train_until_victim_strikes, 3, VICTIM, how, {}, "cuda", "", False,
                                      store_on_victim, env=SOCKET_ENV, timeout=120)
    for rank, survivor in survivors.items():
        assert survivor.error is not None, f"rank {rank} raised nothing"
        assert f"hsync: rank {rank} (nccl): " in survivor.error, survivor.error
        if how == "stop":
            assert "deadline" in survivor.error or "a peer failed first" in survivor.error, survivor.error
        if how == "kill-leaving-a-child":
            assert f"rank {VICTIM} (process " in survivor.error and "has exited" in survivor.error, survivor.error
        assert noticed_after(survivor.error) < DEADLINE_S + 5, survivor.error
        assert survivor.exitcode == 0, f"rank {rank}: {survivor}"


def test_weighted_steps_through_torchs_sync_batch_norm_match_one_process():
    # torch's SyncBatchNorm over gloo (CUDA tensors), hsync's gradients over NCCL.
    results = run_ranks(test_cross_rank_backward.weighted_steps, 3, "sync-batch-norm", "cuda", env=SOCKET_ENV,
                        timeout=120)
    test_cross_rank_backward.check_against_one_process(results, "sync-batch-norm")


def profiled_steps(rank: int, world_size: int) -> list[str]:
    """Six plain steps under torch.profiler, after one that connected the communicator: the names of the NCCL
    collectives the profiler saw issued."""
    from torch.profiler import ProfilerActivity, profile

    import hsync

    torch.cuda.set_device(0)
    model = hsync.WeightedDDP(torch.nn.Linear(10, 10, bias=False).cuda())
    x = torch.rand(3, 10, device="cuda")
    model(x).sum().backward()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(6):
            model(x).sum().backward()
        torch.cuda.synchronize()
    return [event.name for event in prof.events() if event.name.startswith("nccl:")]


def test_hsyncs_nccl_collectives_show_in_torchs_profiler_as_torchs_own_do():
    # torch's NCCL group names its collectives "nccl:all_reduce" and so on (upstream's test_ddp_profiling counts
    # them); hsync's own communicator does the same, at least one all-reduce a step (the step scalars may have one
    # of their own).
    for names in run_ranks(profiled_steps, 2, env=SOCKET_ENV, timeout=120):
        assert names.count("nccl:all_reduce") >= 6, names


def steps_on_a_stream_of_the_users(rank: int, world_size: int, steps: int) -> list[float]:
    """upstream's test_DistributedDataParallel_non_default_stream: wrap, forward, backward and read each gradient
    inside `torch.cuda.stream(s)`, plain steps (rank r's gradient r) then weighted ones (r + 1 examples of r)."""
    import hsync

    torch.cuda.set_device(0)
    seen = []
    with torch.cuda.stream(torch.cuda.Stream()):
        model = hsync.WeightedDDP(torch.nn.Linear(1, 1, bias=False).cuda())
        for step in range(2 * steps):
            if model.module.weight.grad is not None:
                model.module.weight.grad.zero_()
            batch = torch.full((rank + 1, 1), float(rank), device="cuda")
            if step < steps:
                model(batch[:1]).sum().backward()
            else:
                model.backward(model(batch).mean(), weight=rank + 1)
            seen.append(model.module.weight.grad.clone())  # on the user's stream, no host wait before
    return [g.item() for g in seen]


def test_gradients_read_on_a_stream_of_the_users_are_the_reduced_ones():
    # The write-back must be ordered before the user's current stream (Note [Stream ordering]): an unordered read
    # would see the local gradient, the sockets between the ranks being slow.
    steps = 100
    plain, weighted = 0.5, 2 / 3  # mean of 0 and 1; (1 * 0 + 2 * 1) / 3
    for rank, seen in enumerate(run_ranks(steps_on_a_stream_of_the_users, 2, steps, env=SOCKET_ENV, timeout=120)):
        assert seen == pytest.approx([plain] * steps + [weighted] * steps, rel=1e-6), f"rank {rank}: {seen}"


def sync_batch_norm_with_empty_inputs(rank: int, world_size: int, converted: str) -> list[list[float]]:
    """upstream's test_sync_batch_norm_empty_input / _only_empty_input (test_c10d_common.py): torch's SyncBatchNorm
    with rank 0's batch empty, then every rank's, each in a plain step; then rank 0's empty in a weighted one. The
    layer converted before the wrap, or after it (on the wrapper, as upstream does). Returns the bias gradients."""
    import hsync

    torch.cuda.set_device(0)
    model = torch.nn.Sequential(torch.nn.BatchNorm2d(2)).cuda()
    if converted == "before-the-wrap":
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = hsync.WeightedDDP(model)
    if converted == "after-the-wrap":
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    bias = model.module[0].bias
    seen = []
    for sizes, weighted in (([0, 1], False), ([0, 0], False), ([0, 1], True)):
        bias.grad = None
        y = model(torch.zeros(sizes[rank], 2, 11, 13, device="cuda"))
        if weighted:
            model.backward(y.sum(), weight=sizes[rank])
        else:
            y.sum().backward()
        assert not y.isnan().any()
        seen.append(None if bias.grad is None else bias.grad.tolist())
    return seen


@pytest.mark.parametrize("converted", ["before-the-wrap", "after-the-wrap"])
def test_sync_batch_norm_with_empty_inputs_on_some_or_every_rank(converted):
    # y.sum() over zeros gives each example 11 * 13 to the bias: rank 1's 143 averaged over two ranks, none where
    # every batch is empty (SyncBatchNorm's backward gives an empty batch no gradient; DDP writes zeros unless
    # find_unused_parameters, docs/ddp-compat.md), and rank 1's whole where it carries a weighted step's only example.
    expected = [[71.5, 71.5], None, [143.0, 143.0]]
    for rank, seen in enumerate(run_ranks(sync_batch_norm_with_empty_inputs, 2, converted, env=SOCKET_ENV,
                                          timeout=120)):
        assert seen == pytest.approx(expected), f"rank {rank}: {seen}"


def test_a_join_that_throws_on_early_termination_runs_through_torchs_sync_batch_norm():
    # Join's flags through hsync's NCCL communicator, between torch's SyncBatchNorm collectives over gloo.
    results = run_ranks(test_cross_rank_backward.steps_until_a_rank_runs_out, 3, "cuda", env=SOCKET_ENV, timeout=120)
    expected = test_cross_rank_backward.reference_steps("sync-batch-norm")[:len(test_cross_rank_backward.STEPS) - 1]
    for rank, grads in enumerate(results):
        torch.testing.assert_close(grads, expected, rtol=1e-10, atol=1e-12, msg=lambda m, r=rank: f"rank {r}: {m}")


@pytest.mark.parametrize("views", [False, True], ids=["copied", "views"])
def test_torchs_nccl_group_beside_hsyncs_communicator_on_one_gpu(views):
    # Two NCCL communicators of each rank on one GPU at once: torch's, for SyncBatchNorm's all-reduces in
    # forward and backward, and hsync's, with many small buckets in flight during that backward.
    results = run_ranks(test_cross_rank_backward.weighted_steps, 3, "sync-batch-norm", "cuda", views, TINY_BUCKET_MB,
                        backend="nccl", env=SOCKET_ENV, timeout=120)
    test_cross_rank_backward.check_against_one_process(results, "sync-batch-norm")


def packed_sequence_steps(rank: int, world_size: int) -> list[float]:
    import hsync

    torch.cuda.set_device(0)
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(3, 4)
    reference = copy.deepcopy(lstm).cuda()
    model = hsync.WeightedDDP(lstm.cuda(), device_ids=[0])
    packed = torch.nn.utils.rnn.pack_sequence([torch.randn(5, 3), torch.randn(2, 3)])  # on the host
    out, _ = model(packed)
    assert out.data.is_cuda and out.batch_sizes.device.type == "cpu", "moved as DDP moves it"
    model.backward(out.data.square().mean(), weight=2)
    reference_out, _ = reference(packed.to("cuda"))
    reference_out.data.square().mean().backward()
    # Every rank ran the same inputs: the weighted mean is each rank's own gradient.
    return [(ours.grad - theirs.grad).abs().max().item()
            for ours, theirs in zip(model.module.parameters(), reference.parameters(), strict=True)]


def test_a_packed_sequence_moves_to_the_device_as_with_ddp():
    # With device_ids, inputs move as DDP's forward moves them: a PackedSequence's batch sizes stay on
    # the host, where torch requires them.
    for differences in run_ranks(packed_sequence_steps, 2, env=SOCKET_ENV, timeout=120):
        assert max(differences) < 1e-5, differences


def complex_buffer_on_gpu(rank: int, world_size: int) -> dict:
    import hsync

    torch.cuda.set_device(0)
    return test_ddp_dropin.complex_buffer(rank, world_size, hsync.WeightedDDP, "cuda")


def test_a_complex_buffer_travels_over_nccl():
    # NCCL has no complex type: the buffer travels as its bytes.
    results = run_ranks(complex_buffer_on_gpu, 2, env=SOCKET_ENV, timeout=120)
    for result in results:
        for key in ("wrapped", "after", "grads"):
            torch.testing.assert_close(result[key], results[0][key], rtol=0, atol=0)


def test_buffers_of_every_dtype_travel_over_nccl():
    results = run_ranks(test_buffers.buffers_of_every_dtype, 2, "cuda", env=SOCKET_ENV, timeout=120)
    test_buffers.check_rank_zeros_bytes_everywhere(results)


@pytest.mark.parametrize("case", list(test_busy_time.CASES))
def test_nccl_a_fast_rank_does_not_count_its_waits_for_a_slow_one(case):
    # On a GPU the fast rank's waits are its stream's, bracketed by events (Note [Busy time]).
    slow_rank, sleep_at, views, sharded = test_busy_time.CASES[case]
    results = run_ranks(test_busy_time.busy_times, max(2, slow_rank + 1), "cuda", slow_rank, sleep_at, views, sharded,
                        env=SOCKET_ENV, timeout=120)
    fast = results[1 if slow_rank == 0 else 0][1:]
    note(f"busy time, {case}: a fast rank's {[round(b * 1e3, 2) for b in fast]} ms, the slow rank sleeping "
         f"{test_busy_time.SLEEP_S * 1e3:g} ms a step")
    test_busy_time.check_busy_times(results, slow_rank)


@pytest.mark.parametrize(("where", "how"), [
    ("sum-over-ranks", "stop"), ("join", "stop"), ("joined", "stop"), ("sum-over-ranks", "kill")])
def test_nccl_a_lost_peer_ends_hsyncs_other_collectives_within_the_deadline(where, how):
    # sum_over_ranks over an NCCL group goes through an NCCL communicator of hsync's, Join's collectives (torch's
    # Join's flags too: hsync/join.py's JoinGroup) through the model's: the watchdog aborts a stuck one at the
    # deadline, and the host's copy of the result returns. No kernel of torch's NCCL group is left on the
    # device: torch's Join all-reduced its flag there, and with a stopped peer it never ended (an H100,
    # 2026-11-26).
    survivor = run_ranks_with_victim(test_deadlines.collective_without_its_peer, 2, test_deadlines.VICTIM, where,
                                     how, "cuda", env=SOCKET_ENV, backend="nccl", timeout=30, until_exit=False)[0]
    assert survivor.error is not None, f"the survivor raised nothing: {survivor}"
    noticed = float(re.search(r"noticed after ([0-9.]+) s", survivor.error).group(1))
    assert "hsync: rank 0 (nccl): " in survivor.error, survivor.error
    assert noticed < test_deadlines.DEADLINE_S + 5.0, survivor.error
    if how == "stop":
        assert "deadline" in survivor.error, survivor.error
    # The lost rank, named (Note [Naming the lost rank]): a frozen one never posted that it waits; a dead one
    # may be seen either way, by its exited process or, where NCCL reports nothing, at the deadline.
    victim = test_deadlines.VICTIM
    assert re.search(f"rank {victim} (has not reached it|\\(process [0-9]+, on this host\\) has exited)",
                     survivor.error), survivor.error


@pytest.mark.parametrize("optimizer", ["adamw-fused", "sgd-momentum"])
def test_nccl_sharded_optimizer_steps_as_the_unsharded_one(optimizer):
    """Owners broadcast over hsync's NCCL communicator; budgets measured (each rank's free GPU memory)."""
    results = run_ranks(test_sharded_optimizer.train_side_by_side, 2, optimizer, None, 4, 2.0, None, None, "cuda",
                        env=SOCKET_ENV, timeout=120)
    test_sharded_optimizer.assert_same_training(results, exact=False)
    assert sorted(i for r in results for i in r["owned"]) == list(range(10))


MEMORY_CAPS = (0.03, 0.01)  # each rank's fraction of the card: 3:1


def train_capped(rank: int, world_size: int, shares: str, steps: int) -> dict:
    """A stack of linear layers whose parameters take 48% of the small rank's cap, trained with AdamW: through a
    ShardedOptimizer on two ranks, each rank's caching allocator capped at its fraction of the card (3:1), with
    `shares` from the measured memory (what the cap leaves) or "even" ones (both budgets declared alike); or
    "unsharded", the same steps in one process, uncapped, with torch's AdamW alone (the exact weighted mean of
    two ranks' equal batches is that process's gradient)."""
    import datetime

    import hsync

    torch.cuda.set_device(0)
    if shares != "unsharded":
        torch.cuda.set_per_process_memory_fraction(MEMORY_CAPS[rank], 0)
    total = torch.cuda.get_device_properties(0).total_memory
    width = 2048  # 16 MiB a layer
    layers = max(2, int(0.12 * MEMORY_CAPS[1] * total / (width * width)))
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)]).cuda()
    out = {"cap": MEMORY_CAPS[rank] * total, "error": None}
    if shares == "unsharded":
        model, optimizer = net, torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True)
    else:
        # Rank 0's parameters broadcast at wrap time in chunks of a bucket, not one flat copy of all of them.
        model = hsync.WeightedDDP(net, gradient_as_bucket_view=True, timeout=datetime.timedelta(seconds=20))
    try:
        if shares != "unsharded":
            budgets = ["1TiB"] * world_size if shares == "even" else None
            optimizer = hsync.ShardedOptimizer(model, torch.optim.AdamW, memory_budget=budgets, lr=1e-4, fused=True)
            out["owned"] = sum(p.numel() for i, p in enumerate(model.parameters())
                               if i in optimizer.layout.owned[rank])
        x = torch.randn(4, width, device="cuda")
        for _ in range(steps):
            loss = model(x).square().mean()
            if shares == "unsharded":
                loss.backward()
            else:
                assert model.backward(loss, weight=len(x)).finite
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        out["peak"] = torch.cuda.max_memory_allocated(0)
        out["sums"] = [p.double().sum().item() for p in model.parameters()]
    except Exception as error:  # noqa: BLE001 - what ended the run is the result
        out["error"] = f"{type(error).__name__}: {error}"
    return out


def test_memory_proportional_shares_train_where_even_ones_run_out_of_memory():
    """Real budgets: two ranks on one GPU capped 3:1. Even shares need 10 bytes a parameter on the small rank
    (4 of parameters, half of 12 of gradients and moments): past its cap, out of memory. Shares from the measured
    memory put about a fifth of the gradients and moments there, and both ranks train to the parameters of the
    unsharded optimizer in one uncapped process."""
    even = run_ranks(train_capped, 2, "even", 2, env=SOCKET_ENV, timeout=180)
    assert "out of memory" in (even[1]["error"] or "").lower(), even[1]
    shares = run_ranks(train_capped, 2, "measured", 3, env=SOCKET_ENV, timeout=180)
    note(f"memory caps 3:1, {[r['owned'] for r in shares]} parameters owned, peaks "
         f"{[round(r['peak'] / r['cap'], 2) for r in shares]} of the caps")
    assert [r["error"] for r in shares] == [None, None], shares
    assert shares[0]["owned"] > 2 * shares[1]["owned"] > 0, shares
    assert all(r["peak"] <= r["cap"] for r in shares), shares
    assert shares[0]["sums"] == shares[1]["sums"], shares
    unsharded = run_ranks(train_capped, 1, "unsharded", 3, timeout=180)[0]
    assert unsharded["error"] is None, unsharded
    torch.testing.assert_close(shares[0]["sums"], unsharded["sums"], rtol=1e-5, atol=1e-6)


def test_nccl_plain_steps_under_join_through_a_sharded_optimizer():
    """A plain step under Join never resolves a total, which on a GPU is what copies the step's scalars to the host;
    the sharded optimizer still reads whether the step was finite."""
    results = run_ranks(test_sharded_optimizer.plain_steps_under_join, 2, "cuda", env=SOCKET_ENV, timeout=120)
    expected = test_sharded_optimizer.reference_plain_under_join()
    for rank, params in enumerate(results):
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, rtol=1e-4, atol=1e-5, msg=f"rank {rank}, {name}")


@pytest.mark.parametrize(("few_tensors", "world_size"), [(None, 2), ("two-layers", 3)],
                         ids=["every-rank-owns", "a-rank-owns-nothing"])
def test_nccl_a_grad_scaler_around_a_sharded_optimizer_skips_alike_on_every_rank(few_tensors, world_size):
    """Note [A non-finite step on every rank] on the device: each rank's NaN is a masked fill on its stream, after
    the owners' flags are shared, and every rank's GradScaler reads it (a rank that owns nothing: in the witness's
    all-reduced gradient)."""
    histories = run_ranks(test_nonfinite.scaled_training, world_size, 4, True, "cuda", few_tensors, env=SOCKET_ENV,
                          timeout=120)
    test_nonfinite.assert_skipped_alike(histories)


@pytest.mark.parametrize("views", [False, True], ids=["copied", "views"])
def test_nccl_weighted_steps_after_refreshing_the_trainable_parameters_match_one_process(views):
    """A second NCCL communicator built mid-run, after the first was used, and new buckets (views too)."""
    expected = test_ddp_dropin.unfreezing_in_one_process()
    results = run_ranks(test_ddp_dropin.unfreezing_steps, 2, "cuda", views, env=SOCKET_ENV, timeout=120)
    for rank, params in enumerate(results):
        torch.testing.assert_close(params, expected, rtol=1e-10, atol=1e-12, msg=lambda m, r=rank: f"rank {r}: {m}")


def test_nccl_a_backbone_unfrozen_into_a_sharded_optimizer_steps_as_the_unsharded_one():
    """Lightning's BackboneFinetuning order: add_param_group takes parameters frozen at the wrap into new buckets
    (a second NCCL communicator), then gives them owners, reduced to each over it."""
    results = run_ranks(test_sharded_optimizer.a_backbone_added_later, 2, ["3MiB", "1MiB"], "add-unfrozen", "cuda",
                        env=SOCKET_ENV, timeout=120)
    test_sharded_optimizer.assert_same_training(results, exact=False)
    owned = results[0]["owned_bytes"]
    assert abs(owned[0] / sum(owned) - 0.75) < 0.1, owned
