"""Sweep summary: after a Hydra multirun, one table row and one reward curve per run.

Hydra calls `SweepSummary.on_multirun_end` once every job has finished; each job left a
`summary.json` in its run folder (see `lit_grpo.train.train`). The sweep folder gets
`sweep_summary.csv` and `sweep_rewards.png`, and the table is printed.
"""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from lit_grpo.run.curves import plot_curves  # not the callback's module: Hydra loads this one before every run

log = logging.getLogger(__name__)
COLUMNS = ["overrides", "final_reward", "best_reward", "first_reward", "steps", "wall_s"]


def collect_runs(sweep_dir: Path) -> list[dict[str, Any]]:
    """Every run's summary under `sweep_dir`, in job order."""
    runs = []
    for path in sorted(sweep_dir.glob("*/summary.json"), key=lambda p: _job_number(p.parent.name)):
        summary = json.loads(path.read_text())
        summary.setdefault("overrides", path.parent.name)
        runs.append(summary)
    return runs


def _job_number(name: str) -> int:
    head = name.split("_", 1)[0]
    return int(head) if head.isdigit() else 1 << 30


def write_summary(sweep_dir: Path, runs: list[dict[str, Any]]) -> tuple[Path, Path | None]:
    """Write the CSV table and the overlaid reward curves; return their paths."""
    table = sweep_dir / "sweep_summary.csv"
    with table.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for run in runs:
            writer.writerow({k: (f"{run[k]:.4f}" if isinstance(run.get(k), float) else run.get(k)) for k in COLUMNS})
    curves = {run["overrides"]: run["reward_curve"] for run in runs if run.get("reward_curve")}
    plot = (
        plot_curves(curves, sweep_dir / "sweep_rewards.png", title="reward per step", ylabel="reward/mean")
        if curves
        else None
    )
    return table, plot


def format_table(runs: list[dict[str, Any]]) -> str:
    """The summary as aligned text, the overrides column as wide as its longest entry."""
    width = max(len("overrides"), *(len(str(r["overrides"])) for r in runs))
    lines = [f"{'overrides':<{width}} {'final':>7} {'best':>7} {'first':>7} {'steps':>6} {'wall_s':>8}"]
    for r in runs:
        lines.append(
            f"{str(r['overrides']):<{width}} {r['final_reward']:>7.3f} {r['best_reward']:>7.3f} "
            f"{r['first_reward']:>7.3f} {int(r['steps']):>6d} {r['wall_s']:>8.1f}"
        )
    return "\n".join(lines)


class SweepSummary(Callback):
    """Hydra callback (`hydra.callbacks.sweep_summary`) that summarizes a multirun."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        runs = collect_runs(sweep_dir)
        if not runs:
            log.warning("no run summaries found under %s", sweep_dir)
            return
        table, plot = write_summary(sweep_dir, runs)
        print(f"\nSweep summary ({table}{', ' + str(plot) if plot else ''}):\n{format_table(runs)}", flush=True)
