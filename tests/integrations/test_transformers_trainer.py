"""hsync.integrations.transformers.Trainer on two real ranks (gloo), against one process over the same
global batches: a classifier (a mean over examples), a masked LM (a mean over tokens) and a causal LM (over
the tokens after the first), uneven fixed shares and measured ones, gradient accumulation on; saving, and what
is refused."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests import integrations
from tests.integrations import LAUNCH_ENV, assert_near_float32
from tests.spawn import run_ranks

pytestmark = pytest.mark.distributed
transformers = pytest.importorskip("transformers")

EXAMPLES = 96
PER_DEVICE = 8
ACCUMULATION = 2  # micro-batches per step: a global batch of 8 x 2 x 2 ranks = 32
EPOCHS = 2
LR = 0.5
ENV = LAUNCH_ENV


def tiny_model(task: str) -> torch.nn.Module:
    from transformers import BertConfig, BertForMaskedLM, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel

    if task == "causal":  # a causal LM whose loss_type is unset, as GPT-2's: its loss shifts the labels all the same
        torch.manual_seed(0)
        return GPT2LMHeadModel(GPT2Config(vocab_size=40, n_positions=32, n_embd=16, n_layer=1, n_head=2,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    config = BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=32, num_labels=3, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    return (BertForSequenceClassification if task == "classify" else BertForMaskedLM)(config)


class Texts(torch.utils.data.Dataset):
    """Token sequences of 3 to 20 tokens; a label per text (classify) or per masked token (mlm). Records the
    indices it serves once `recording` is set, a list per optimizer step."""

    def __init__(self, task: str) -> None:
        g = torch.Generator().manual_seed(1)
        self.items = []
        for _ in range(EXAMPLES):
            ids = torch.randint(1, 40, (int(torch.randint(3, 21, (1,), generator=g)),), generator=g)
            if task == "classify":
                labels = int(ids.sum() % 3)
            elif task == "causal":  # every next token (collate pads with -100)
                labels = ids
            else:
                labels = torch.where(torch.rand(len(ids), generator=g) < 0.3, ids, torch.full_like(ids, -100))
                labels[0] = ids[0]  # at least one token to predict
            self.items.append({"input_ids": ids.tolist(), "labels": labels if isinstance(labels, int)
                               else labels.tolist()})
        self.recording = False
        self.steps: list[list[int]] = [[]]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        if self.recording:
            self.steps[-1].append(i)
        return self.items[i]


def collate(features: list[dict]) -> dict[str, torch.Tensor]:
    longest = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), longest, dtype=torch.long)
    mask = torch.zeros(len(features), longest, dtype=torch.long)
    for row, f in enumerate(features):
        ids[row, :len(f["input_ids"])] = torch.tensor(f["input_ids"])
        mask[row, :len(f["input_ids"])] = 1
    batch = {"input_ids": ids, "attention_mask": mask}
    if isinstance(features[0]["labels"], int):
        batch["labels"] = torch.tensor([f["labels"] for f in features])
    else:
        labels = torch.full((len(features), longest), -100, dtype=torch.long)
        for row, f in enumerate(features):
            labels[row, :len(f["labels"])] = torch.tensor(f["labels"])
        batch["labels"] = labels
    return batch


def training_args(output_dir: str, **overrides) -> transformers.TrainingArguments:
    options = dict(output_dir=output_dir, per_device_train_batch_size=PER_DEVICE,
                   gradient_accumulation_steps=ACCUMULATION, num_train_epochs=EPOCHS, learning_rate=LR,
                   optim="sgd", lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0, use_cpu=True,
                   report_to=[], logging_steps=1, save_strategy="no", disable_tqdm=True, seed=3)
    return transformers.TrainingArguments(**{**options, **overrides})


def train_with_hsync(rank: int, world_size: int, task: str, shares: list[int] | None, output_dir: str,
                     resume_from: str | None = None, overrides: dict | None = None, global_batch: int | None = None,
                     callbacks: tuple = (), shard_optimizer: bool = False) -> dict:
    from transformers import TrainerCallback

    from hsync.integrations.transformers import BalancingArguments, Trainer

    data = Texts(task)
    model = tiny_model(task)
    skipped: list[bool] = []
    epochs: list[float] = []  # state.epoch as a callback sees it after each step
    dtypes = set()  # of every linear layer's output: float32, or bfloat16 under autocast
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_hook(lambda module, inputs, output: dtypes.add(str(output.dtype)))

    class Steps(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            data.recording = True

        def on_step_end(self, args, state, control, optimizer=None, **kwargs):
            data.steps.append([])
            epochs.append(state.epoch)
            skipped.append(bool(getattr(optimizer, "step_was_skipped", False)))  # by float16's GradScaler

    trainer = Trainer(model=model, args=training_args(output_dir, **(overrides or {})), train_dataset=data,
                      eval_dataset=Texts(task), data_collator=collate, callbacks=[Steps(), *callbacks],
                      balancing=BalancingArguments(global_batch_size=global_batch, rank_batch_sizes=shares,
                                                   replan_every=2, shard_optimizer=shard_optimizer))
    trainer.train(resume_from_checkpoint=resume_from)
    if rank == 0:
        trainer.save_model(os.path.join(output_dir, "final"))
    torch.distributed.barrier()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return {"params": {n: p.detach().cpu().clone() for n, p in trainer.model.named_parameters()},
            "steps": data.steps[:-1], "global_step": trainer.state.global_step, "losses": losses,
            "loader_length": len(trainer.get_train_dataloader()), "plan": trainer.balancer.planned_split(),
            "dtypes": sorted(dtypes), "checkpointing": trainer.model.is_gradient_checkpointing,
            "find_unused": trainer.weighted_model.find_unused_parameters, "log": trainer.state.log_history,
            "compiled": type(trainer.model_wrapped).__name__,
            "best_checkpoint": trainer.state.best_model_checkpoint, "skipped": skipped,
            "sharded": type(trainer.sharded_optimizer).__name__, "tokens_seen": trainer.state.num_input_tokens_seen,
            "epochs": epochs, "flos": trainer.state.total_flos,
            "flos_per_token": 6 * model.num_parameters(exclude_embeddings=True)}


def one_process(task: str, steps: list[list[int]]) -> tuple[dict[str, torch.Tensor], list[float]]:
    """SGD over the same global batches, each in one forward: the model's mean over the whole batch."""
    model, data = tiny_model(task), Texts(task)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for indices in steps:
        loss = model(**collate([data[i] for i in indices])).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {n: p.detach() for n, p in model.named_parameters()}, losses


# Fixed shares with a mean over examples, measured ones with a mean over tokens (both kinds of weight, both
# kinds of split; the resume test below runs the second again). A compiled wrapper (torch_compile) and
# gradient checkpointing, which recomputes the same activations, make the same steps; with checkpointing
# find_unused_parameters is off, as TrainingArguments then asks.
@pytest.mark.parametrize(("task", "shares", "overrides"), [
    ("classify", [24, 8], {"torch_compile": True, "torch_compile_backend": "aot_eager"}),
    ("classify", [24, 8], {"gradient_checkpointing": True}), ("mlm", None, {}), ("causal", [20, 12], {})],
    ids=["classify-24+8-compiled", "classify-24+8-checkpointing", "mlm-auto", "causal-lm-20+12"])
def test_trainer_steps_equal_one_process_over_the_same_global_batches(task, shares, overrides, tmp_path):
    ranks = run_ranks(train_with_hsync, 2, task, shares, str(tmp_path), None, overrides, env=ENV, timeout=240)
    steps = EPOCHS * EXAMPLES // (PER_DEVICE * ACCUMULATION * 2)
    for result in ranks:
        assert result["global_step"] == steps and result["loader_length"] == steps // EPOCHS
        assert result["dtypes"] == ["torch.float32"]
        checkpointing = overrides.get("gradient_checkpointing", False)
        assert result["checkpointing"] == checkpointing and result["find_unused"] == (not checkpointing)
        assert result["compiled"] == ("OptimizedModule" if overrides.get("torch_compile") else "WeightedDDP")
    global_batches = [a + b for a, b in zip(ranks[0]["steps"], ranks[1]["steps"], strict=True)]
    assert len(global_batches) == steps
    for epoch in range(EPOCHS):  # every example once per epoch
        seen = [i for batch in global_batches[epoch * 3:(epoch + 1) * 3] for i in batch]
        assert sorted(seen) == list(range(EXAMPLES))
    if shares is not None:
        assert [[len(s) for s in rank["steps"]] for rank in ranks] == [[shares[0]] * steps, [shares[1]] * steps]
    expected, losses = one_process(task, global_batches)
    for result in ranks:
        for name, value in expected.items():
            torch.testing.assert_close(result["params"][name], value, rtol=1e-5, atol=1e-6, msg=name)
        # Trainer logs the step's loss over every rank.
        assert result["losses"] == pytest.approx(losses, rel=1e-5)
    saved = transformers.AutoModel.from_pretrained(tmp_path / "final")  # no "module." prefix: it loads whole
    base = dict(saved.named_parameters())
    for name, value in expected.items():
        if name.startswith("bert."):
            torch.testing.assert_close(base[name.removeprefix("bert.")], value, rtol=1e-5, atol=1e-6)


def test_dataloader_drop_last_sequential_sampling_and_the_tokens_seen_are_trainers(tmp_path):
    # 96 examples in global batches of 40: two whole steps an epoch, the short third dropped, in the data's order;
    # the tokens seen counted over every micro-batch of every rank (Trainer read a step's list of them as none).
    overrides = {"dataloader_drop_last": True, "train_sampling_strategy": "sequential",
                 "include_num_input_tokens_seen": "non_padding"}
    ranks = run_ranks(train_with_hsync, 2, "classify", [30, 10], str(tmp_path), None, overrides, 40, env=ENV,
                      timeout=240)
    global_batches = [sorted(a + b) for a, b in zip(ranks[0]["steps"], ranks[1]["steps"], strict=True)]
    assert global_batches == [list(range(40)), list(range(40, 80))] * EPOCHS
    tokens = EPOCHS * sum(len(Texts("classify").items[i]["input_ids"]) for i in range(80))
    for result in ranks:
        assert result["global_step"] == 2 * EPOCHS and result["loader_length"] == 2
        assert result["tokens_seen"] == tokens
        assert result["flos"] >= result["flos_per_token"] * tokens > 0  # padding counts there too


def test_a_resume_through_trainers_checkpoint_ends_as_an_uninterrupted_run(tmp_path):
    # Checkpoints every 2 steps of 6 (3 an epoch): the one at step 4 lies inside the second epoch.
    straight = run_ranks(train_with_hsync, 2, "mlm", None, str(tmp_path / "a"), None,
                         {"save_strategy": "steps", "save_steps": 2}, env=ENV, timeout=240)
    checkpoint = tmp_path / "a" / "checkpoint-4"
    assert (checkpoint / "hsync_balancer.pt").is_file()
    resumed = run_ranks(train_with_hsync, 2, "mlm", None, str(tmp_path / "b"), str(checkpoint), env=ENV, timeout=240)
    def global_batches(ranks: list[dict]) -> list[list[int]]:
        return [sorted(a + b) for a, b in zip(ranks[0]["steps"], ranks[1]["steps"], strict=True)]

    # The same global batches; the ranks' shares of them follow what each run measured.
    assert global_batches(resumed) == global_batches(straight)[4:]
    for before, after in zip(straight, resumed, strict=True):
        assert after["global_step"] == 6
        # Trainer's count went back to 1 + 1/3 at the first step resumed, and ended at 1 + 2/3.
        assert after["epochs"] == before["epochs"][4:] == pytest.approx([5 / 3, 2.0])
        for name, value in before["params"].items():
            torch.testing.assert_close(after["params"][name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_a_sharded_optimizer_makes_the_updates_of_trainers_own_and_its_checkpoints_resume_without_it(tmp_path):
    """AdamW with weight decay (Trainer's two groups) and clipping, through hsync.ShardedOptimizer: the steps of the
    same run without sharding, and a checkpoint that a run without sharding resumes."""
    adamw = {"optim": "adamw_torch", "learning_rate": 1e-3, "weight_decay": 0.01, "max_grad_norm": 0.5,
             "save_strategy": "steps", "save_steps": 2}
    whole = run_ranks(train_with_hsync, 2, "classify", [24, 8], str(tmp_path / "whole"), None, adamw, env=ENV,
                      timeout=240)
    sharded = run_ranks(train_with_hsync, 2, "classify", [24, 8], str(tmp_path / "sharded"), None, adamw, None, (),
                        True, env=ENV, timeout=240)
    assert [r["sharded"] for r in sharded] == ["ShardedOptimizer"] * 2
    resumed = run_ranks(train_with_hsync, 2, "classify", [24, 8], str(tmp_path / "resumed"),
                        str(tmp_path / "sharded" / "checkpoint-4"), adamw, env=ENV, timeout=240)
    for how, other in (("sharded", sharded), ("resumed without sharding", resumed)):
        for before, after in zip(whole, other, strict=True):
            # Clipping sums the shards' norms in another order: the same updates within float32 rounding.
            for name, value in before["params"].items():
                torch.testing.assert_close(after["params"][name], value, rtol=1e-5, atol=1e-6, msg=f"{how}: {name}")
    norms = [[entry["grad_norm"] for entry in r["log"] if "grad_norm" in entry] for r in (whole[0], sharded[0])]
    assert norms[1] == pytest.approx(norms[0], rel=1e-5), norms  # the logged norm is over every rank's shard


def test_a_resume_in_one_process_goes_on_with_the_same_global_batches(tmp_path):
    # The global batch is fixed (BalancingArguments.global_batch_size), not derived from the ranks: two ranks
    # stop at step 4 of 6, one plain process (no torchrun, hence no process group) trains the rest.
    both = run_ranks(train_with_hsync, 2, "mlm", None, str(tmp_path / "a"), None,
                     {"save_strategy": "steps", "save_steps": 2}, 32, env=ENV, timeout=240)
    alone = run_ranks(integrations.alone, 1, train_with_hsync, "mlm", None, str(tmp_path / "b"),
                      str(tmp_path / "a" / "checkpoint-4"), None, 32, timeout=240)[0]
    assert alone["global_step"] == 6 and alone["loader_length"] == 3
    global_batches = [sorted(a + b) for a, b in zip(both[0]["steps"], both[1]["steps"], strict=True)]
    assert [sorted(step) for step in alone["steps"]] == global_batches[4:]
    for name, value in both[0]["params"].items():
        torch.testing.assert_close(alone["params"][name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_bf16_runs_the_forward_under_autocast_and_stays_near_float32(tmp_path):
    # bfloat16 rounds each rank's micro-batches as it rounds one process's whole batch only to within its 8
    # bits of mantissa: the steps are compared with one float32 process's over the same global batches
    # (which a float32 run equals, above), within what that rounding allows.
    mixed = run_ranks(train_with_hsync, 2, "classify", [24, 8], str(tmp_path), None, {"bf16": True},
                      env=ENV, timeout=240)
    expected, losses = one_process("classify", [a + b for a, b in zip(mixed[0]["steps"], mixed[1]["steps"],
                                                                      strict=True)])
    for result in mixed:
        assert result["dtypes"] == ["torch.bfloat16"]
        assert result["losses"] == pytest.approx(losses, rel=1e-3)
        assert_near_float32(result["params"], expected, dict(tiny_model("classify").named_parameters()))
    torch.testing.assert_close(mixed[0]["params"], mixed[1]["params"], rtol=0, atol=0)  # one update on every rank


def test_early_stopping_stops_every_rank_at_the_same_step_with_the_best_model(tmp_path):
    # Evaluated and saved every step; no gain of 10 in the loss ever counts as one, so the second evaluation
    # uses up a patience of 1 and training stops at step 2 of 6, then loads the best of the two checkpoints.
    from transformers import EarlyStoppingCallback

    overrides = {"eval_strategy": "steps", "eval_steps": 1, "save_strategy": "steps", "save_steps": 1,
                 "load_best_model_at_end": True, "metric_for_best_model": "eval_loss", "per_device_eval_batch_size": 8}
    stopper = EarlyStoppingCallback(early_stopping_patience=1, early_stopping_threshold=10.0)
    ranks = run_ranks(train_with_hsync, 2, "classify", [24, 8], str(tmp_path), None, overrides, None, (stopper,),
                      env=ENV, timeout=240)
    evaluations = [[entry["eval_loss"] for entry in result["log"] if "eval_loss" in entry] for result in ranks]
    assert evaluations[0] == evaluations[1] and len(evaluations[0]) == 2  # over every rank, and the same
    best = 1 + min(range(2), key=lambda i: evaluations[0][i])
    global_batches = [a + b for a, b in zip(ranks[0]["steps"], ranks[1]["steps"], strict=True)]
    expected, _ = one_process("classify", global_batches[:best])
    for result in ranks:
        assert result["global_step"] == 2 and result["best_checkpoint"].endswith(f"checkpoint-{best}")
        for name, value in expected.items():
            torch.testing.assert_close(result["params"][name], value, rtol=1e-5, atol=1e-6, msg=name)


def evaluation_loss(rank: int, world_size: int, task: str, output_dir: str, plain: bool = False) -> float:
    from hsync.integrations.transformers import Trainer

    trainer = (transformers.Trainer if plain else Trainer)(
        model=tiny_model(task), args=training_args(output_dir, per_device_eval_batch_size=8), train_dataset=Texts(task),
        eval_dataset=Texts(task), data_collator=collate)
    return trainer.evaluate()["eval_loss"]


@pytest.mark.parametrize("task", ["classify", "causal"])
def test_the_evaluation_loss_is_one_processs(task, tmp_path):
    # Ranks evaluate batches of 8 in turn, as one process does all of them: the same batches, each one's loss
    # averaged over the examples. transformers' own, under DDP, multiplies each rank's batch loss by the number of
    # ranks, which only a model dividing its loss by every rank's tokens undoes: a classifier's was twice as high.
    # (A causal LM's is a mean over the tokens after the first, where plain transformers counts the first too.)
    one = run_ranks(integrations.alone, 1, evaluation_loss, task, str(tmp_path / "one"), timeout=120)[0]
    if task == "classify":
        plain = run_ranks(integrations.alone, 1, evaluation_loss, task, str(tmp_path / "plain"), True, timeout=120)
        assert one == pytest.approx(plain[0], rel=1e-6)
    for loss in run_ranks(evaluation_loss, 2, task, str(tmp_path / "two"), env=ENV, timeout=120):
        assert loss == pytest.approx(one, rel=1e-6), (loss, one)


def wrapped_in_torch_ddp(rank: int, world_size: int) -> str:
    import hsync

    outer = torch.nn.parallel.DistributedDataParallel(hsync.WeightedDDP(torch.nn.Linear(4, 1)))
    try:
        outer(torch.randn(2, 4))
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_a_weighted_ddp_inside_torch_ddp_is_refused_on_every_rank():
    for message in run_ranks(wrapped_in_torch_ddp, 2):
        assert "wrapped in a torch DistributedDataParallel" in message, message


def balancer_through_accelerate(rank: int, world_size: int) -> str:
    from accelerate import Accelerator

    import hsync

    model = hsync.WeightedDDP(torch.nn.Linear(4, 1))
    balancer = hsync.Balancer(model, 64, hsync.BalanceConfig(global_batch_size=16))
    loader = torch.utils.data.DataLoader(torch.randn(64, 4), batch_sampler=balancer)
    try:
        Accelerator(cpu=True).prepare(loader)
    except TypeError as error:
        return str(error)
    return "no error"


def test_a_balancer_is_refused_by_accelerates_sharding_on_every_rank():
    pytest.importorskip("accelerate")
    for message in run_ranks(balancer_through_accelerate, 2, env=ENV):
        assert "do not shard its loader again" in message, message


@pytest.mark.parametrize(("overrides", "world", "message"), [
    ({"fsdp": True}, "1", "cannot weigh gradients under fsdp"),
    # On a machine without a GPU, transformers sees no launch unless use_cpu is set.
    ({"use_cpu": False}, "2", "the launcher started 2 processes but TrainingArguments see 1"),
], ids=["fsdp", "launch-unseen"])
def test_what_cannot_work_is_refused_before_any_work(overrides, world, message, tmp_path, monkeypatch):
    # In the constructor, from the arguments and the launch's environment alone, which every rank shares: each
    # refuses alike, before the model is wrapped or any rank waits on another.
    from hsync.integrations.transformers import Trainer

    if world != "1" and torch.cuda.is_available():
        pytest.skip("with a GPU, transformers sees the launch")
    monkeypatch.setenv("WORLD_SIZE", world)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match=message):
        Trainer(model=tiny_model("classify"), args=training_args(str(tmp_path), **overrides),
                train_dataset=Texts("classify"), data_collator=collate)


def test_a_transformers_release_outside_the_tested_range_is_refused(monkeypatch, tmp_path):
    import hsync.integrations.transformers as integration

    monkeypatch.setattr(integration.transformers, "__version__", "4.46.0")
    with pytest.raises(RuntimeError, match="supports transformers >= 5.0, < 6; found 4.46.0"):
        integration.Trainer(model=tiny_model("classify"), args=training_args(str(tmp_path)),
                            train_dataset=Texts("classify"), data_collator=collate)


def handed_a_torch_ddp(rank: int, world_size: int, root: str) -> str:
    from hsync.integrations.transformers import Trainer

    model = torch.nn.parallel.DistributedDataParallel(tiny_model("classify"))
    try:  # Trainer's defaults: remove_unused_columns reads the forward's signature, DDP's (*inputs, **kwargs)
        Trainer(model=model, args=training_args(root), train_dataset=Texts("classify"), data_collator=collate)
    except TypeError as error:
        return str(error)
    return "no error"


def test_a_model_already_in_torch_ddp_is_refused_in_one_line_on_every_rank(tmp_path):
    # Once it hung until the deadline: the inner DDP's buffer broadcast waited on a rank running another micro-batch.
    for message in run_ranks(handed_a_torch_ddp, 2, str(tmp_path), env=LAUNCH_ENV):
        assert message == ("hsync.integrations.transformers.Trainer: the model is already wrapped in a "
                           "DistributedDataParallel; pass the module inside it (its .module): hsync wraps it itself")


class Regression(torch.nn.Module):
    """A plain nn.Module, as Trainer takes besides a PreTrainedModel: no .device, a dict with the loss out."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.net(x).squeeze(-1)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


class Points(torch.utils.data.Dataset):
    """Examples without input_ids (balanced by examples); records what it serves, a list per optimizer step."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(2)
        self.x = torch.randn(32, 8, generator=g)
        self.y = self.x @ torch.randn(8, generator=g)
        self.recording = False
        self.steps: list[list[int]] = [[]]

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if self.recording:
            self.steps[-1].append(i)
        return {"x": self.x[i], "labels": self.y[i]}


def plain_module_on_points(rank: int, world_size: int, output_dir: str) -> dict:
    from transformers import TrainerCallback

    from hsync.integrations.transformers import BalancingArguments, Trainer

    data = Points()

    class Steps(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            data.recording = True

        def on_step_end(self, args, state, control, **kwargs):
            data.steps.append([])

    trainer = Trainer(model=Regression(), args=training_args(output_dir, per_device_train_batch_size=4),
                      train_dataset=data, callbacks=[Steps()], balancing=BalancingArguments(rank_batch_sizes=[12, 4]))
    trainer.train()
    return {"params": {n: p.detach().clone() for n, p in trainer.model.named_parameters()}, "steps": data.steps[:-1]}


def test_a_plain_module_on_examples_without_input_ids_trains_as_one_process(tmp_path):
    # Both failed before any step: the module has no .device (a PreTrainedModel's), and transformers 5.23 renamed
    # TrainingArguments.group_by_length, which deciding whether to balance by tokens read.
    ranks = run_ranks(plain_module_on_points, 2, str(tmp_path), env=ENV, timeout=120)
    global_batches = [a + b for a, b in zip(ranks[0]["steps"], ranks[1]["steps"], strict=True)]
    assert [len(batch) for batch in global_batches] == [16] * 4  # 32 examples, 2 epochs
    model, data = Regression(), Points()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for indices in global_batches:
        model(data.x[indices], data.y[indices])["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()
    for result in ranks:
        for name, value in model.named_parameters():
            torch.testing.assert_close(result["params"][name], value.detach(), rtol=1e-5, atol=1e-6, msg=name)


ENDS_AT_EXIT = """
import atexit, sys
import torch, torch.distributed as dist
atexit.register(lambda: print("group at exit:", dist.is_initialized()))  # runs after hsync's, registered later
import transformers
from hsync.integrations.transformers import BalancingArguments, Trainer

class Regression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def forward(self, x, labels):
        return {"loss": torch.nn.functional.mse_loss(self.net(x).squeeze(-1), labels)}

data = [{"x": torch.randn(4), "labels": torch.randn(())} for _ in range(8)]
args = transformers.TrainingArguments(output_dir=sys.argv[1], per_device_train_batch_size=4, num_train_epochs=1,
                                      use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True)
Trainer(model=Regression(), args=args, train_dataset=data, balancing=BalancingArguments()).train()
if sys.argv[2] == "fail":
    raise RuntimeError("the program failed after training")
"""


@pytest.mark.parametrize("ending", ["success", "fail"])
def test_the_process_group_ends_at_exit_after_a_run_that_did_not_fail(ending, tmp_path):
    # Left to the interpreter's shutdown, a gloo thread releasing an evaluation's all-gather aborted about one
    # Trainer exit in eight ("terminate called without an active exception"), under torch DDP too. After a
    # failure the group is left alone: its end would wait for gloo's threads until gloo's own deadline.
    script = tmp_path / "train.py"
    script.write_text(ENDS_AT_EXIT)
    launcher = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in launcher}  # `python train.py`: a world of one
    result = subprocess.run([sys.executable, str(script), str(tmp_path / "out"), ending], capture_output=True,
                            text=True, timeout=120, env=env)
    assert result.returncode == (0 if ending == "success" else 1), result.stderr[-2000:]
    assert f"group at exit: {ending == 'fail'}" in result.stdout, result.stdout + result.stderr[-2000:]
