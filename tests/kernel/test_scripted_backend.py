"""Tests for the scripted backend (rollgym.testing.scripted_vllm, entry point scripts/scripted_backend.py), run as a
real subprocess on a free port."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import orjson
import pytest
from openai.types.chat import ChatCompletion

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "scripted_backend.py"

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
LOOKUP_TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}


def _start_backend(tmp_dir: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    """Start the backend with --port 0 and wait for its port file -> (process, base URL)."""
    port_file = tmp_dir / "port"
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--host", "127.0.0.1", "--port", "0", "--port-file", str(port_file), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 20
        while not port_file.exists():
            if proc.poll() is not None:
                raise RuntimeError(f"backend exited early: {proc.stderr.read().decode()}")
            if time.monotonic() > deadline:
                raise TimeoutError("backend did not write its port file")
            time.sleep(0.02)
        port = int(port_file.read_text().strip())
        line = proc.stdout.readline().decode().strip()
        assert line == f"scripted backend listening on http://127.0.0.1:{port}"
    except BaseException:
        _stop(proc)
        raise
    return proc, f"http://127.0.0.1:{port}"


def _stop(proc: subprocess.Popen) -> None:
    """Terminate the backend, killing it if it does not exit promptly."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


@pytest.fixture(scope="module")
def backend(tmp_path_factory) -> Iterator[str]:
    proc, url = _start_backend(tmp_path_factory.mktemp("backend"))
    try:
        yield url
    finally:
        _stop(proc)


@pytest.fixture(scope="module")
def token_backend(tmp_path_factory) -> Iterator[str]:
    proc, url = _start_backend(tmp_path_factory.mktemp("token_backend"), "--token-info", "--seed", "7")
    try:
        yield url
    finally:
        _stop(proc)


@pytest.fixture
def failing_backend(tmp_path) -> Iterator[str]:
    proc, url = _start_backend(tmp_path, "--fail-rate", "1.0")
    try:
        yield url
    finally:
        _stop(proc)


@pytest.fixture
def hanging_backend(tmp_path) -> Iterator[str]:
    proc, url = _start_backend(tmp_path, "--hang-rate", "1.0")
    try:
        yield url
    finally:
        _stop(proc)


async def _post(url: str, body: dict | bytes) -> tuple[int, dict]:
    """POST a chat completion request -> (status, parsed JSON body)."""
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    async with aiohttp.ClientSession() as session:
        async with session.post(
            f"{url}/v1/chat/completions", data=data, headers={"Content-Type": "application/json"}
        ) as resp:
            return resp.status, orjson.loads(await resp.read())


def _decode(ids: list[int]) -> str:
    """Toy token ids -> text (id = UTF-8 byte + 3)."""
    return bytes(i - 3 for i in ids).decode()


@pytest.mark.asyncio
async def test_health_and_models(backend):
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{backend}/health") as resp:
            assert resp.status == 200
            assert await resp.read() == b""  # as vLLM answers
        async with session.get(f"{backend}/v1/models") as resp:
            body = await resp.json()
    [card] = body["data"]
    assert body["object"] == "list" and card["id"] == card["root"] == "scripted" and card["parent"] is None
    assert card["owned_by"] == "vllm" and card["object"] == "model" and card["permission"][0]["allow_sampling"]


@pytest.mark.asyncio
async def test_weather_tool_call_turn(backend):
    status, body = await _post(
        backend,
        {"model": "policy", "messages": [{"role": "user", "content": "What's the weather in New York?"}], "tools": [WEATHER_TOOL]},
    )
    assert status == 200
    ChatCompletion.model_validate(body)
    assert re.fullmatch(r"chatcmpl-[0-9a-f]+", body["id"])
    assert body["object"] == "chat.completion"
    assert body["model"] == "policy"
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["index"] == 0
    assert choice["logprobs"] is None
    assert choice["message"]["content"] is None
    assert choice["message"]["reasoning"] is None
    [call] = choice["message"]["tool_calls"]
    assert re.fullmatch(r"call_[0-9a-f]+", call["id"])
    assert call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    assert orjson.loads(call["function"]["arguments"]) == {"city": "New York"}
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert body["prompt_token_ids"] is None


@pytest.mark.asyncio
async def test_city_fallback_is_paris(backend):
    _, body = await _post(backend, {"messages": [{"role": "user", "content": "Hi there"}], "tools": [WEATHER_TOOL]})
    args = body["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
    assert orjson.loads(args) == {"city": "Paris"}
    assert body["model"] == "scripted"


@pytest.mark.asyncio
async def test_tool_result_turn(backend):
    messages = [
        {"role": "user", "content": "weather for Rio de Janeiro, please"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rio de Janeiro"}'}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "30C, sunny"},
    ]
    status, body = await _post(backend, {"messages": messages, "tools": [WEATHER_TOOL]})
    assert status == 200
    choice = body["choices"][0]
    assert choice["message"]["content"] == "The weather in Rio de Janeiro: 30C, sunny"
    assert "tool_calls" not in choice["message"]  # vLLM leaves the key out when there is no call
    assert choice["finish_reason"] == "stop"


@pytest.mark.asyncio
async def test_forced_tool_choice(backend):
    _, body = await _post(
        backend,
        {
            "messages": [{"role": "user", "content": "Reverse this text: abc"}],
            "tools": [LOOKUP_TOOL, WEATHER_TOOL],
            "tool_choice": {"type": "function", "function": {"name": "lookup"}},
        },
    )
    [call] = body["choices"][0]["message"]["tool_calls"]
    assert call["function"] == {"name": "lookup", "arguments": "{}"}
    assert body["choices"][0]["finish_reason"] == "tool_calls"

    # forced even when the last message is a tool result
    _, body = await _post(
        backend,
        {
            "messages": [
                {"role": "user", "content": "weather in Oslo"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "c", "content": "cold"},
            ],
            "tools": [WEATHER_TOOL],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        },
    )
    call = body["choices"][0]["message"]["tool_calls"][0]
    assert call["function"]["name"] == "get_weather"
    assert orjson.loads(call["function"]["arguments"]) == {"city": "Oslo"}


@pytest.mark.asyncio
async def test_tool_choice_none_does_not_call(backend):
    _, body = await _post(
        backend,
        {"messages": [{"role": "user", "content": "weather in Oslo?"}], "tools": [WEATHER_TOOL], "tool_choice": "none"},
    )
    assert body["choices"][0]["message"]["content"] == "You said: weather in Oslo?"
    assert "tool_calls" not in body["choices"][0]["message"]


@pytest.mark.asyncio
async def test_reverse_and_echo(backend):
    _, body = await _post(backend, {"messages": [{"role": "user", "content": "Reverse this text: hello world"}]})
    assert body["choices"][0]["message"]["content"] == "dlrow olleh"
    _, body = await _post(
        backend,
        {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text", "text": "ping"}]}]},
    )
    assert body["choices"][0]["message"]["content"] == "You said: ping"
    assert body["choices"][0]["finish_reason"] == "stop"


@pytest.mark.asyncio
async def test_max_tokens_truncation(backend):
    _, body = await _post(backend, {"messages": [{"role": "user", "content": "one two three four"}], "max_tokens": 3})
    choice = body["choices"][0]
    assert choice["message"]["content"] == "You said: one"
    assert choice["finish_reason"] == "length"
    _, body = await _post(backend, {"messages": [{"role": "user", "content": "one"}], "max_tokens": 3})
    assert body["choices"][0]["message"]["content"] == "You said: one"
    assert body["choices"][0]["finish_reason"] == "stop"


@pytest.mark.asyncio
async def test_token_info_shape_on_request(backend):
    request = {"messages": [{"role": "user", "content": "Reverse this text: héllo"}], "logprobs": True}
    _, body = await _post(backend, request)
    ChatCompletion.model_validate(body)
    choice = body["choices"][0]
    assert choice["message"]["content"] == "olléh"
    prompt_ids, gen_ids = body["prompt_token_ids"], choice["token_ids"]
    assert _decode(prompt_ids) == "<|im_start|>user\nReverse this text: héllo<|im_end|>\n<|im_start|>assistant\n"
    assert _decode(gen_ids) == "olléh"
    assert body["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": len(gen_ids),
        "total_tokens": len(prompt_ids) + len(gen_ids),
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }
    entries = choice["logprobs"]["content"]
    assert len(entries) == len(gen_ids)
    for tid, entry in zip(gen_ids, entries):
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["token"] == f"token_id:{tid}"
        assert entry["bytes"] == [tid - 3]
        assert entry["top_logprobs"] == []
        assert -5.0 <= entry["logprob"] < 0
    # deterministic: same request, same logprobs
    _, again = await _post(backend, request)
    assert again["choices"][0]["logprobs"] == choice["logprobs"]


@pytest.mark.asyncio
async def test_token_info_flag_and_multi_turn_prefix(token_backend):
    messages = [{"role": "user", "content": "What is the weather in Lima?"}]
    _, first = await _post(token_backend, {"messages": messages, "tools": [WEATHER_TOOL]})
    choice = first["choices"][0]
    assert first["prompt_token_ids"] and choice["token_ids"]  # no logprobs flag needed with --token-info
    assert len(choice["logprobs"]["content"]) == len(choice["token_ids"])
    call = choice["message"]["tool_calls"][0]
    assert _decode(choice["token_ids"]) == f"<tool_call>get_weather\n{call['function']['arguments']}</tool_call>"

    messages += [
        {"role": "assistant", "content": None, "tool_calls": choice["message"]["tool_calls"]},
        {"role": "tool", "tool_call_id": call["id"], "content": "18C"},
    ]
    _, second = await _post(token_backend, {"messages": messages, "tools": [WEATHER_TOOL]})
    assert second["choices"][0]["message"]["content"] == "The weather in Lima: 18C"
    # the next prompt extends the previous prompt + generation, like a real chat template
    prefix = first["prompt_token_ids"] + choice["token_ids"]
    assert second["prompt_token_ids"][: len(prefix)] == prefix


@pytest.mark.asyncio
async def test_fail_rate_one_gives_errors(failing_backend):
    seen = set()
    for _ in range(30):
        status, body = await _post(failing_backend, {"messages": [{"role": "user", "content": "x"}]})
        assert status in (500, 503, 429)
        assert body["error"]["code"] == status
        assert body["error"]["message"]
        seen.add(status)
    assert seen == {500, 503, 429}


@pytest.mark.asyncio
async def test_hang_rate_one_needs_client_timeout(hanging_backend):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.3)) as session:
        with pytest.raises(asyncio.TimeoutError):
            async with session.post(f"{hanging_backend}/v1/chat/completions", json={"messages": []}) as resp:
                await resp.read()
        async with session.get(f"{hanging_backend}/health") as resp:
            assert resp.status == 200


@pytest.mark.asyncio
async def test_malformed_json_is_400(backend):
    status, body = await _post(backend, b"{not json")
    assert status == 400
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"]
    status, body = await _post(backend, {"no": "messages"})
    assert status == 400
    assert body["error"]["type"] == "invalid_request_error"


@pytest.mark.asyncio
async def test_build_app_in_process():
    from aiohttp.test_utils import TestClient, TestServer

    from rollgym.testing import scripted_vllm

    async with TestClient(TestServer(scripted_vllm.build_app(token_info=True))) as client:
        resp = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hey"}]})
        body = await resp.json()
    assert body["choices"][0]["message"]["content"] == "You said: hey"
    assert _decode(body["choices"][0]["token_ids"]) == "You said: hey"
