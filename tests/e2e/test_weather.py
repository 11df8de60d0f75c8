"""End to end: `rollgym run` brings up a real stack (scripted backend → chat_completions,
simple_agent, weather), `rollgym collect-rollouts` collects 100 tasks × 4 repeats at concurrency 32,
and a rerun of the same command resumes with nothing added."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from rollgym.schema import RolloutLine
from rollgym.testing import REPO_ROOT, scripted_backend
from tests.conftest import start_rollgym, stop_rollgym

KNOWN = [("Paris", ["sunny", "22"]), ("London", ["rainy", "14"]), ("Tokyo", ["cloudy"]), ("Oslo", ["snowy", "-3"])]
TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def make_tasks(path: Path, count: int) -> int:
    """Tasks whose expected answer is right for 3 of every 4 rows; returns how many can pass."""
    passing = 0
    with path.open("w") as handle:
        for index in range(count):
            city, expected = KNOWN[index % len(KNOWN)]
            if index % 4 == 3:
                expected = ["sunny"]  # the weather tool says otherwise: a real 0.0 reward
            else:
                passing += 1
            row = {"responses_create_params": {"input": [{"role": "user", "content": f"What is the weather in {city}?"}],
                                               "tools": [TOOL]}, "city": city, "expected": expected}
            handle.write(json.dumps(row) + "\n")
    return passing


@pytest.fixture(scope="module")
def running_stack(tmp_path_factory):
    """`rollgym run` as a user would start it; yields the registry file."""
    tmp = tmp_path_factory.mktemp("stack")
    registry = tmp / "registry.json"
    with scripted_backend() as backend_url:
        process = start_rollgym(
            "run", "resources_servers/weather/configs/weather.yaml", "models/chat_completions/configs/chat_completions.yaml",
            f"policy_model.base_url={backend_url}", "policy_model.model=scripted", "--registry-file", str(registry),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        try:
            lines = []
            deadline = time.monotonic() + 60
            while not registry.exists():
                assert process.poll() is None, "".join(lines) + process.stdout.read()
                assert time.monotonic() < deadline, "stack did not start"
                time.sleep(0.05)
            for _ in range(5):
                lines.append(process.stdout.readline())
            yield registry, lines
        finally:
            stop_rollgym(process, grace_s=20)


def collect(registry: Path, tasks: Path, output: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rollgym.cli", "collect-rollouts", "--registry-file", str(registry),
         "--input", str(tasks), "--output", str(output), "--repeats", "4", "--concurrency", "32", "--no-progress", *extra],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )


def test_collect_400_rollouts_then_resume(running_stack, tmp_path: Path) -> None:
    registry, startup_lines = running_stack
    assert startup_lines[0].startswith("rollgym: stack ready in ")
    assert {line.split()[0] for line in startup_lines[1:4]} == {"weather", "weather_agent", "policy_model"}

    tasks = tmp_path / "tasks.jsonl"
    passing = make_tasks(tasks, 100)
    output = tmp_path / "rollouts.jsonl"
    first = collect(registry, tasks, output)
    assert first.returncode == 0, first.stderr

    rollouts = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(rollouts) == 400
    ids = [r["rollout_id"] for r in rollouts]
    assert len(set(ids)) == 400
    groups = Counter(r["group_id"] for r in rollouts)
    assert len(groups) == 100 and set(groups.values()) == {4}
    for r in rollouts:
        RolloutLine.model_validate(r)  # a line of the rollouts file: output at the top, metadata beside it
        assert r["status"] == "ok" and r["reward"] in (0.0, 1.0)
        assert r["rollout_id"].startswith(r["group_id"] + "-r")
        assert r["looked_up"] == [r["city"]]  # the session's own tool calls, no cross-talk
    assert sum(r["reward"] for r in rollouts) == passing * 4

    metrics = json.loads((tmp_path / "rollouts.metrics.json").read_text())
    assert metrics["rollouts"] == 400 and metrics["groups"] == 100 and metrics["failed"] == 0
    assert metrics["mean_reward"] == pytest.approx(passing / 100)
    assert metrics["pass@1"] == pytest.approx(passing / 100) and metrics["pass@4"] == pytest.approx(passing / 100)
    assert metrics["status_counts"] == {"ok": 400}
    assert metrics["latency_s"]["p50"] > 0 and metrics["latency_s"]["p99"] >= metrics["latency_s"]["p50"]
    assert "mean reward 0.750" in first.stdout and "pass@4 0.750" in first.stdout
    assert (tmp_path / "rollouts.failures.jsonl").read_text() == ""

    before = output.read_bytes()
    second = collect(registry, tasks, output)
    assert second.returncode == 0, second.stderr
    assert "resuming: 400 of 400 rollouts already" in second.stderr
    assert output.read_bytes() == before
    assert json.loads((tmp_path / "rollouts.metrics.json").read_text())["rollouts"] == 400


def test_bad_lines_are_skipped_with_their_line_number(running_stack, tmp_path: Path) -> None:
    registry, _ = running_stack
    tasks = tmp_path / "tasks.jsonl"
    make_tasks(tasks, 2)
    with tasks.open("a") as handle:
        handle.write("{oops\n")
        handle.write(json.dumps({"responses_create_params": {"input": "x"}}) + "\n")  # weather needs city
    output = tmp_path / "out.jsonl"
    result = collect(registry, tasks, output)
    assert result.returncode == 1  # a task ended as a failure (rejected), and the exit code says so
    assert "4 rollouts failed after their attempts: exit 1" in result.stderr
    assert f"{tasks}:3: skipped: not valid JSON" in result.stderr
    assert "skipped 1 unusable task lines" in result.stdout
    assert len(output.read_text().splitlines()) == 8
    failures = [json.loads(line) for line in (tmp_path / "out.failures.jsonl").read_text().splitlines()]
    # The environment rejected row 4 (no city): recorded once, not retried, never a reward.
    assert len(failures) == 4 and {f["status"] for f in failures} == {"rejected"}
    assert all("city" in f["error"] and f["final"] for f in failures)
    assert all('"reward"' not in line or json.loads(line)["reward"] is not None for line in output.read_text().splitlines())


def test_cli_errors_are_clear(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "rollgym.cli", "collect-rollouts", "--input", "missing.jsonl",
                             "--output", str(tmp_path / "o.jsonl"), "--agent-url", "http://127.0.0.1:9"],
                            cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 2 and result.stderr.strip() == "rollgym: error: --input: no such file: missing.jsonl"
    result = subprocess.run([sys.executable, "-m", "rollgym.cli", "run", "no_such.yaml"],
                            cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 2 and "config file not found: no_such.yaml" in result.stderr
    assert "Traceback" not in result.stderr
