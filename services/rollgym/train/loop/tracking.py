"""Experiment trackers: every history line's numbers, sent where people watch runs.

    tracking: {backend: tensorboard}      # the default: event files in OUTPUT/tensorboard (offline)
    tracking: {backend: wandb, project: weather-rl, run_name: s1}     # when wandb is installed
    tracking: {backend: none}

A line's numeric fields are flattened to tags (`train/loss`, `train/importance_ratio_mean`,
`validation/mean_reward`, `orchestrator/staleness/1`, `phases_s/collect`) at its epoch (or async step).
A tracker never stops training: a backend that fails is reported once and left out.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class TrackingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    backend: Literal["tensorboard", "wandb", "none"] = "tensorboard"
    project: str | None = Field(default=None, description="wandb: the project")
    run_name: str | None = Field(default=None, description="wandb: the run's name (default: the output folder's)")

    @model_validator(mode="after")
    def _installed(self) -> "TrackingConfig":
        if self.backend == "wandb" and importlib.util.find_spec("wandb") is None:
            raise ValueError("backend wandb: the wandb package is not installed (pip install wandb), "
                             "or use backend: tensorboard")
        return self


def scalars(line: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The numeric fields of a history line, flattened to slash-separated tags."""
    out: dict[str, float] = {}
    for key, value in line.items():
        tag = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(scalars(value, f"{tag}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and key not in ("epoch", "step"):
            out[tag] = float(value)
    return out


class Tracker:
    """One run's tracker; `log(line)` after every history line, `close()` at the end."""

    def __init__(self, section: TrackingConfig, output: Path, log: Callable[[str], None]) -> None:
        self.section = section
        self.say = log
        self.writer: Any = None
        self.run: Any = None
        if section.backend == "tensorboard":
            if importlib.util.find_spec("tensorboard") is None:
                log("tracking: tensorboard is not installed (pip install tensorboard); history.jsonl only")
                return
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(output / "tensorboard"))
        elif section.backend == "wandb":
            import wandb

            name = section.run_name or output.name
            self.run = wandb.init(project=section.project, name=name, id=name, resume="allow", dir=str(output))

    def log(self, line: dict[str, Any]) -> None:
        step = int(line.get("step", line.get("epoch", 0)))
        values = scalars(line)
        try:
            if self.writer is not None:
                for tag, value in values.items():
                    self.writer.add_scalar(tag, value, step)
                self.writer.flush()
            if self.run is not None:
                self.run.log(values, step=step)
        except Exception as exc:  # noqa: BLE001 - a tracker must never stop training
            self.say(f"tracking: {self.section.backend} failed ({type(exc).__name__}: {exc}); history.jsonl only")
            self.writer = self.run = None

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.run is not None:
            self.run.finish()


__all__ = ["Tracker", "TrackingConfig", "scalars"]
