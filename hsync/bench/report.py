"""The results as a console table, a JSON file, a Markdown page and a plot, with the environment."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time

import torch
import torch.distributed as dist

import hsync
from hsync.bench.result import LABELS, MEMORY_VARIANTS, VARIANTS, Result


def environment(device: torch.device) -> dict:
    env = {"torch": torch.__version__, "hsync": hsync.__version__, "python": platform.python_version(),
           "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
           "world_size": dist.get_world_size(), "backend": dist.get_backend(), "device": device.type,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    try:
        with open("/proc/cpuinfo") as f:
            env["cpu"] = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    if device.type == "cuda":
        env.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda,
                   nccl=hsync._C.nccl_version())
    return env


def write_outputs(args: argparse.Namespace, output: dict) -> None:
    print("\n" + "\n".join(table(output)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(output, f, indent=1)
    if args.plot:
        plot(output, args.plot)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(output, args))


def report(rank: int, result: Result) -> None:
    if rank == 0:
        print(f"  {result.workload}: hsync {_ms(result.hsync_step_s)} ms, plain {_ms(result.hsync_plain_step_s)} ms, "
              f"ddp {_ms(result.ddp_step_s)} ms (ratio {result.ratio_vs_ddp:.3f})", flush=True)


def table(output: dict) -> list[str]:
    env = output["env"]
    lines = [f"hsync {env['hsync']}, torch {env['torch']}, {env['backend']}, {env['world_size']} ranks, "
             f"{env.get('gpu', env['cpu'])}",
             "| workload | hsync p50 (p90) ms | hsync plain ms | DDP p50 (p90) ms | no-sync ms | hsync/DDP | "
             "plain/DDP | hsync over floor | DDP over floor | hsync samples/s | peak MiB hsync / DDP / no-sync | "
             "notes |",
             "|" + " --- |" * 12]
    for r in output["results"]:
        notes = ", ".join(f"{k} {'-' if _missing(v) else f'{v:.3g}'}" for k, v in r["extra"].items())
        memory = " / ".join(f"{r['peak_memory_mb'][v]:.1f}" for v in MEMORY_VARIANTS) if r["peak_memory_mb"] else "-"
        ranks = r.get("world_size", env["world_size"])
        name = r["workload"] + (f" ({ranks} ranks)" if ranks != env["world_size"] else "")
        rate = r["samples_per_step"] / r["hsync_step_s"] if r["samples_per_step"] else 0  # none: a row of no steps
        lines.append(f"| {name} | {_ms(r['hsync_step_s'])} ({_ms(r['hsync_p90_s'])}) | "
                     f"{_ms(r['hsync_plain_step_s'])} | {_ms(r['ddp_step_s'])} ({_ms(r['ddp_p90_s'])}) | "
                     f"{_ms(r['nosync_step_s'])} | {_ratio(r['ratio_vs_ddp'])} | {_ratio(r['plain_ratio_vs_ddp'])} | "
                     f"{_pct(r['hsync_overhead_vs_nosync'])} | {_pct(r['ddp_overhead_vs_nosync'])} | "
                     f"{rate:.0f} | {memory} | {notes} |")
    return lines


def markdown(output: dict, args: argparse.Namespace) -> str:
    """A results page: the command that made it, where and when it ran, the table and the plot."""
    env = output["env"]
    options = [f"--device {args.device}", f"--world-size {env['world_size']}", f"--rounds {args.rounds}",
               f"--steps {args.steps}"] + (["--quick"] if args.quick else [])
    if args.only:
        options.append("--only " + " ".join(map(shlex.quote, args.only)))  # patterns, as a shell must see them
    where = env.get("gpu", env["cpu"]) + (f", CUDA {env['cuda']}, NCCL {env['nccl']}" if "cuda" in env else
                                          f" ({env['cpu_count']} cores)")
    lines = [f"# {env['device'].upper()}, {env['world_size']} ranks over {env['backend']}", "",
             f"Command: `python -m hsync.bench {' '.join(options)}`", "",
             f"Measured {env['date']} on {where}; Python {env['python']}, torch {env['torch']}, hsync {env['hsync']}. "
             f"Medians (p90) of {args.rounds * args.steps} timed steps per variant in {args.rounds} interleaved "
             "rounds, each step the slowest rank's.", "", *table(output)[1:]]
    if any(r["workload"].endswith(("-bf16", "-fp16")) for r in output["results"]):
        lines += ["", "Rows ending in -bf16: hsync with `comm_dtype=torch.bfloat16`, DDP with torch's "
                  "`bf16_compress_hook`; GB/s count the float32 gradient bytes delivered."]
    if args.plot:
        lines += ["", f"![step times relative to no sync]({os.path.basename(args.plot)})"]
    return "\n".join(lines) + "\n"


def _missing(x: float | None) -> bool:
    return x is None or x != x  # NaN in memory, null in JSON


def _pct(x: float | None) -> str:
    return "-" if _missing(x) else f"{100 * x:+.1f}%"


def _ms(x: float | None) -> str:
    return "-" if _missing(x) else f"{x * 1e3:.2f}"


def _ratio(x: float | None) -> str:
    return "-" if _missing(x) else f"{x:.3f}"


def plot(output: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Training steps only: the comm path and mixed-speed rows measure other things.
    rows = [r for r in output["results"] if r["samples_per_step"] and not _missing(r["nosync_step_s"])]
    if not rows:
        print(f"no plot written to {path}: it shows training rows against the no-sync floor, and none ran",
              file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(rows)), 4))
    width = 0.8 / len(VARIANTS)
    for i, variant in enumerate(VARIANTS):
        ax.bar([x + (i - (len(VARIANTS) - 1) / 2) * width for x in range(len(rows))],
               [r[f"{variant}_step_s"] / r["nosync_step_s"] for r in rows], width, label=LABELS[variant])
    ax.axhline(1.0, color="grey", linewidth=0.8)
    top = max(r[f"{v}_step_s"] / r["nosync_step_s"] for r in rows for v in VARIANTS)
    ax.set_ylim(0, top * 1.3)  # headroom for the legend
    ax.set_xticks(range(len(rows)), [r["workload"] for r in rows], rotation=30, ha="right")
    ax.set_ylabel("step time / no-sync step time")
    env = output["env"]
    ax.set_title(f"{env['world_size']} ranks, {env['backend']}, {env.get('gpu', env['cpu'])[:40]}", fontsize=9)
    ax.legend(ncol=2, fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
