"""Settings the orchestrator cannot honour are refused when the config or plan is loaded, naming the key:
`advantage.type: return_to_go` (its batches carry one advantage per rollout, not one per model turn) and
Surogate's `skip_verification` (its batches are reward-weighed groups)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rollgym.cli import main
from rollgym.testing import REPO_ROOT
from rollgym.train.orchestrator.config import load_orchestrator_config

ASYNC = REPO_ROOT / "scripts/train/async.yaml"


def async_plan(tmp_path: Path, **orchestrator: object) -> Path:
    data = yaml.safe_load(ASYNC.read_text())
    data["output"] = str(tmp_path / "run")
    data["stack"]["configs"] = [str(REPO_ROOT / item) for item in data["stack"]["configs"]]
    data["validation"]["input"] = str(REPO_ROOT / data["validation"]["input"])
    for env in data["orchestrator"]["envs"]:
        env["input"] = str(REPO_ROOT / env["input"])
    data["orchestrator"].update(orchestrator)
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_train_check_refuses_return_to_go_in_async_mode(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", str(async_plan(tmp_path)), "--check"]) == 0
    capsys.readouterr()
    plan = async_plan(tmp_path, advantage={"type": "return_to_go", "gamma": 0.9})
    assert main(["train", str(plan), "--check"]) == 2
    error = capsys.readouterr().err
    assert f"{plan}: key 'orchestrator.advantage': type return_to_go gives every model turn its own advantage" in error
    assert "stages[i].curate.advantage" in error and "Traceback" not in error
    assert not (tmp_path / "run").exists()  # nothing started, the output folder not claimed


@pytest.mark.parametrize("setting, key, message", [
    ({"advantage": {"type": "return_to_go"}}, "advantage", "type return_to_go gives every model turn"),
    ({"skip_verification": True}, "skip_verification", "a batch is GRPO groups weighed by their rewards"),
])
def test_an_orchestrator_config_refuses_what_its_batches_cannot_carry(tmp_path: Path, setting: dict, key: str,
                                                                       message: str) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"responses_create_params": {"input": "hi"}}\n')
    config = {"batch_size": 4, "rollouts_per_example": 2, "envs": [{"name": "e", "input": str(tasks)}]}
    path = tmp_path / "orchestrator.yaml"
    path.write_text(yaml.safe_dump(config))
    assert load_orchestrator_config(path).advantage.type == "normalized"
    path.write_text(yaml.safe_dump({**config, **setting}))
    with pytest.raises(ValueError, match=f"{path}: key '{key}': {message}"):
        load_orchestrator_config(path)


def test_one_difficulty_section_each_mode_refusing_the_others_keys(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """`difficulty` is one section (rollgym.data.rollout_filters.DifficultyConfig) in both modes; a key only
    the other mode applies is refused by name, a dumped section (every key at its default) is not."""
    from rollgym.data.rollout_filters import DifficultyConfig
    from rollgym.train.loop.dynamic_sampling import difficulty_problem

    plan = async_plan(tmp_path, difficulty={"enabled": True, "max_refill_rounds": 3})
    assert main(["train", str(plan), "--check"]) == 2
    assert "key 'orchestrator.difficulty': max_refill_rounds: a key of mode: epochs" in capsys.readouterr().err
    assert main(["train", str(async_plan(tmp_path, difficulty=DifficultyConfig(enabled=True).model_dump())),
                 "--check"]) == 0
    problem = difficulty_problem(DifficultyConfig(enabled=True, easy_fraction=0.5), "groups", "grpo")
    assert problem is not None and "easy_fraction apply in mode: async (orchestrator.difficulty)" in problem
