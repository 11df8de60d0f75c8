"""`rollgym train` with `mode: async` against a running scripted stack: the orchestrator's batches go to a
trainer adapter in a child process, every step's adapter is hot-loaded, validation follows the versions.

The trainer is tests/train/toy_trainers.CountingTrainer (a real adapter that writes a PEFT-shaped folder
and trains nothing); the TRL GRPO adapter on the embedded model is run by scripts/train/async.yaml.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import orjson
import pytest

from rollgym.client import ServerAddress
from rollgym.train.async_loop import AsyncTrainLoop
from rollgym.train.plan import PlanError, load_plan
from tests.train.orchestrator_support import medium_rows, scripted_stack, write_rows


@pytest.fixture(scope="module")
def stack() -> Iterator[dict[str, ServerAddress]]:
    with scripted_stack() as registry:
        yield registry


def write_plan(tmp_path: Path, stack: dict[str, ServerAddress], **changes: object) -> Path:
    registry = tmp_path / "stack.json"
    registry.write_bytes(orjson.dumps({name: address.to_json() for name, address in stack.items()}))
    tasks = write_rows(tmp_path / "tasks.jsonl", medium_rows(20))
    plan = {
        "output": str(tmp_path / "run"), "mode": "async",
        "stack": {"registry_file": str(registry), "agent": "reverse_text_agent"},
        "validation": {"input": write_rows(tmp_path / "validation.jsonl", medium_rows(3, "v")), "every": 2,
                       "repeats": 1},
        "orchestrator": {"batch_size": 4, "rollouts_per_example": 2, "max_steps": 3, "max_async_level": 1,
                         "max_off_policy_steps": 2, "concurrency": 4,
                         "envs": [{"name": "reverse", "input": tasks, "agent": "reverse_text_agent"}]},
        "optimize": {"adapter": "tests.train.toy_trainers:CountingTrainer", "data": "sft"},
        **changes,
    }
    path = tmp_path / "plan.json"
    path.write_bytes(orjson.dumps(plan))
    return path


def test_async_plan_trains_hot_loads_and_validates_per_step(stack, tmp_path):
    plan = load_plan(write_plan(tmp_path, stack))
    AsyncTrainLoop(plan, progress=False, log=lambda _: None).run()
    run = tmp_path / "run"
    history = [orjson.loads(line) for line in (run / "history.jsonl").read_bytes().splitlines()]
    assert [line["step"] for line in history] == [0, 1, 2, 3]
    assert [line["model_version"] for line in history] == [None, "policy@1", "policy@2", "policy@3"]
    # The base model's validation, then every 2nd step's, on the adapter just loaded.
    assert [bool(line.get("validation")) for line in history] == [True, False, True, False]
    validation = [orjson.loads(line) for line in (run / "step-002" / "validation.jsonl").read_bytes().splitlines()]
    assert {r["response"]["model_version"] for r in validation} == {"policy@2"}
    # Each step trained once, from the previous step's adapter, on that step's batch (4 rollouts as SFT rows).
    calls = (run / "calls.log").read_text().split("\n")[:-1]
    assert [c.split()[:2] for c in calls] == [["policy-s001", "4"], ["policy-s002", "4"], ["policy-s003", "4"]]
    assert calls[0].split()[2] == "None" and calls[1].split()[2] == str(run / "step-001" / "train" / "adapter")
    for line in history[1:]:
        metrics = line["orchestrator"]
        assert metrics["rollouts"] == 4 and max(int(lag) for lag in metrics["staleness"]) <= 2
    assert (run / "steps.png").stat().st_size > 0 and (run / "reward.png").stat().st_size > 0


def test_async_plan_errors_name_the_key(stack, tmp_path):
    with pytest.raises(PlanError, match="mode: async needs orchestrator and optimize"):
        load_plan(write_plan(tmp_path, stack, optimize=None))
    with pytest.raises(PlanError, match=r"key .orchestrator.: batch_size \(5\) must be a multiple of"):
        load_plan(write_plan(tmp_path, stack, orchestrator={
            "batch_size": 5, "rollouts_per_example": 2, "envs": [{"name": "r", "input": "t.jsonl"}]}))
    plan = load_plan(write_plan(tmp_path, stack))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "old.txt").write_text("x")
    with pytest.raises(Exception, match="is not empty"):
        AsyncTrainLoop(plan, progress=False, log=lambda _: None).run()
