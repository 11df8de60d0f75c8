"""guard.accept on any metric of the validation summary: mean_reward, pass@K, reward_components.NAME and a
suite's environments.ENV.METRIC; judged by guard_problems (a missing metric counts as below) and refused at
plan load when the plan's validation can never report it."""

from __future__ import annotations

import tempfile
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Iterator

import orjson
import pytest
import yaml

from rollgym.testing import REPO_ROOT
from rollgym.train.loop.guard import guard_problems, metric_value
from rollgym.train.loop.plan import PlanError, load_plan
from rollgym.train.loop.validation import component_means

DEMO = REPO_ROOT / "scripts/train/weather.yaml"

# A suite's summary as Validation._suite builds it: the mean over environments beside each one's own.
SUITE_SUMMARY = {
    "suite": "smoke", "mean_reward": 0.5, "pass@1": 0.5, "pass@4": 0.75,
    "environments": {
        "weather": {"mean_reward": 0.8, "pass@1": 0.8, "pass@4": 1.0,
                    "reward_components": {"reports_weather": 0.9, "used_tool": 1.0}},
        "mcq": {"mean_reward": 0.2, "pass@1": 0.2, "pass@4": 0.5},
    },
}


def test_metric_value_reads_dotted_paths_into_the_summary() -> None:
    single = {"mean_reward": 0.4, "pass@2": 0.6, "reward_components": {"0:all_lowercase": 0.25, "store/apple": 1}}
    assert metric_value(single, "mean_reward") == 0.4
    assert metric_value(single, "pass@2") == 0.6
    assert metric_value(single, "reward_components.0:all_lowercase") == 0.25
    assert metric_value(single, "reward_components.store/apple") == 1.0
    assert metric_value(single, "reward_components.absent") is None
    assert metric_value(single, "pass@4") is None
    assert metric_value(SUITE_SUMMARY, "environments.weather.mean_reward") == 0.8
    assert metric_value(SUITE_SUMMARY, "environments.mcq.pass@4") == 0.5
    assert metric_value(SUITE_SUMMARY, "environments.weather.reward_components.used_tool") == 1.0
    assert metric_value(SUITE_SUMMARY, "environments.code.mean_reward") is None
    assert metric_value({"mean_reward": None}, "mean_reward") is None


def test_guard_problems_judge_any_metric_a_missing_one_as_below() -> None:
    accept = {"environments.weather.mean_reward": 0.7, "environments.mcq.mean_reward": 0.3, "pass@4": 0.7}
    assert guard_problems(SUITE_SUMMARY, None, None, accept) == [
        "validation environments.mcq.mean_reward 0.200 is below the accepted 0.3"]
    assert guard_problems(SUITE_SUMMARY, None, None, {"environments.weather.reward_components.reports_weather": 0.9,
                                                      "environments.weather.pass@4": 1.0}) == []
    single = {"mean_reward": 0.6, "reward_components": {"used_tool": 0.5}}
    assert guard_problems(single, None, None, {"reward_components.used_tool": 0.75,
                                               "reward_components.reports_weather": 0.1}) == [
        "validation reward_components.used_tool 0.500 is below the accepted 0.75",
        "validation reward_components.reports_weather missing is below the accepted 0.1"]
    # max_drop still compares mean rewards, beside the thresholds.
    assert guard_problems(single, {"reward": 0.9}, 0.1, {"mean_reward": 0.5}) == [
        "validation reward 0.600 fell more than 0.1 below the best 0.900"]


def test_component_means_average_each_component_over_the_rollouts_reporting_it() -> None:
    rollouts = [{"reward": 1.0, "reward_components": {"a": 1.0, "b": 0.0}},
                {"reward": 0.0, "reward_components": {"a": 0.0}},
                {"reward": 0.5, "reward_components": None},
                {"reward": 0.5, "reward_components": {"a": 0.5, "flag": True}}]
    assert component_means(rollouts) == {"a": 0.5, "b": 0.0}
    assert component_means([{"reward": 1.0}]) == {}


def write(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def demo_with(accept: dict, suite: bool = False) -> dict:
    data = yaml.safe_load(DEMO.read_text())
    if suite:
        data["validation"] = {"suite": "smoke"}
        data["stack"]["agent"] = "weather_agent"
    data["guard"]["accept"] = accept
    return data


def test_metrics_the_validation_can_report_load(tmp_path: Path) -> None:
    single = {"mean_reward": 0.5, "pass@1": 0.2, "pass@3": 0.5, "reward_components.used_tool": 1.0}
    assert load_plan(write(tmp_path, demo_with(single))).guard.accept == single
    suite = {"pass@4": 0.5, "environments.weather.pass@2": 0.5, "environments.mcq.reward_components.x": 0.1}
    assert load_plan(write(tmp_path, demo_with(suite, suite=True))).guard.accept == suite


@pytest.mark.parametrize(("accept", "suite", "message"), [
    ({"accuracy": 0.9}, False, r"key 'guard': accept: unknown metric 'accuracy': use mean_reward, pass@K, "
                               r"reward_components\.NAME, or environments\.ENV\.METRIC"),
    ({"reward_components.": 0.9}, False, r"key 'guard': accept: unknown metric 'reward_components\.'"),
    ({"pass@0": 0.9}, False, r"unknown metric 'pass@0'"),
    ({"environments.weather": 0.9}, True, r"key 'guard': accept: metric 'environments\.weather': write "
                                         r"environments\.ENV\.METRIC"),
    ({"environments.weather.accuracy": 0.9}, True, r"unknown metric 'environments\.weather\.accuracy'"),
    ({"pass@4": 0.5}, False, r"key 'guard\.accept': 'pass@4' is never measured: validation with 3 repeats "
                             r"measures pass@1, pass@2, pass@3"),
    ({"environments.weather.mean_reward": 0.5}, False,
     r"key 'guard\.accept': 'environments\.weather\.mean_reward': per-environment metrics need validation\.suite"),
    ({"environments.code.mean_reward": 0.5}, True,
     r"key 'guard\.accept': 'environments\.code\.mean_reward': the suite has no environment 'code' "
     r"\(reverse_text, weather, mcq\)"),
    ({"environments.mcq.pass@3": 0.5}, True,
     r"key 'guard\.accept': 'environments\.mcq\.pass@3' is never measured: validation with 4 repeats measures "
     r"pass@1, pass@2, pass@4 \(environment 'mcq'\)"),
])
def test_metrics_that_cannot_exist_are_refused_with_the_key(tmp_path: Path, accept: dict, suite: bool,
                                                             message: str) -> None:
    with pytest.raises(PlanError, match=message):
        load_plan(write(tmp_path, demo_with(accept, suite)))



@contextmanager
def weather_with_components() -> Iterator[Path]:
    """The scripted stack's weather environment, its verdict split into two components: whether the answer
    names the right weather (the reward) and whether the tool was called."""
    from models.chat_completions.app import ChatCompletionsConfig, ChatCompletionsModel
    from resources_servers.weather.app import WeatherServer
    from rollgym.client import ServerAddress
    from rollgym.resources import Verdict
    from rollgym.testing import scripted_backend, serve_in_thread
    from tests.conftest import simple_agent

    class ComponentWeather(WeatherServer):
        async def verify(self, request, state):  # type: ignore[no-untyped-def]
            verdict = await super().verify(request, state)
            return Verdict(verdict.reward, {"answered": verdict.reward, "looked_up": float(bool(state["lookups"]))})

    with ExitStack() as stack:
        backend = stack.enter_context(scripted_backend("--token-info"))
        model = ChatCompletionsModel(ChatCompletionsConfig(base_url=backend, model="scripted", return_token_ids=True),
                                     name="policy_model")
        model_url = stack.enter_context(serve_in_thread(model))
        env_url = stack.enter_context(serve_in_thread(ComponentWeather(name="weather")))
        agent_url = stack.enter_context(serve_in_thread(simple_agent("weather_agent", "weather", model_url, env_url)))
        registry = {"policy_model": ServerAddress(model_url, "models"),
                    "weather_agent": ServerAddress(agent_url, "agents")}
        path = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "stack.json"
        path.write_bytes(orjson.dumps({name: {"url": a.url, "role": a.role} for name, a in registry.items()}))
        yield path


def test_a_run_records_component_means_and_guards_on_them(tmp_path: Path, importable_toys: None) -> None:
    """Through a run over a scripted stack: validation's summary holds each reward component's mean (the
    same as averaging validation.jsonl by hand), and a threshold on one of them stops the run."""
    from rollgym.data.jsonl import read_whole_lines
    from rollgym.train.loop.epochs import TrainLoop

    tasks = str(REPO_ROOT / "resources_servers/weather/data/example.jsonl")
    with weather_with_components() as registry:
        plan = {"output": str(tmp_path / "run"), "stack": {"registry_file": str(registry), "agent": "weather_agent"},
                "validation": {"input": tasks, "repeats": 2, "limit": 3},
                "stages": [{"name": "sft", "epochs": 2, "collect": {"input": tasks, "repeats": 2, "limit": 2},
                            "optimize": {"trainer": "tests.train.toy_trainers:CountingTrainer", "data": "sft"},
                            "apply": "none"}],
                "guard": {"max_drop": None, "accept": {"reward_components.looked_up": 1.01}, "on_violation": "stop"}}
        loop = TrainLoop(load_plan(write(tmp_path, plan)), progress=False, log=lambda message: None)
        state = loop.run()
    history = loop.history()
    rollouts = read_whole_lines(tmp_path / "run" / "epoch-001" / "validation.jsonl")
    by_hand = {name: sum(r["reward_components"][name] for r in rollouts) / len(rollouts)
               for name in ("answered", "looked_up")}
    assert len(rollouts) == 6
    assert history[1]["validation"]["reward_components"] == pytest.approx(by_hand)
    assert history[1]["validation"]["reward_components"]["answered"] == pytest.approx(
        history[1]["validation"]["mean_reward"])
    assert [line["epoch"] for line in history] == [0, 1], "the run went on past the guard"
    assert history[1]["guard"]["problems"] == [
        f"validation reward_components.looked_up {by_hand['looked_up']:.3f} is below the accepted 1.01"]
    assert state["stopped"].startswith("validation reward_components.looked_up")
