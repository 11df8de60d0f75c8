"""`rollgym train PLAN --check` of co-locate plans (`colocate: true`): with no `apply` key a stage publishes
in memory and the plan checks clean; what co-locate mode cannot do is refused by key, with exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rollgym.cli import main
from rollgym.testing import REPO_ROOT
from rollgym.train.loop.colocate import CONFIG
from rollgym.train.loop.plan import load_plan

PLAN = REPO_ROOT / "scripts/train/weather-colocate.yaml"


def plan_data(tmp_path: Path) -> dict:
    data = yaml.safe_load(PLAN.read_text())
    data["output"] = str(tmp_path / "run")
    data["stack"]["configs"] = [str(REPO_ROOT / item) for item in data["stack"]["configs"]]
    data["validation"]["input"] = str(REPO_ROOT / data["validation"]["input"])
    for stage in data["stages"]:
        stage["collect"]["input"] = str(REPO_ROOT / stage["collect"]["input"])
    return data


def check(tmp_path: Path, capsys: pytest.CaptureFixture[str], data: dict) -> tuple[int, str]:
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(data))
    code = main(["train", str(path), "--check"])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_a_colocate_plan_without_apply_checks_clean_and_publishes_in_memory(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = plan_data(tmp_path)
    assert data["colocate"] is True and all("apply" not in stage for stage in data["stages"])
    assert all(stage["optimize"]["args"]["finetune"] == "full" for stage in data["stages"])
    code, out = check(tmp_path, capsys, data)
    assert code == 0, out
    assert "apply memory" in out and not (tmp_path / "run").exists()
    plan = load_plan(tmp_path / "plan.yaml")
    assert [stage.apply for stage in plan.stages] == ["memory"] and CONFIG.is_file()


@pytest.mark.parametrize(("change", "named"), [
    (lambda d: d["stages"][0].update(apply="merged"), "stages[0].apply: merged"),
    (lambda d: d["stages"][0]["optimize"].update(trainer="trl_sft", args={}), "stages[0].optimize.trainer"),
    (lambda d: d["stages"][0]["optimize"]["args"].update(processes=2), "stages[0].optimize.args.processes"),
    (lambda d: d["stages"][0]["optimize"]["args"].update(nnodes=2, rdzv_endpoint="node0:29500"),
     "stages[0].optimize.args.nnodes: colocate: true runs one trainer process"),
    (lambda d: d["stages"][0]["optimize"]["args"].update(devices=[1]), "stages[0].optimize.args.devices"),
    (lambda d: d["stages"][0]["optimize"]["args"].update(checkpoint_every=4),
     "stages[0].optimize.args.checkpoint_every: colocate: true checkpoints every step"),
    (lambda d: d.update(colocate=False) or d["stages"][0].update(apply="memory"), "it needs colocate: true"),
])
def test_what_colocate_cannot_do_is_refused_by_key(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   change: object, named: str) -> None:
    data = plan_data(tmp_path)
    change(data)  # type: ignore[operator]
    code, out = check(tmp_path, capsys, data)
    assert code == 2 and named in out, out


def test_an_async_colocate_plan_trains_full_weights_and_checks_clean(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """mode: async with colocate: true: finetune: full is on-policy (each step published in memory); without it a
    policy model that cannot reload full weights, and a trainer that cannot run in the server, are refused by key."""
    data = plan_data(tmp_path)
    stage = data.pop("stages")[0]
    data.update(mode="async", optimize=stage["optimize"], orchestrator={
        "batch_size": 12, "rollouts_per_example": 6, "max_steps": 4,
        "envs": [{"name": "weather", "input": stage["collect"]["input"], "agent": "weather_agent",
                  "params": stage["collect"]["params"]}]})
    code, out = check(tmp_path, capsys, data)
    assert code == 0, out
    data.pop("colocate")
    code, out = check(tmp_path, capsys, data)
    assert code == 2 and "key 'optimize.args.finetune': the stack's policy_model is models/" in out, out
    data.update(colocate=True, optimize={"trainer": "trl_sft", "args": {}})
    code, out = check(tmp_path, capsys, data)
    assert code == 2 and "optimize.trainer: colocate: true trains with grpo" in out, out
