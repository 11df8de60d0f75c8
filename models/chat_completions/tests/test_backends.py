"""chat_completions against vLLM-, SGLang- and OpenAI-shaped backends: token fields, token-id prompts,
reasoning, context-length errors, tokenizer routes, model versions and the raw-text parsers.

The backend is scripts/scripted_backend.py (a subprocess; toy tokenizer: token id = UTF-8 byte + 3).
The shapes it reproduces were checked against the backends' own source, read from stored copies of
their repositories (not against a running server):

- vLLM (main, 2025-26; `return_token_ids` exists since 0.10.2 -- fairly sure of that version,
  sure of the shapes): vllm/entrypoints/openai/chat_completion/protocol.py -- ChatCompletionRequest
  `logprobs`, `return_tokens_as_token_ids` ("token_id:{id}" logprob tokens), `return_token_ids`;
  ChatCompletionResponse.prompt_token_ids (top level); ChatCompletionResponseChoice.token_ids;
  ChatMessage.reasoning (older versions: reasoning_content; requests' reasoning_content is renamed
  to reasoning). vllm/entrypoints/openai/completion/protocol.py -- CompletionRequest.prompt accepts a
  list of token ids, `logprobs: int`, CompletionResponseChoice.token_ids / prompt_token_ids /
  logprobs {text_offset, token_logprobs, tokens, top_logprobs}; `max_tokens` defaults to 16.
  vllm/entrypoints/serve/tokenize/{protocol,api_router}.py -- POST /tokenize (server root, not /v1)
  with `prompt` or `messages` + `add_generation_prompt` + `tools` -> {count, max_model_len, tokens,
  token_strs}; POST /detokenize {tokens} -> {prompt}.
- SGLang (main, 2025-26; which release added each field I could not pin down -- older SGLang lacks
  `return_prompt_token_ids`, `input_ids` on chat and `messages` on /tokenize, and then the model
  server falls back to plain chat): python/sglang/srt/entrypoints/openai/protocol.py --
  ChatCompletionRequest `logprobs`, `return_prompt_token_ids`, `return_token_ids`, `return_meta_info`,
  `input_ids` ("bypasses chat template tokenization"); ChatCompletionResponseChoice.prompt_token_ids
  and .token_ids (on the choice, not top level), .meta_info; ChatMessage.reasoning_content; logprob
  entries carry token text; TokenizeRequest (prompt or messages; always with the generation prompt)
  -> {tokens, count, max_model_len}; serving_tokenize.py: detokenize -> {text}; errors are
  {"object": "error", "message", ...} at the top level.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from models.chat_completions.app import ChatCompletionsConfig, ChatCompletionsModel, token_triple
from models.chat_completions.parsers import hermes_tool_parser, think_reasoning_parser
from rollgym.schema import ModelResponse
from rollgym.testing import scripted_backend, serve_in_thread

TOOL = {"type": "function", "name": "get_weather", "description": "Weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        "strict": False}
TOKEN_KEYS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


def decode(ids: list[int]) -> str:
    return bytes(i - 3 for i in ids).decode()


_BACKENDS: dict[tuple[str, ...], str] = {}


@pytest.fixture(scope="module", autouse=True)
def _backends() -> Iterator[None]:
    """Scripted backends are started once per set of flags and shared by this module's tests."""
    with ExitStack() as stack:
        _BACKENDS["stack"] = stack  # type: ignore[assignment]
        yield
        _BACKENDS.clear()


def backend_for(flags: tuple[str, ...]) -> str:
    if flags not in _BACKENDS:
        stack: ExitStack = _BACKENDS["stack"]  # type: ignore[assignment]
        _BACKENDS[flags] = stack.enter_context(scripted_backend(*flags))
    url = _BACKENDS[flags]
    httpx.post(f"{url.removesuffix('/v1')}/scripted/clear")
    return url


@contextmanager
def model_on(*flags: str, **config: Any) -> Iterator[tuple[httpx.Client, str]]:
    """A chat_completions server in front of a scripted backend; yields (client, backend root URL)."""
    config.setdefault("return_token_ids", True)
    backend = backend_for(flags)
    model = ChatCompletionsModel(ChatCompletionsConfig(base_url=backend, model="scripted", **config), name="policy_model")
    with serve_in_thread(model) as url, httpx.Client(base_url=url, timeout=15.0) as client:
        yield client, backend.removesuffix("/v1")


def backend_log(root: str) -> list[dict[str, Any]]:
    return httpx.get(f"{root}/scripted/requests").json()["requests"]


def respond(client: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    reply = client.post("/v1/responses", json=body)
    assert reply.status_code == 200, reply.text
    ModelResponse.model_validate(reply.json())
    return reply.json()


def weather(city: str = "Oslo", system: str = "You are a weather assistant.") -> list[dict[str, Any]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": f"What is the weather in {city}?"}]


def two_turns(client: httpx.Client, system: str = "You are a weather assistant.") -> tuple[dict, dict, list]:
    """A tool call, then the answer to the tool output: (first response, second response, second input)."""
    first = respond(client, {"input": weather(system=system), "tools": [TOOL]})
    call = first["output"][-1]
    assert call["type"] == "function_call"
    second_input = weather(system=system) + first["output"] + [
        {"type": "function_call_output", "call_id": call["call_id"], "output": "Oslo: snowy, -3 C"}]
    second = respond(client, {"input": second_input, "tools": [TOOL]})
    return first, second, second_input


def extends(first: dict[str, Any], second: dict[str, Any]) -> bool:
    before = first["output"][-1]["prompt_token_ids"] + first["output"][-1]["generation_token_ids"]
    return second["output"][-1]["prompt_token_ids"][: len(before)] == before


# --- vLLM ------------------------------------------------------------------------------------------


def test_vllm_asks_for_token_ids_then_extends_them_with_a_token_id_prompt() -> None:
    with model_on() as (client, root):
        first, second, _ = two_turns(client)
        log = backend_log(root)
    chat = log[0]
    assert chat["path"] == "/v1/chat/completions"
    assert chat["body"]["logprobs"] is True
    assert chat["body"]["return_tokens_as_token_ids"] is True and chat["body"]["return_token_ids"] is True
    call = first["output"][-1]
    assert decode(call["generation_token_ids"]).startswith("<tool_call>get_weather\n")
    assert len(call["generation_token_ids"]) == len(call["generation_log_probs"])
    # Turn 2: the backend tokenizes the conversation before the assistant turn, through it, and all
    # of it; the token-id prompt goes to /v1/completions.
    assert [entry["path"] for entry in log[1:]] == ["/tokenize", "/tokenize", "/tokenize", "/v1/completions"]
    tokenized = {(entry["body"]["messages"][-1]["role"], entry["body"]["add_generation_prompt"]): entry["body"]
                 for entry in log[1:4]}
    assert set(tokenized) == {("user", True), ("assistant", False), ("tool", True)}
    assert tokenized[("tool", True)]["tools"][0]["function"]["name"] == "get_weather"
    completion = log[4]["body"]
    assert isinstance(completion["prompt"], list) and all(isinstance(i, int) for i in completion["prompt"])
    assert completion["return_token_ids"] is True and completion["logprobs"] == 0
    assert completion["max_tokens"] is None  # not vLLM's default of 16
    # The answer was parsed from raw text, and its prompt is exactly turn 1's tokens + the new ones.
    message = second["output"][-1]
    assert message["type"] == "message"
    assert message["content"][0]["text"] == "The weather in Oslo: Oslo: snowy, -3 C"
    assert message["prompt_token_ids"] == completion["prompt"]
    assert extends(first, second)
    added = decode(message["prompt_token_ids"][len(call["prompt_token_ids"]) + len(call["generation_token_ids"]):])
    assert added == "<|im_end|>\n<|im_start|>tool\nOslo: snowy, -3 C<|im_end|>\n<|im_start|>assistant\n"
    assert second["usage"]["input_tokens"] == len(message["prompt_token_ids"])


def test_a_backend_without_tokenize_falls_back_to_chat() -> None:
    with model_on("--no-token-routes") as (client, root):
        first, second, _ = two_turns(client)
        paths = [entry["path"] for entry in backend_log(root)]
    assert paths == ["/v1/chat/completions", "/v1/chat/completions"]
    assert extends(first, second)  # the toy template is stable; a drifting one shows in prefix_ok


def test_a_forced_tool_choice_goes_through_chat() -> None:
    with model_on() as (client, root):
        first = respond(client, {"input": weather(), "tools": [TOOL]})
        second_input = weather() + first["output"] + [
            {"type": "function_call_output", "call_id": first["output"][-1]["call_id"], "output": "cold"}]
        respond(client, {"input": second_input, "tools": [TOOL], "tool_choice": {"type": "function", "name": "get_weather"}})
        paths = [entry["path"] for entry in backend_log(root)]
    assert paths == ["/v1/chat/completions", "/v1/chat/completions"]


def test_drifting_tokenizer_chat_prompt_drifts_token_prompt_does_not() -> None:
    with model_on("--drift", token_prompts=False) as (client, _):
        first, second, _ = two_turns(client)
        assert not extends(first, second)
    with model_on("--drift") as (client, _):
        first, second, _ = two_turns(client)
        assert extends(first, second)


# --- SGLang ----------------------------------------------------------------------------------------


def test_sglang_fields_and_input_ids_prompt() -> None:
    with model_on("--shape", "sglang", "--weight-version", "step-7", backend="sglang") as (client, root):
        first, second, _ = two_turns(client)
        log = backend_log(root)
    chat = log[0]["body"]
    assert chat["logprobs"] is True and chat["return_prompt_token_ids"] is True and chat["return_token_ids"] is True
    assert "return_tokens_as_token_ids" not in chat  # vLLM only
    assert [entry["path"] for entry in log[1:]] == ["/tokenize", "/tokenize", "/tokenize", "/v1/chat/completions"]
    second_chat = log[4]["body"]
    assert second_chat["input_ids"] == second["output"][-1]["prompt_token_ids"]
    assert second_chat["messages"][-1]["role"] == "tool"  # SGLang still reads messages for stop tokens
    assert extends(first, second)
    # SGLang reports the weights version in meta_info: it lands on every generated item.
    assert {item["model_version"] for item in first["output"] + second["output"]} == {"step-7"}


def test_token_triple_from_sglang_shape() -> None:
    chat = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                         "prompt_token_ids": [1, 2], "token_ids": [7, 8],
                         "logprobs": {"content": [{"token": "h", "bytes": [104], "logprob": -0.5, "top_logprobs": []},
                                                  {"token": "i", "bytes": [105], "logprob": -0.25, "top_logprobs": []}]}}]}
    assert token_triple(chat) == {"prompt_token_ids": [1, 2], "generation_token_ids": [7, 8],
                                  "generation_log_probs": [-0.5, -0.25]}
    # Token text without ids (SGLang without return_token_ids): no exact record.
    del chat["choices"][0]["token_ids"]
    assert token_triple(chat) is None


# --- OpenAI ----------------------------------------------------------------------------------------


def test_openai_backend_gets_none_of_the_extra_fields() -> None:
    system = "Think first. You are a weather assistant."
    with model_on(backend="openai") as (client, root):
        first, second, _ = two_turns(client, system=system)
        log = backend_log(root)
    assert [entry["path"] for entry in log] == ["/v1/chat/completions", "/v1/chat/completions"]
    for entry in log:
        body = entry["body"]
        assert not {"logprobs", "return_token_ids", "return_tokens_as_token_ids", "return_prompt_token_ids",
                    "input_ids", "return_meta_info", "max_tokens"} & set(body)
        assert all("reasoning_content" not in message and "reasoning" not in message for message in body["messages"])
    for item in first["output"] + second["output"]:
        assert not set(TOKEN_KEYS) & set(item)


# --- reasoning -------------------------------------------------------------------------------------


def test_reasoning_round_trip() -> None:
    system = "Think first. You are a weather assistant."
    with model_on() as (client, root):
        first, second, _ = two_turns(client, system=system)
        log = backend_log(root)
    reasoning, call = first["output"]
    assert reasoning["type"] == "reasoning"
    thought = reasoning["summary"][0]["text"]
    assert thought == "The user needs an answer; let me work it out."
    # The thought is part of the generated tokens...
    assert decode(call["generation_token_ids"]).startswith(f"<think>{thought}</think><tool_call>")
    # ...goes back in the assistant message as reasoning_content (vLLM renames it to `reasoning`)...
    head = next(e["body"] for e in log if e["path"] == "/tokenize" and not e["body"]["add_generation_prompt"])
    assert head["messages"][-1]["reasoning_content"] == thought
    # ...and the next turn's <think> block, parsed from the raw completion text, is a reasoning item.
    assert [item["type"] for item in second["output"]] == ["reasoning", "message"]
    assert second["output"][0]["summary"][0]["text"] == "The tool answered; now I can reply."
    assert second["output"][1]["content"][0]["text"] == "The weather in Oslo: Oslo: snowy, -3 C"
    assert extends(first, second)


@pytest.mark.parametrize(("field", "check"), [
    ("reasoning", lambda m, t: m["reasoning"] == t and "reasoning_content" not in m),
    ("think_tags", lambda m, t: m["content"].startswith(f"<think>{t}</think>") and "reasoning_content" not in m),
    ("drop", lambda m, t: "reasoning_content" not in m and "reasoning" not in m),
])
def test_reasoning_field_options(field: str, check: Any) -> None:
    system = "Think first. You are a weather assistant."
    with model_on(reasoning_field=field, token_prompts=False) as (client, root):
        first, _, _ = two_turns(client, system=system)
        chat = backend_log(root)[1]["body"]
    assistant = next(m for m in chat["messages"] if m["role"] == "assistant")
    assert check(assistant, first["output"][0]["summary"][0]["text"])


# --- context length --------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", ["vllm", "sglang"])
def test_context_length_error_is_an_incomplete_response(shape: str) -> None:
    with model_on("--shape", shape, "--max-model-len", "400", backend=shape) as (client, _):
        reply = client.post("/v1/responses", json={"input": "x" * 500})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        ModelResponse.model_validate(body)
        assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
        assert body["output"] == []
        # The token-id path too: a second turn whose prompt outgrows the context.
        first = respond(client, {"input": weather(), "tools": [TOOL]})
        second_input = weather() + first["output"] + [
            {"type": "function_call_output", "call_id": first["output"][-1]["call_id"], "output": "y" * 400}]
        second = respond(client, {"input": second_input, "tools": [TOOL]})
        assert second["status"] == "incomplete" and second["incomplete_details"] == {"reason": "max_output_tokens"}


# --- tokenizer routes, model version ---------------------------------------------------------------


def test_tokenize_and_detokenize_routes() -> None:
    with model_on("--drift") as (client, _):
        text = client.post("/tokenize", json={"text": "the weather"}).json()
        assert decode(text["tokens"]) == "the weather" and text["count"] == len("the weather")
        conversation = client.post("/tokenize", json={
            "input": weather() + [{"type": "message", "role": "assistant", "content": "the answer"}],
            "tools": [TOOL], "add_generation_prompt": False}).json()["tokens"]
        pieces = client.post("/detokenize", json={"tokens": conversation[-18:], "pieces": True}).json()
        assert pieces["text"] == "the answer<|im_end|>\n"
        assert "th" in pieces["pieces"] and "an" in pieces["pieces"]  # the drifting tokenizer merged pairs
        assert client.post("/detokenize", json={"tokens": "abc"}).json()["error"]["field"] == "tokens"


def test_configured_model_version_on_every_generated_item() -> None:
    with model_on(model_version="policy-v3") as (client, _):
        first, second, _ = two_turns(client)
    assert all(item["model_version"] == "policy-v3" for item in first["output"] + second["output"])


# --- parsers ---------------------------------------------------------------------------------------


def test_hermes_parser() -> None:
    text = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    content, calls = hermes_tool_parser(text)
    assert content == "Sure."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [("get_weather", {"city": "Paris"})]
    # The compact NAME\n{json} form keeps the arguments byte for byte; an unclosed last call counts.
    content, calls = hermes_tool_parser('<tool_call>get_weather\n{"city":"Rome"}</tool_call><tool_call>{"name": "f", "arguments": {}}')
    assert content == "" and [c["function"]["arguments"] for c in calls] == ['{"city":"Rome"}', "{}"]
    # Something that is not a call stays in the content for the agent to see.
    assert hermes_tool_parser("<tool_call>oops</tool_call>") == ("<tool_call>oops</tool_call>", [])


def test_think_parser() -> None:
    assert think_reasoning_parser("<think> plan </think>answer") == ("plan", "answer")
    assert think_reasoning_parser("plan</think>\n\nanswer") == ("plan", "answer")  # opened by the template
    assert think_reasoning_parser("<think>cut off") == ("cut off", "")
    assert think_reasoning_parser("plain") == (None, "plain")


def test_parsers_are_pluggable_and_checked() -> None:
    config = ChatCompletionsConfig(base_url="http://127.0.0.1:1/v1", model="m",
                                   tool_parser="models.chat_completions.parsers:no_tool_parser")
    assert config.tool_parser.endswith(":no_tool_parser")
    with pytest.raises(ValidationError, match="unknown parser"):
        ChatCompletionsConfig(base_url="http://127.0.0.1:1/v1", model="m", tool_parser="no_such_format")
    with pytest.raises(ValidationError, match="base_url"):
        ChatCompletionsConfig(base_url=[], model="m")
