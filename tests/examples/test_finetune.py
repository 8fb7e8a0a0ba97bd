"""examples/finetune.py: a pretrained MiniLM fine-tuned across two ranks, batches split by hsync.Balancer."""

import re
import subprocess
import sys

import pytest
import torch

from tests.examples import EXAMPLES, load, main_on_ranks, output_on_ranks

pytestmark = pytest.mark.distributed

FINETUNE = EXAMPLES / "finetune.py"
finetune = load(FINETUNE)


def test_demo_task_is_learned_across_two_ranks_as_by_one(tmp_path):
    args = ("--epochs", "1", "--dropout", "0")
    printed = output_on_ranks("finetune.py", tmp_path, *args, "--save-dir", str(tmp_path / "tuned"))
    epochs = re.findall(r"epoch (\d): train loss [0-9.]+, held-out accuracy ([0-9.]+) on (\d+) examples, "
                        r"last split \[(\d+), (\d+)\]", printed)
    assert [e[0] for e in epochs] == ["1"], printed
    # chance is 0.5; unseen adjectives need the pretrained weights. Both ranks' shards are counted.
    assert float(epochs[-1][1]) >= 0.7 and all(e[2] == "80" for e in epochs), printed
    assert all(int(a) + int(b) == 16 for *_, a, b in epochs), printed
    from transformers import AutoModelForSequenceClassification

    tuned = AutoModelForSequenceClassification.from_pretrained(tmp_path / "tuned")
    assert tuned.config.num_labels == 2 and (tmp_path / "tuned" / "tokenizer_config.json").is_file()
    # Without dropout (whose masks each rank draws), one process makes the same updates. The flag reaches the
    # attention's probability too, which transformers reads from the configuration.
    assert tuned.config.hidden_dropout_prob == tuned.config.attention_probs_dropout_prob == 0
    [(alone, refusal)] = main_on_ranks("finetune.py", tmp_path, [*args, "--save-dir", str(tmp_path / "alone")],
                                       nproc=1)
    assert refusal is None, alone
    one = AutoModelForSequenceClassification.from_pretrained(tmp_path / "alone").state_dict()
    for name, value in tuned.state_dict().items():
        torch.testing.assert_close(value, one[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize(("lines", "args", "message"), [
    ("1\tfine\nnot a label line\n", (), "bad.txt:2: expected 'label<TAB>text'"),
    ("1\tfine\n0\tpoor\n1\tgood\n", (), "bad.txt holds 3 labelled line(s): too few to hold a fifth out"),
    ("1\tfine\n-1\tpoor\n", (), "bad.txt:2: the label '-1' is not a class number 0, 1, 2, ..."),
    ("1\tfine\n0\tpoor\n7\tgood\n1\tok\n0\tmeh\n", (), "5 of the classes 0..7 never appear (2, 3, 4, 5, 6)"),
    ("1\tfine\n\u00b2\tpoor\n", (), "bad.txt:2: the label '\u00b2' is not a class number 0, 1, 2, ..."),
    ("1\tfine\n", ("--batch-size", "0"), "argument --batch-size: must be at least 1, got 0"),
    ("1\tfine\n", ("--warmup-fraction", "1"), "--warmup-fraction must be in [0, 1), got 1.0"),
    ("\n \n", (), "bad.txt holds no labelled line ('label<TAB>text')"),
    ("0\tfine\n0\tpoor\n0\tgood\n0\tok\n0\tmeh\n", (), "a classifier needs two classes or more; every line has "
                                                         "label 0"),
    ("1\tfine\n0\tpoor\n1\tgood\n1\tok\n0\tmeh\n", ("--save-dir", "{tmp}/bad.txt/out"),
     "bad.txt/out cannot be written: NotADirectoryError"),
    ("1\tfine\n", ("--dropout", "1"), "argument --dropout: must be in [0, 1), got 1"),
    # The folder the check made to write in was left behind by a run refused afterwards.
    ("1\tfine\nnot a label line\n", ("--save-dir", "{tmp}/new/out"), "bad.txt:2: expected 'label<TAB>text'"),
    ("1\tfine\n0\tpoor\n1\tgood\n1\tok\n0\tmeh\n", ("--model", "{tmp}/model", "--save-dir", "{tmp}/model/."),
     "--save-dir {tmp}/model is the --model folder: the fine-tuned model would overwrite the one it starts from"),
    # Path("") is the current folder: the model and tokenizer files went loose there.
    ("1\tfine\n0\tpoor\n1\tgood\n1\tok\n0\tmeh\n", ("--save-dir", ""),
     "argument --save-dir: expected a path, got an empty one"),
], ids=["malformed", "too-small", "negative-label", "stray-label", "superscript-label", "batch-size", "warmup",
        "empty", "one-class", "unwritable-save-dir", "dropout", "save-dir-refused-later", "save-dir-is-the-model",
        "empty-save-dir"])
def test_a_bad_file_or_flag_is_one_line_before_any_work(tmp_path, capsys, lines, args, message):
    bad = tmp_path / "bad.txt"
    bad.write_text(lines)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    with pytest.raises(SystemExit) as refused:
        finetune.parse(["--data", str(bad), *(arg.format(tmp=tmp_path) for arg in args)])
    error = capsys.readouterr().err
    assert refused.value.code == 2 and error.count("\n") == 1 and message.format(tmp=tmp_path) in error, error
    assert not (tmp_path / "new").exists(), "a refused run left a folder"


def test_the_program_refuses_before_any_work_in_one_line(tmp_path):
    """parse() above is the program's first step: run as users run it, that is all it prints."""
    result = subprocess.run([sys.executable, str(FINETUNE), "--batch-size", "0"], capture_output=True, text=True,
                            timeout=120, cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "argument --batch-size: must be at least 1, got 0" in result.stderr


@pytest.mark.parametrize(("config", "message"), [
    ("{}", "does not load as a model with its tokenizer: ValueError: "),
    ("{", "does not load as a model with its tokenizer: OSError: It looks like the config file at "),
], ids=["not-a-model", "bad-json"])
def test_a_model_folder_that_does_not_load_is_one_line(tmp_path, config, message):
    # It passed the flag check (it has a config.json), then from_pretrained's traceback ended the program.
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(config)
    result = subprocess.run([sys.executable, str(FINETUNE), "--model", str(folder), "--device", "cpu"],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert f"finetune.py: error: --model {folder} {message}" in result.stderr, result.stderr


def test_a_batch_larger_than_the_data_is_noted(tmp_path):
    data = tmp_path / "small.txt"
    data.write_text("".join(f"{i % 2}\ttext {i}\n" for i in range(10)))  # 8 to train on, 2 held out
    *_, notes = finetune.parse(["--data", str(data), "--batch-size", "64"])
    assert "--batch-size 64 is more than the 8 training texts: each step takes all of them, one step an epoch" \
        in notes, notes
    *_, notes = finetune.parse(["--data", str(data), "--batch-size", "8"])
    assert not any("--batch-size" in note for note in notes), notes


def test_the_classifier_starts_in_training_mode_with_a_head_for_the_tasks_classes(tmp_path):
    # from_pretrained gives a model in eval mode: the first epoch ran without dropout. And a classifier fine-tuned
    # for another number of classes failed to load, where a new head is what the task needs.
    _, two, _ = finetune.labelled.pretrained_classifier(None, 2)
    assert two.training and all(module.training for module in two.modules())
    two.save_pretrained(tmp_path / "two")
    _, again, _ = finetune.labelled.pretrained_classifier(tmp_path / "two", 2)
    assert torch.equal(again.classifier.weight, two.classifier.weight), "a head of the task's size is kept"
    _, three, _ = finetune.labelled.pretrained_classifier(tmp_path / "two", 3)
    assert three.training and three.classifier.weight.shape[0] == 3 and three.config.num_labels == 3
