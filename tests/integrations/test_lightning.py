"""hsync.integrations.lightning on two real ranks (gloo): an unchanged LightningModule under
Trainer(strategy="hsync") against one process over the same global batches, with fixed and measured
shares, accumulate_grad_batches, sync_dist logging and a resume through ckpt_path; what is refused."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from tests.integrations import LAUNCH_ENV, assert_near_float32
from tests.integrations.test_accelerate import EPOCHS, EXAMPLES, GLOBAL_BATCH, LR, MOMENTUM, data, net, one_process
from tests.spawn import run_ranks

pytestmark = pytest.mark.distributed
lightning = pytest.importorskip("lightning")

ENV = {**LAUNCH_ENV, "GROUP_RANK": "0"}  # what Lightning reads as torchrun's (TorchElasticEnvironment)
BATCH = 8  # the train loader's batch_size
VALIDATION = 33  # examples in the validation set
CLIP = 0.05  # a gradient norm most steps exceed


def example_weights(index: torch.Tensor) -> torch.Tensor:
    """What each example counts for in the "weighted" module's loss (a mean over tokens would count tokens)."""
    return 1.0 + (index % 3).float()


SKIPPED = (5, 50)  # the "skip" variant's training_step returns None for a batch that holds one of these examples


def module_class(weighted: bool = False, sharded: bool = False, skip: bool = False):
    import lightning as L

    import hsync

    class Regression(L.LightningModule):
        """A LightningModule as users write one, recording the examples of each optimizer step (and the dtype of
        its layers' outputs). `weighted`: its loss is a weighted mean over the examples, and it says over what."""

        def __init__(self) -> None:
            super().__init__()
            self.net = net()
            self.steps: list[list[int]] = [[]]
            self.losses: list[float] = []  # each step's over every rank
            self.skipped: list[bool] = []
            self.dtypes: set[str] = set()
            for layer in self.net:
                layer.register_forward_hook(lambda module, inputs, output: self.dtypes.add(str(output.dtype)))

        def training_step(self, batch, batch_idx):
            x, y, index = batch
            skipped = skip and any(i in SKIPPED for i in index.tolist())
            if not skipped:
                self.steps[-1] += index.tolist()
            if weighted:
                w = example_weights(index)
                loss = (w * ((self.net(x).float() - y) ** 2).squeeze(1)).sum() / w.sum()
                self.log("train_loss", loss, sync_dist=True)
                return {"loss": loss, "weight": w.sum()}
            loss = nn.functional.mse_loss(self.net(x).float(), y)
            self.log("train_loss", loss, sync_dist=True)
            self.log("epoch_loss", loss, sync_dist=True, on_step=False, on_epoch=True)
            return None if skipped else loss  # None: Lightning's way to skip a batch (logged alike on every rank)

        def on_before_optimizer_step(self, optimizer):
            scaler = getattr(self.trainer.precision_plugin, "scaler", None)  # 16-mixed's GradScaler
            self.scale = scaler.get_scale() if scaler is not None else 1.0  # what this step's losses were scaled by

        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.steps.append([])
            self.losses.append(self.trainer.strategy.step_stats.loss / self.scale)
            scaler = getattr(self.trainer.precision_plugin, "scaler", None)
            self.skipped.append(scaler is not None and scaler.get_scale() < self.scale)  # it shrinks on a skip

        def validation_step(self, batch, batch_idx):
            x, y, _ = batch
            self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)
            self.log("val_count", float(len(x)), reduce_fx="sum", sync_dist=True)

        def val_dataloader(self):
            # 33 examples: Lightning's DistributedSampler repeats the first to give both ranks 17, as with DDP.
            return torch.utils.data.DataLoader(torch.utils.data.Subset(data(), range(VALIDATION)), batch_size=BATCH)

        @property
        def backbone(self) -> nn.Module:  # what Lightning's BackboneFinetuning freezes and unfreezes
            return self.net[0]

        def configure_optimizers(self):
            if sharded:  # the state of its momentum split across the ranks
                return hsync.ShardedOptimizer(self.trainer.model, torch.optim.SGD, lr=LR, momentum=MOMENTUM)
            return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=LR)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(data(), batch_size=BATCH, shuffle=True)

    return Regression


def fit(rank: int, world_size: int, strategy_options: dict | None, accumulate: int, root: str,
        resume_from: str | None = None, max_steps: int = -1, variant: str = "") -> dict:
    """Trainer.fit on this rank; `variant`: "bf16" (precision bf16-mixed), "clip-compiled" (gradient_clip_val
    0.05, a torch.compile'd module), "weighted" (a module whose loss says its weight), "drop-last" (a train
    loader of 90 examples that drops its last batch), "skip" (a training_step that skips some batches) or "fp16"
    (on the GPU, with precision 16-mixed; every rank on the one GPU, as if each were a node of its own)."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from hsync.integrations.lightning import HsyncStrategy

    torch.manual_seed(0)
    module = module_class(weighted=variant == "weighted", sharded=variant.startswith("sharded"),
                          skip=variant == "skip")()
    if variant == "drop-last":  # 90 examples: an epoch's last step would hold 10 of 16
        module.train_dataloader = lambda: torch.utils.data.DataLoader(
            torch.utils.data.Subset(data(), range(90)), batch_size=BATCH, shuffle=True, drop_last=True)
    strategy = "hsync" if strategy_options is None else HsyncStrategy(**strategy_options)
    savers = [ModelCheckpoint(dirpath=root, every_n_train_steps=2, save_top_k=-1, filename="{step}"),
              ModelCheckpoint(dirpath=root, every_n_epochs=1, save_top_k=-1, filename="{epoch}")]  # at its end
    if variant.endswith("backbone-finetuning"):  # the first layer frozen in the first epoch, a tenth of the lr after
        from lightning.pytorch.callbacks import BackboneFinetuning

        savers.append(BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=0.1))
    precision = {"bf16": "bf16-mixed", "fp16": "16-mixed"}.get(variant, "32-true")
    hardware = dict(accelerator="gpu", devices=1, num_nodes=world_size) if variant == "fp16" else dict(
        accelerator="cpu", devices=world_size)
    trainer = L.Trainer(strategy=strategy, **hardware, max_epochs=EPOCHS,
                        max_steps=max_steps, accumulate_grad_batches=accumulate, callbacks=savers, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                        num_sanity_val_steps=0, precision=precision,
                        gradient_clip_val=CLIP if variant in ("clip-compiled", "sharded-clipped") else None)
    compiled = variant == "clip-compiled"
    trainer.fit(torch.compile(module, backend="aot_eager") if compiled else module, ckpt_path=resume_from)
    result = {"params": {n: p.detach().cpu().clone() for n, p in module.net.named_parameters()},
            "dtypes": sorted(module.dtypes), "steps": module.steps[:-1], "losses": module.losses,
            "skipped": module.skipped, "global_step": trainer.global_step,
            "logged": float(trainer.callback_metrics["train_loss"]), "batches": trainer.num_training_batches,
            "epoch_loss": float(trainer.callback_metrics.get("epoch_loss", float("nan"))),
            "loss": trainer.strategy.step_stats.loss, "plan": trainer.strategy.balancer.planned_split(),
            "val_loss": float(trainer.callback_metrics["val_loss"]),
            "val_count": float(trainer.callback_metrics["val_count"]),
            "comm_hook": trainer.strategy._weighted._comm_hook is not None}
    validated = trainer.validate(module, verbose=False)[0]
    result["validated_count"], result["validated_loss"] = validated["val_count"], validated["val_loss"]
    return result


def global_batches(ranks: list[dict]) -> list[list[int]]:
    return [sorted(a + b) for a, b in zip(ranks[0]["steps"], ranks[1]["steps"], strict=True)]


@pytest.mark.parametrize(("options", "accumulate"), [
    ({"balance": {"global_batch_size": GLOBAL_BATCH, "rank_batch_sizes": [24, 8], "micro_batch_limit": 8}}, 1),
    ({"balance": {"global_batch_size": GLOBAL_BATCH, "rank_batch_sizes": [24, 8]}}, 1),
    (None, 2)], ids=["fixed-24+8", "fixed-24+8-whole", "auto-accumulating"])
def test_lightning_steps_equal_one_process_over_the_same_global_batches(options, accumulate, tmp_path):
    # The last: strategy="hsync" by name, each global batch batch_size x accumulate_grad_batches x ranks = 32, in
    # micro-batches of 8 or fewer, of different sizes.
    import hsync

    if options is not None:
        options = {"balance": hsync.BalanceConfig(**options["balance"], replan_every=2)}
    ranks = run_ranks(fit, 2, options, accumulate, str(tmp_path), env=ENV, timeout=240)
    batches = global_batches(ranks)
    steps = EPOCHS * EXAMPLES // GLOBAL_BATCH
    assert len(batches) == steps
    for epoch in range(EPOCHS):  # every example once per epoch
        assert sorted(i for b in batches[epoch * 3:(epoch + 1) * 3] for i in b) == list(range(EXAMPLES))
    if options is not None:
        assert [len(s) for s in ranks[0]["steps"]] == [24] * steps
    expected, losses = one_process(batches)
    whole = options is not None and options["balance"].micro_batch_limit is None  # one micro-batch a rank
    for result in ranks:
        assert result["global_step"] == steps and result["batches"] == steps // EPOCHS
        assert result["loss"] == pytest.approx(losses[-1], rel=1e-5)  # the last step's loss over every rank
        # An epoch's sync_dist mean: over its every example, each micro-batch weighing its own (Lightning would
        # weigh them all as the step's first).
        assert result["epoch_loss"] == pytest.approx(sum(losses[-3:]) / 3, rel=1e-5)
        if whole:  # a step's value: the ranks' one micro-batch each, weighed by their examples, is the step's
            assert result["logged"] == pytest.approx(losses[-1], rel=1e-5)
        for name, value in expected.items():
            torch.testing.assert_close(result["params"][name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert ranks[0]["logged"] == ranks[1]["logged"]  # sync_dist: one value on every rank
    # The last epoch's validation, with the final parameters, over what Lightning's DistributedSampler gives the
    # ranks as with DDP: 17 examples each, the first twice (equal batches on every rank, so that a collective per
    # batch in a validation_step pairs up).
    x, y, _ = data()[:VALIDATION]
    model = net()
    model.load_state_dict(expected)
    padded = [*range(VALIDATION), 0]
    with torch.no_grad():
        val_loss = float(nn.functional.mse_loss(model(x[padded]), y[padded]))
    for result in ranks:
        assert result["val_count"] == VALIDATION + 1
        assert result["val_loss"] == pytest.approx(val_loss, rel=1e-5)
        # trainer.validate() after fit: the same.
        assert result["validated_count"] == VALIDATION + 1
        assert result["validated_loss"] == pytest.approx(val_loss, rel=1e-5)


@pytest.mark.parametrize("variant", ["clip-compiled", "weighted", "comm-hook", "sharded-clipped",
                                     "backbone-finetuning", "sharded-backbone-finetuning", "skip"])
def test_lightnings_options_keep_the_steps_exact(variant, tmp_path):
    # Fixed shares, rank 0's 24 in three micro-batches: clipping acts on the step's whole gradient, after the
    # last, and a compiled module runs the same steps (both in one run); a loss that gives its weight is
    # weighted by it; a ddp_comm_hook of the user's (an all-reduce divided by the world size) runs on the CPU;
    # an hsync.ShardedOptimizer (SGD with momentum) is clipped over both ranks' shards; Lightning's
    # BackboneFinetuning unfreezes the first layer after the model was wrapped, and it trains on averaged gradients
    # (under torch's DDP each rank's copy of it would train on its own); with a ShardedOptimizer too, whose
    # add_param_group takes the layer into the buckets and shares its state; a training_step that returns None
    # (Lightning's skip) leaves its micro-batch out of the step, which runs on the others' examples.
    import hsync
    from tests.distributed.test_comm_hooks import mean_allreduce_hook

    options = {"balance": hsync.BalanceConfig(global_batch_size=GLOBAL_BATCH, rank_batch_sizes=[24, 8],
                                              micro_batch_limit=8)}
    if variant == "comm-hook":
        options["ddp_comm_hook"] = mean_allreduce_hook
    ranks = run_ranks(fit, 2, options, 1, str(tmp_path), None, -1, variant, env=ENV, timeout=240)
    if variant == "skip":  # each epoch, the micro-batch of each skipped example left out
        trained = [i for batch in global_batches(ranks) for i in batch]
        assert not set(trained) & set(SKIPPED) and EPOCHS * (EXAMPLES - 16) <= len(trained) < EPOCHS * EXAMPLES
    clipped = variant in ("clip-compiled", "sharded-clipped")
    expected, losses = one_process(global_batches(ranks), clip=CLIP if clipped else None,
                                   weights=example_weights if variant == "weighted" else None,
                                   momentum=MOMENTUM if variant.startswith("sharded") else 0.0,
                                   **(dict(first_layer_from_step=EXAMPLES // GLOBAL_BATCH, first_layer_lr=LR / 10)
                                      if variant.endswith("backbone-finetuning") else {}))
    for result in ranks:
        assert result["dtypes"] == ["torch.float32"] and result["comm_hook"] == (variant == "comm-hook")
        assert result["loss"] == pytest.approx(losses[-1], rel=1e-5)
        for name, value in expected.items():
            torch.testing.assert_close(result["params"][name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_a_train_loader_that_drops_its_last_batch_drops_an_epochs_short_last_step(tmp_path):
    # As under torch's DDP: 45 examples a rank, five batches of 8 and the rest dropped.
    ranks = run_ranks(fit, 2, None, 1, str(tmp_path), None, -1, "drop-last", env=ENV, timeout=240)
    batches = global_batches(ranks)
    assert [len(b) for b in batches] == [16] * 5 * EPOCHS
    for epoch in range(EPOCHS):
        seen = [i for b in batches[epoch * 5:(epoch + 1) * 5] for i in b]
        assert len(set(seen)) == 80 and max(seen) < 90
    expected, _ = one_process(batches)
    for result in ranks:
        assert result["global_step"] == 5 * EPOCHS and result["batches"] == 5
        for name, value in expected.items():
            torch.testing.assert_close(result["params"][name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_bf16_mixed_runs_the_forward_under_autocast_and_stays_near_float32(tmp_path):
    # Against one float32 process over the same global batches, which a float32 run equals (above).
    mixed = run_ranks(fit, 2, None, 2, str(tmp_path), None, -1, "bf16", env=ENV, timeout=240)
    expected, _ = one_process(global_batches(mixed))
    for result in mixed:
        assert result["dtypes"] == ["torch.bfloat16"]
        assert_near_float32(result["params"], expected, dict(net().named_parameters()))


def test_a_resume_through_ckpt_path_ends_as_an_uninterrupted_run_on_as_many_ranks_or_one(tmp_path):
    # The global batch fixed (BalanceConfig), not derived from the ranks: two ranks checkpoint every 2 steps of
    # 6; from step 4, two ranks and then one alone go on with the same global batches.
    import hsync

    options = {"balance": hsync.BalanceConfig(global_batch_size=GLOBAL_BATCH, micro_batch_limit=8)}
    straight = run_ranks(fit, 2, options, 1, str(tmp_path / "a"), env=ENV, timeout=240)
    checkpoint = tmp_path / "a" / "step=4.ckpt"
    # Lightning keeps a stateful loader's state in the checkpoint: the Balancer's, four steps in.
    saved = torch.load(checkpoint, weights_only=False)["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert saved[0]["global_step"] == 4
    resumed = run_ranks(fit, 2, options, 1, str(tmp_path / "b"), str(checkpoint), env=ENV, timeout=240)
    alone = run_ranks(fit, 1, options, 1, str(tmp_path / "c"), str(checkpoint),
                      env={**ENV, "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}, timeout=240)
    # From the end of the first epoch (3 steps), where Lightning does not restore a loader's state itself: the
    # second epoch ran the first's order again.
    at_epoch_end = run_ranks(fit, 2, options, 1, str(tmp_path / "d"), str(tmp_path / "a" / "epoch=0.ckpt"), env=ENV,
                             timeout=240)
    assert global_batches(resumed) == global_batches(straight)[4:]
    assert [sorted(step) for step in alone[0]["steps"]] == global_batches(straight)[4:]
    assert global_batches(at_epoch_end) == global_batches(straight)[3:]
    for after in (*resumed, *alone, *at_epoch_end):
        assert after["global_step"] == 6
        for name, value in straight[0]["params"].items():
            torch.testing.assert_close(after["params"][name], value, rtol=1e-5, atol=1e-6, msg=name)


def fit_refused(rank: int, world_size: int, case: str) -> str:
    import lightning as L

    import hsync.integrations.lightning  # noqa: F401 - registers strategy="hsync"

    try:
        if case == "manual":
            module = module_class()()
            module.automatic_optimization = False
            L.Trainer(strategy="hsync", accelerator="cpu", devices=world_size, max_steps=1, logger=False,
                      enable_progress_bar=False).fit(module)
        elif case.startswith("sampler"):  # a sampler of the user's own, which the strategy cannot split by speed
            module = module_class()()
            sampler = torch.utils.data.WeightedRandomSampler([1.0] * EXAMPLES, EXAMPLES)
            module.train_dataloader = lambda: torch.utils.data.DataLoader(data(), batch_size=BATCH, sampler=sampler)
            # Lightning wraps it in its DistributedSamplerWrapper, unless told not to.
            L.Trainer(strategy="hsync", accelerator="cpu", devices=world_size, max_steps=1, logger=False,
                      use_distributed_sampler=case == "sampler-wrapped", enable_progress_bar=False).fit(module)
        elif case == "backward":
            class Overriding(module_class()):
                def backward(self, loss, *args, **kwargs):
                    loss.backward(*args, **kwargs)

            module = Overriding()
            L.Trainer(strategy="hsync", accelerator="cpu", devices=world_size, max_steps=1, logger=False,
                      enable_progress_bar=False).fit(module)
        else:  # two train loaders, as Lightning combines them
            module = module_class()()
            module.train_dataloader = lambda: {"a": torch.utils.data.DataLoader(data(), batch_size=BATCH),
                                               "b": torch.utils.data.DataLoader(data(), batch_size=BATCH)}
            L.Trainer(strategy="hsync", accelerator="cpu", devices=world_size, max_steps=1, logger=False,
                      enable_progress_bar=False).fit(module)
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize(("case", "message"), [
    ("manual", "needs automatic optimization"),
    ("sampler", "no sampler or batch_sampler of its own (found sampler WeightedRandomSampler, batch_size 8)"),
    # Was taken, and the user's sampler dropped: every example drawn alike.
    ("sampler-wrapped", "no sampler or batch_sampler of its own (found sampler WeightedRandomSampler (in "
                        "Lightning's DistributedSamplerWrapper), batch_size 8)"),
    # Was never called.
    ("backward", "overrides backward(), which the Balancer's weighted backward takes the place of"),
    # One loader was indexed by the other's Balancer (an IndexError), or the module got a dict of steps.
    ("two-loaders", "HsyncStrategy balances one train dataloader, and the module's train_dataloader returned "
                    "several")])
def test_what_cannot_work_is_refused_on_every_rank(case, message):
    for text in run_ranks(fit_refused, 2, case, env=ENV, timeout=120):
        assert message in text, text


def test_torch_ddps_own_options_are_refused():
    from hsync.integrations.lightning import HsyncStrategy

    with pytest.raises(ValueError, match="model_averaging_period averages the ranks' models"):
        HsyncStrategy(model_averaging_period=4)


def test_a_lightning_release_outside_the_tested_range_is_refused(monkeypatch):
    import lightning

    import hsync.integrations.lightning as integration

    monkeypatch.setattr(lightning, "__version__", "2.1.0")
    with pytest.raises(RuntimeError, match="supports lightning >= 2.4, < 3; found 2.1.0"):
        integration.HsyncStrategy()


def test_importing_the_integration_registers_the_strategy():
    from lightning.pytorch.strategies import StrategyRegistry

    import hsync.integrations.lightning  # noqa: F401

    assert "hsync" in StrategyRegistry
    assert os.environ.get("RANK") is None  # nothing launched by the import


def lightning_as_users_write_it(rank: int, world_size: int, root: str) -> dict:
    """A module that relies on what Lightning does with DDP: seed_everything's order, limit_train_batches over two
    epochs, reload_dataloaders_every_n_epochs onto a larger set, batches as dicts that on_before_batch_transfer
    makes tuples, every rank's training_step returning None for one whole step (AdamW with weight decay), the
    strategy's timeout, and a validation that syncs a value per batch and all_gathers its predictions."""
    import datetime

    import lightning as L

    from hsync.integrations.lightning import HsyncStrategy

    L.seed_everything(7)

    class AsDicts(torch.utils.data.Dataset):
        def __init__(self, size: int) -> None:
            self.x, self.y, _ = data()[:size]

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, i: int) -> dict:
            return {"x": self.x[i], "y": self.y[i], "index": i}

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net()
            self.steps: list[list[int]] = []
            self.around_the_skip: list[torch.Tensor] = []
            self.predictions: list[torch.Tensor] = []
            self.gathered: list[tuple] = []

        def on_before_batch_transfer(self, batch, dataloader_idx):
            return batch["x"], batch["y"], batch["index"]  # a micro-batch's dict, not the step's list of them

        def on_train_batch_start(self, batch, batch_idx):
            if self.global_step in (1, 2):  # the parameters before and after the step skipped everywhere
                self.around_the_skip.append(self.net[0].weight.detach().clone())
            self.steps.append([])

        def training_step(self, batch, batch_idx):
            x, y, index = batch
            self.steps[-1] += index.tolist()
            return None if self.global_step == 1 else nn.functional.mse_loss(self.net(x), y)

        def validation_step(self, batch, batch_idx):
            x, y, _ = batch
            prediction = self.net(x)
            self.predictions.append(prediction)
            self.log("val_loss", nn.functional.mse_loss(prediction, y), on_step=True, on_epoch=True, sync_dist=True)

        def on_validation_epoch_end(self):
            self.gathered.append(tuple(self.all_gather(torch.cat(self.predictions)).shape))
            self.predictions = []

        def train_dataloader(self):  # 32 examples in the first epoch, 64 from the second
            return torch.utils.data.DataLoader(AsDicts(32 * (1 + self.current_epoch)), batch_size=BATCH,
                                               shuffle=True)

        def val_dataloader(self):
            return torch.utils.data.DataLoader(AsDicts(VALIDATION), batch_size=BATCH)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.5)

    module = Module()
    strategy = HsyncStrategy(timeout=datetime.timedelta(seconds=45))
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=world_size, max_epochs=2,
                        limit_train_batches=2, reload_dataloaders_every_n_epochs=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        num_sanity_val_steps=0, default_root_dir=root)
    trainer.fit(module)
    return {"steps": module.steps, "around_the_skip": module.around_the_skip, "gathered": module.gathered,
            "timeout": strategy._weighted.timeout.total_seconds()}


def test_what_lightning_does_under_ddp_it_does_under_hsync(tmp_path):
    ranks = run_ranks(lightning_as_users_write_it, 2, str(tmp_path), env=ENV, timeout=240)
    steps = [sorted(a + b) for a, b in zip(ranks[0]["steps"], ranks[1]["steps"], strict=True)]
    # Each epoch's global batches are DistributedSampler's order for seed_everything's seed (it was seed 0's
    # whatever the seed), over the epoch's set (the reloaded one had kept the first's 32 examples), from the
    # epoch's first step (a second epoch cut short by limit_train_batches had gone on from the first's third).
    global_batch = BATCH * 2
    for epoch, size in enumerate((32, 64)):
        order = torch.randperm(size, generator=torch.Generator().manual_seed(7 + epoch)).tolist()
        expected = [sorted(order[k * global_batch:(k + 1) * global_batch]) for k in range(2)]
        assert steps[2 * epoch:2 * epoch + 2] == expected, (epoch, steps)
    for result in ranks:
        before, after = result["around_the_skip"]
        torch.testing.assert_close(after, before, rtol=0, atol=0)  # AdamW's decay had moved them
        # Lightning's DistributedSampler gives both ranks 17 of the 33 (per-batch syncs pair up); an unrepeated
        # one gave 17 and 16: a wrong val_loss on one rank, an ended process on the other.
        assert result["gathered"] == [(2, 17, 1), (2, 17, 1)]
        assert result["timeout"] == 45.0  # hsync's deadline, where it kept its own 300 s
