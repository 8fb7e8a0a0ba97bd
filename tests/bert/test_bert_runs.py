"""examples/bert.py launched the way users launch it (torchrun, real processes, gloo on CPU) and, where a test is
about the updates rather than the launcher, its main run in torchrun's environment on spawned ranks."""

import contextlib
import hashlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from filelock import FileLock

# At module level, so that a spawned rank imports it (unpickling its function) before init_process_group,
# as examples/bert.py does (examples/apps/bert/model.py says why).
from transformers import AutoTokenizer, BertForPreTraining, BertForSequenceClassification

from tests import examples
from tests.spawn import free_port, run_ranks

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).parents[2]
SLICE = ROOT / "tests" / "data" / "kjv-genesis.txt"
CRASH_ONCE = ROOT / "tests" / "bert" / "crash_once.py"


def shared_data(tmp_path: Path) -> Path:
    """Where the session's runs cache the corpus's vocabulary and examples: tmp_path's parent is the
    session's temporary folder, and the caches are keyed by content, so the runs may share them."""
    return tmp_path.parent / "bert-data"


def torchrun(tmp_path: Path, *args: str, nproc: int = 2, launcher: tuple[str, ...] = ("--standalone",),
             timeout: float = 180, script: Path = ROOT / "examples" / "bert.py",
             env: dict[str, str] | None = None, data_dir: Path | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", *launcher, f"--nproc_per_node={nproc}",
           str(script), "--corpus", str(SLICE), "--data-dir", str(data_dir or shared_data(tmp_path)), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "examples")]), **(env or {})}  # tests, apps
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=tmp_path, env=env)


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def in_ranks(tmp_path: Path, *args: str, nproc: int = 2, data_dir: Path | None = None) -> str:
    """examples/bert.py's main on `nproc` ranks in torchrun's environment, forked from tests.spawn's server
    (which has imported torch and transformers: seconds less per process than a launch), for the tests of what
    the updates are rather than of the launcher; returns what rank 0 printed, stdout and stderr."""
    ranks = main_on_ranks(tmp_path, args, nproc, data_dir)
    assert not any(refusal for _, refusal in ranks), ranks
    return ranks[0][0]


def refusals_in_ranks(tmp_path: Path, *args: str, nproc: int = 2, data_dir: Path | None = None) -> list[str]:
    """As in_ranks, for a run that every rank refuses: each rank's one line (what SystemExit prints)."""
    ranks = main_on_ranks(tmp_path, args, nproc, data_dir)
    assert all(refusal for _, refusal in ranks), ranks
    return [refusal for _, refusal in ranks]


def main_on_ranks(tmp_path: Path, args: tuple[str, ...], nproc: int, data_dir: Path | None,
                  entry: Callable[..., tuple] | None = None) -> list[tuple]:
    argv = ["--corpus", str(SLICE), "--data-dir", str(data_dir or shared_data(tmp_path)), *args]
    return examples.main_on_ranks("bert.py", tmp_path, argv, nproc, entry)


def read_log(path: Path, kind: str = "loss") -> list[dict]:
    """The log's training rows (kind "loss") or evaluation rows ("valid_loss")."""
    return [row for row in map(json.loads, path.read_text().splitlines()) if kind in row]


def held_out_evaluation(rank: int, world_size: int, final: Path, valid_fraction: float) -> dict[str, float]:
    """The trainer's evaluation of the saved model, redone by one process alone."""
    from apps.bert import data, model

    documents = data.read_documents(SLICE)
    _, held_out = data.hold_out(documents, valid_fraction, seed=0)
    vocab = data.Vocabulary((final / "vocab.txt").read_text("utf-8").splitlines())
    examples = data.build_examples(held_out, vocab.tokens, max_seq_len=64, seed=0)
    return model.evaluate(BertForPreTraining.from_pretrained(final), examples, vocab, seed=0, batch_size=5)


def test_tiny_run_learns_evaluates_exactly_and_leaves_a_model_that_from_pretrained_loads(tmp_path):
    log, save = tmp_path / "log.jsonl", tmp_path / "run"
    result = ok(torchrun(tmp_path, "--max-steps", "60", "--log-every", "10", "--eval-every", "30",
                         "--valid-fraction", "0.1", "--save-dir", str(save), "--log-file", str(log)))
    train_rows, valid_rows = read_log(log), read_log(log, "valid_loss")
    assert [r["step"] for r in train_rows] == [10, 20, 30, 40, 50, 60]
    assert all(r["finite"] for r in train_rows)
    assert train_rows[-1]["loss"] < train_rows[0]["loss"] - 1.0, [r["loss"] for r in train_rows]
    for r in train_rows:  # what is optimised weighs next-sentence examples by their expected masked tokens
        assert r["objective"] == pytest.approx(r["mlm_loss"] + r["nsp_loss"], rel=0.02), r
    assert [r["step"] for r in valid_rows] == [30, 60]
    assert valid_rows[1]["valid_mlm_loss"] < valid_rows[0]["valid_mlm_loss"], valid_rows
    last_line = result.stderr.strip().splitlines()[-1]
    assert f"trained model in {save / 'final'}" in last_line and "validation loss" in last_line, last_line

    # Two ranks' evaluation, each of its shard, equals one process's over every held-out example.
    alone = run_ranks(held_out_evaluation, 1, save / "final", 0.1)[0]
    logged = valid_rows[-1]
    assert alone["valid_examples"] == logged["valid_examples"] > 0
    for key in ("valid_mlm_loss", "valid_mlm_accuracy", "valid_nsp_loss", "valid_nsp_accuracy"):
        assert alone[key] == pytest.approx(logged[key], abs=2e-5), key

    pretrained = BertForPreTraining.from_pretrained(save / "final")
    assert pretrained.config.num_hidden_layers == 2
    classifier = BertForSequenceClassification.from_pretrained(save / "final", num_labels=2)
    tokenizer = AutoTokenizer.from_pretrained(save / "final")
    batch = tokenizer(["In the beginning God created the heaven and the earth."], return_tensors="pt")
    assert tokenizer.unk_token_id not in batch["input_ids"][0].tolist()
    assert classifier(**batch).logits.shape == (1, 2)

    # ... and examples/finetune.py starts from it, on one rank; texts longer than the model's 64 positions are
    # cut, not a crash.
    labelled = tmp_path / "labelled.txt"
    long_text = " ".join(["and the lord said unto moses"] * 40)
    labelled.write_text("".join(f"{i % 2}\t{long_text if i == 3 else 'let there be light'} {i}\n" for i in range(10)))
    ((tuned, refusal),) = examples.main_on_ranks("finetune.py", tmp_path, [
        "--model", str(save / "final"), "--data", str(labelled), "--epochs", "1", "--batch-size", "4",
        "--device", "cpu"], nproc=1)
    epoch_line = r"epoch 1: train loss [0-9.]+, held-out accuracy [0-9.]+ on 2 examples"
    assert refusal is None and re.search(epoch_line, tuned), tuned


def test_auto_balance_follows_a_simulated_slow_rank(tmp_path):
    log = tmp_path / "log.jsonl"
    # Gradients travel in bfloat16 here, to run the trainer's --comm-dtype too: balancing doesn't depend on it.
    # 40 steps: under a loaded machine's noise the policy may wait for a few windows before it moves; and rank 1
    # 4x slower, so that the move promises more (60%) than the noise of a step's time there can hide (a CI run saw
    # 3x held at the equal split for all 40 steps while the other worker compiled).
    printed = in_ranks(tmp_path, "--max-steps", "40", "--probe-steps", "1", "--rebalance-every", "6",
                       "--log-every", "2", "--balance", "auto", "--simulate-slowdown", "1=4.0",
                       "--log-file", str(log), "--comm-dtype", "bf16")
    plans = [r["plan"] for r in read_log(log)]
    assert plans[0] == [16, 16], "warm-up steps split equally"
    fast, slow = [plan for plan in plans if sum(plan) == 32][-1]  # an epoch's last step may be short
    # Ideally 25.6 + 6.4; on two shared cores the tiny model's timings are noisy, so ask for a clear lean.
    assert fast >= 1.5 * slow, plans
    assert "measured rank 0:" in printed


def model_state(save_dir: Path) -> dict[str, torch.Tensor]:
    (path,) = sorted(save_dir.glob("step-*.pt"))[-1:]
    return torch.load(path, weights_only=False)["model"]


# Without dropout, so that a run on another number of ranks makes the same updates too.
STRAIGHT = ("--max-steps", "8", "--balance", "equal", "--dropout", "0")


@dataclass
class StraightRun:
    """The uninterrupted run of STRAIGHT that the resumed, restarted, elastic and compiled runs are compared with."""

    state: dict[str, torch.Tensor]
    """The parameters at its end."""
    losses: list[float]
    """Each step's loss."""
    data_dir: Path
    """Its --data-dir, for the runs compared with it: WordPiece training breaks ties differently from run to run,
    so that a vocabulary trained again would make other updates."""
    save_dir: Path
    """Its checkpoints, one every two steps."""

    def torchrun(self, tmp_path: Path, *args: str, **kwargs) -> subprocess.CompletedProcess:
        """tests' torchrun, on this run's data."""
        return torchrun(tmp_path, *args, data_dir=self.data_dir, **kwargs)

    def in_ranks(self, tmp_path: Path, *args: str, nproc: int = 2) -> str:
        """tests' in_ranks, on this run's data."""
        return in_ranks(tmp_path, *args, nproc=nproc, data_dir=self.data_dir)


@pytest.fixture(scope="session")
def straight_run(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> StraightRun:
    """Run once a session, by whichever pytest worker asks first (pytest-xdist's recipe for a shared
    fixture), with a checkpoint every two steps."""
    shared = tmp_path_factory.getbasetemp()
    shared = shared if worker_id == "master" else shared.parent
    done, log, data_dir = shared / "straight-run", shared / "straight-run.jsonl", shared / "straight-run-data"
    with FileLock(shared / "straight-run.lock"):
        if not done.exists():
            running = shared / "straight-run.partial"
            in_ranks(tmp_path_factory.mktemp("straight"), *STRAIGHT, "--save-every", "2", "--log-every", "1",
                     "--log-file", str(log), "--save-dir", str(running), data_dir=data_dir)
            running.replace(done)
    return StraightRun(model_state(done), [row["loss"] for row in read_log(log)], data_dir, done)


def test_a_resumed_run_ends_with_the_parameters_of_an_uninterrupted_one(tmp_path, straight_run):
    split = tmp_path / "split"
    stopped = straight_run.in_ranks(tmp_path, *STRAIGHT, "--save-dir", str(split), "--stop-at", "3")
    (written,) = split.glob("step-*.pt")
    assert f"stopped at step 3 (--stop-at); checkpoint {written} written, continue to step" in stopped, stopped
    digest = hashlib.sha256(written.read_bytes()).hexdigest()

    # A resume its checkpoint refuses (here a flag its optimizer state would silently override) is one line
    # before any work, and overwrites nothing. test_checkpoint.py shows the other refusals in-process.
    (refusal,) = refusals_in_ranks(tmp_path, "--max-steps", "8", "--save-dir", str(split), "--resume", "--lr", "1e-4",
                                   nproc=1, data_dir=straight_run.data_dir)
    assert "was written with lr=0.002, this run has lr=0.0001" in refusal, refusal
    # Another seed would have trained its own vocabulary first (minutes for the base preset), then been refused.
    (refusal,) = refusals_in_ranks(tmp_path, "--max-steps", "8", "--save-dir", str(split), "--resume", "--seed", "7",
                                   nproc=1, data_dir=tmp_path / "unused")
    assert "was written with seed=0, this run has seed=7" in refusal, refusal
    # Another held-out part trains on other examples.
    (refusal,) = refusals_in_ranks(tmp_path, "--max-steps", "8", "--save-dir", str(split), "--resume",
                                   "--valid-fraction", "0.2", nproc=1, data_dir=tmp_path / "unused")
    assert "this run has valid_fraction=0.2" in refusal, refusal
    assert not (tmp_path / "unused").exists(), "no data prepared before the checkpoint was found another run's"
    # Beside the checkpoint: the run's lock (checkpoint.claim) and its vocabulary (data.prepare_data).
    assert sorted(p.name for p in split.iterdir()) == ["run.lock", written.name, "vocab.txt"]
    assert hashlib.sha256(written.read_bytes()).hexdigest() == digest

    # Collated in a worker process this time, and on data prepared anew (as on a node that never trained the
    # vocabulary: WordPiece would train another, and the checkpoint refused it): the same batches, the same updates.
    in_ranks(tmp_path, *STRAIGHT, "--save-dir", str(split), "--resume", "--data-workers", "1",
             data_dir=tmp_path / "fresh-data")
    resumed = model_state(split)
    for name, value in straight_run.state.items():
        assert torch.equal(value, resumed[name]), name


def test_a_run_goes_on_at_other_world_sizes_with_the_updates_of_an_uninterrupted_one(tmp_path, straight_run):
    elastic = ("--save-dir", str(tmp_path / "elastic"))
    straight_run.in_ranks(tmp_path, *STRAIGHT, *elastic, "--stop-at", "3")
    one = straight_run.in_ranks(tmp_path, *STRAIGHT, *elastic, "--resume", "--stop-at", "6", nproc=1)
    assert "resuming from step 3" in one and "written by 2 ranks, now 1" in one, one
    assert "changed since the checkpoint" not in one, one
    three = straight_run.in_ranks(tmp_path, *STRAIGHT, *elastic, "--resume", nproc=3)
    assert "resuming from step 6" in three and "written by 1 ranks, now 3" in three, three
    elastic_run = model_state(tmp_path / "elastic")
    for name, value in straight_run.state.items():  # equal up to the order of floating-point sums
        torch.testing.assert_close(elastic_run[name], value, rtol=1e-5, atol=1e-6, msg=name)


def main_then_compiled_wrapper_forwards(rank: int, world_size: int, *main_args) -> tuple[str, str | None, int]:
    """examples.run_main, then how many compiled versions of WeightedDDP.forward dynamo holds in this rank."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    import hsync

    return *examples.run_main(rank, world_size, *main_args), len(_debug_get_cache_entry_list(hsync.WeightedDDP.forward))


def test_a_compiled_run_makes_the_updates_of_an_uncompiled_one(tmp_path, straight_run):
    log = tmp_path / "compiled.jsonl"
    ranks = main_on_ranks(tmp_path, (*STRAIGHT, "--compile", "--log-every", "1", "--log-file", str(log), "--save-dir",
                                     str(tmp_path / "compiled")), 2, straight_run.data_dir,
                          main_then_compiled_wrapper_forwards)
    assert all(refusal is None and forwards >= 1 for _, refusal, forwards in ranks), "the wrapper was compiled"
    losses = [row["loss"] for row in read_log(log)]
    assert losses == pytest.approx(straight_run.losses, rel=1e-4) and len(losses) == 8
    compiled = model_state(tmp_path / "compiled")
    assert compiled.keys() == straight_run.state.keys(), "a compiled run's checkpoint resumes an eager run, and back"
    for name, value in straight_run.state.items():  # compiled kernels round differently
        torch.testing.assert_close(compiled[name], value, rtol=1e-3, atol=5e-5, msg=name)


def test_ctrl_c_stops_every_rank_after_the_step_with_a_checkpoint_to_resume_from(tmp_path):
    log, save = tmp_path / "log.jsonl", tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "examples" / "bert.py"), "--corpus", str(SLICE), "--data-dir", str(shared_data(tmp_path)),
           "--max-steps", "1000", "--log-every", "1", "--log-file", str(log), "--save-dir", str(save)]
    # A session of its own, so that the Ctrl-C reaches its whole group (agent and workers) as a terminal's would.
    run = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                           env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    deadline = time.monotonic() + 120
    while not (log.exists() and len(read_log(log)) >= 3) and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    os.killpg(run.pid, signal.SIGINT)
    out, err = run.communicate(timeout=60)
    lines = re.findall(r"interrupted by SIGINT after step (\d+); checkpoint (\S+) written, continue with --resume",
                       err)
    assert len(lines) == 1, out[-2000:] + err[-3000:]
    step, written = int(lines[0][0]), Path(lines[0][1])
    assert 3 <= step < 1000 and written.name == f"step-{step:08d}.pt" and written.exists()
    assert read_log(log)[-1]["step"] == step, "every rank stopped at the same step"
    resumed = in_ranks(tmp_path, "--max-steps", str(step + 1), "--save-dir", str(save), "--resume", nproc=1)
    assert f"resuming from step {step}" in resumed
    # A shorter run than the interrupted one asked for, and its schedule with it: said, not refused.
    assert f"changed since the checkpoint, and taken as given: --max-steps 1000 -> {step + 1}" in resumed


def test_a_killed_worker_is_restarted_and_the_run_ends_as_if_uninterrupted(tmp_path, straight_run):
    # Rank 1 is killed in step 6 of the first attempt; torchrun restarts both workers, which resume
    # from the checkpoint of step 4 and redo steps 5 and 6.
    save = tmp_path / "crashed"
    crashed = ok(straight_run.torchrun(tmp_path, *STRAIGHT, "--save-every", "2", "--save-dir", str(save),
                                       script=CRASH_ONCE, launcher=("--standalone", "--max-restarts", "1"),
                                       env={"CRASH_RANK": "1", "CRASH_AT_STEP": "6"}))
    output = crashed.stdout + crashed.stderr
    assert "killed rank 1 in step 6" in output and "restart 1: resuming from" in output, output[-3000:]
    assert "step-00000004.pt" in output.split("restart 1: resuming from")[1].splitlines()[0]
    restarted = model_state(save)
    for name, value in straight_run.state.items():
        assert torch.equal(value, restarted[name]), name


def error_lines(result: subprocess.CompletedProcess, message: str) -> list[str]:
    """The lines naming the problem, after checking that the run failed without a traceback of ours."""
    assert result.returncode != 0, result.stdout[-2000:]
    ours = [f'File "{ROOT / folder}' for folder in ("hsync", "examples")]  # torchrun's own traceback may follow
    assert not any(frame in result.stderr for frame in ours), result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if message in line]
    assert lines, result.stderr[-3000:]
    return lines


def test_bad_input_is_one_line_on_every_rank_before_any_work(tmp_path):
    flag = torchrun(tmp_path, "--update-freq", "3")
    # Every rank refuses it alone, at once; torchrun may stop the second before it prints.
    lines = error_lines(flag, "--global-batch-size 32 is not a multiple of --update-freq 3")
    assert len(lines) <= 2 and all(line.startswith("bert.py: error:") for line in lines), lines

    # The run's decisions, in main as the launch runs it: every rank exits with the same line.
    one_sentence = tmp_path / "one.txt"
    one_sentence.write_text("In the beginning God created the heaven and the earth.\n")
    corpus = ("--corpus", str(one_sentence))
    for refusal in refusals_in_ranks(tmp_path, *corpus, data_dir=tmp_path / "one-data"):
        assert "holds 1 document(s): too few to hold 2 out" in refusal, refusal
    assert not list((tmp_path / "one-data").glob("vocab-*")), "refused before a vocabulary was trained"
    (refusal,) = refusals_in_ranks(tmp_path, *corpus, "--valid-fraction", "0", nproc=1)
    assert "gave no training example" in refusal, refusal
    for refusal in refusals_in_ranks(tmp_path, "--global-batch-size", "100000"):  # cut to the corpus, silently
        assert "training examples, fewer than --global-batch-size 100000" in refusal, refusal

    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "step-00000004.pt").write_bytes(b"")  # an interrupted copy of a run's folder, say
    for refusal in refusals_in_ranks(tmp_path, "--save-dir", str(damaged), "--resume"):
        assert "step-00000004.pt is damaged or not a checkpoint: EOFError" in refusal, refusal

    a_file = tmp_path / "a-file"
    a_file.write_text("")
    for refusal in refusals_in_ranks(tmp_path, "--save-dir", str(a_file / "run"), data_dir=tmp_path / "unused"):
        assert "cannot write the run's outputs" in refusal, refusal
    assert not (tmp_path / "unused").exists(), "no data prepared before the outputs were found unwritable"


def prepare_three_times(rank: int, world_size: int, corpus: Path, data_dir: Path) -> list[tuple[str, str, int]]:
    """The trainer's data preparation of `corpus`, again, and once more after rank 0 edited it (the same name,
    another text): each time what it reported on rank 0, the vocabulary's digest and the training examples."""
    from apps.bert.config import parse_args
    from apps.bert.data import prepare_data

    cfg, preset = parse_args(["--corpus", str(corpus), "--data-dir", str(data_dir)], world_size=world_size)
    prepared = []
    for edit in (False, False, True):
        if edit and rank == 0:
            corpus.write_text(SLICE.read_text().replace("God", "Elohim"))
        torch.distributed.barrier()
        with contextlib.redirect_stderr(io.StringIO()) as said:
            data = prepare_data(cfg, preset)
        prepared.append((said.getvalue(), data.vocab.digest, len(data.train)))
    return prepared


def test_data_is_prepared_once_and_cached_by_content(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(SLICE.read_text())
    ranks = run_ranks(prepare_three_times, 2, corpus, tmp_path / "data", env={"LOCAL_RANK": "{rank}"})
    (first, _, _), (again, _, _), (edited, _, _) = ranks[0]
    assert "vocabulary: trained" in first and "examples: built" in first, first
    assert "vocabulary: reused" in again and "examples: reused" in again, again
    assert "vocabulary: trained" in edited and "examples: built" in edited, edited
    assert [(digest, n) for _, digest, n in ranks[0]] == [(digest, n) for _, digest, n in ranks[1]]
    assert ranks[0][2][1] != ranks[0][0][1] == ranks[0][1][1], "the edited text has a vocabulary of its own"


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (read from /proc)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += parents.get(tree[-1], [])
    return tree


def wait_for_listener(port: int, process: subprocess.Popen, limit_s: float = 60.0) -> None:
    """Returns once a socket of this machine listens on `port`, while `process` lives (read from /proc, so
    the listener sees no connection)."""
    listening = re.compile(rf":{port:04X} 0+:0000 0A ")  # the local port, no remote end, state LISTEN
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and process.poll() is None:
        if any(listening.search(Path(table).read_text()) for table in ("/proc/net/tcp", "/proc/net/tcp6")
               if Path(table).exists()):
            return
        time.sleep(0.1)
    raise AssertionError(f"nothing listened on port {port} within {limit_s} s (exit code {process.poll()})")


def test_nodes_joined_by_c10d_rendezvous_go_on_when_one_is_lost(tmp_path):
    """torchrun --nnodes 1:2 on two "machines" (separate data directories, a shared checkpoint directory):
    one is lost (its agent and workers killed); the other's workers restart as a world of one and
    resume from the latest checkpoint."""
    port = free_port()
    endpoint = f"127.0.0.1:{port}"
    logs = [tmp_path / f"node{n}.jsonl" for n in (0, 1)]
    nodes = []
    # The lost node is dropped from the rendezvous after three missed heartbeats, 1 s apart (torch's default: 5 s).
    rendezvous = "last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3"
    for node in (0, 1):
        launcher = ("--nnodes", "1:2", "--nproc_per_node=1", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                    "--rdzv-id", "hsync-test", "--max-restarts", "1", "--rdzv-conf", rendezvous)
        cmd = [sys.executable, "-m", "torch.distributed.run", *launcher, str(ROOT / "examples" / "bert.py"),
               "--corpus", str(SLICE), "--data-dir", str(tmp_path / f"data{node}"), "--max-steps", "12",
               "--balance", "equal", "--log-every", "1", "--log-file", str(logs[node]),
               "--save-dir", str(tmp_path / "run"), "--save-every", "2"]
        nodes.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
                                      env={**os.environ, "OMP_NUM_THREADS": "1"}))
        if node == 0:  # node 0's agent must host the rendezvous store (it is the one to survive): it binds first
            wait_for_listener(port, nodes[0])

    def steps_logged() -> list[dict]:
        return [row for log in logs if log.exists() for row in read_log(log)]

    deadline = time.monotonic() + 120
    while not any(row["step"] >= 4 for row in steps_logged()) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in process_tree(nodes[1].pid):
        os.kill(pid, signal.SIGKILL)
    nodes[1].wait()
    survivor = nodes[0].communicate(timeout=180)[0]
    assert nodes[0].returncode == 0, survivor[-4000:]
    resumed = re.search(r"restart 1: resuming from step (\d+) \(\S+, written by 2 ranks, now 1\)", survivor)
    assert resumed, survivor[-4000:]
    rows = steps_logged()
    before, after = [r for r in rows if len(r["rank_busy_seconds"]) == 2], read_log(logs[0])
    assert before and before[0]["step"] == 1 and after[-1]["step"] == 12, "two ranks first, one rank to the end"
    assert len(after[-1]["rank_busy_seconds"]) == 1 and len(after[-1]["plan"]) == 1


def test_a_sharded_optimizer_makes_the_whole_ones_updates_and_its_checkpoints_resume_without_it(tmp_path,
                                                                                                 straight_run):
    sharded = tmp_path / "sharded"
    straight_run.in_ranks(tmp_path, *STRAIGHT, "--shard-optimizer", "--save-dir", str(sharded), "--stop-at", "4")
    resumed = straight_run.in_ranks(tmp_path, *STRAIGHT, "--save-dir", str(sharded), "--resume", nproc=1)
    assert "--shard-optimizer True -> False" in resumed, resumed
    # Clipping sums the shards' norms in another order: the same updates within float32 rounding.
    for name, value in model_state(sharded).items():
        torch.testing.assert_close(value, straight_run.state[name], rtol=1e-4, atol=1e-5, msg=name)
