"""`rollgym train` with `mode: async` against a running scripted stack: the orchestrator's batches go to a
trainer adapter in a child process, every step's adapter is hot-loaded, validation follows the versions.

The trainer is tests/train/toy_trainers.CountingTrainer (a real adapter that writes a PEFT-shaped folder
and trains nothing); the TRL GRPO adapter on the embedded model is run by scripts/train/async.yaml.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import orjson
import pytest

from rollgym.adapters import content_digest
from rollgym.client import ServerAddress
from rollgym.train.loop.async_driver import AsyncTrainLoop
from rollgym.train.loop.plan import PlanError, load_plan
from tests.train.orchestrator.support import medium_rows, scripted_stack, write_rows


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
        "optimize": {"trainer": "tests.train.toy_trainers:CountingTrainer", "data": "sft"},
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
    loaded = [f"policy@{content_digest(str(run / f'step-00{n}' / 'train' / 'adapter'))}" for n in (1, 2, 3)]
    assert [line["model_version"] for line in history] == [None, *loaded]
    # The base model's validation, then every 2nd step's, on the adapter just loaded.
    assert [bool(line.get("validation")) for line in history] == [True, False, True, False]
    validation = [orjson.loads(line) for line in (run / "step-002" / "validation.jsonl").read_bytes().splitlines()]
    assert {r["response"]["model_version"] for r in validation} == {loaded[1]}
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
    with pytest.raises(PlanError, match=r"guard.on_violation: an async run's guard can only stop it"):
        load_plan(write_plan(tmp_path, stack, guard={"max_drop": 0.1, "on_violation": "continue"}))
    plan = load_plan(write_plan(tmp_path, stack))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "old.txt").write_text("x")
    with pytest.raises(Exception, match="is not empty and holds no run"):
        AsyncTrainLoop(plan, progress=False, log=lambda _: None).run()


def _lines(path: Path) -> list[dict]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def test_killed_async_train_resumes_after_the_last_finished_step(stack, tmp_path):
    """`rollgym train` in async mode is SIGKILLed while step 2 trains; the same command continues it."""
    plan_path = write_plan(tmp_path, stack, optimize={
        "trainer": "tests.train.toy_trainers:CountingTrainer", "data": "sft", "args": {"sleep_s": 3.0}})
    plan = orjson.loads(plan_path.read_bytes())
    plan["orchestrator"]["max_steps"] = 4
    plan_path.write_bytes(orjson.dumps(plan))
    run = tmp_path / "run"
    steps = run / "orchestrator" / "steps"
    command = [sys.executable, "-m", "rollgym.cli", "train", str(plan_path), "--no-progress"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    def digests() -> dict[int, str]:
        return {int(folder.name[5:]): hashlib.sha1((folder / "batch.jsonl").read_bytes()).hexdigest()
                for folder in steps.glob("step_*") if (folder / "READY").exists()}

    first = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 90

        def training_step_2() -> bool:  # step 2's trainer started (and sleeps), step 3 is out already
            calls = (run / "calls.log").read_text().splitlines() if (run / "calls.log").is_file() else []
            return len(calls) >= 2 and (steps / "step_3" / "READY").exists()

        while not training_step_2():
            assert first.poll() is None and time.monotonic() < deadline, first.stdout.read().decode()
            time.sleep(0.05)
        before_kill = digests()
        assert not (run / "step-002" / "train" / "artefact.json").exists()  # the kill lands mid-step
        first.send_signal(signal.SIGKILL)
        first.wait(10)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert [line["step"] for line in _lines(run / "history.jsonl")] == [0, 1]
    assert sorted(before_kill) == [1, 2, 3]  # at most max_async_level (1) ahead of the trainer
    version_1 = _lines(run / "history.jsonl")[1]["model_version"]

    second = subprocess.run(command, capture_output=True, text=True, env=env, timeout=180)
    assert second.returncode == 0, second.stderr
    assert "resuming after step 1" in second.stderr
    adapter_1 = run / "step-001" / "train" / "adapter"
    assert f"step 1: adapter {adapter_1} loaded on policy_model" in second.stderr  # before anything generates
    assert second.stderr.index(f"step 1: adapter {adapter_1}") < second.stderr.index("step 2: adapter")

    history = _lines(run / "history.jsonl")
    assert [line["step"] for line in history] == [0, 1, 2, 3, 4]  # no step written twice
    assert [bool(line.get("validation")) for line in history] == [True, False, True, False, True]
    assert len({line["model_version"] for line in history[1:]}) == 4
    # Step 1 trained once; step 2 again from step 1's adapter (its trainer was killed); 3 and 4 once each.
    calls = [line.split() for line in (run / "calls.log").read_text().splitlines()]
    assert [c[0] for c in calls] == ["policy-s001", "policy-s002", "policy-s002", "policy-s003", "policy-s004"]
    assert calls[2][2] == str(adapter_1) and calls[3][2] == str(run / "step-002" / "train" / "adapter")
    # The batches published before the kill were handed out again unchanged; no rollout twice, none lost.
    after = digests()
    assert sorted(after) == [1, 2, 3, 4] and all(after[step] == before_kill[step] for step in before_kill)
    batches = {step: _lines(steps / f"step_{step}" / "batch.jsonl") for step in after}
    ids = [r["rollout_id"] for step in sorted(batches) for r in batches[step]]
    assert len(ids) == len(set(ids)) == 16
    for step in (2, 3, 4):  # each step trained on its own batch
        curated = _lines(run / f"step-{step:03d}" / "curated.jsonl")
        assert len(curated) == 4
    # What was generated after the resume came from the adapter loaded again, not from the dead run's load.
    fresh = [r for step in batches if step not in before_kill for r in batches[step]]
    assert fresh and all(version_1 not in {r["response"].get("model_version")} for r in fresh)
    assert [line["step"] for line in _lines(run / "orchestrator" / "history.jsonl")] == [1, 2, 3, 4]
    assert all(max(int(lag) for lag in line["orchestrator"]["staleness"]) <= 2 for line in history[1:])

    # Run again once more: nothing is left to do, and nothing is repeated.
    again = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert again.returncode == 0, again.stderr
    assert [line["step"] for line in _lines(run / "history.jsonl")] == [0, 1, 2, 3, 4]
    assert len((run / "calls.log").read_text().splitlines()) == 5


def test_a_step_applied_but_not_recorded_is_applied_again_not_trained_again(stack, tmp_path):
    """The kill came after step 2's adapter was loaded and recorded by the orchestrator, before its history line."""
    plan = load_plan(write_plan(tmp_path, stack, orchestrator={
        "batch_size": 4, "rollouts_per_example": 2, "max_steps": 2, "max_async_level": 1, "max_off_policy_steps": 2,
        "concurrency": 4, "envs": [{"name": "reverse", "input": str(tmp_path / "tasks.jsonl"),
                                    "agent": "reverse_text_agent"}]}))
    AsyncTrainLoop(plan, progress=False, log=lambda _: None).run()
    run = tmp_path / "run"
    history = (run / "history.jsonl").read_bytes().splitlines(keepends=True)
    (run / "history.jsonl").write_bytes(b"".join(history[:2]) + history[2][:40])  # step 2's line torn
    batch_2 = (run / "orchestrator" / "steps" / "step_2" / "batch.jsonl").read_bytes()
    assert (run / "orchestrator" / "steps" / "step_2" / "ADAPTER").read_text().strip()

    said: list[str] = []
    AsyncTrainLoop(plan, progress=False, log=said.append).run()
    assert "resuming after step 1" in said
    adapter_2 = run / "step-002" / "train" / "adapter"
    # Step 1's adapter is served again first (the last step on record), then step 2's is applied again.
    loads = [line for line in said if " loaded on policy_model" in line]
    assert loads == [f"step 1: adapter {run / 'step-001' / 'train' / 'adapter'} loaded on policy_model",
                     f"step 2: adapter {adapter_2} loaded on policy_model"]
    lines = _lines(run / "history.jsonl")
    assert [line["step"] for line in lines] == [0, 1, 2] and lines[2]["validation"]
    assert len((run / "calls.log").read_text().splitlines()) == 2  # step 2 was not trained again
    assert (run / "orchestrator" / "steps" / "step_2" / "batch.jsonl").read_bytes() == batch_2


def test_an_async_guard_stops_the_run_and_a_rewind_goes_on_from_an_earlier_step(stack, tmp_path):
    """A step's validation below `accept` stops an async run, leaving the best model applied; rewound to
    step 1 with the guard relaxed, the run trains steps 2 and 3 again from step 1's adapter, and the
    orchestrator's later batches are moved aside with the rest."""
    plan_path = write_plan(tmp_path, stack, guard={"max_drop": None, "accept": {"mean_reward": 1.5}})
    said: list[str] = []
    state = AsyncTrainLoop(load_plan(plan_path), progress=False, log=said.append).run()
    run = tmp_path / "run"
    history = _lines(run / "history.jsonl")
    assert [line["step"] for line in history] == [0, 1, 2]  # step 2 was validated and refused; no step 3
    assert history[2]["guard"]["ok"] is False and history[2]["guard"]["action"] == "stop"
    assert "below the accepted 1.5" in state["stopped"] and state["applied"] is None  # the base model was best
    assert AsyncTrainLoop(load_plan(plan_path), progress=False, log=said.append).run()["stopped"]
    assert "this run has stopped already" in said[-1]

    plan = orjson.loads(plan_path.read_bytes())
    plan["guard"] = {"max_drop": None}  # a resumed run may change its guard
    plan_path.write_bytes(orjson.dumps(plan))
    state = AsyncTrainLoop(load_plan(plan_path), progress=False, log=said.append, rewind_to=1).run()
    assert not state["stopped"]
    assert [line["step"] for line in _lines(run / "history.jsonl")] == [0, 1, 2, 3]
    calls = [line.split() for line in (run / "calls.log").read_text().splitlines()]
    assert [c[0] for c in calls] == ["policy-s001", "policy-s002", "policy-s002", "policy-s003"]
    assert calls[2][2] == str(run / "step-001" / "train" / "adapter")
    [aside] = (run / "rewound").iterdir()
    assert (aside / "step-002" / "train" / "artefact.json").is_file()
    assert sorted(p.name for p in (aside / "orchestrator-steps").iterdir())[0] == "step_2"
    ids = [r["rollout_id"] for n in (1, 2, 3) for r in _lines(run / "orchestrator" / "steps" / f"step_{n}" / "batch.jsonl")]
    assert len(ids) == len(set(ids)) == 12
