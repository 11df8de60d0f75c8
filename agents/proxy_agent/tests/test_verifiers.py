"""verifiers (`verifiers.v1`) Envs run by the proxy agent over real HTTP: the Env's harness program
calls its rollout's proxy URL (in front of the scripted backend, whose toy tokenizer makes every
token readable: id = byte + 3); the Env's reward functions give `reward` and `reward_components`.
The tasksets are real verifiers objects, in `examples/verifiers_env/`."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

# Found at collection, imported only where these tests run (verifiers_imported): the import takes seconds.
if importlib.util.find_spec("verifiers") is None or importlib.util.find_spec("verifiers.v1") is None:
    pytest.skip("verifiers environments need verifiers 0.4 (the 'envs' extra)", allow_module_level=True)

from agents.proxy_agent.app import ProxyAgent, ProxyAgentConfig  # noqa: E402
from agents.proxy_agent.verifiers_export import export_rows  # noqa: E402
from models.chat_completions.app import ChatCompletionsConfig, ChatCompletionsModel  # noqa: E402
from rollgym.client import ServerAddress  # noqa: E402
from rollgym.testing import scripted_backend, serve_in_thread  # noqa: E402

ENVS = str(Path(__file__).parents[1] / "examples" / "verifiers_env")
LOCAL = {"runtime": {"type": "subprocess"}}


@pytest.fixture(scope="module", autouse=True)
def verifiers_imported() -> None:
    """verifiers.v1 imported before the first episode, whose time is bounded, starts."""
    import verifiers.v1  # noqa: F401


def decode(ids: list[int]) -> str:
    return bytes(i - 3 for i in ids if 3 <= i < 259).decode(errors="replace")


@pytest.fixture(scope="module")
def registry() -> Iterator[dict[str, ServerAddress]]:
    with ExitStack() as stack:
        backend = stack.enter_context(scripted_backend("--token-info"))
        model = ChatCompletionsModel(ChatCompletionsConfig(base_url=backend, model="scripted", return_token_ids=True),
                                     name="policy_model")
        yield {"policy_model": ServerAddress(stack.enter_context(serve_in_thread(model)), "models")}


@contextmanager
def proxy(registry: dict[str, ServerAddress], env: dict[str, Any], seen: list[ProxyAgent] | None = None) -> Iterator[str]:
    config = ProxyAgentConfig(model_server={"name": "policy_model"}, reward="agent", timeout_s=60,
                              agent={"kind": "verifiers", "env": env, "python_path": [ENVS]})
    server = ProxyAgent(config, name="proxy_agent", registry=registry)
    if seen is not None:
        seen.append(server)
    with serve_in_thread(server, timeout_s=120) as url:
        yield url


def rows(taskset: str, limit: int) -> list[dict[str, Any]]:
    return export_rows({"taskset": {"id": taskset}}, limit=limit, python_path=[ENVS])


def run(url: str, row: dict[str, Any]) -> dict[str, Any]:
    reply = httpx.post(f"{url}/run", json=row, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def sampled_texts(sequence: dict[str, Any]) -> list[str]:
    texts, current = [], []
    for token, mask in zip(sequence["completion_ids"], sequence["completion_mask"]):
        if mask:
            current.append(token)
        elif current:
            texts.append(decode(current))
            current = []
    return texts + ([decode(current)] if current else [])


def check_token_exact(result: dict[str, Any], turns: list[str]) -> None:
    """One token chain whose sampled runs are exactly what the backend generated, turn by turn."""
    assert result["prefix_ok"] is True and len(result["sequences"]) == 1
    assert sampled_texts(result["sequences"][0]) == turns
    assert result["metrics"]["turns"] == len(turns)


def test_a_single_turn_env_gives_its_weighted_reward_and_components(registry: dict[str, ServerAddress]) -> None:
    env = {"taskset": {"id": "rollgym_vf_reverse"}, "agent": {"harness": {"id": "null"}, **LOCAL}}
    seen: list[ProxyAgent] = []
    with proxy(registry, env, seen) as url:
        row = rows("rollgym_vf_reverse", 1)[0]
        result = run(url, row)
        assert result["status"] == "ok", result.get("error")
        assert result["reward"] == 1.0 and result["reward_components"] == {"exact": 1.0, "same_length": 1.0}
        assert result["agent_answer"] == "mygllor"
        check_token_exact(result, ["mygllor"])
        # A reply of the right length but wrong text: the weights (0.75 exact, 0.25 length) apply.
        wrong = json.loads(json.dumps(row))
        wrong["verifiers"]["data"]["answer"] = "xxxxxxx"
        result = run(url, wrong)
        # Each rollout's model client (its own URL) is closed when its episode ends, not kept by verifiers.
        interception = seen[0].config.agent._env._interception
        assert all(not server.clients for server in interception.servers)
    assert result["reward"] == 0.25 and result["reward_components"] == {"exact": 0.0, "same_length": 1.0}


@pytest.mark.slow  # verifiers serves the Toolset from a child process that imports verifiers: ~30 s here
def test_an_env_with_a_tool_calls_it_through_the_harness(registry: dict[str, ServerAddress]) -> None:
    env = {"taskset": {"id": "rollgym_vf_weather"}, "agent": {"harness": {"id": "null"}, **LOCAL}}
    with proxy(registry, env) as url:
        result = run(url, rows("rollgym_vf_weather", 2)[1])
    assert result["status"] == "ok", result.get("error")
    assert result["reward"] == 1.0 and result["reward_components"] == {"reports_weather": 1.0, "used_tool": 1.0}
    check_token_exact(result, ['<tool_call>get_weather\n{"city":"Oslo"}</tool_call>',
                               "The weather in Oslo: Oslo: snow, -3 C"])
    kinds = [item["type"] for item in result["response"]["output"]]
    assert kinds == ["function_call", "function_call_output", "message"]


def test_a_multi_turn_env_answers_between_turns(registry: dict[str, ServerAddress]) -> None:
    env = {"taskset": {"id": "rollgym_vf_echo_game"}, "player": {"harness": {"id": "null"}, **LOCAL}}
    with proxy(registry, env) as url:
        result = run(url, rows("rollgym_vf_echo_game", 1)[0])
    assert result["status"] == "ok", result.get("error")
    assert result["reward"] == 1.0 and result["reward_components"] == {"rounds_won": 1.0}
    check_token_exact(result, ["cba", "mygllor"])
    prompt = decode(result["sequences"][0]["prompt_ids"] + result["sequences"][0]["completion_ids"])
    assert "Reverse this text: rollgym" in prompt


def test_a_rubric_that_raises_fails_the_rollout_with_its_cause(registry: dict[str, ServerAddress]) -> None:
    env = {"taskset": {"id": "rollgym_vf_broken"}, "agent": {"harness": {"id": "null"}, **LOCAL}}
    with proxy(registry, env) as url:
        result = run(url, rows("rollgym_vf_broken", 1)[0])
        assert result["status"] == "agent_error" and result["reward"] is None
        assert "the rubric's own bug" in result["error"], result["error"]
        # A row without the verifiers task is the caller's fault: 422 naming the field.
        reply = httpx.post(f"{url}/run", json={"responses_create_params": {"input": "hi"}}, timeout=60)
        assert reply.status_code == 422 and reply.json()["error"]["field"] == "verifiers.data"
        reply = httpx.post(f"{url}/run", json={"responses_create_params": {"input": "hi"},
                                               "verifiers": {"data": {"prompt": 3}}}, timeout=60)
        assert reply.status_code == 422 and "BrokenTask's data" in reply.json()["error"]["message"]


def test_bad_configs_and_rows_are_one_line_naming_the_thing(registry: dict[str, ServerAddress]) -> None:
    with pytest.raises(ValueError, match="set reward: agent"):
        ProxyAgentConfig(model_server={"name": "policy_model"}, resources_server={"name": "weather"},
                         agent={"kind": "verifiers", "env": {}})
    with pytest.raises(ValueError, match="'prime' runs the harness off this host"):
        from agents.proxy_agent.verifiers_runner import load_env
        load_env({"taskset": {"id": "rollgym_vf_reverse"}}, [ENVS])
    with pytest.raises(ValueError, match="taskset 'no_such_taskset' not found"):
        rows("no_such_taskset", 1)
    export = subprocess.run([sys.executable, "-m", "agents.proxy_agent.verifiers_export", "--env", "{nope"],
                            capture_output=True, text=True)
    assert export.returncode == 2 and export.stderr.startswith("--env: not JSON") and "Traceback" not in export.stderr
