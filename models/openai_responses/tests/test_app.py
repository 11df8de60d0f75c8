"""openai_responses over real HTTP: the official SDK against a scripted Responses API backend written
here (a rollgym BaseServer serving `POST /v1/responses` with OpenAI's response shapes), and a live
check against OpenAI when OPENAI_API_KEY is set.

The scripted backend answers like the Responses API (https://platform.openai.com/docs/api-reference/
responses/create, and the `openai` package's Response type): a weather question with the
get_weather tool -> a `function_call` item; after a `function_call_output` -> an assistant `message`.
It can fail its first requests (429 with `retry-after-ms`, or 500), answer a context-length error
(400, code `context_length_exceeded`), and records every request body and the most requests it had
in flight at once.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from agents.simple_agent.app import SimpleAgent, SimpleAgentConfig
from models.openai_responses.app import OpenAIResponsesConfig, OpenAIResponsesModel
from resources_servers.weather.app import WeatherServer
from rollgym import BaseServer, ServerAddress
from rollgym.schema import ModelResponse, RunResponse
from rollgym.server import ServerStartError
from rollgym.testing import serve_in_thread

TOOL = {"type": "function", "name": "get_weather", "description": "Weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        "strict": False}


class ScriptedResponses(BaseServer):
    """A stand-in for the OpenAI Responses API."""

    def __init__(self, *, failures: list[int] | None = None, latency_s: float = 0.0) -> None:
        super().__init__(name="scripted_responses")
        self.failures = list(failures or [])
        self.latency_s = latency_s
        self.requests: list[dict[str, Any]] = []
        self.in_flight = 0
        self.max_in_flight = 0

    def add_routes(self, app: FastAPI) -> None:
        @app.post("/v1/responses")
        async def responses(request: Request) -> JSONResponse:
            body = await request.json()
            self.requests.append(body)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                await asyncio.sleep(self.latency_s)
            finally:
                self.in_flight -= 1
            if self.failures:
                status = self.failures.pop(0)
                return JSONResponse({"error": {"message": f"scripted {status}", "type": "server_error", "code": None}},
                                    status_code=status, headers={"retry-after-ms": "10"})
            text = str(body.get("input"))
            if "TOO LONG" in text:
                return JSONResponse({"error": {"message": "Your input exceeds the context window of this model.",
                                               "type": "invalid_request_error", "param": "input",
                                               "code": "context_length_exceeded"}}, status_code=400)
            return JSONResponse(self.answer(body))

    @staticmethod
    def answer(body: dict[str, Any]) -> dict[str, Any]:
        items = body["input"] if isinstance(body["input"], list) else [{"role": "user", "content": body["input"]}]
        outputs = [item for item in items if item.get("type") == "function_call_output"]
        if body.get("tools") and not outputs:
            output = [{"type": "function_call", "id": f"fc_{secrets.token_hex(8)}", "call_id": f"call_{secrets.token_hex(8)}",
                       "name": "get_weather", "arguments": '{"city":"Paris"}', "status": "completed"}]
        else:
            said = outputs[-1]["output"] if outputs else "hello"
            output = [{"type": "message", "id": f"msg_{secrets.token_hex(8)}", "role": "assistant", "status": "completed",
                       "content": [{"type": "output_text", "text": f"The weather: {said}", "annotations": []}]}]
        return {"id": f"resp_{secrets.token_hex(8)}", "object": "response", "created_at": int(time.time()),
                "model": "gpt-scripted-2025-01-01", "status": "completed", "output": output, "error": None,
                "incomplete_details": None, "instructions": None, "metadata": {}, "parallel_tool_calls": True,
                "temperature": 1.0, "top_p": 1.0, "tool_choice": "auto", "tools": body.get("tools") or [],
                "usage": {"input_tokens": 20, "input_tokens_details": {"cached_tokens": 0},
                          "output_tokens": 5, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 25}}


@contextmanager
def stack(backend: ScriptedResponses, **config: Any) -> Iterator[httpx.Client]:
    with ExitStack() as exits:
        backend_url = exits.enter_context(serve_in_thread(backend))
        model = OpenAIResponsesModel(OpenAIResponsesConfig(
            model="gpt-test", api_key="test-key", base_url=f"{backend_url}/v1", **config), name="policy_model")
        model_url = exits.enter_context(serve_in_thread(model))
        yield exits.enter_context(httpx.Client(base_url=model_url, timeout=30.0))


def weather_input() -> list[dict[str, Any]]:
    return [{"role": "user", "content": "What is the weather in Paris?"}]


def test_passthrough_strips_what_openai_rejects() -> None:
    backend = ScriptedResponses()
    with stack(backend) as client:
        first = client.post("/v1/responses", json={"input": weather_input(), "tools": [TOOL], "seed": 3,
                                                    "model": "whatever", "max_output_tokens": 50})
        assert first.status_code == 200, first.text
        call = first.json()["output"][0]
        # An item echoed back with rollgym's token fields (as another model server would leave them).
        echoed = {**call, "prompt_token_ids": [1], "generation_token_ids": [2], "generation_log_probs": [-0.1]}
        second = client.post("/v1/responses", json={
            "input": [*weather_input(), echoed, {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}],
            "tools": [TOOL]})
        assert second.status_code == 200, second.text
    ModelResponse.model_validate(first.json())
    ModelResponse.model_validate(second.json())
    assert call["type"] == "function_call" and call["model_version"] == "gpt-scripted-2025-01-01"
    assert first.json()["model_version"] == "gpt-scripted-2025-01-01"
    assert second.json()["output"][0]["content"][0]["text"] == "The weather: sunny"
    sent_first, sent_second = backend.requests
    assert sent_first["model"] == "gpt-test" and "seed" not in sent_first and sent_first["max_output_tokens"] == 50
    assert sent_first["store"] is False and sent_first["include"] == ["reasoning.encrypted_content"]
    for item in sent_second["input"]:
        assert not {"prompt_token_ids", "generation_token_ids", "generation_log_probs", "model_version"} & set(item)
    assert first.json()["usage"]["input_tokens_details"] == {"cached_tokens": 0, "cache_write_tokens": 0}


@pytest.mark.parametrize(("failures", "retries", "status", "calls"), [
    ([429, 500], 2, 200, 3),  # the SDK retries 429 and 5xx
    ([500], 0, 502, 1),
    ([429], 0, 429, 1),
])
def test_retries_on_429_and_5xx(failures: list[int], retries: int, status: int, calls: int) -> None:
    backend = ScriptedResponses(failures=failures)
    with stack(backend, max_retries=retries) as client:
        reply = client.post("/v1/responses", json={"input": "hi"})
    assert reply.status_code == status, reply.text
    assert len(backend.requests) == calls
    if status != 200:
        assert f"OpenAI answered HTTP {failures[0]}" in reply.json()["error"]["message"]


def test_concurrency_is_bounded() -> None:
    backend = ScriptedResponses(latency_s=0.2)
    with stack(backend, max_concurrency=2) as client, ThreadPoolExecutor(max_workers=6) as pool:
        replies = list(pool.map(lambda _: client.post("/v1/responses", json={"input": "hi"}), range(6)))
    assert [reply.status_code for reply in replies] == [200] * 6
    assert backend.max_in_flight == 2


def test_context_length_error_is_incomplete() -> None:
    with stack(ScriptedResponses()) as client:
        reply = client.post("/v1/responses", json={"input": "TOO LONG " * 10})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    ModelResponse.model_validate(body)
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}


def test_a_missing_api_key_stops_the_server_at_start() -> None:
    with pytest.raises(ServerStartError, match="OPENAI_API_KEY"):
        OpenAIResponsesModel(OpenAIResponsesConfig(model="gpt-test"), name="policy_model")


def test_agent_rollout_through_openai_responses() -> None:
    backend = ScriptedResponses()
    with ExitStack() as exits:
        backend_url = exits.enter_context(serve_in_thread(backend))
        model = OpenAIResponsesModel(OpenAIResponsesConfig(model="gpt-test", api_key="k", base_url=f"{backend_url}/v1"),
                                     name="policy_model")
        model_url = exits.enter_context(serve_in_thread(model))
        weather_url = exits.enter_context(serve_in_thread(WeatherServer(name="weather")))
        agent = SimpleAgent(SimpleAgentConfig(model_server={"name": "policy_model"}, resources_server={"name": "weather"}),
                            name="agent", registry={"policy_model": ServerAddress(url=model_url, role="models"),
                                                    "weather": ServerAddress(url=weather_url, role="resources_servers")})
        agent_url = exits.enter_context(serve_in_thread(agent))
        reply = httpx.post(f"{agent_url}/run", timeout=30.0, json={
            "responses_create_params": {"input": weather_input(), "tools": [TOOL]}, "city": "Paris", "expected": ["sunny"]})
    assert reply.status_code == 200, reply.text
    result = reply.json()
    RunResponse.model_validate(result)
    assert result["status"] == "ok" and result["reward"] == 1.0
    assert "sequences" not in result  # OpenAI gives no token ids


@pytest.mark.skipif(not os.environ.get("OPENAI_API_KEY"), reason="live OpenAI check: set OPENAI_API_KEY to run it")
def test_live_openai() -> None:
    model = OpenAIResponsesModel(OpenAIResponsesConfig(
        model=os.environ.get("ROLLGYM_OPENAI_MODEL", "gpt-4.1-mini"), api_key=os.environ["OPENAI_API_KEY"]),
        name="policy_model")
    with serve_in_thread(model) as url:
        reply = httpx.post(f"{url}/v1/responses", timeout=120.0, json={
            "input": weather_input(), "tools": [TOOL], "tool_choice": {"type": "function", "name": "get_weather"}})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    ModelResponse.model_validate(body)
    assert any(item["type"] == "function_call" and item["name"] == "get_weather" for item in body["output"])
