"""The plan YAML: a valid plan loads; every mistake is reported with the file and the key."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rollgym.train.plan import PlanError, load_plan
from rollgym.testing import REPO_ROOT

DEMO = REPO_ROOT / "scripts/train/weather.yaml"


def write(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


def demo() -> dict:
    return yaml.safe_load(DEMO.read_text())


def test_the_demo_plan_is_valid() -> None:
    plan = load_plan(DEMO)
    assert [stage.name for stage in plan.stages] == ["rs-sft", "grpo"]
    assert plan.stages[0].optimize.data == "sft" and plan.stages[1].optimize.data == "groups"
    assert [epoch for epoch, _ in plan.epochs()] == [1, 2]
    assert plan.validation is not None and plan.validation.every == 1


def test_overrides_replace_top_level_keys(tmp_path: Path) -> None:
    plan = load_plan(DEMO, {"output": str(tmp_path / "x"), "seed": 3})
    assert plan.output == str(tmp_path / "x") and plan.seed == 3


@pytest.mark.parametrize(("change", "message"), [
    (lambda p: p["stages"][1]["optimize"].update(adapter="trl_ppo"), r"key 'stages\[1\]\.optimize': unknown adapter 'trl_ppo'"),
    (lambda p: p["stages"][0]["collect"].update(repeats=0), r"key 'stages\[0\]\.collect\.repeats': Input should be greater"),
    (lambda p: p["stages"][0]["curate"].update(min_rewad=1), r"key 'stages\[0\]\.curate\.min_rewad': Extra inputs"),
    (lambda p: p["stages"][0]["curate"].update(curriculum={"initial_percentile": 2}),
     r"key 'stages\[0\]\.curate\.curriculum\.initial_percentile'"),
    (lambda p: p["stages"][0].update(apply="restart"), r"key 'stages\[0\]\.apply': Input should be 'lora', 'merged' or 'none'"),
    (lambda p: p.pop("output"), r"key 'output': Field required"),
    (lambda p: p["stack"].update(registry_file="stack.json"), r"key 'stack': give either configs .* or registry_file"),
    (lambda p: p.update(validation=None), r"a guard needs a validation section"),
    (lambda p: p["stages"][1].update(name="rs-sft"), r"stage names must be distinct"),
    (lambda p: p["stages"][0]["optimize"].update(adapter="mypkg.trainer:Remote"), r"say what a custom adapter trains on"),
])
def test_mistakes_name_the_key(tmp_path: Path, change, message: str) -> None:
    data = demo()
    change(data)
    with pytest.raises(PlanError, match=message) as caught:
        load_plan(write(tmp_path, data))
    assert str(tmp_path / "plan.yaml") in str(caught.value)


def test_unreadable_plans(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="no such plan file"):
        load_plan(tmp_path / "missing.yaml")
    with pytest.raises(PlanError, match="not valid YAML"):
        load_plan(write(tmp_path, "stages: [\n"))
    with pytest.raises(PlanError, match="a plan is a mapping"):
        load_plan(write(tmp_path, "- 1\n- 2\n"))


def test_cli_reports_plan_errors_without_a_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from rollgym.cli import main

    data = demo()
    data["stages"][0]["collect"]["repeats"] = "four"
    assert main(["train", str(write(tmp_path, data))]) == 2
    err = capsys.readouterr().err
    assert "key 'stages[0].collect.repeats'" in err and "Traceback" not in err
    assert main(["train", str(DEMO), "seed"]) == 2
    assert "must look like KEY=VALUE" in capsys.readouterr().err
