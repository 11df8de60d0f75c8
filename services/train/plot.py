"""reward.png: train and validation reward per epoch, drawn with matplotlib (no display needed)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


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
    partial = output.with_name(f".{output.stem}.tmp{os.getpid()}.png")
    figure.savefig(partial)
    plt.close(figure)
    partial.replace(output)
    return output


__all__ = ["plot_history", "save_figure"]
