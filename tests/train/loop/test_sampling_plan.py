"""Sampling in a plan: a temperature schedule over a stage's epochs (Surogate's temp_scheduler), min_tokens and
repetition_penalty refused for an RL trainer, and the degenerate-generation filters counted in history. The
schedule and the filters run through a real epoch loop (the scripted stack, the toy trainer)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from rollgym.client import ServerAddress
from rollgym.data.jsonl import read_whole_lines
from rollgym.data.records import output_items
from rollgym.data.sampling import TemperatureSchedule, params_at
from rollgym.sampling_contract import refuse_unreproducible
from rollgym.testing import REPO_ROOT
from rollgym.train.loop.epochs import TrainLoop
from rollgym.train.loop.plan import PlanError, load_plan
from rollgym.train.trainers.base import TrainingFailed
from rollgym.train.trainers.grpo_trainer import sampling_temperature

TOY = "tests.train.toy_trainers"
TASKS = REPO_ROOT / "resources_servers/weather/data/example.jsonl"
DEMO = REPO_ROOT / "scripts/train/weather.yaml"


def test_a_schedule_moves_from_start_to_end_over_the_steps() -> None:
    linear = TemperatureSchedule(type="linear", start_temperature=1.0, end_temperature=0.5)
    assert [linear.at(step, 4) for step in range(5)] == [1.0, 0.875, 0.75, 0.625, 0.5]
    cosine = TemperatureSchedule(type="cosine", start_temperature=1.0, end_temperature=0.5)
    by_hand = [1.0 - 0.5 * (1 - math.cos(math.pi * step / 4)) / 2 for step in range(5)]
    assert [cosine.at(step, 4) for step in range(5)] == pytest.approx(by_hand, abs=1e-6)
    assert cosine.at(1, 4) == pytest.approx(0.926777, abs=1e-6)
    assert linear.at(0, 0) == 1.0 and linear.at(9, 4) == 0.5  # one step only; past the last
    assert params_at({"temperature": 0.7, "top_p": 1.0}, 3, 4) == {"temperature": 0.7, "top_p": 1.0}


def demo() -> dict[str, Any]:
    return yaml.safe_load(DEMO.read_text())


def load(tmp_path: Path, data: dict[str, Any]) -> Any:
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_plan(path)


SCHEDULE = {"type": "linear", "start_temperature": 1.0, "end_temperature": 0.5}


@pytest.mark.parametrize(("change", "message"), [
    (lambda p: p["stages"][1]["collect"]["params"].update(min_tokens=8),
     r"stages\[1\]\.collect\.params: min_tokens reshape the sampling distribution, which (trl_)?grpo cannot"),
    (lambda p: p["stages"][1]["collect"]["params"].update(repetition_penalty=1.1),
     r"stages\[1\]\.collect\.params: repetition_penalty reshape"),
    (lambda p: (p["stages"][1]["collect"]["params"].update(temperature=SCHEDULE),
                p["stages"][1]["optimize"]["args"].update(temperature=1.0)),
     r"stages\[1\]\.optimize\.args\.temperature: stages\[1\]\.collect\.params\.temperature is a schedule"),
    (lambda p: p["stages"][1]["collect"]["params"].update(temperature={"type": "exponential"}),
     r"key 'stages\[1\]\.collect\.params': temperature\.type: Input should be 'linear' or 'cosine'"),
    (lambda p: p["stages"][1].setdefault("curate", {}).update(filters=[{"type": "gibberish"}]),
     r"key 'stages\[1\]\.curate\.filters\[0\]\.gibberish\.vocab_size': Field required"),
    (lambda p: p["stages"][1].setdefault("curate", {}).update(filters=[{"type": "repetiton"}]),
     r"key 'stages\[1\]\.curate\.filters\[0\]': .*'repetition', 'gibberish'"),
])
def test_mistakes_name_the_key(tmp_path: Path, change, message: str) -> None:
    data = demo()
    change(data)
    with pytest.raises(PlanError, match=message):
        load(tmp_path, data)


def test_an_sft_stage_may_collect_under_the_knobs_and_an_rl_stage_under_a_schedule(tmp_path: Path) -> None:
    data = demo()
    data["stages"][0]["collect"]["params"].update(min_tokens=8, repetition_penalty=1.1)
    data["stages"][1]["collect"]["params"]["temperature"] = SCHEDULE
    data["stages"][1]["optimize"]["args"].pop("temperature", None)
    plan = load(tmp_path, data)
    assert plan.stages[1].collect.params["temperature"] == SCHEDULE


def test_the_trainer_refuses_a_rollout_sampled_under_a_knob() -> None:
    member = {"sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "logprobs": "processed", "min_tokens": 8}}
    with pytest.raises(TrainingFailed, match="min_tokens 8"):
        sampling_temperature(member, "group g rollout r0")
    with pytest.raises(TrainingFailed, match="repetition_penalty 1.1"):
        sampling_temperature({"sampling": {**member["sampling"], "min_tokens": 0, "repetition_penalty": 1.1}}, "r")
    assert sampling_temperature({"sampling": {**member["sampling"], "min_tokens": 0}}, "r") == 1.0
    refuse_unreproducible({"min_tokens": 0, "repetition_penalty": 1.0}, "neutral")  # nothing to refuse


@pytest.fixture(autouse=True)
def toys(importable_toys: None) -> None:
    """The epoch test runs a toy trainer in a child process."""


def test_each_epoch_collects_at_its_scheduled_temperature_and_history_counts_the_filters(
        tmp_path: Path, scripted_agents: dict[str, ServerAddress]) -> None:
    registry = tmp_path / "stack.json"
    registry.write_bytes(orjson.dumps({name: {"url": a.url, "role": a.role} for name, a in scripted_agents.items()}))
    plan = {
        "output": str(tmp_path / "run"),
        "stack": {"registry_file": str(registry), "agent": "weather_agent", "concurrency": 4},
        "stages": [{
            "name": "sft", "epochs": 3,
            "collect": {"input": str(TASKS), "repeats": 2, "limit": 2, "params": {"temperature": SCHEDULE}},
            # Every sampled token above probability 1e-9: each rollout with a sampled token is flagged; counted only.
            "curate": {"filters": [{"type": "repetition", "window": 1, "prob_threshold": 1e-9}]},
            "optimize": {"trainer": f"{TOY}:CountingTrainer", "data": "sft"},
            "apply": "none",
        }],
    }
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(plan))
    loop = TrainLoop(load_plan(tmp_path / "plan.yaml"), progress=False)
    loop.run()
    history = loop.history()
    assert [line["train"]["temperature"] for line in history] == [1.0, 0.75, 0.5]
    for epoch, temperature in zip((1, 2, 3), (1.0, 0.75, 0.5)):
        rollouts = read_whole_lines(tmp_path / "run" / f"epoch-00{epoch}" / "rollouts.jsonl")
        assert rollouts and all(r["responses_create_params"]["temperature"] == temperature for r in rollouts)
        recorded = [item["sampling"]["temperature"] for r in rollouts for item in output_items(r) if "sampling" in item]
        assert recorded and set(recorded) == {temperature}
    curated = history[0]["curated"]
    assert curated["flagged"] == {"repetition": 4} and curated["dropped"] == {} and curated["records"] == 4


def test_an_async_schedule_needs_the_last_step() -> None:
    from pydantic import ValidationError

    from rollgym.train.orchestrator.config import OrchestratorConfig

    env = {"name": "weather", "input": str(TASKS), "params": {"temperature": SCHEDULE}}
    with pytest.raises(ValidationError, match="temperature schedule runs from the first step to the last: set max_steps"):
        OrchestratorConfig.model_validate({"batch_size": 8, "rollouts_per_example": 4, "envs": [env]})
    assert OrchestratorConfig.model_validate({"batch_size": 8, "rollouts_per_example": 4, "max_steps": 5,
                                              "envs": [env]}).max_steps == 5
