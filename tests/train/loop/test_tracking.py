"""History lines reach the experiment tracker: TensorBoard event files a user opens with `tensorboard
--logdir OUTPUT/tensorboard`, read back here with TensorBoard's own reader."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollgym.train.loop.tracking import Tracker, TrackingConfig, scalars

pytest.importorskip("tensorboard")


def test_history_lines_become_tensorboard_scalars(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    said: list[str] = []
    tracker = Tracker(TrackingConfig(), tmp_path, said.append)
    tracker.log({"epoch": 0, "validation": {"mean_reward": 0.25, "pass@4": 0.5}})
    tracker.log({"epoch": 1, "stage": "grpo", "train": {"mean_reward": 0.4, "loss": -0.02, "grad_norm": 0.3,
                                                         "importance_ratio_mean": 1.01, "clip_fraction": 0.0},
                 "validation": {"mean_reward": 0.5}, "orchestrator": {"staleness": {"0": 12, "1": 4}}})
    tracker.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/grad_norm", "train/importance_ratio_mean", "validation/mean_reward",
            "orchestrator/staleness/1"} <= tags
    assert [(e.step, round(e.value, 3)) for e in events.Scalars("validation/mean_reward")] == [(0, 0.25), (1, 0.5)]
    assert said == []


def test_flattening_keeps_numbers_only() -> None:
    assert scalars({"epoch": 3, "stage": "x", "skipped": True, "train": {"loss": 1, "steps": 2.0, "note": "n"},
                    "guard": None}) == {"train/loss": 1.0, "train/steps": 2.0}


def test_a_missing_wandb_is_reported_when_the_plan_loads() -> None:
    import importlib.util

    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    with pytest.raises(ValueError, match="the wandb package is not installed"):
        TrackingConfig(backend="wandb")
