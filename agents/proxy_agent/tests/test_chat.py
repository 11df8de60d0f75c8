"""The proxy's chat face: chat requests to Responses requests and Responses back to chat completions."""

from __future__ import annotations

import pytest

from agents.proxy_agent.chat import chat_to_responses, response_to_chat
from rollgym.server import BadRequest


def test_a_chat_request_becomes_a_responses_request() -> None:
    params = chat_to_responses({
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
        "tool_choice": "required", "max_completion_tokens": 32, "temperature": 0.2, "stop": ["\n"]})
    assert [item["role"] for item in params["input"]] == ["system", "user"]
    assert params["tools"][0]["name"] == "get_weather" and params["tool_choice"] == "required"
    assert params["max_output_tokens"] == 32 and params["temperature"] == 0.2 and params["stop"] == ["\n"]


@pytest.mark.parametrize("body, field", [
    ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, "n"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "sometimes"}, "tool_choice"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
])
def test_what_cannot_be_converted_names_its_field(body: dict, field: str) -> None:
    with pytest.raises(BadRequest) as caught:
        chat_to_responses(body)
    assert caught.value.errors[0]["field"] == field


def response(*output: dict, status: str = "completed") -> dict:
    return {"id": "resp_abc", "created_at": 7, "model": "m", "status": status, "output": list(output),
            "usage": {"input_tokens": 5, "output_tokens": 3}}


CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Oslo"}',
        "prompt_token_ids": [1, 2], "generation_token_ids": [3, 4], "generation_log_probs": [-0.1, -0.2]}


def test_a_response_becomes_a_chat_completion_without_token_fields_unless_asked() -> None:
    thought = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "look it up"}]}
    chat = response_to_chat(response(thought, CALL))
    choice = chat["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"] == [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city":"Oslo"}'}}]
    assert choice["message"]["reasoning_content"] == "look it up"
    assert chat["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    assert "prompt_token_ids" not in chat and "token_ids" not in choice and choice["logprobs"] is None
    asked = response_to_chat(response(CALL), token_ids=True, logprobs=True)
    assert asked["prompt_token_ids"] == [1, 2] and asked["choices"][0]["token_ids"] == [3, 4]
    assert [e["token"] for e in asked["choices"][0]["logprobs"]["content"]] == ["token_id:3", "token_id:4"]


def test_an_incomplete_response_finishes_with_length() -> None:
    text = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Oslo is"}]}
    chat = response_to_chat(response(text, status="incomplete"))
    assert chat["choices"][0]["finish_reason"] == "length" and chat["choices"][0]["message"]["content"] == "Oslo is"
