"""What rank 0 tells: the log of steps and evaluations, and the batch plan when it changes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import hsync
from apps.bert.config import TrainConfig
from apps.cli import report


class PlanReport:
    """Says on rank 0 when the balancer's plan changes, and what the ranks measured."""

    def __init__(self, balancer: hsync.Balancer, rank: int) -> None:
        self.balancer, self.rank = balancer, rank
        self.models = balancer.cost_models
        self.plan = balancer.planned_split()
        report(rank, f"batch plan: {balancer.config.rank_batch_sizes or 'equal, then measured'} "
                     f"examples per rank and step")

    def update(self, step: int) -> None:
        models = self.balancer.cost_models
        if models is None or models is self.models:
            return  # the plan changes only with the models: no split to compute on most steps
        self.models = models
        plan = self.balancer.planned_split()
        if plan == self.plan:
            return
        shown = ", ".join(f"rank {r}: {m.fixed_s * 1e3:.1f} ms + {1 / m.per_unit_s:.1f} ex/s"
                          for r, m in enumerate(self.balancer.fitted_costs()) if m is not None)
        report(self.rank, f"measured {shown}; batch plan {self.plan} -> {plan} after step {step}")
        self.plan = plan


class Logger:
    """tqdm progress and JSON lines on rank 0; numbers come from the step's fused stats and the evaluations."""

    def __init__(self, cfg: TrainConfig, rank: int, world: int) -> None:
        self.every, self.world, self.enabled = cfg.log_every, world, rank == 0
        self.validates = cfg.valid_fraction > 0
        self.last_evaluation: dict[str, float] | None = None
        # unwritable_outputs() has opened the file once already, before any work.
        self.file = open(cfg.log_file, "a") if cfg.log_file and self.enabled else None  # noqa: SIM115
        self.bar = None
        if self.enabled:
            from tqdm import tqdm

            # A bar only on a terminal: in a log file its redraws would bury the JSON lines.
            self.bar = tqdm(total=cfg.max_steps, dynamic_ncols=True, file=sys.stderr, disable=not sys.stderr.isatty())

    def step(self, step: int, stats: hsync.StepStats, balancer: hsync.Balancer, seconds: float, lr: float) -> None:
        if not self.enabled:
            return
        self.bar.update(step - self.bar.n)
        self.bar.set_postfix(loss=f"{stats.loss:.3f}", refresh=False)
        if step % self.every and step != self.bar.total:
            return
        busy = [report.busy_s for report in balancer.last_reports]  # of the step before
        mlm = stats.metrics["mlm"] / max(stats.weight, 1.0)  # means over the global batch
        nsp = stats.metrics["nsp"] / max(stats.metrics["examples"], 1.0)
        self.write({"step": step, "loss": round(mlm + nsp, 5), "mlm_loss": round(mlm, 5), "nsp_loss": round(nsp, 5),
                    "objective": round(stats.loss, 5), "lr": lr, "finite": stats.finite,
                    "masked_tokens": stats.weight, "step_seconds": round(seconds, 4),
                    "tokens_per_s": round(stats.metrics["tokens"] / seconds, 1),
                    "rank_busy_seconds": [round(b, 4) for b in busy], "plan": balancer.last_plan})

    def evaluation(self, step: int, metrics: dict[str, float]) -> None:
        self.last_evaluation = metrics
        if self.enabled:
            self.write({"step": step, **{k: round(v, 5) for k, v in metrics.items()}})

    def write(self, record: dict) -> None:
        (self.bar.write if not self.bar.disable else print)(json.dumps(record))
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def summary(self, final: Path | None) -> str:
        """The run's last line: where the usable model is, and how it does on held-out text."""
        where = (f"trained model in {final} (BertForPreTraining.from_pretrained)" if final else
                 "the model was not kept (pass --save-dir to keep it)")
        v = self.last_evaluation
        if v is None:
            why = "no step ran: the run had reached --max-steps" if self.validates else "--valid-fraction 0"
            return f"{where}; no validation ({why})"
        return (f"{where}; validation loss {v['valid_loss']:.3f} on {v['valid_examples']} held-out examples "
                f"(masked LM {v['valid_mlm_loss']:.3f}, accuracy {v['valid_mlm_accuracy']:.3f}; "
                f"next sentence {v['valid_nsp_loss']:.3f}, accuracy {v['valid_nsp_accuracy']:.3f})")

    def close(self) -> None:
        if self.bar:
            self.bar.close()
        if self.file:
            self.file.close()
