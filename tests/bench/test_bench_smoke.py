"""python -m hsync.bench runs end to end on CPU and writes valid JSON and a plot (timings not judged)."""

import json
import math
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.distributed


# Each its framework's own loop. Its rows of other speeds (-mixed-2x, -equal-speeds) run the same code with
# another simulated rank (SimulatedSlowdown, which the own loop's rows run), less the attainable step.
FRAMEWORK_ROWS = "^(hf-trainer|accelerate|lightning)-affine-2x$"


def quick_bench(tmp_path, *only: str) -> tuple[dict, subprocess.CompletedProcess]:
    """`python -m hsync.bench --quick` on two CPU ranks, the rows `only` selects: its JSON and its run."""
    out, png = tmp_path / "results.json", tmp_path / "results.png"
    cmd = [sys.executable, "-m", "hsync.bench", "--device", "cpu", "--world-size", "2", "--quick", "--rounds", "2",
           "--steps", "2", "--json", str(out), "--plot", str(png), "--only", *only]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "| workload |" in result.stdout
    data = json.loads(out.read_text())
    assert {"torch", "hsync", "cpu", "world_size", "backend"} <= set(data["env"])
    for r in data["results"]:
        if r["workload"] == "shard-capacity-3to1":  # sizes, not times
            continue
        assert r["hsync_step_s"] > 0 and r["ddp_step_s"] > 0
        assert math.isclose(r["ratio_vs_ddp"], r["hsync_step_s"] / r["ddp_step_s"])
    return data, result


def test_quick_benchmark_writes_results(tmp_path):
    # Every quick row but the frameworks' (the next test's: the two run side by side).
    data, _ = quick_bench(tmp_path, "^bert-micro", "^gradient-mover", "^bucket-cap-", "^comm-path-", "^mixed-",
                          "^equal-speeds", "^powersgd-hook$", "^shard-")
    assert (tmp_path / "results.png").stat().st_size > 1000
    names = [r["workload"] for r in data["results"]]
    assert names[:2] == ["bert-micro", "gradient-mover-50"]
    assert any(n.startswith("bucket-cap-") for n in names) and any(n.startswith("comm-path-") for n in names)
    assert names[-7:] == ["shard-throughput", "shard-capacity-3to1", "mixed-speeds-2x", "equal-speeds-auto",
                          "mixed-affine-2x", "mixed-compute-2x", "mixed-speeds-1-1-2-4"], names
    assert [r["world_size"] for r in data["results"][-5:]] == [2, 2, 2, 2, 4]
    # Sharding against torch's: every system's step ran, and each rank holds its share of AdamW's moments.
    extra = next(r for r in data["results"] if r["workload"] == "shard-throughput")["extra"]
    assert extra["speedup_vs_zero"] > 0 and extra["speedup_vs_fsdp2"] > 0, extra
    for system in ("hsync", "zero"):
        shares = [extra[f"state_share_{system}_rank{r}"] for r in range(2)]
        assert sum(shares) == pytest.approx(1.0) and all(0 < s < 1 for s in shares), (system, shares)
    assert {"bert-micro-bucket-views", "bert-micro-bf16", "powersgd-hook"} <= set(names)
    for r in data["results"]:
        if r["nosync_step_s"] is not None and r["samples_per_step"]:  # a training workload: memory measured too
            assert set(r["peak_memory_mb"]) == {"hsync", "ddp", "nosync"}
            assert all(mb > 0 for mb in r["peak_memory_mb"].values()), r["peak_memory_mb"]
    for row in (r for r in data["results"] if r["workload"].startswith("comm-path-")):
        extra = row["extra"]
        assert extra["pack_gb_per_s"] > 0 and extra["copy_gb_per_s"] > 0, extra
        assert math.isclose(extra["pack_vs_copy"], extra["pack_gb_per_s"] / extra["copy_gb_per_s"]), extra
        assert math.isclose(extra["hsync_of_flat"], extra["hsync_gb_per_s"] / extra["torch_flat_gb_per_s"]), extra
        # Bucket views are timed in float32 (a row with a comm_dtype times hsync in float32 beside it instead).
        assert ("hsync_views_of_flat" in extra) != ("hsync_fp32_gb_per_s" in extra), extra
        assert ("hsync_views_of_one_pass" in extra) == ("hsync_views_of_flat" in extra), extra
    # The widest model each system trains within budgets of 3:1 (which is widest is not judged here).
    capacity = data["results"][-6]["extra"]
    assert all(capacity[f"params_{system}"] > 0 for system in ("hsync", "zero", "fsdp2", "ddp")), capacity
    # Which rank gets more depends on timings, which this test does not judge (a loaded machine can
    # measure two equal speeds); every plan must still split the whole global batch.
    *slowed, affine, compute, four = data["results"][-5:]
    for row in (*slowed, affine, four):
        extra, ranks = row["extra"], row["world_size"]
        assert sum(extra[f"plan_rank{r}"] for r in range(ranks)) == 4 * ranks, extra
        assert extra["speedup_vs_ddp"] > 0 and extra["plan_changes"] >= 0, extra
        assert extra["core_per_rank"] == float(ranks <= len(os.sched_getaffinity(0))), extra
        assert min(extra[f"measured_slowdown_rank{r}"] for r in range(ranks)) == 1.0, extra
        assert all(extra[f"fitted_per_example_s_rank{r}"] > 0 for r in range(ranks)), extra
    assert all(row["extra"]["ideal_speedup"] >= 1 for row in (*slowed, four))
    attained(affine["extra"])
    # Real compute: the sweep of fixed splits ran, and its fastest is the oracle auto is measured against.
    extra = compute["extra"]
    sweep = {key: value for key, value in extra.items() if key.startswith("fixed-")}
    assert len(sweep) >= 2 and extra["oracle_samples_per_s"] == max(sweep.values()), extra
    assert extra["auto_vs_oracle"] > 0 and extra["plan_rank0"] + extra["plan_rank1"] == 8, extra
    # And the fits beside each rank's step alone. Which rank's real work is dearer per example is not judged: a
    # sweep of 1 to 7 examples on a loaded machine can fit the slopes either way round.
    attained(extra, ordered=False)
    assert all(extra[f"fit_vs_alone_per_example_rank{r}"] == pytest.approx(
        extra[f"fitted_per_example_s_rank{r}"] / extra[f"alone_per_example_s_rank{r}"]) for r in range(2)), extra


def attained(extra: dict, ordered: bool = True) -> None:
    """A row's attainable step: each rank's step alone fitted (`ordered`: rank 1's dearer per example, as the
    simulated 2 and 4 ms are beyond their real work's noise), the best split of 8 examples found, and the
    throughput set against it."""
    per_example = [extra[f"alone_per_example_s_rank{r}"] for r in range(2)]
    assert all(p > 0 for p in per_example) and (per_example[0] < per_example[1] or not ordered), extra
    assert 1 <= extra["attainable_rank0"] <= 7 and extra["attainable_step_s"] > 0, extra
    assert math.isclose(extra["of_attainable"], extra["attainable_step_s"] * extra["hsync_samples_per_s"] / 8), extra


def test_quick_framework_rows_write_results(tmp_path):
    data, result = quick_bench(tmp_path, FRAMEWORK_ROWS)
    # The plot shows training rows against the no-sync floor: none here, said in one line.
    assert not (tmp_path / "results.png").exists() and "no plot written to" in result.stderr
    rows = data["results"]
    assert [r["workload"] for r in rows] == ["hf-trainer-affine-2x", "accelerate-affine-2x", "lightning-affine-2x"]
    for row in rows:  # transformers.Trainer, Accelerate, Lightning: hsync and without
        extra = row["extra"]
        assert row["world_size"] == 2
        assert extra["plan_rank0"] + extra["plan_rank1"] == 8 and extra["speedup_vs_ddp"] > 0, extra
        assert extra["plan_changes"] >= 0 and extra["fitted_per_example_s_rank1"] > 0, extra
        attained(extra)
