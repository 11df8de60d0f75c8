"""End to end on the real embedded model (llama.cpp + SmolLM2-135M, CPU): no mocks.

The stack is started the way a user starts it (the default model is added because the configs name
`policy_model` and give no model config), rollouts are collected with the CLI, and the token records
are checked: equal lengths, logprobs <= 0, and each turn's prompt extending the previous tokens.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from rollgym import Stack, load_stack
from rollgym.schema import RolloutLine
from rollgym.testing import REPO_ROOT
from rollgym.data.records import output_items

pytest.importorskip("llama_cpp", reason="the embedded model needs llama-cpp-python (make install builds it)")
try:
    from models.llamacpp.engine import bundled_model_path

    bundled_model_path()
except Exception as exc:  # noqa: BLE001 - any reason the weights are missing
    pytest.skip(f"the bundled SmolLM2 weights are not installed: {exc}", allow_module_level=True)

pytestmark = pytest.mark.slow

CONFIGS = ["resources_servers/reverse_text/configs/reverse_text.yaml", "resources_servers/weather/configs/weather.yaml"]
FORCED = {"type": "function", "name": "get_weather"}


@pytest.fixture(scope="module")
def stack():
    config = load_stack([REPO_ROOT / path for path in CONFIGS], ["policy_model.n_ctx=2048"])
    assert config.servers["policy_model"].folder == "llamacpp"  # the default model was added
    running = Stack(config)
    registry = running.start(timeout_s=180)
    try:
        yield registry
    finally:
        running.stop()


def write_registry(registry: dict, path: Path) -> Path:
    path.write_text(json.dumps({name: address.to_json() for name, address in registry.items()}))
    return path


def collect(registry_file: Path, agent: str, tasks: Path, output: Path, *extra: str) -> list[dict]:
    result = subprocess.run(
        [sys.executable, "-m", "rollgym.cli", "collect-rollouts", "--registry-file", str(registry_file),
         "--agent", agent, "--input", str(tasks), "--output", str(output), "--no-progress", *extra],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr
    assert "mean reward" in result.stdout and "pass@1" in result.stdout
    return [json.loads(line) for line in output.read_text().splitlines()]


def check_token_records(rollout: dict) -> int:
    """Every model call's record is consistent and each prompt extends the tokens before it."""
    generated = [item for item in output_items(rollout) if item.get("generation_token_ids") is not None]
    assert generated, "no item carried a token record"
    previous: list[int] | None = None
    for item in generated:
        assert len(item["generation_token_ids"]) == len(item["generation_log_probs"]) > 0
        assert all(isinstance(lp, float) and lp <= 0.0 for lp in item["generation_log_probs"])
        if previous is not None:
            assert item["prompt_token_ids"][: len(previous)] == previous
        previous = item["prompt_token_ids"] + item["generation_token_ids"]
    assert rollout["prefix_ok"] is True and len(rollout["sequences"]) == 1
    sequence = rollout["sequences"][0]
    assert len(sequence["completion_ids"]) == len(sequence["completion_mask"]) == len(sequence["completion_logprobs"])
    assert sequence["prompt_ids"] + sequence["completion_ids"] == previous
    return len(generated)


def test_reverse_text_rollouts_carry_real_tokens(stack, tmp_path: Path) -> None:
    tasks = REPO_ROOT / "resources_servers/reverse_text/data/example.jsonl"
    rollouts = collect(write_registry(stack, tmp_path / "r.json"), "reverse_text_agent", tasks,
                       tmp_path / "rt.jsonl", "--limit", "3", "--repeats", "2", "--max-output-tokens", "16")
    assert len(rollouts) == 6
    for rollout in rollouts:
        RolloutLine.model_validate(rollout)
        assert rollout["status"] in ("ok", "truncated")
        assert 0.0 <= rollout["reward"] <= 1.0
        assert check_token_records(rollout) == 1


def test_weather_forced_tool_call_then_answer(stack, tmp_path: Path) -> None:
    tasks = REPO_ROOT / "resources_servers/weather/data/example.jsonl"
    rollouts = collect(write_registry(stack, tmp_path / "r.json"), "weather_agent", tasks, tmp_path / "w.jsonl",
                       "--limit", "2", "--max-output-tokens", "40", "--param", f"tool_choice={json.dumps(FORCED)}")
    assert len(rollouts) == 2
    for rollout in rollouts:
        output = output_items(rollout)
        first_call = output[0]
        assert first_call["type"] == "function_call" and first_call["name"] == "get_weather"
        assert isinstance(json.loads(first_call["arguments"])["city"], str)
        assert output[1]["type"] == "function_call_output" and output[1]["call_id"] == first_call["call_id"]
        assert rollout["metrics"]["turns"] >= 2
        # Multi-turn: the tool result went in between, as environment tokens (mask 0).
        assert check_token_records(rollout) >= 2
        assert 0 in rollout["sequences"][0]["completion_mask"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"input": "hi", "tool_choice": "sometimes"}, "tool_choice"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": 42}, "input"),
        ({"input": {"role": "user"}}, "input"),
    ],
)
def test_bad_requests_name_the_field(stack, body: dict, field: str) -> None:
    reply = httpx.post(stack["policy_model"].url + "/v1/responses", json=body, timeout=30)
    assert 400 <= reply.status_code < 500
    assert reply.json()["error"]["field"] == field


def test_chat_completions_and_models(stack) -> None:
    url = stack["policy_model"].url
    assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "SmolLM2-135M-Instruct.Q4_1"
    chat = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8, "logprobs": True}).json()
    choice = chat["choices"][0]
    assert len(choice["token_ids"]) == len(choice["logprobs"]["content"]) <= 8
    assert chat["usage"]["completion_tokens"] == len(choice["token_ids"])
