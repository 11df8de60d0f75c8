"""A tool call the model botched, over real HTTP: the scripted backend writes one on request (a last user
message saying `malformed tool call`), the token-prompt path parses the raw completion here, and the call
becomes a text answer the agent and the trainer see, counted in `GET /backends` under `parsing`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from models.chat_completions.app import ChatCompletionsConfig, ChatCompletionsModel
from rollgym.testing import scripted_backend, serve_in_thread

WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "Get the current weather for a city.",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[httpx.Client, httpx.Client]]:
    """(the model server, the scripted backend's root)."""
    with scripted_backend("--token-info") as backend:
        model = ChatCompletionsModel(ChatCompletionsConfig(base_url=backend, model="scripted", return_token_ids=True),
                                     name="policy_model")
        with serve_in_thread(model) as url, httpx.Client(base_url=url, timeout=10) as client, \
                httpx.Client(base_url=backend.removesuffix("/v1"), timeout=10) as raw:
            yield client, raw


def after_a_first_turn(client: httpx.Client, question: str) -> dict[str, Any]:
    """A second turn asking `question` with the weather tool, on the tokens of a first turn: the token-prompt
    path, where the model server parses the backend's raw completion itself."""
    first = client.post("/v1/responses", json={"input": [{"role": "user", "content": "hi"}], "tools": [WEATHER_TOOL],
                                                "tool_choice": "none"}).json()
    assert "prompt_token_ids" in first["output"][-1]
    reply = client.post("/v1/responses", json={
        "input": [{"role": "user", "content": "hi"}, *first["output"], {"role": "user", "content": question}],
        "tools": [WEATHER_TOOL]})
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_a_malformed_tool_call_is_a_text_answer_and_a_counted_parse_failure(
        servers: tuple[httpx.Client, httpx.Client]) -> None:
    client, backend = servers
    before = client.get("/backends").json()["parsing"]
    assert before["tool_parser"] == "hermes"
    backend.post("/scripted/clear")

    def parsed_since() -> tuple[int, int]:
        now = client.get("/backends").json()["parsing"]
        return now["generations"] - before["generations"], now["failures"] - before["failures"]

    answer = after_a_first_turn(client, "What is the weather in Rome? Send a malformed tool call.")
    assert [item["type"] for item in answer["output"]] == ["message"]
    text = answer["output"][0]["content"][0]["text"]
    assert text == '<tool_call>get_weather\n{"city":"Rome"</tool_call>'  # what the model wrote, as text
    assert answer["status"] == "completed" and answer["output"][0]["generation_token_ids"]
    paths = [entry["path"] for entry in backend.get("/scripted/requests").json()["requests"]]
    assert "/v1/completions" in paths  # parsed here, not by the backend
    assert parsed_since() == (1, 1)

    # The same question, well asked: a function call, and no new failure.
    answer = after_a_first_turn(client, "What is the weather in Rome?")
    assert [item["type"] for item in answer["output"]] == ["function_call"]
    assert answer["output"][0]["name"] == "get_weather" and answer["output"][0]["arguments"] == '{"city":"Rome"}'
    assert parsed_since() == (2, 1)


def test_the_chat_path_gives_the_malformed_call_back_as_text(servers: tuple[httpx.Client, httpx.Client]) -> None:
    client, _ = servers
    reply = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Weather in Oslo? malformed tool call"}],
        "tools": [{"type": "function", "function": {k: v for k, v in WEATHER_TOOL.items() if k != "type"}}]}).json()
    message = reply["choices"][0]["message"]
    assert not message.get("tool_calls") and message["content"] == '<tool_call>get_weather\n{"city":"Oslo"</tool_call>'
    assert reply["choices"][0]["finish_reason"] == "stop"


def test_tokens_a_grammar_forced_are_flagged_and_tool_choice_none_keeps_calls_as_text(
        servers: tuple[httpx.Client, httpx.Client]) -> None:
    client, _ = servers
    forced = client.post("/v1/responses", json={
        "input": [{"role": "user", "content": "What is the weather in Oslo?"}], "tools": [WEATHER_TOOL],
        "tool_choice": {"type": "function", "name": "get_weather"}}).json()
    call = forced["output"][-1]
    assert call["type"] == "function_call"
    opening = len('<tool_call>get_weather\n'.encode())  # what the backend's grammar admitted alone (logprob 0.0)
    assert call["generation_forced"] == [1] * opening + [0] * (len(call["generation_token_ids"]) - opening)
    assert all(lp < 0 for lp in call["generation_log_probs"][opening:])
    free = client.post("/v1/responses", json={
        "input": [{"role": "user", "content": "What is the weather in Oslo?"}], "tools": [WEATHER_TOOL]}).json()
    assert free["output"][-1]["type"] == "function_call" and "generation_forced" not in free["output"][-1]
    assert call["generation_constrained"] == [1] * len(call["generation_token_ids"])
    assert "generation_constrained" not in free["output"][-1]

    # On the token-prompt path the backend never sees tool_choice: a call written anyway under "none" stays text.
    first = client.post("/v1/responses", json={"input": [{"role": "user", "content": "hi"}], "tools": [WEATHER_TOOL],
                                                "tool_choice": "none"}).json()
    answer = client.post("/v1/responses", json={
        "input": [{"role": "user", "content": "hi"}, *first["output"],
                  {"role": "user", "content": "What is the weather in Rome?"}],
        "tools": [WEATHER_TOOL], "tool_choice": "none"}).json()
    assert [item["type"] for item in answer["output"]] == ["message"], answer["output"]
    assert answer["output"][0]["content"][0]["text"].startswith("<tool_call>get_weather")
