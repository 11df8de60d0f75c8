"""steps.png: what the async orchestrator did per step, drawn with matplotlib (no display needed).

Three panels over the training steps: the batch's reward (mean and spread) with the validation
reward; how long the trainer waited for its batch and inference for the trainer; the groups dropped
by reason and the mean policy lag of the rollouts used.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .plot import save_figure


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


__all__ = ["plot_steps"]
