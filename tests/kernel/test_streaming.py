"""Model servers stream SSE that the OpenAI SDK's own parsers accept (rollgym.streaming)."""

from __future__ import annotations

import json
from typing import Iterator

import httpx
import pytest
from openai import OpenAI

from models.chat_completions.app import ChatCompletionsConfig, ChatCompletionsModel
from rollgym.testing import scripted_backend, serve_in_thread

TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather of a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


@pytest.fixture(scope="module")
def model_url() -> Iterator[str]:
    with scripted_backend("--token-info") as backend:
        model = ChatCompletionsModel(ChatCompletionsConfig(base_url=backend, model="scripted", return_token_ids=True),
                                     name="policy_model")
        with serve_in_thread(model) as url:
            yield url


@pytest.fixture
def client(model_url: str) -> Iterator[OpenAI]:
    with OpenAI(base_url=f"{model_url}/v1", api_key="unused", max_retries=0) as sdk:
        yield sdk


def test_responses_stream_parses_with_the_sdk_and_ends_with_the_token_fields(client: OpenAI) -> None:
    with client.responses.stream(model="scripted", input="What is the weather in Oslo?", tools=TOOLS) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.delta" in kinds
    call = final.output[0]
    assert call.type == "function_call" and call.name == "get_weather" and '"Oslo"' in call.arguments
    assert call.model_extra["generation_token_ids"] and call.model_extra["prompt_token_ids"]


def test_responses_text_stream_accumulates_deltas(client: OpenAI) -> None:
    with client.responses.stream(model="scripted", input="Reverse this text: abc") as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == "cba"


def test_chat_stream_parses_with_the_sdk(client: OpenAI) -> None:
    messages = [{"role": "user", "content": "What is the weather in Lima?"}]
    tools = [{"type": "function", "function": {k: TOOLS[0][k] for k in ("name", "description", "parameters")}}]
    with client.chat.completions.stream(model="scripted", messages=messages, tools=tools) as stream:
        final = stream.get_final_completion()
    call = final.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Lima"}
    assert final.choices[0].finish_reason == "tool_calls"
    chunks = list(client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "hello"}],
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "You said: hello"
    assert chunks[-1].usage.completion_tokens > 0


def test_a_stream_flag_that_is_not_a_boolean_is_refused(model_url: str) -> None:
    reply = httpx.post(f"{model_url}/v1/responses", json={"input": "hi", "stream": "yes"})
    assert reply.status_code == 422 and reply.json()["error"]["field"] == "stream"
