"""`rollgym collect-rollouts` as a user meets it: exit codes, agent routing, and mistakes reported in one
line with exit 2 (never a traceback). Runs against a real in-process stack (tests/conftest.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rollgym.cli import main
from rollgym.client import ServerAddress
from rollgym.testing import REPO_ROOT, free_port

WEATHER_TASKS = REPO_ROOT / "resources_servers/weather/data/example.jsonl"


def registry_file(tmp_path: Path, registry: dict[str, ServerAddress]) -> Path:
    path = tmp_path / "stack.json"
    path.write_text(json.dumps({name: address.to_json() for name, address in registry.items()}))
    return path


def tasks_file(tmp_path: Path, rows: list[dict[str, Any]]) -> Path:
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def weather_rows(count: int = 2, **extra: Any) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in WEATHER_TASKS.read_text().splitlines()[:count]]
    return [{**row, **extra} for row in rows]


def collect(*args: str) -> int:
    return main(["collect-rollouts", "--no-progress", "--max-attempts", "1", *args])


def test_every_rollout_succeeds_exit_0(scripted_agents, tmp_path: Path, capsys) -> None:
    tasks = tasks_file(tmp_path, weather_rows(agent_ref={"type": "agents", "name": "weather_agent"}))
    out = tmp_path / "out.jsonl"
    assert collect("--registry-file", str(registry_file(tmp_path, scripted_agents)), "--input", str(tasks),
                   "--output", str(out), "--repeats", "2") == 0
    printed = capsys.readouterr().out
    assert len(out.read_text().splitlines()) == 4
    assert "(a pass: reward >= 1)" in printed  # pass@k says what counts as a pass


def test_an_unknown_agent_ref_is_refused_before_anything_is_sent(scripted_agents, tmp_path: Path, capsys) -> None:
    rows = weather_rows(3, agent_ref="weather_agent")  # a bare string is a name too
    rows[1]["agent_ref"] = {"type": "agents", "name": "simple_weather_simple_agent"}  # a NeMo Gym instance name
    rows[2]["agent_ref"] = "another_missing_agent"
    tasks, out = tasks_file(tmp_path, rows), tmp_path / "out.jsonl"
    code = collect("--registry-file", str(registry_file(tmp_path, scripted_agents)), "--input", str(tasks),
                   "--output", str(out))
    error = capsys.readouterr().err
    assert code == 2
    assert f"{tasks}:2: agent_ref names agent 'simple_weather_simple_agent'" in error
    assert "and 1 more rows" in error and "reverse_text_agent, weather_agent" in error and "--agent NAME" in error
    assert not out.exists()  # nothing was sent, nothing written

    # --agent NAME routes rows written for another stack to one agent of this one.
    assert collect("--registry-file", str(registry_file(tmp_path, scripted_agents)), "--input", str(tasks),
                   "--output", str(out), "--agent", "weather_agent") == 0
    assert len(out.read_text().splitlines()) == 3


def test_with_several_agents_each_row_names_its_own(scripted_agents, tmp_path: Path, capsys) -> None:
    tasks = tasks_file(tmp_path, weather_rows(2))
    code = collect("--registry-file", str(registry_file(tmp_path, scripted_agents)), "--input", str(tasks),
                   "--output", str(tmp_path / "out.jsonl"))
    assert code == 2
    assert f"{tasks}:1: the row names no agent (agent_ref)" in capsys.readouterr().err


def test_a_stopped_stack_exits_1_and_says_so(tmp_path: Path, capsys) -> None:
    dead = {"weather_agent": ServerAddress(f"http://127.0.0.1:{free_port()}", "agents")}
    args = ["--registry-file", str(registry_file(tmp_path, dead)), "--input", str(tasks_file(tmp_path, weather_rows())),
            "--output", str(tmp_path / "out.jsonl")]
    assert collect(*args) == 1
    captured = capsys.readouterr()
    assert "collected 0 rollouts" in captured.out and "failed (not counted as reward): 2" in captured.out
    assert "no rollout succeeded: exit 1" in captured.err
    assert collect(*args, "--allow-failures") == 0
    assert "(exit 0: --allow-failures)" in capsys.readouterr().err


@pytest.mark.parametrize("content, message", [
    (None, "no such file"),
    ("{not json", "not valid JSON"),
    ("[]", "expected a JSON object"),
    ('{"agent": 3}', "registry entry 'agent'"),
])
def test_a_bad_registry_file_is_one_line_and_exit_2(tmp_path: Path, capsys, content: str | None, message: str) -> None:
    path = tmp_path / "stack.json"
    if content is not None:
        path.write_text(content)
    code = collect("--registry-file", str(path), "--input", str(WEATHER_TASKS), "--output", str(tmp_path / "o.jsonl"))
    error = capsys.readouterr().err
    assert code == 2 and error.startswith(f"rollgym: error: --registry-file: registry file {path}") and message in error
    assert "Traceback" not in error


def test_output_mistakes_are_refused(tmp_path: Path, capsys) -> None:
    tasks = tasks_file(tmp_path, weather_rows())
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    cases = [
        (["--output", str(blocker / "out.jsonl")], f"--output: {blocker} is a file"),
        (["--output", str(tasks)], "would write over the --input file"),
        (["--output", str(tmp_path)], "is a folder"),
        (["--output", str(tmp_path / "o.jsonl"), "--concurrency", "0"], "--concurrency must be at least 1, got 0"),
        (["--output", str(tmp_path / "o.jsonl"), "--rollout-budget-s", "0"],
         "--rollout-budget-s must be a positive number of seconds, got 0.0"),
        (["--output", str(tmp_path / "o.jsonl"), "--timeout", "-1"], "--timeout must be a positive number of seconds"),
    ]
    for extra, message in cases:
        code = collect("--agent-url", "http://127.0.0.1:9", "--input", str(tasks), *extra)
        error = capsys.readouterr().err
        assert code == 2 and message in error, (extra, error)
    assert tasks.read_text().count("\n") == 2  # the tasks were not touched
