"""Collecting without `/verify` (`skip_verification`), over real HTTP against the in-process scripted stack
(tests/conftest.py): rollouts come back with `reward: null` and `verification: "skipped"`, and neither the
rollouts file, the metrics nor the failures count them as failures or as reward 0."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from rollgym import AgentServer, RunRequest
from rollgym.cli import main
from rollgym.client import ServerAddress
from rollgym.rollouts.metrics import RolloutRecord, summarize
from rollgym.rollouts.rollout_client import RolloutClient, RolloutsFailed
from rollgym.rollouts.sink import companion_paths
from rollgym.testing import REPO_ROOT, serve_in_thread

WEATHER_TASKS = REPO_ROOT / "resources_servers/weather/data/example.jsonl"


def weather_rows(count: int, **extra: Any) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in WEATHER_TASKS.read_text().splitlines()[:count]]
    return [{**row, "agent_ref": {"type": "agents", "name": "weather_agent"}, **extra} for row in rows]


def collect(tmp_path: Path, registry: dict[str, ServerAddress], rows: list[dict[str, Any]], name: str,
            *flags: str) -> tuple[int, list[dict[str, Any]], dict[str, Any], list[dict[str, Any]]]:
    """`rollgym collect-rollouts` on `rows`: (exit code, rollout lines, metrics, failure lines)."""
    stack = tmp_path / "stack.json"
    stack.write_text(json.dumps({key: address.to_json() for key, address in registry.items()}))
    tasks, out = tmp_path / f"{name}.tasks.jsonl", tmp_path / f"{name}.jsonl"
    tasks.write_text("".join(json.dumps(row) + "\n" for row in rows))
    code = main(["collect-rollouts", "--no-progress", "--max-attempts", "1", "--registry-file", str(stack),
                 "--input", str(tasks), "--output", str(out), "--repeats", "2", *flags])
    failures_path, metrics_path = companion_paths(out)
    lines = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    failures = [json.loads(line) for line in failures_path.read_text().splitlines()] if failures_path.exists() else []
    return code, lines, json.loads(metrics_path.read_text()), failures


def test_collect_rollouts_skip_verification_writes_unverified_rollouts(scripted_agents, tmp_path: Path) -> None:
    code, lines, metrics, failures = collect(tmp_path, scripted_agents, weather_rows(3), "skipped",
                                             "--skip-verification")
    assert code == 0 and failures == []
    assert len(lines) == 6
    for line in lines:
        assert line["status"] == "ok" and line["error"] is None
        assert line["reward"] is None and line["verification"] == "skipped"
        assert "looked_up" not in line  # what the weather environment's /verify adds: it was not called
        assert [item["type"] for item in line["output"]] == ["function_call", "function_call_output", "message"]
    assert metrics["rollouts"] == 6 and metrics["unverified"] == 6 and metrics["failed"] == 0
    assert metrics["mean_reward"] is None and metrics["reward_std"] is None  # not 0.0: there is no reward
    assert not any(key.startswith("pass@") for key in metrics)
    assert metrics["status_counts"] == {"ok": 6}

    # The same tasks verified: rewards, and no unverified count.
    code, lines, metrics, _ = collect(tmp_path, scripted_agents, weather_rows(3), "verified")
    assert code == 0 and all(line["reward"] == 1.0 and "verification" not in line for line in lines)
    assert metrics["mean_reward"] == 1.0 and "unverified" not in metrics and metrics["pass@1"] == 1.0


def test_whether_to_verify_is_the_runs_choice_not_the_rows(scripted_agents, tmp_path: Path) -> None:
    """A task row's own skip_verification is dropped: a collection that did not ask to skip verifies."""
    code, lines, metrics, _ = collect(tmp_path, scripted_agents, weather_rows(1, skip_verification=True), "row")
    assert code == 0 and [line["reward"] for line in lines] == [1.0, 1.0]
    assert all("verification" not in line and line["looked_up"] for line in lines)


class SkippingAgent(AgentServer):
    """An agent that skips /verify whatever it is asked."""

    async def run(self, task: RunRequest, payload: dict[str, Any]) -> dict[str, Any]:
        return {**payload, "response": None, "reward": None, "verification": "skipped", "status": "ok"}


def test_a_skip_the_run_did_not_ask_for_is_a_failure_not_a_reward() -> None:
    row = weather_rows(1)[0]
    with serve_in_thread(SkippingAgent(name="skipping")) as url:
        with RolloutClient(url, max_attempts=1) as client:
            with pytest.raises(RolloutsFailed, match="agent_error 2") as failed:
                client.run_sync([row], repeats=2)
            assert "without a reward" in str(failed.value)
        with RolloutClient(url, max_attempts=1, skip_verification=True) as client:
            [[rollout]] = client.run_sync([row])
    assert rollout["reward"] is None and rollout["verification"] == "skipped"


def test_rollout_client_skip_verification(scripted_agents) -> None:
    rows = weather_rows(2)
    with RolloutClient(scripted_agents, agent="weather_agent", skip_verification=True, max_attempts=1) as client:
        groups = client.run_sync(rows, repeats=2)
    assert [len(group) for group in groups] == [2, 2]
    assert all(r["reward"] is None and r["verification"] == "skipped" and r["status"] == "ok"
               for group in groups for r in group)


def test_summary_counts_unverified_rollouts_apart_from_rewards() -> None:
    records = [RolloutRecord("g1", 1.0, "ok", 10, 5, 0.1), RolloutRecord("g1", None, "ok", 10, 5, 0.3),
               RolloutRecord("g2", 0.0, "truncated", 10, 7, 0.2), RolloutRecord("g2", None, "ok", 10, 3, 0.4)]
    summary = summarize(records, repeats=2)
    assert summary["rollouts"] == 4 and summary["unverified"] == 2
    assert summary["mean_reward"] == pytest.approx(0.5)  # over the two verified rollouts only
    assert summary["pass@1"] == pytest.approx(0.5)  # each group's one verified rollout
    assert "pass@2" not in summary  # no group has two verified rollouts to estimate it from
    assert summary["tokens"]["output_total"] == 20  # tokens and latency count every rollout
    assert RolloutRecord.from_rollout({"group_id": "g", "reward": None, "verification": "skipped"}).reward is None
