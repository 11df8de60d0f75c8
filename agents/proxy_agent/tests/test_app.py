"""The proxy agent over real HTTP: external agents (openai SDK, in-process and as commands) run
through per-rollout endpoints to chat_completions in front of the scripted backend (vLLM's stand-in,
whose toy tokenizer makes every token readable: id = byte + 3)."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from contextlib import ExitStack, contextmanager
from typing import Any, Iterator

import httpx
import pytest

from fastapi import FastAPI, Request

from agents.proxy_agent.app import ProxyAgent, ProxyAgentConfig
from agents.proxy_agent.runners import Endpoint
from agents.proxy_agent.tests import fixture_agents
from models.chat_completions.app import ChatCompletionsConfig, ChatCompletionsModel
from resources_servers.weather.app import WEATHER, WeatherServer
from rollgym import BaseServer
from rollgym.client import ServerAddress
from rollgym.testing import free_port, scripted_backend, serve_in_thread

CITIES = [entry["city"] for entry in WEATHER.values()]


def task(city: str = "Paris") -> dict[str, Any]:
    entry = WEATHER[city.lower()]
    return {"responses_create_params": {"input": [{"role": "user", "content": f"What is the weather in {city}?"}]},
            "city": city, "expected": [entry["condition"], str(entry["temperature_c"])]}


def decode(ids: list[int]) -> str:
    return bytes(i - 3 for i in ids if 3 <= i < 259).decode(errors="replace")


@pytest.fixture(scope="module")
def registry() -> Iterator[dict[str, ServerAddress]]:
    with ExitStack() as stack:
        backend = stack.enter_context(scripted_backend("--token-info"))
        model = ChatCompletionsModel(ChatCompletionsConfig(base_url=backend, model="scripted", return_token_ids=True),
                                     name="policy_model")
        yield {"policy_model": ServerAddress(stack.enter_context(serve_in_thread(model)), "models"),
               "weather": ServerAddress(stack.enter_context(serve_in_thread(WeatherServer(name="weather"))),
                                        "resources_servers")}


@contextmanager
def proxy(registry: dict[str, ServerAddress], agent: dict[str, Any], **options: Any) -> Iterator[str]:
    config = ProxyAgentConfig(model_server={"name": "policy_model"}, resources_server={"name": "weather"},
                              agent=agent, **options)
    with serve_in_thread(ProxyAgent(config, name="proxy_agent", registry=registry)) as url:
        yield url


def callable_agent(name: str) -> dict[str, str]:
    return {"kind": "callable", "target": f"agents.proxy_agent.tests.fixture_agents:{name}"}


def run(url: str, row: dict[str, Any]) -> dict[str, Any]:
    reply = httpx.post(f"{url}/run", json=row, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def sampled_texts(sequence: dict[str, Any]) -> list[str]:
    """The runs of model-sampled tokens (mask 1) of a sequence, decoded."""
    texts, current = [], []
    for token, mask in zip(sequence["completion_ids"], sequence["completion_mask"]):
        if mask:
            current.append(token)
        elif current:
            texts.append(decode(current))
            current = []
    return texts + ([decode(current)] if current else [])


@pytest.mark.parametrize("agent", ["weather_loop", "weather_loop_streaming", "responses_loop", "chained_responses"])
def test_an_sdk_agent_gives_a_verified_token_exact_rollout(registry: dict[str, ServerAddress], agent: str) -> None:
    with proxy(registry, callable_agent(agent)) as url:
        result = run(url, task("Paris"))
    assert result["status"] == "ok" and result["reward"] == 1.0, result
    assert result["prefix_ok"] is True and len(result["sequences"]) == 1
    # What the trainer gets as sampled is exactly what the backend generated, turn by turn.
    assert sampled_texts(result["sequences"][0]) == [
        '<tool_call>get_weather\n{"city":"Paris"}</tool_call>', "The weather in Paris: Paris: sunny, 22 C"]
    assert result["metrics"]["turns"] == 2 and result["metrics"]["tool_calls"] == 1
    kinds = [item["type"] for item in result["response"]["output"]]
    assert kinds == ["function_call", "function_call_output", "message"]
    assert result["agent_answer"] == "The weather in Paris: Paris: sunny, 22 C"


def test_token_fields_reach_the_agent_only_when_asked(registry: dict[str, ServerAddress]) -> None:
    with proxy(registry, callable_agent("token_visibility")) as url:
        result = run(url, task())
    assert json.loads(result["agent_answer"]) == {"chat_False": False, "responses_False": False,
                                                   "chat_True": True, "responses_True": True}


def test_a_branching_agent_gives_one_sequence_per_branch(registry: dict[str, ServerAddress]) -> None:
    with proxy(registry, callable_agent("branching")) as url:
        result = run(url, task("Tokyo"))
    assert result["status"] == "ok" and result["prefix_ok"] is True
    assert len(result["sequences"]) == 3 and all(s["prefix_ok"] for s in result["sequences"])
    prompts = sorted(decode(s["prompt_ids"]) for s in result["sequences"])
    assert "Sub-task 1" in prompts[0] + prompts[1] + prompts[2] and "Tokyo" in "".join(prompts)


def test_a_rollout_url_refuses_other_rollouts_and_calls_after_the_end(registry: dict[str, ServerAddress]) -> None:
    fixture_agents.PEERS.clear()
    fixture_agents.CROSSED.clear()
    with proxy(registry, callable_agent("cross_check")) as url:
        async def both() -> list[dict[str, Any]]:
            async with httpx.AsyncClient(timeout=60) as http:
                replies = await asyncio.gather(*(http.post(f"{url}/run", json=task(city)) for city in ("Paris", "Oslo")))
            return [reply.json() for reply in replies]

        results = asyncio.run(both())
        assert [r["agent_answer"] for r in results] == ["401", "401"]
        assert all(r["reward"] == 1.0 for r in results)
        ended = fixture_agents.PEERS["Paris"]
        reply = httpx.post(f"{ended.base_url}/chat/completions", headers={"Authorization": f"Bearer {ended.api_key}"},
                           json={"model": "m", "messages": [{"role": "user", "content": "late"}]})
        assert reply.status_code == 409 and "has ended" in reply.json()["error"]["message"]
        assert httpx.get(f"{url}/rollouts/nope/v1/models").status_code == 404


@pytest.mark.parametrize("argv, status, cause", [
    ([sys.executable, "-c", "import sys; sys.stderr.write('boom: no such tool'); sys.exit(3)"], "agent_error",
     "exited with code 3; stderr: ...boom: no such tool"),
    ([sys.executable, "-c", "import sys, time; sys.stderr.write('thinking'); sys.stderr.flush(); time.sleep(60)"],
     "timeout", "ran past 1 s; stderr: ...thinking"),
    (["/nonexistent/agent"], "agent_error", "cannot start '/nonexistent/agent'"),
    ([sys.executable, "-c", "print('x' * 3000)"], "agent_error", "more than 1000 bytes to stdout"),
])
def test_a_failing_agent_command_is_a_failure_with_its_cause(registry: dict[str, ServerAddress], argv: list[str],
                                                             status: str, cause: str) -> None:
    with proxy(registry, {"kind": "command", "argv": argv, "max_output_bytes": 1000}, timeout_s=1) as url:
        result = run(url, task())
    assert result["status"] == status and result["reward"] is None
    assert cause in result["error"]


def test_a_raising_callable_is_an_agent_error(registry: dict[str, ServerAddress]) -> None:
    with proxy(registry, callable_agent("crash")) as url:
        result = run(url, task())
    assert result["status"] == "agent_error" and result["reward"] is None
    assert "RuntimeError: the agent's own bug" in result["error"]


def test_the_workflow_can_score_itself(registry: dict[str, ServerAddress]) -> None:
    with proxy(registry, callable_agent("scored"), reward="agent") as url:
        result = run(url, task("Lima"))
    assert result["reward"] == 0.25 and result["agent_score"] == 0.25 and result["status"] == "ok"


def test_64_concurrent_rollouts_do_not_cross_talk(registry: dict[str, ServerAddress]) -> None:
    rows = [task(CITIES[index % len(CITIES)]) for index in range(64)]
    with proxy(registry, callable_agent("weather_loop")) as url:
        async def collect() -> list[dict[str, Any]]:
            async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=64)) as http:
                replies = await asyncio.gather(*(http.post(f"{url}/run", json=row) for row in rows))
            return [reply.json() for reply in replies]

        results = asyncio.run(collect())
    for row, result in zip(rows, results):
        city = row["city"]
        assert result["status"] == "ok" and result["reward"] == 1.0, result["error"]
        tokens = decode(result["sequences"][0]["prompt_ids"] + result["sequences"][0]["completion_ids"])
        assert [name for name in CITIES if name in tokens] == [city]
        assert result["agent_answer"].startswith(f"The weather in {city}:")


class Workflow(BaseServer):
    """A company's own agent service: POST {task, base_url, api_key, ...} -> {answer, score}."""

    def add_routes(self, app: FastAPI) -> None:
        @app.post("/workflow")
        async def workflow(request: Request) -> dict[str, Any]:
            body = await request.json()
            endpoint = Endpoint(**{key: body[key] for key in ("base_url", "api_key", "model", "tools_url", "rollout_id")})
            return {"answer": await fixture_agents.weather_loop(body["task"], endpoint), "score": 0.5}

        @app.post("/broken")
        async def broken() -> None:
            raise RuntimeError("workflow bug")


def test_an_http_workflow_runs_and_its_score_is_recorded(registry: dict[str, ServerAddress]) -> None:
    with serve_in_thread(Workflow(name="workflow")) as workflow:
        with proxy(registry, {"kind": "http", "url": f"{workflow}/workflow"}) as url:
            result = run(url, task("Sydney"))
        assert result["status"] == "ok" and result["reward"] == 1.0 and result["agent_score"] == 0.5
        assert result["prefix_ok"] is True
        with proxy(registry, {"kind": "http", "url": f"{workflow}/broken"}) as url:
            result = run(url, task("Sydney"))
        assert result["status"] == "agent_error" and "HTTP 500" in result["error"] and result["reward"] is None


def test_calls_past_max_model_calls_are_refused_and_the_rollout_is_max_steps(registry: dict[str, ServerAddress]) -> None:
    with proxy(registry, callable_agent("weather_loop"), max_model_calls=1) as url:
        result = run(url, task())
    assert result["status"] == "max_steps" and result["reward"] == 0.0 and result["metrics"]["turns"] == 1


def test_an_mcp_agent_uses_the_environments_tools_over_mcp(registry: dict[str, ServerAddress]) -> None:
    pytest.importorskip("mcp", reason="serving tools over MCP needs the mcp package (the 'agents' extra)")
    fixture_agents.SEEN.clear()
    with proxy(registry, callable_agent("mcp_tools_loop"), serve_mcp=True) as url:
        result = run(url, task("Toronto"))
        assert result["status"] == "ok" and result["reward"] == 1.0, result.get("error")
        assert result["looked_up"] == ["Toronto"]  # the tool ran in the rollout's environment session
        assert result["prefix_ok"] is True
        ended = fixture_agents.SEEN[-1]
        late = httpx.post(ended.mcp_url, json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
                          headers={"Authorization": f"Bearer {ended.api_key}"})
        assert late.status_code == 409 and "has ended" in late.json()["error"]["message"]
        stranger = httpx.post(f"{url}/rollouts/nope/mcp", json={})
        assert stranger.status_code == 404


def test_a_child_left_behind_does_not_hold_the_rollout(registry: dict[str, ServerAddress]) -> None:
    script = "import subprocess, sys; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); print('done')"
    with proxy(registry, {"kind": "command", "argv": [sys.executable, "-c", script]}, timeout_s=20) as url:
        started = time.monotonic()
        result = run(url, task())
    assert time.monotonic() - started < 10 and result["agent_answer"] == "done"
    # And an agent that never called its endpoint gave nothing to train on: a failure that says why.
    assert result["status"] == "agent_error" and "made no model call" in result["error"]


def test_an_environment_that_is_down_is_an_env_error(registry: dict[str, ServerAddress]) -> None:
    down = {**registry, "weather": ServerAddress(f"http://127.0.0.1:{free_port()}", "resources_servers")}
    with proxy(down, callable_agent("weather_loop"), client_max_retries=0) as url:
        result = run(url, task())
    assert result["status"] == "env_error" and result["reward"] is None and "seed_session" in result["error"]


def test_a_model_server_that_fails_under_the_agent_is_a_model_error(registry: dict[str, ServerAddress]) -> None:
    down = {**registry, "policy_model": ServerAddress(f"http://127.0.0.1:{free_port()}", "models")}
    with proxy(down, callable_agent("weather_loop"), client_max_retries=0) as url:
        result = run(url, task())
    assert result["status"] == "model_error" and result["reward"] is None, result["error"]


def test_a_prompt_past_the_context_is_a_context_overflow(registry: dict[str, ServerAddress]) -> None:
    with scripted_backend("--token-info", "--max-model-len", "60") as backend:
        model = ChatCompletionsModel(ChatCompletionsConfig(base_url=backend, model="scripted", return_token_ids=True),
                                     name="policy_model")
        with serve_in_thread(model) as model_url:
            small = {**registry, "policy_model": ServerAddress(model_url, "models")}
            with proxy(small, callable_agent("weather_loop")) as url:
                result = run(url, task())
    assert result["status"] == "context_overflow" and result["reward"] is None, result
    assert "does not fit the model's context" in result["error"]


@pytest.mark.parametrize("reward", ["verify", "agent"])
def test_skip_verification_scores_nothing_and_makes_up_no_reward(registry: dict[str, ServerAddress],
                                                                 reward: str) -> None:
    agent = "weather_loop" if reward == "verify" else "scored"
    with proxy(registry, callable_agent(agent), reward=reward) as url:
        result = run(url, {**task("Lima"), "skip_verification": True})
    assert result["status"] == "ok" and result["error"] is None, result
    assert result["reward"] is None and result["verification"] == "skipped"
    assert "looked_up" not in result  # the environment's /verify answer never came
    assert result["prefix_ok"] is True and result["metrics"]["turns"] == 2  # the rollout itself is whole
    if reward == "agent":  # the workflow's own score is kept where it was, not made the reward
        assert result["agent_score"] == 0.25
