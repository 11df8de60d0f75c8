"""`apply: lora` in the epoch loop, live: each epoch's adapter is hot-loaded into the stack's policy model
(chat_completions in front of the scripted backend, which marks what an adapter generates), the next
collection samples from it, and a reload of that adapter in the middle of a collection makes the
rollouts sampled after it stale: counted, and not trained on.

Each test has its own stack: loading adapters changes what the policy model serves."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import orjson
import pytest
import yaml

from rollgym.adapters import content_digest
from rollgym.client import ServerAddress
from rollgym.testing import REPO_ROOT
from rollgym.data.jsonl import read_whole_lines as read_rollouts
from rollgym.train.loop.epochs import TrainLoop
from rollgym.train.loop.plan import load_plan
from rollgym.data.records import output_items
from tests.conftest import scripted_stack

TOY = "tests.train.toy_trainers"
TASKS = REPO_ROOT / "resources_servers/weather/data/example.jsonl"


@pytest.fixture(autouse=True)
def toys(importable_toys: None) -> None:
    """Every test here runs a toy adapter in a child process."""


@pytest.fixture()
def stack() -> Iterator[dict[str, ServerAddress]]:
    # Slow enough that a reload can land between two rollouts of one collection.
    with scripted_stack("--latency-ms", "40") as registry:
        yield registry


def write_plan(tmp_path: Path, registry: dict[str, ServerAddress], epochs: int) -> Path:
    registry_file = tmp_path / "stack.json"
    registry_file.write_bytes(orjson.dumps({name: {"url": a.url, "role": a.role} for name, a in registry.items()}))
    plan: dict[str, Any] = {
        "output": str(tmp_path / "run"),
        "stack": {"registry_file": str(registry_file), "agent": "weather_agent", "concurrency": 1},
        "validation": {"input": str(TASKS), "repeats": 2, "limit": 2},
        "stages": [{
            "name": "sft", "epochs": epochs,
            "collect": {"input": str(TASKS), "repeats": 4, "limit": 3},
            "curate": {"min_reward": 1.0},
            "optimize": {"trainer": f"{TOY}:CountingTrainer", "data": "sft"},
            "apply": "lora",
        }],
    }
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    return path


def versions(rollout: dict[str, Any]) -> set[str]:
    return {item["model_version"] for item in output_items(rollout) if "model_version" in item}


def answers(rollout: dict[str, Any]) -> str:
    return " ".join(part.get("text", "") for item in output_items(rollout) if item.get("type") == "message"
                    for part in item.get("content", []))


def test_each_epoch_samples_from_the_adapter_it_hot_loaded(tmp_path: Path, stack: dict[str, ServerAddress]) -> None:
    loop = TrainLoop(load_plan(write_plan(tmp_path, stack, epochs=2)), progress=False)
    loop.run()
    history = loop.history()
    run = tmp_path / "run"
    e1, e2 = (f"policy-e00{n}@{content_digest(str(run / f'epoch-00{n}' / 'train' / 'adapter'))}" for n in (1, 2))
    assert [line["model_version"] for line in history] == ["scripted", e1, e2]
    first = read_rollouts(run / "epoch-001" / "rollouts.jsonl")
    second = read_rollouts(run / "epoch-002" / "rollouts.jsonl")
    assert all(versions(r) == {"scripted"} for r in first)
    # Epoch 2 collected from epoch 1's adapter: every turn reports its load, and what it generated is
    # what the scripted backend's adapter answers.
    assert all(versions(r) == {e1} for r in second) and len(second) == 12
    assert all(answers(r).startswith("[policy-e001]") for r in second)
    assert all(versions(r) == {e2} for r in read_rollouts(run / "epoch-002" / "validation.jsonl"))
    assert history[2]["curated"]["dropped"].get("stale", 0) == 0
    listed = httpx.get(f"{stack['policy_model'].url}/v1/models").json()["data"]
    assert {card["id"]: card["model_version"] for card in listed if card["id"].startswith("policy-")} == {
        "policy-e001": e1, "policy-e002": e2}


def test_a_reload_during_collection_makes_later_rollouts_stale(tmp_path: Path,
                                                               stack: dict[str, ServerAddress]) -> None:
    """Someone loads other weights under the name being sampled from (`load_inplace`) while epoch 2 collects:
    the rollouts sampled after it report the new files' version, not the one the loop applied, so curation
    drops them as stale and counts them; the ones before it are trained on."""
    plan = load_plan(write_plan(tmp_path, stack, epochs=2))
    rollouts_file = tmp_path / "run" / "epoch-002" / "rollouts.jsonl"
    adapter = tmp_path / "run" / "epoch-001" / "train" / "adapter"
    other = tmp_path / "other-adapter"
    reloaded = threading.Event()

    def reload_after_three() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if len(read_rollouts(rollouts_file)) >= 3:
                shutil.copytree(adapter, other)
                (other / "adapter_model.safetensors").write_bytes(b"other weights")
                reply = httpx.post(f"{stack['policy_model'].url}/v1/load_lora_adapter",
                                   json={"lora_name": "policy-e001", "lora_path": str(other), "load_inplace": True})
                assert reply.status_code == 200, reply.text
                reloaded.set()
                return
            time.sleep(0.01)

    watcher = threading.Thread(target=reload_after_three, daemon=True)
    watcher.start()
    loop = TrainLoop(plan, progress=False)
    loop.run()
    watcher.join(5)
    assert reloaded.is_set(), "the collection ended before the reload"
    collected = read_rollouts(rollouts_file)
    applied = f"policy-e001@{content_digest(str(adapter))}"
    before = [r for r in collected if versions(r) == {applied}]
    after = [r for r in collected if r not in before]
    assert len(before) >= 3 and after, [sorted(versions(r)) for r in collected]
    assert all(f"policy-e001@{content_digest(str(other))}" in versions(r) for r in after)
    curated = loop.history()[2]["curated"]
    assert curated["dropped"]["stale"] == len(after)
    assert curated["rollouts_kept"] == len(before)


def test_a_run_killed_while_validating_resumes_on_a_restarted_stack(tmp_path: Path) -> None:
    """SIGKILL while epoch 2 validates, then a new stack (a fresh model server, as when the loop starts its
    own, which has loaded nothing before): the resumed run loads epoch 2's adapter files again, gets the
    same version, keeps the validation rollouts collected before the kill and collects only the rest."""
    validation = tmp_path / "run" / "epoch-002" / "validation.jsonl"
    with scripted_stack("--latency-ms", "40") as first:
        plan = write_plan(tmp_path, first, epochs=2)
        command = [sys.executable, "-m", "rollgym.cli", "train", str(plan), "--no-progress"]
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 120
        while not read_rollouts(validation) and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.01)
        process.send_signal(signal.SIGKILL)
        process.wait(10)
    before = read_rollouts(validation)
    assert 1 <= len(before) < 4, f"the kill missed the validation: {len(before)} rollouts"
    with scripted_stack("--latency-ms", "40") as second:
        assert write_plan(tmp_path, second, epochs=2).read_bytes() == plan.read_bytes()  # the same plan
        loop = TrainLoop(load_plan(plan), progress=False)
        loop.run()
    applied = f"policy-e002@{content_digest(str(tmp_path / 'run' / 'epoch-002' / 'train' / 'adapter'))}"
    assert [line["epoch"] for line in loop.history()] == [0, 1, 2]
    assert loop.history()[2]["model_version"] == applied
    after = read_rollouts(validation)
    assert after[:len(before)] == before and len(after) == 4
    assert len({r["rollout_id"] for r in after}) == 4 and all(versions(r) == {applied} for r in after)
    assert (tmp_path / "run" / "calls.log").read_text().split().count("policy-e002") == 1  # trained once
