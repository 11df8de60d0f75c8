"""Ray (the optional extra): `rollgym run --ray ADDRESS` starts a stack's servers as actors with the
resources their configs ask for; `rollgym collect-rollouts --ray ADDRESS` deals the rollouts to
collector actors and merges what they send into one JSONL; a killed collector actor's rollouts go
to a fresh one, and a rerun adds nothing. A local Ray head on 127.0.0.1 stands in for the cluster."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

import pytest

from rollgym.cli import main
from rollgym.client import registry_from_json
from rollgym.rollouts.collector import CollectOptions
from rollgym.testing import REPO_ROOT, scripted_backend
from tests.conftest import start_rollgym, stop_rollgym

pytestmark = pytest.mark.slow

WEATHER = "resources_servers/weather/configs/weather.yaml"
CHAT = "models/chat_completions/configs/chat_completions.yaml"
TOOL = {"type": "function", "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CITIES = [("Paris", "sunny"), ("London", "rainy"), ("Tokyo", "cloudy"), ("Oslo", "snowy"), ("Lima", "foggy")]


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    """A one-node Ray cluster of this process, bound to loopback."""
    with pytest.MonkeyPatch.context() as env:
        # Ray keeps a one-node cluster on 127.0.0.1 only when told no other node will join (as on macOS);
        # these reach every `rollgym` process the tests start too. No usage report leaves the machine.
        env.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        env.setenv("RAY_USAGE_STATS_ENABLED", "0")
        ray = pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'rollgym[ray]'")
        ray.init(address="local", include_dashboard=False, num_cpus=2, _node_ip_address="127.0.0.1",
                 log_to_driver=False, configure_logging=False)
        try:
            address = ray.get_runtime_context().gcs_address
            assert address.startswith("127.0.0.1:"), address
            yield address
        finally:
            ray.shutdown()


def rollgym_actors() -> list[str]:
    import ray

    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == "rollgym")


@pytest.fixture(scope="module")
def ray_stack(ray_address: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, Any]]]:
    """`rollgym run ... --ray ADDRESS` as a user starts it: weather in two replicas of half a CPU each."""
    registry_file = tmp_path_factory.mktemp("ray-stack") / "stack.json"
    with scripted_backend("--latency-ms", "40") as backend_url:
        process = start_rollgym(
            "run", WEATHER, CHAT, f"policy_model.base_url={backend_url}", "policy_model.model=scripted",
            "weather.replicas=2", "weather.ray_resources.num_cpus=0.5", "--registry-file", str(registry_file),
            "--ray", ray_address, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        try:
            deadline = time.monotonic() + 120
            while not registry_file.exists():
                assert process.poll() is None, process.stdout.read()
                assert time.monotonic() < deadline, "the stack did not start on Ray"
                time.sleep(0.1)
            time.sleep(0.2)  # the file is written in one call; let it land
            yield registry_file, json.loads(registry_file.read_text())
        finally:
            assert stop_rollgym(process, grace_s=60) == 0, process.stdout.read()
    assert not [name for name in rollgym_actors() if not name.startswith("collector-")], "server actors outlived the stack"


def make_tasks(path: Path, count: int) -> None:
    with path.open("w") as handle:
        for index in range(count):
            city, expected = CITIES[index % len(CITIES)]
            row = {"responses_create_params": {"input": [{"role": "user", "content": f"What is the weather in {city}?"}],
                                               "tools": [TOOL]}, "city": city, "expected": [expected]}
            handle.write(json.dumps(row) + "\n")


def read_rollouts(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def check_rollouts(rollouts: list[dict[str, Any]], tasks: int, repeats: int) -> None:
    ids = [r["rollout_id"] for r in rollouts]
    assert len(ids) == tasks * repeats and len(set(ids)) == len(ids), Counter(ids).most_common(3)
    assert set(Counter(r["group_id"] for r in rollouts).values()) == {repeats}
    assert all(r["status"] == "ok" and r["reward"] == 1.0 for r in rollouts)
    assert all(r["looked_up"] == [r["city"]] for r in rollouts)


def test_servers_run_as_actors_with_their_resources_and_collectors_merge_into_one_output(
        ray_stack: tuple[Path, dict[str, Any]], ray_address: str, tmp_path: Path, capsys) -> None:
    import ray

    registry_file, registry = ray_stack
    assert set(registry) == {"weather", "weather_agent", "policy_model"}
    assert len(registry["weather"]["urls"]) == 2
    assert all(url.startswith("http://127.0.0.1:") for entry in registry.values() for url in entry.get("urls", [entry["url"]]))
    names = rollgym_actors()
    for replica in ("weather[0]", "weather[1]", "weather_agent", "policy_model"):
        assert any(name.startswith(replica + "@") for name in names), names
    for name in names:
        if name.startswith("weather["):
            given = ray.get(ray.get_actor(name, namespace="rollgym").resources.remote(), timeout=30)
            assert given["resources"] == {"CPU": 0.5} and given["host"] == "127.0.0.1"

    tasks, output = tmp_path / "tasks.jsonl", tmp_path / "rollouts.jsonl"
    make_tasks(tasks, 20)
    command = ["collect-rollouts", "--registry-file", str(registry_file), "--input", str(tasks), "--output", str(output),
               "--repeats", "3", "--concurrency", "8", "--no-progress", "--ray", ray_address, "--ray-collectors", "2"]
    first = subprocess.run([sys.executable, "-m", "rollgym.cli", *command], cwd=REPO_ROOT, capture_output=True,
                           text=True, timeout=180)
    assert first.returncode == 0, first.stderr
    check_rollouts(read_rollouts(output), 20, 3)
    metrics = json.loads((tmp_path / "rollouts.metrics.json").read_text())
    assert metrics["rollouts"] == 60 and metrics["mean_reward"] == 1.0 and metrics["failed"] == 0
    assert metrics["run"]["ray_collectors"] == 2 and metrics["run"]["new_rollouts"] == 60
    assert "collected 60 rollouts in 20 groups" in first.stdout

    before = output.read_bytes()
    assert main(command) == 0  # the same command again (here in-process): nothing left, Ray not even joined
    assert "resuming: 60 of 60 rollouts already" in capsys.readouterr().err
    assert output.read_bytes() == before


def test_a_killed_collector_actor_is_replaced_and_a_rerun_adds_nothing(
        ray_stack: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    import ray
    from rollgym.stack.ray import collect_on_ray

    registry = registry_from_json(ray_stack[1])
    tasks, output = tmp_path / "tasks.jsonl", tmp_path / "rollouts.jsonl"
    make_tasks(tasks, 30)
    options = CollectOptions(input=tasks, output=output, repeats=2, concurrency=2, progress=False)
    outcome: dict[str, Any] = {}
    logged: list[str] = []

    def run() -> None:
        try:
            outcome["summary"] = collect_on_ray(registry, "weather_agent", options, collectors=2, log=logged.append)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            outcome["error"] = exc

    earlier = set(rollgym_actors())
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not output.exists() or len(output.read_bytes().splitlines()) < 2:
        assert thread.is_alive(), outcome
        assert time.monotonic() < deadline, "no rollout arrived"
        time.sleep(0.01)
    victim = next(name for name in rollgym_actors() if name.startswith("collector-0.0@") and name not in earlier)
    ray.kill(ray.get_actor(victim, namespace="rollgym"), no_restart=True)
    thread.join(timeout=150)
    assert not thread.is_alive() and "error" not in outcome, outcome
    assert outcome["summary"]["run"]["ray_collector_restarts"] == 1, logged
    assert any("collector shard 0 died" in message for message in logged), logged
    check_rollouts(read_rollouts(output), 30, 2)

    before = output.read_bytes()
    again = collect_on_ray(registry, "weather_agent", options, collectors=2, log=logged.append)
    assert again["run"]["new_rollouts"] == 0 and again["rollouts"] == 60
    assert output.read_bytes() == before
