"""Reward curves as PNG files (matplotlib, imported when a curve is drawn): a run's own, and a
sweep's runs side by side (`lit_grpo.run.sweep`)."""

from __future__ import annotations

from pathlib import Path


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over the last `window` values (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_curves(curves: dict[str, list[float]], path: Path, *, title: str, ylabel: str, window: int = 10) -> Path:
    """One line per curve (its moving average solid, raw values faint) into a PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, values in curves.items():
        steps = list(range(1, len(values) + 1))
        (line,) = ax.plot(steps, moving_average(values, window), label=label)
        ax.plot(steps, values, color=line.get_color(), alpha=0.2, linewidth=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
