"""The plan key of in-flight weight updates: off by default, read from the orchestrator section, refused where
nothing would abort and continue (a LoRA hot-load) or where the server publishes between batches (co-located)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rollgym.testing import REPO_ROOT
from rollgym.train.loop.plan import PlanError, load_plan


def write(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def full_async_plan(tmp_path: Path) -> dict:
    """GRPO on full weights, mode: async, through chat_completions (vLLM): each step reloaded on the replicas."""
    weather = REPO_ROOT / "resources_servers/weather"
    return {"base_model": str(tmp_path), "output": str(tmp_path / "run"), "mode": "async",
            "stack": {"configs": [str(weather / "configs/weather.yaml"),
                                  str(REPO_ROOT / "models/chat_completions/configs/chat_completions.yaml")]},
            "optimize": {"trainer": "grpo", "args": {"finetune": "full", "temperature": 1.0}},
            "orchestrator": {"batch_size": 4, "rollouts_per_example": 2, "max_steps": 2,
                             "envs": [{"name": "weather", "input": str(weather / "data/train.jsonl"),
                                       "agent": "weather_agent", "params": {"temperature": 1.0}}]}}


def test_inflight_updates_are_off_by_default_and_one_key_turns_them_on(tmp_path: Path) -> None:
    data = full_async_plan(tmp_path)
    assert load_plan(write(tmp_path, data)).orchestrator.inflight_updates is False
    data["orchestrator"]["inflight_updates"] = True
    assert load_plan(write(tmp_path, data)).orchestrator.inflight_updates is True
    data["orchestrator"]["inflight_updates"] = "sometimes"
    with pytest.raises(PlanError, match=r"orchestrator\.inflight_updates"):
        load_plan(write(tmp_path, data))


def test_inflight_updates_are_refused_where_nothing_would_be_continued(tmp_path: Path) -> None:
    data = yaml.safe_load((REPO_ROOT / "scripts/train/async.yaml").read_text())  # LoRA, hot-loaded
    data["orchestrator"]["inflight_updates"] = True
    with pytest.raises(PlanError, match=r"orchestrator\.inflight_updates: a LoRA hot-load does not pause"):
        load_plan(write(tmp_path, data))
    data["colocate"] = True
    with pytest.raises(PlanError, match=r"orchestrator\.inflight_updates: the co-located server publishes"):
        load_plan(write(tmp_path, data))
