"""A run's pictures, drawn with matplotlib (no display needed) from its history lines.

- reward.png (`plot_history`): train and validation reward per epoch (async: step), guard verdicts marked;
- steps.png (`plot_steps`, async runs): per training step, the batch's reward (mean and spread) with the
  validation reward; how long the trainer waited for its batch and inference for the trainer; the groups
  dropped by reason and the mean policy lag of the rollouts used.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from ...data.jsonl import write_atomic


def plot_history(history: list[dict[str, Any]], output: Path) -> Path:
    """Draw the mean train reward (collected on-policy) and the mean validation reward per epoch,
    with the validation pass@k when there is one; writes `output` atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(h["epoch"], h["train"]["mean_reward"]) for h in history
             if h.get("train") and h["train"].get("mean_reward") is not None]
    validation = [(h["epoch"], h["validation"]["mean_reward"]) for h in history
                  if h.get("validation") and h["validation"].get("mean_reward") is not None]
    pass_keys = sorted({k for h in history for k in (h.get("validation") or {}) if k.startswith("pass@")},
                       key=lambda k: int(k.split("@")[1]))
    figure, axes = plt.subplots(figsize=(7, 4.4), dpi=110)
    if train:
        axes.plot(*zip(*train), marker="o", label="train (collected) mean reward")
    if validation:
        axes.plot(*zip(*validation), marker="s", label="validation mean reward")
    if pass_keys:
        key = pass_keys[-1]
        points = [(h["epoch"], h["validation"][key]) for h in history if (h.get("validation") or {}).get(key) is not None]
        axes.plot(*zip(*points), linestyle="--", marker=".", label=f"validation {key}")
    for h in history:
        if h.get("guard") and not h["guard"].get("ok", True):
            axes.axvline(h["epoch"], color="red", alpha=0.3)
    from matplotlib.ticker import MaxNLocator

    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_xlabel("epoch (0 = base model)")
    axes.set_ylabel("reward")
    axes.set_ylim(-0.02, 1.02)
    axes.grid(alpha=0.3)
    axes.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=3, fontsize="small", frameon=False)
    return save_figure(figure, output)


def save_figure(figure: Any, output: Path) -> Path:
    """Write a matplotlib figure to `output` atomically (a viewer never reads half a PNG) and close it."""
    import matplotlib.pyplot as plt

    figure.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    image = io.BytesIO()
    figure.savefig(image, format="png")
    plt.close(figure)
    write_atomic(output, image.getvalue())
    return output


def plot_steps(history: list[dict[str, Any]], output: Path) -> Path:
    """`history`: lines with an `orchestrator` entry (its step metrics); writes `output` atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    metrics = [h["orchestrator"] for h in history]
    figure, (rewards, waits, drops) = plt.subplots(3, 1, figsize=(7, 8), dpi=110, sharex=True)
    means = [m["reward_mean"] for m in metrics]
    spreads = [m["reward_std"] for m in metrics]
    rewards.errorbar(steps, means, yerr=spreads, marker="o", capsize=3, label="batch reward (mean ± std)")
    validation = [(h["step"], h["validation"]["mean_reward"]) for h in history
                  if (h.get("validation") or {}).get("mean_reward") is not None]
    if validation:
        rewards.plot(*zip(*validation), marker="s", label="validation mean reward")
    rewards.set_ylabel("reward")
    rewards.legend(loc="lower right")
    waits.plot(steps, [m["trainer_wait_s"] for m in metrics], marker="o", label="trainer waited for its batch")
    waits.plot(steps, [m["inference_wait_s"] for m in metrics], marker="s", label="inference waited for the trainer")
    waits.set_ylabel("seconds")
    waits.legend(loc="upper right")
    bottom = [0] * len(steps)
    for reason in ("easy", "hard", "stale", "failed"):
        counts = [m["dropped"].get(reason, 0) for m in metrics]
        drops.bar(steps, counts, bottom=bottom, label=f"dropped: {reason}")
        bottom = [b + c for b, c in zip(bottom, counts)]
    drops.set_ylabel("groups dropped")
    drops.set_ylim(bottom=0)
    drops.xaxis.get_major_locator().set_params(integer=True)
    lag = drops.twinx()
    lag.plot(steps, [_mean_lag(m["staleness"]) for m in metrics], color="black", marker="x", label="mean policy lag")
    lag.set_ylabel("mean policy lag (steps)")
    drops.set_xlabel("step")
    handles = drops.get_legend_handles_labels()
    extra = lag.get_legend_handles_labels()
    drops.legend(handles[0] + extra[0], handles[1] + extra[1], loc="upper right", fontsize="small")
    for axes in (rewards, waits, drops):
        axes.grid(alpha=0.3)
    return save_figure(figure, output)


def _mean_lag(histogram: dict[str, int]) -> float:
    total = sum(histogram.values())
    return sum(int(lag) * count for lag, count in histogram.items()) / total if total else 0.0


__all__ = ["plot_history", "plot_steps", "save_figure"]
