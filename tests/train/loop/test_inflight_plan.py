"""The plan key of in-flight weight updates: off by default, read from the orchestrator section, refused where
the policy server publishes between batches (co-located)."""

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


def async_plan() -> dict:
    return yaml.safe_load((REPO_ROOT / "scripts/train/async.yaml").read_text())


def test_inflight_updates_are_off_by_default_and_one_key_turns_them_on(tmp_path: Path) -> None:
    assert load_plan(write(tmp_path, async_plan())).orchestrator.inflight_updates is False
    data = async_plan()
    data["orchestrator"]["inflight_updates"] = True
    assert load_plan(write(tmp_path, data)).orchestrator.inflight_updates is True
    data["orchestrator"]["inflight_updates"] = "sometimes"
    with pytest.raises(PlanError, match=r"orchestrator\.inflight_updates"):
        load_plan(write(tmp_path, data))


def test_inflight_updates_are_refused_under_colocate(tmp_path: Path) -> None:
    data = async_plan()
    data["orchestrator"]["inflight_updates"] = True
    data["colocate"] = True
    with pytest.raises(PlanError, match=r"orchestrator\.inflight_updates: the co-located server publishes"):
        load_plan(write(tmp_path, data))
