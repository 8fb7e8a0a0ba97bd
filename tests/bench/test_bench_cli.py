"""The benchmark's command line: which rows --only selects, and flags it refuses before any work."""

import argparse
import os
import re
import subprocess
import sys

import pytest
import torch

from hsync.bench.report import markdown
from hsync.bench.run import main, plan_jobs


def selected(device: str, *patterns: str, quick: bool = False) -> list[str]:
    args = argparse.Namespace(quick=quick, only=list(patterns), rounds=1, steps=1)
    return [job.name for job in plan_jobs(args, torch.device(device))]


def kinds(names: list[str]) -> set[str]:
    """Row names without their sizes: bert-mini-bf16 and bert-micro-bf16 are one kind of row."""
    return {re.sub(r"^bert-(tiny|mini|micro)", "bert", re.sub(r"-\d+(MiB)?$|-\d+(MiB)?(?=-)", "-N", name))
            for name in names}


def test_the_quick_rows_are_every_kind_of_default_row():
    # The smoke tests run every quick row (tests/bench/test_bench_smoke.py): so every kind of row the default
    # run has runs in CI, at its smallest, but the compiled BERT (its machinery: test_bench_compiled.py) and four
    # equal ranks (equal-speeds-auto's code, on as many ranks as mixed-speeds-1-1-2-4 runs).
    default, quick = kinds(selected("cpu")), kinds(selected("cpu", quick=True))
    assert quick == default - {"bert-compiled", "equal-speeds-auto-N"}, (sorted(default), sorted(quick))


def test_a_plain_name_selects_every_row_containing_it():
    assert selected("cpu", "comm-path") == ["comm-path-16MiB", "comm-path-16MiB-bf16"]
    assert selected("cuda", "bert-base") == ["bert-base", "bert-base-bucket-views", "bert-base-bf16",
                                             "bert-base-compiled"]
    assert selected("cpu", "mixed-speeds", "equal-speeds") == [
        "mixed-speeds-2x", "mixed-speeds-1-1-2-4", "equal-speeds-auto", "equal-speeds-auto-4",
        "hf-trainer-equal-speeds", "accelerate-equal-speeds", "lightning-equal-speeds"]


def test_an_anchored_pattern_selects_one_row():
    # Anchored at both ends, as the GPU check asks for bert-base: that row alone, not its variants.
    assert selected("cuda", "^bert-base$", "^comm-path-64MiB$") == ["bert-base", "comm-path-64MiB"]


@pytest.mark.parametrize(("flags", "message"), [
    (["--only", "bert-("], "--only 'bert-(' is not a regular expression"),
    (["--only", "^bert$", "resnet"], "--only ^bert$ resnet matches no workload"),
    (["--rounds", "0"], "--rounds must be at least 1"),
    (["--steps", "x"], "argument --steps: invalid int value: 'x'"),
    # Spawned without a word until a timeout ended it.
    (["--world-size", "1000"], f"--world-size 1000: at most {4 * (os.cpu_count() or 1)} CPU ranks on this machine's"),
    # Each was found only after every row had run, its figures lost.
    (["--json", "/proc/no-such/r.json"], "--json /proc/no-such/r.json: cannot write there (FileNotFoundError"),
    (["--plot", "."], "--plot .: cannot write there (it is a folder)"),
    (["--markdown", "{file}/page.md"], "--markdown {file}/page.md: cannot write there (NotADirectoryError"),
])
def test_bad_flags_are_refused_in_one_line(flags, message, capsys, tmp_path):
    file = tmp_path / "a-file"
    file.write_text("")
    flags = [flag.format(file=file) for flag in flags]
    with pytest.raises(SystemExit) as exit_info:
        main(["--device", "cpu", "--only", "^bert-mini$", *flags])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and message.format(file=file) in error, error


@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="a CUDA device is visible")
def test_cuda_without_a_device_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--device", "cuda"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith("--device cuda: no CUDA device is visible here")


def test_the_command_refuses_before_spawning_anything():
    result = subprocess.run([sys.executable, "-m", "hsync.bench", "--only", "nothing-named-so"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].endswith("--only nothing-named-so matches no workload")


def test_a_results_page_gives_its_command_as_a_shell_must_read_it():
    env = {"device": "cpu", "world_size": 2, "backend": "gloo", "cpu": "a CPU", "cpu_count": 2, "date": "today",
           "python": "3", "torch": "2", "hsync": "0"}
    args = argparse.Namespace(device="cpu", rounds=5, steps=6, quick=False, only=["^bert-mini$", "comm-path"],
                              plot=None)
    page = markdown({"env": env, "results": []}, args)
    assert "--only '^bert-mini$' comm-path`" in page, page


def test_cuda_rows_that_need_more_ranks_than_gpus_are_refused_in_one_line(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(["--device", "cuda", "--world-size", "1", "--only", "^bert-base$", "mixed-speeds-2x"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.endswith("--device cuda: each rank needs a GPU of its own (1 visible), but these rows need "
                          "more ranks: mixed-speeds-2x (2); lower --world-size or choose rows with --only"), error


def test_simulate_cluster_writes_its_table_plot_and_json(tmp_path, capsys):
    page, plot, data = tmp_path / "t.md", tmp_path / "p.png", tmp_path / "r.json"
    main(["--simulate-cluster", "8", "--markdown", str(page), "--plot", str(plot), "--json", str(data)])
    import json

    (row,) = json.loads(data.read_text())["rows"]
    assert row["ranks"] == 8 and row["oracle_ms"] <= row["hsync_ms"] < row["equal_ms"]
    assert row["oracle_ms"] / row["hsync_ms"] >= 0.95, row
    assert page.read_text().count("\n| 8 |") == 1 and plot.stat().st_size > 0
    assert "8 ranks: hsync" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "message"), [
    (["1"], "--simulate-cluster: every size must be at least 2 ranks, got [1]"),
    (["99999999999"], "--simulate-cluster: at most 16384 ranks, got 99999999999"),
    (["3", "--only", "nomatch"], "--only does not apply to --simulate-cluster, which runs no rows"),
    (["3", "--world-size", "4"], "--world-size does not apply to --simulate-cluster, which runs no rows"),
])
def test_simulate_cluster_refuses_nonsense_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--simulate-cluster", *argv])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().endswith(message)


def test_the_step_profile_compares_hsyncs_step_with_the_floors(tmp_path):
    # What the GPU check runs on a GPU (scripts/gpu_check.sh), here on the CPU at its smallest: both variants
    # profiled, their totals and the ops that differ most in a table.
    page = tmp_path / "profile.md"
    subprocess.run([sys.executable, "-m", "hsync.bench.step_profile", "--device", "cpu", "--size", "tiny",
                    "--steps", "2", "--markdown", str(page)], check=True, capture_output=True, timeout=120)
    text = page.read_text()
    totals = dict(re.findall(r"(\w+_(?:us|ms)) ([0-9.]+)", text))
    assert set(totals) == {"hsync_cpu_us", "floor_cpu_us", "hsync_wall_ms", "floor_wall_ms"}, text
    assert all(float(v) > 0 for v in totals.values()), text
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert len(rows) >= 20, text
    # hsync's step runs collectives the bare model's never does. (Not necessarily first: on a loaded CPU one slow
    # call of another op, the non-finite check's, once came before them.)
    collectives = [row for row in rows if row.startswith("| `c10d::")]
    assert collectives and all(re.match(r"\| `c10d::\w+` \| [0-9.]+ \| 0\.0 \|", row) for row in collectives), text


def test_the_step_profile_refuses_a_nonsense_step_count():
    done = subprocess.run([sys.executable, "-m", "hsync.bench.step_profile", "--steps", "0"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "--steps must be at least 1" in done.stderr, done.stderr
