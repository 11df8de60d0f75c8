"""Token-exact training data through the real agent: scripted backend -> chat_completions -> simple_agent
-> weather environment, all over real HTTP; and `rollgym check-tokens` on that stack.

The scripted backend (scripts/scripted_backend.py) reproduces vLLM's and SGLang's response shapes
(sources and versions: models/chat_completions/tests/test_backends.py). Its toy tokenizer maps each
UTF-8 byte to id byte+3; with --drift it re-encodes assistant text with merged byte pairs when it
renders a chat prompt, the way a real BPE tokenizer re-tokenizes generated text differently.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import httpx
import pytest

from agents.simple_agent.app import SimpleAgent, SimpleAgentConfig
from models.chat_completions.app import ChatCompletionsConfig, ChatCompletionsModel
from resources_servers.weather.app import WeatherServer
from rollgym import ServerAddress
from rollgym.cli import main
from rollgym.schema import RunResponse
from rollgym.testing import REPO_ROOT, scripted_backend, serve_in_thread

TOOL = {"type": "function", "name": "get_weather", "description": "Weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        "strict": False}


def weather_row(city: str = "Tokyo", expected: list[str] | None = None, system: str | None = None) -> dict[str, Any]:
    messages = [{"role": "user", "content": f"What is the weather in {city}?"}]
    if system:
        messages.insert(0, {"role": "system", "content": system})
    return {"responses_create_params": {"input": messages, "tools": [TOOL]}, "city": city,
            "expected": expected or ["cloudy", "18"]}


@pytest.fixture(scope="module")
def weather_url() -> Iterator[str]:
    with serve_in_thread(WeatherServer(name="weather")) as url:
        yield url


@contextmanager
def agent_on(weather_url: str, *flags: str, **config: Any) -> Iterator[tuple[httpx.Client, str]]:
    """(agent client, backend root URL) for a scripted backend started with `flags`."""
    config.setdefault("return_token_ids", True)
    with ExitStack() as stack:
        backend = stack.enter_context(scripted_backend(*flags))
        model = ChatCompletionsModel(ChatCompletionsConfig(base_url=backend, model="scripted", **config), name="policy_model")
        model_url = stack.enter_context(serve_in_thread(model))
        agent = SimpleAgent(
            SimpleAgentConfig(model_server={"name": "policy_model"}, resources_server={"name": "weather"}),
            name="agent", registry={"policy_model": ServerAddress(url=model_url, role="models"),
                                    "weather": ServerAddress(url=weather_url, role="resources_servers")})
        agent_url = stack.enter_context(serve_in_thread(agent))
        yield stack.enter_context(httpx.Client(base_url=agent_url, timeout=30.0)), backend.removesuffix("/v1")


def run(client: httpx.Client, row: dict[str, Any]) -> dict[str, Any]:
    reply = client.post("/run", json=row)
    assert reply.status_code == 200, reply.text
    result = reply.json()
    RunResponse.model_validate(result)
    assert result["status"] == "ok" and result["reward"] == 1.0, result.get("error")
    return result


def calls(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [item for item in result["response"]["output"] if item.get("generation_token_ids") is not None]


def decode(ids: list[int]) -> str:
    return bytes(i - 3 for i in ids).decode()


@pytest.mark.parametrize("shape", ["vllm", "sglang"])
def test_two_turn_tool_loop_extends_exactly(weather_url: str, shape: str) -> None:
    with agent_on(weather_url, "--shape", shape, backend=shape) as (client, root):
        result = run(client, weather_row())
        paths = [entry["path"] for entry in httpx.get(f"{root}/scripted/requests").json()["requests"]]
    second_path = "/v1/completions" if shape == "vllm" else "/v1/chat/completions"
    assert paths == ["/v1/chat/completions", "/tokenize", "/tokenize", "/tokenize", second_path]
    first, second = calls(result)
    assert result["prefix_ok"] is True and len(result["sequences"]) == 1
    sequence = result["sequences"][0]
    previous = first["prompt_token_ids"] + first["generation_token_ids"]
    assert second["prompt_token_ids"][: len(previous)] == previous
    assert sequence["prompt_ids"] + sequence["completion_ids"] == second["prompt_token_ids"] + second["generation_token_ids"]
    # Between the turns: the template glue and the tool's answer, masked out with logprob 0.
    added = [token for token, mask in zip(sequence["completion_ids"], sequence["completion_mask"]) if mask == 0]
    assert decode(added) == "<|im_end|>\n<|im_start|>tool\nTokyo: cloudy, 18 C<|im_end|>\n<|im_start|>assistant\n"
    assert all(lp == 0.0 for lp, mask in zip(sequence["completion_logprobs"], sequence["completion_mask"]) if mask == 0)
    assert all(lp < 0.0 for lp, mask in zip(sequence["completion_logprobs"], sequence["completion_mask"]) if mask == 1)


@pytest.mark.parametrize("flags", [("--drift",), ("--drift", "--no-token-routes")], ids=["chat-prompts", "no-tokenize"])
def test_drift_yields_two_sequences_and_prefix_ok_false(weather_url: str, flags: tuple[str, ...]) -> None:
    # Chat prompts re-render the assistant's tool call with the drifting tokenizer: turn 2's prompt
    # does not extend turn 1's tokens. Either because token prompts are off, or because the backend
    # has no /tokenize and the model server falls back to chat.
    config = {"token_prompts": False} if flags == ("--drift",) else {}
    with agent_on(weather_url, *flags, **config) as (client, _):
        result = run(client, weather_row())
    first, second = calls(result)
    assert result["prefix_ok"] is False
    assert len(result["sequences"]) == 2
    one, two = result["sequences"]
    assert one["prompt_ids"] == first["prompt_token_ids"] and one["completion_ids"] == first["generation_token_ids"]
    assert two["prompt_ids"] == second["prompt_token_ids"] and two["completion_ids"] == second["generation_token_ids"]
    assert set(one["completion_mask"]) == set(two["completion_mask"]) == {1}


def test_drifting_tokenizer_stays_exact_with_token_prompts(weather_url: str) -> None:
    with agent_on(weather_url, "--drift", model_version="step-42") as (client, _):
        result = run(client, weather_row(system="Think first."))
    assert result["prefix_ok"] is True and len(result["sequences"]) == 1
    assert [item["type"] for item in result["response"]["output"]] == [
        "reasoning", "function_call", "function_call_output", "reasoning", "message"]
    assert result["sequences"][0]["model_versions"] == ["step-42", "step-42"]


def check_tokens(backend: str, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rollgym.cli", "check-tokens", "--config",
         "resources_servers/weather/configs/weather.yaml", "models/chat_completions/configs/chat_completions.yaml",
         f"policy_model.base_url={backend}", "policy_model.model=scripted", "policy_model.return_token_ids=true",
         *overrides, "--rollouts", "2"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )


def test_check_tokens_fails_on_drift_and_points_at_it() -> None:
    with scripted_backend("--drift") as backend:
        drifting = check_tokens(backend, "policy_model.token_prompts=false")
        exact = check_tokens(backend)
    assert drifting.returncode == 1, drifting.stdout + drifting.stderr
    out = drifting.stdout
    assert out.count("DRIFT: the prompt") == 2 and "FAIL: 2 of 2 turn boundaries drifted" in out
    # The decoded tokens around the first mismatch: byte tokens sampled, merged pairs re-rendered.
    assert "previous tokens: … '>' 'g' 'e' 't' '_' 'w' | 'e' 'a' 't' 'h' 'e' 'r'" in out
    assert "this prompt:     … '>' 'g' 'e' 't' '_' 'w' | 'ea' 'th' 'er'" in out
    assert "prefix_ok false, 2 sequence(s)" in out
    # With token-id prompts every turn extends exactly; re-tokenizing the text would still drift.
    assert exact.returncode == 0, exact.stdout + exact.stderr
    assert "PASS: 2 turn boundaries in 2 rollouts" in exact.stdout
    assert "re-tokenized conversations identical to the sampled ids: 0 of 2" in exact.stdout
    assert "re-tokenized final conversation: differs from the sampled ids at token" in exact.stdout


def test_check_tokens_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    weather = str(REPO_ROOT / "resources_servers/weather/configs/weather.yaml")
    assert main(["check-tokens", "--config", weather, "--rollouts", "0"]) == 2
    assert "--rollouts must be at least 1" in capsys.readouterr().err
    assert main(["check-tokens", "--config", weather, "--agent", "nobody"]) == 2
    assert "--agent: no agent named 'nobody' (agents: weather_agent)" in capsys.readouterr().err
    assert main(["check-tokens", "--config", weather, "--input", "/nonexistent.jsonl"]) == 2
    assert "--input: no such file" in capsys.readouterr().err
