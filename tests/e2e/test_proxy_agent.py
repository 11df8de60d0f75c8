"""The proxy agent's stack config, collected with the CLI as the README says, with the scripted
backend (vLLM's stand-in) as the model: the unchanged openai SDK example runs as a command per
rollout, and every JSONL line carries a reward and one token-exact sequence."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from rollgym.testing import REPO_ROOT, scripted_backend


def test_collect_rollouts_from_an_unchanged_example_agent(tmp_path: Path) -> None:
    output = tmp_path / "weather.jsonl"
    with scripted_backend("--token-info") as backend:
        result = subprocess.run(
            [sys.executable, "-m", "rollgym.cli", "collect-rollouts", "--config",
             "resources_servers/weather/configs/weather_proxy_agent.yaml",
             "models/chat_completions/configs/chat_completions.yaml",
             f"policy_model.base_url={backend}", "policy_model.return_token_ids=true",
             "--input", "resources_servers/weather/data/example.jsonl", "--limit", "2", "--repeats", "2",
             "--output", str(output), "--no-progress"],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr + result.stdout
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(rows) == 4
    for row in rows:
        assert row["status"] == "ok" and row["reward"] == 1.0
        assert row["prefix_ok"] is True and len(row["sequences"]) == 1 and row["metrics"]["turns"] == 2
        assert row["agent_answer"].startswith(f"The weather in {row['city']}")
