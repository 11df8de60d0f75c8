"""Tests of the chat_completions model server over real HTTP, in front of the scripted backend.

Every server runs in-process on a loopback port (rollgym.testing.serve_in_thread); the only stand-in
is scripts/scripted_backend.py, a vLLM-shaped Chat Completions backend run as a subprocess.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from models.chat_completions.app import ChatCompletionsConfig, ChatCompletionsModel, token_triple
from rollgym.schema import ModelResponse
from rollgym.testing import free_port, scripted_backend, serve_in_thread

WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather for a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "description": "City name, e.g. Paris"}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": False,
}
SYSTEM = "You are a weather assistant. Use the get_weather tool, then answer with the condition and the temperature."
# What the scripted backend "generates" for a get_weather call on Paris (toy tokens: one per UTF-8 byte).
PARIS_CALL_BODY = '<tool_call>get_weather\n{"city":"Paris"}</tool_call>'
TOOL_OUTPUT = "Paris: sunny, 22 C"


def weather_input(city: str = "Paris") -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"What is the weather in {city}?"},
    ]


def weather_request(city: str = "Paris", **extra: Any) -> dict[str, Any]:
    return {"input": weather_input(city), "tools": [WEATHER_TOOL], **extra}


def make_model(base_url: str, **config: Any) -> ChatCompletionsModel:
    return ChatCompletionsModel(ChatCompletionsConfig(base_url=base_url, model="scripted", **config), name="policy_model")


@pytest.fixture(scope="module")
def backend_url() -> Iterator[str]:
    with scripted_backend() as url:
        yield url


@pytest.fixture(scope="module")
def model_url(backend_url: str) -> Iterator[str]:
    with serve_in_thread(make_model(backend_url)) as url:
        yield url


@pytest.fixture(scope="module")
def client(model_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=model_url, timeout=10.0) as http:
        yield http


@pytest.fixture(scope="module")
def token_model_url() -> Iterator[str]:
    with scripted_backend("--token-info") as backend:
        with serve_in_thread(make_model(backend, return_token_ids=True)) as url:
            yield url


@pytest.fixture(scope="module")
def token_client(token_model_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=token_model_url, timeout=10.0) as http:
        yield http


def post_ok(client: httpx.Client, body: Any) -> dict[str, Any]:
    reply = client.post("/v1/responses", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()


def assistant_text(item: dict[str, Any]) -> str:
    assert item["type"] == "message" and item["role"] == "assistant", item
    return "".join(part["text"] for part in item["content"] if part["type"] == "output_text")


def error_of(reply: httpx.Response) -> dict[str, Any]:
    assert reply.headers["content-type"].startswith("application/json"), reply.headers
    body = reply.json()
    assert isinstance(body.get("error"), dict), body
    assert body["error"]["message"], body
    return body["error"]


# --- the Responses API round trip ---------------------------------------------------------------


def test_weather_question_gets_one_get_weather_call(client: httpx.Client) -> None:
    body = post_ok(client, weather_request())
    ModelResponse.model_validate(body)
    assert body["object"] == "response"
    assert body["status"] == "completed"
    assert body["model"] == "scripted"
    assert len(body["output"]) == 1
    call = body["output"][0]
    assert call["type"] == "function_call"
    assert call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == {"city": "Paris"}
    assert call["call_id"]
    # No token fields unless the server is asked for them.
    assert "prompt_token_ids" not in call and "generation_token_ids" not in call
    usage = body["usage"]
    assert usage["input_tokens"] > 0
    assert usage["output_tokens"] == len(PARIS_CALL_BODY.encode())
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    # The request's tools are echoed on the response.
    assert [tool["name"] for tool in body["tools"]] == ["get_weather"]


def test_second_turn_answers_from_the_tool_output(client: httpx.Client) -> None:
    first = post_ok(client, weather_request("Paris"))
    call = first["output"][0]
    second_input = weather_input("Paris") + [call, {"type": "function_call_output", "call_id": call["call_id"], "output": TOOL_OUTPUT}]
    body = post_ok(client, {"input": second_input, "tools": [WEATHER_TOOL]})
    ModelResponse.model_validate(body)
    assert [item["type"] for item in body["output"]] == ["message"]
    text = assistant_text(body["output"][0])
    assert "sunny" in text
    assert text == f"The weather in Paris: {TOOL_OUTPUT}"
    assert body["status"] == "completed"


def test_string_input(client: httpx.Client) -> None:
    body = post_ok(client, {"input": "Hello there"})
    ModelResponse.model_validate(body)
    assert len(body["output"]) == 1
    assert assistant_text(body["output"][0]) == "You said: Hello there"


def test_instructions_become_the_system_message(client: httpx.Client) -> None:
    # With instructions + a string input, the backend sees [system, user]: the answer echoes the user text.
    body = post_ok(client, {"input": "Reverse this text: abc", "instructions": "Be brief."})
    assert assistant_text(body["output"][0]) == "cba"
    assert body["instructions"] == "Be brief."


def test_max_output_tokens_truncates_with_incomplete_status(client: httpx.Client) -> None:
    body = post_ok(client, {"input": "one two three four five", "max_output_tokens": 2})
    ModelResponse.model_validate(body)
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert assistant_text(body["output"][0]) == "You said:"


# --- token ids and logprobs ----------------------------------------------------------------------


def test_token_fields_on_the_generated_item(token_client: httpx.Client) -> None:
    body = post_ok(token_client, weather_request())
    ModelResponse.model_validate(body)
    last = body["output"][-1]
    assert last["type"] == "function_call"
    prompt, gen, logprobs = last["prompt_token_ids"], last["generation_token_ids"], last["generation_log_probs"]
    assert all(isinstance(i, int) for i in prompt + gen)
    assert len(gen) == len(logprobs) > 0
    assert all(lp <= 0.0 for lp in logprobs)
    # The toy tokenizer: token id = UTF-8 byte + 3; the generation is the tool-call body.
    assert bytes(i - 3 for i in gen).decode() == PARIS_CALL_BODY
    assert bytes(i - 3 for i in prompt).decode().endswith("<|im_start|>assistant\n")
    assert body["usage"]["input_tokens"] == len(prompt)
    assert body["usage"]["output_tokens"] == len(gen)


def test_second_turn_prompt_extends_previous_prompt_and_generation(token_client: httpx.Client) -> None:
    first = post_ok(token_client, weather_request())
    call = first["output"][-1]
    # Echo the generated item back as is, token fields included (the schema accepts them on input).
    second_input = weather_input() + [call, {"type": "function_call_output", "call_id": call["call_id"], "output": TOOL_OUTPUT}]
    second = post_ok(token_client, {"input": second_input, "tools": [WEATHER_TOOL]})
    ModelResponse.model_validate(second)
    message = second["output"][-1]
    assert assistant_text(message) == f"The weather in Paris: {TOOL_OUTPUT}"
    previous = call["prompt_token_ids"] + call["generation_token_ids"]
    new_prompt = message["prompt_token_ids"]
    assert len(new_prompt) > len(previous)
    assert new_prompt[: len(previous)] == previous
    assert len(message["generation_token_ids"]) == len(message["generation_log_probs"])
    assert all(lp <= 0.0 for lp in message["generation_log_probs"])
    # What the tokens were sampled under, and which logprobs these are (vLLM's default: raw).
    assert message["sampling"] == {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "logprobs": "raw"}


def test_token_triple_from_vllm_shape() -> None:
    chat = {
        "prompt_token_ids": [1, 2, 3],
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "hi"},
                "token_ids": [10, 11],
                "logprobs": {"content": [
                    {"token": "token_id:10", "logprob": -0.5, "bytes": [], "top_logprobs": []},
                    {"token": "token_id:11", "logprob": -1, "bytes": [], "top_logprobs": []},
                ]},
            }
        ],
    }
    triple = token_triple(chat)
    assert triple == {"prompt_token_ids": [1, 2, 3], "generation_token_ids": [10, 11], "generation_log_probs": [-0.5, -1.0]}
    assert all(isinstance(lp, float) for lp in triple["generation_log_probs"])


def test_token_triple_older_vllm_ids_from_token_strings() -> None:
    chat = {
        "choices": [
            {
                "prompt_token_ids": [7, 8],  # on the choice rather than at the top level
                "logprobs": {"content": [
                    {"token": "token_id:42", "logprob": -0.25},
                    {"token": "token_id:7", "logprob": -2.0},
                    {"token": "token_id:1000", "logprob": 0.0},
                ]},
            }
        ],
    }
    assert token_triple(chat) == {
        "prompt_token_ids": [7, 8],
        "generation_token_ids": [42, 7, 1000],
        "generation_log_probs": [-0.25, -2.0, 0.0],
    }


def test_token_triple_absent_or_inconsistent() -> None:
    content = {"content": [{"token": "token_id:1", "logprob": -0.1}]}
    # No prompt ids (a backend without return_token_ids).
    assert token_triple({"choices": [{"token_ids": [1], "logprobs": content}]}) is None
    # No logprobs.
    assert token_triple({"prompt_token_ids": [1], "choices": [{"token_ids": [1], "logprobs": None}]}) is None
    # Generated ids and logprobs of different lengths.
    assert token_triple({"prompt_token_ids": [1], "choices": [{"token_ids": [1, 2], "logprobs": content}]}) is None
    # No choices at all.
    assert token_triple({"choices": []}) is None


# --- bad requests ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({**weather_request(), "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": 5}, "input"),
        ({**weather_request(), "tool_choice": "sometimes"}, "tool_choice"),
        ({**weather_request(), "temperature": 3.0}, "temperature"),
        ({"tools": [WEATHER_TOOL]}, "input"),
    ],
    ids=["max_output_tokens", "input-int", "tool_choice", "temperature", "input-missing"],
)
def test_invalid_params_name_the_field(client: httpx.Client, body: dict[str, Any], field: str) -> None:
    reply = client.post("/v1/responses", json=body)
    assert reply.status_code == 422, reply.text
    error = error_of(reply)
    assert error["type"] == "invalid_request"
    assert error["field"] == field
    assert field in error["message"]


def test_tool_choice_naming_a_missing_function_names_tool_choice(client: httpx.Client) -> None:
    reply = client.post("/v1/responses", json={**weather_request(), "tool_choice": {"type": "function", "name": "nope"}})
    assert reply.status_code == 422, reply.text
    error = error_of(reply)
    assert "'nope'" in error["message"]
    assert error["field"] == "tool_choice"


def test_bad_content_part_field_path_has_no_class_names(client: httpx.Client) -> None:
    reply = client.post("/v1/responses", json={"input": [{"role": "user", "content": [{"type": "input_text"}]}]})
    assert reply.status_code == 422, reply.text
    assert error_of(reply)["field"] == "input[0].content[0].text"


def test_function_call_output_for_unknown_call_id(client: httpx.Client) -> None:
    body = {"input": weather_input() + [{"type": "function_call_output", "call_id": "call_never_issued", "output": "x"}],
            "tools": [WEATHER_TOOL]}
    reply = client.post("/v1/responses", json=body)
    assert 400 <= reply.status_code < 500, reply.text
    error = error_of(reply)
    assert error["field"] == "input[2].call_id"
    assert "call_never_issued" in error["message"]


def test_malformed_json_is_400(client: httpx.Client) -> None:
    reply = client.post("/v1/responses", content=b'{"input": "hi",', headers={"content-type": "application/json"})
    assert reply.status_code == 400
    error = error_of(reply)
    assert error["field"] == "body"
    assert "not valid JSON" in error["message"]


def test_empty_body_is_400(client: httpx.Client) -> None:
    reply = client.post("/v1/responses", content=b"", headers={"content-type": "application/json"})
    assert reply.status_code == 400
    assert error_of(reply)["field"] == "body"


@pytest.fixture(scope="module")
def small_limit_client(backend_url: str) -> Iterator[httpx.Client]:
    with serve_in_thread(make_model(backend_url, max_body_bytes=1024)) as url:
        with httpx.Client(base_url=url, timeout=10.0) as http:
            yield http


def test_body_over_limit_is_413(small_limit_client: httpx.Client) -> None:
    big = json.dumps({"input": "x" * 4000}).encode()
    reply = small_limit_client.post("/v1/responses", content=big, headers={"content-type": "application/json"})
    assert reply.status_code == 413
    error = error_of(reply)
    assert error["type"] == "payload_too_large"
    assert "1024" in error["message"]
    # A body under the limit still goes through on the same server.
    assert assistant_text(post_ok(small_limit_client, {"input": "short"})["output"][0]) == "You said: short"


def test_chunked_body_over_limit_is_413(small_limit_client: httpx.Client) -> None:
    # No Content-Length: the limit has to be enforced while the body streams in.
    def chunks() -> Iterator[bytes]:
        yield b'{"input": "'
        for _ in range(8):
            yield b"x" * 500
        yield b'"}'

    reply = small_limit_client.post("/v1/responses", content=chunks(), headers={"content-type": "application/json"})
    assert "content-length" not in reply.request.headers
    assert reply.status_code == 413, reply.text
    assert error_of(reply)["type"] == "payload_too_large"


# --- backend failures ----------------------------------------------------------------------------------


def test_backend_failures_answer_502_after_retrying() -> None:
    # With --seed 1 the backend's failures come in the order 500, 503, ...: the model server reports
    # the status of its LAST attempt, so "HTTP 503" shows it retried once, and "HTTP 500" that it did not.
    for max_retries, expected in ((1, "HTTP 503"), (0, "HTTP 500")):
        with scripted_backend("--fail-rate", "1.0", "--seed", "1") as backend:
            with serve_in_thread(make_model(backend, max_retries=max_retries)) as url:
                started = time.monotonic()
                reply = httpx.post(f"{url}/v1/responses", json=weather_request(), timeout=10.0)
                assert time.monotonic() - started < 5.0
        assert reply.status_code == 502, reply.text
        error = error_of(reply)
        assert expected in error["message"], error
        assert "scripted failure" in error["message"]


def test_backend_unreachable_is_502() -> None:
    dead = f"http://127.0.0.1:{free_port()}/v1"
    with serve_in_thread(make_model(dead, max_retries=1)) as url:
        reply = httpx.post(f"{url}/v1/responses", json=weather_request(), timeout=10.0)
    assert reply.status_code == 502, reply.text
    message = error_of(reply)["message"]
    assert message.startswith("backend: ")
    assert "connect" in message


def test_backend_hang_is_504_after_timeout() -> None:
    with scripted_backend("--hang-rate", "1.0") as backend:
        with serve_in_thread(make_model(backend, timeout_s=0.5, max_retries=0)) as url:
            started = time.monotonic()
            reply = httpx.post(f"{url}/v1/responses", json=weather_request(), timeout=10.0)
            elapsed = time.monotonic() - started
    assert reply.status_code == 504, reply.text
    assert 0.45 <= elapsed < 2.5
    assert "timeout" in error_of(reply)["message"]


# --- other routes ------------------------------------------------------------------------------------


def test_models_lists_the_configured_model(client: httpx.Client) -> None:
    reply = client.get("/v1/models")
    assert reply.status_code == 200
    body = reply.json()
    assert body["object"] == "list"
    assert [entry["id"] for entry in body["data"]] == ["scripted"]
    assert body["data"][0]["object"] == "model"


def test_chat_completions_pass_through(client: httpx.Client) -> None:
    reply = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Reverse this text: hello"}]})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["object"] == "chat.completion"
    assert body["model"] == "scripted"  # filled in from the config when the request names none
    assert body["choices"][0]["message"]["content"] == "olleh"
    assert body["choices"][0]["finish_reason"] == "stop"


def test_chat_completions_with_tools_pass_through(client: httpx.Client) -> None:
    chat_tool = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_TOOL["parameters"]}}
    reply = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "What is the weather in Oslo?"}], "tools": [chat_tool]})
    assert reply.status_code == 200, reply.text
    calls = reply.json()["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}


def test_chat_completions_stream_answers_server_sent_events(client: httpx.Client) -> None:
    reply = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "stream": True})
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
    assert reply.text.endswith("data: [DONE]\n\n")
    refused = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "stream": "yes"})
    assert refused.status_code == 422 and error_of(refused)["field"] == "stream"


def test_chat_completions_without_messages(client: httpx.Client) -> None:
    reply = client.post("/v1/chat/completions", json={"prompt": "hi"})
    assert reply.status_code == 422
    assert error_of(reply)["field"] == "messages"


def test_unknown_route_is_json_404(client: httpx.Client) -> None:
    reply = client.get("/v1/nothing")
    assert reply.status_code == 404
    assert error_of(reply)["type"] == "not_found"


def test_health(client: httpx.Client) -> None:
    reply = client.get("/health")
    assert reply.status_code == 200
    assert reply.json() == {"status": "ok", "name": "policy_model", "role": "models"}
