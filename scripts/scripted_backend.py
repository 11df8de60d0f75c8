"""Scripted OpenAI-compatible Chat Completions backend: a stand-in for vLLM in tests and benchmarks.

Run: ``python scripts/scripted_backend.py --host 127.0.0.1 --port 0 --port-file PATH
[--latency-ms 0] [--fail-rate 0.0] [--hang-rate 0.0] [--seed 0] [--token-info]``.
With ``--port 0`` a free port is bound and written to ``--port-file`` once listening.
In-process use: ``build_app(...)`` returns the aiohttp application.

Routes: ``GET /health``, ``GET /v1/models``, ``POST /v1/chat/completions``.

Script for ``/v1/chat/completions`` (first match wins):
1. ``tool_choice`` forcing ``{"type":"function","function":{"name":N}}`` -> a call to N
   (``{"city": CITY}`` for get_weather, else ``{}``). ``"required"`` calls get_weather if
   offered, else the first tool.
2. Tools offered incl. ``get_weather``, last message from the user, tool_choice not "none"
   -> a get_weather call with ``{"city": CITY}`` (CITY parsed from "weather in/for X", default Paris).
3. Last message is a tool result -> ``The weather in {city}: {tool content}``.
4. Last user message contains ``Reverse this text:`` -> the text after it, reversed.
5. Otherwise ``You said: {last user content}``.
``max_tokens`` (or ``max_completion_tokens``) cuts the reply text to that many
whitespace-separated words with ``finish_reason: "length"``.

Token info (``--token-info``, or a request with ``"logprobs": true`` or
``"return_token_ids": true``) mimics vLLM's OpenAI server (>= 0.10) shapes:
- top-level ``prompt_token_ids: [int]`` (vLLM: request ``return_token_ids: true``),
- ``choices[0].token_ids: [int]`` (the generated ids),
- ``choices[0].logprobs = {"content": [{"token": "token_id:<id>", "logprob": <float < 0>,
  "bytes": [...], "top_logprobs": []}, ...]}`` (vLLM: ``return_tokens_as_token_ids: true``).
Without token info these fields are null, as in vLLM.

Toy tokenizer: every UTF-8 byte b of the text is token id ``b + 3`` (decode:
``bytes(i - 3 for i in ids)``). The prompt text is a chatml-like rendering:
``<|im_start|>tools\\n{tools json}<|im_end|>\\n`` (if tools), then per message
``<|im_start|>{role}\\n{body}<|im_end|>\\n``, then ``<|im_start|>assistant\\n``. An assistant
body is its content followed by ``<tool_call>{name}\\n{arguments}</tool_call>`` per tool call;
the generated ids are exactly the body of the reply, so a follow-up turn's prompt ids
extend the previous prompt ids + generated ids. ``usage`` counts these toy tokens (so
``completion_tokens`` can exceed ``max_tokens``, which counts words).
Logprobs are deterministic negative floats computed from (seed, position, token id).

Failure injection uses ``random.Random(seed)``: with probability ``--fail-rate`` a request
gets 500, 503 or 429 with a JSON error body; with probability ``--hang-rate`` it sleeps
3600 s (the caller's timeout must fire).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import secrets
import signal
import sys
import time
from typing import Any

import orjson
from aiohttp import web

_CITY_RE = re.compile(r"(?i)weather (?:in|for) ([A-Za-z][A-Za-z .'-]*?)(?:[?.!,]|$)")
_REVERSE_MARKER = "Reverse this text:"
_DEFAULT_CITY = "Paris"
_FAILURE_STATUSES = (500, 503, 429)
_FAILURE_TYPES = {500: "server_error", 503: "service_unavailable", 429: "rate_limit_error"}
_HANG_SECONDS = 3600.0
_JSON = "application/json"

_HEALTH_BODY = orjson.dumps({"status": "ok"})
_MODELS_BODY = orjson.dumps(
    {"object": "list", "data": [{"id": "scripted", "object": "model", "owned_by": "rollgym"}]}
)

# App keys (aiohttp warns on plain string keys).
_CONFIG = web.AppKey("scripted_config", dict)
_RNG = web.AppKey("scripted_rng", random.Random)


def _json_response(payload: Any, status: int = 200) -> web.Response:
    """Payload -> orjson-encoded JSON response."""
    return web.Response(body=orjson.dumps(payload), status=status, content_type=_JSON)


def _error(status: int, message: str, err_type: str) -> web.Response:
    """OpenAI-style error body with the given HTTP status."""
    return _json_response({"error": {"message": message, "type": err_type, "param": None, "code": status}}, status)


def _text_of(content: Any) -> str:
    """Chat message content (str, list of text parts or None) -> string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text") or "" for p in content if isinstance(p, dict))
    return str(content)


def _city_from(text: str) -> str:
    """User text -> city named after 'weather in/for', else the default city."""
    match = _CITY_RE.search(text)
    return match.group(1).strip() if match else _DEFAULT_CITY


def _assistant_body(content: str | None, tool_calls: list[dict[str, Any]] | None) -> str:
    """Assistant turn -> the text the toy model 'generates' for it (content + tool calls)."""
    body = content or ""
    for tc in tool_calls or ():
        fn = tc.get("function") or {}
        args = fn.get("arguments")
        if not isinstance(args, str):
            args = orjson.dumps(args).decode() if args is not None else "{}"
        body += f"<tool_call>{fn.get('name', '')}\n{args}</tool_call>"
    return body


def render_prompt(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    """Chat messages + tools -> chatml-like prompt text ending with the assistant header."""
    parts: list[str] = []
    if tools:
        parts.append(f"<|im_start|>tools\n{orjson.dumps(tools).decode()}<|im_end|>\n")
    for msg in messages:
        role = msg.get("role", "user")
        if role == "assistant":
            body = _assistant_body(_text_of(msg.get("content")), msg.get("tool_calls"))
        else:
            body = _text_of(msg.get("content"))
        parts.append(f"<|im_start|>{role}\n{body}<|im_end|>\n")
    parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def tokenize(text: str) -> list[int]:
    """Text -> toy token ids (UTF-8 byte + 3)."""
    return [b + 3 for b in text.encode()]


def _logprob(seed: int, position: int, token_id: int) -> float:
    """Deterministic toy logprob in [-5.0, -0.0005] from seed, position and token id."""
    h = (token_id * 2654435761 + position * 40503 + seed * 97 + 12345) % 10000
    return -(h + 1) / 2000.0


def _tool_names(tools: list[dict[str, Any]]) -> list[str]:
    """Chat tools -> offered function names."""
    names = []
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and fn.get("name"):
            names.append(fn["name"])
    return names


def _tool_call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """Function name + arguments -> chat tool call dict."""
    return {
        "id": f"call_{secrets.token_hex(12)}",
        "type": "function",
        "function": {"name": name, "arguments": orjson.dumps(arguments).decode()},
    }


def _city_for_tool_result(messages: list[dict[str, Any]]) -> str:
    """Messages ending with a tool message -> city from the matching assistant tool call."""
    call_id = messages[-1].get("tool_call_id")
    fallback: str | None = None
    for msg in reversed(messages[:-1]):
        if msg.get("role") != "assistant" or not msg.get("tool_calls"):
            continue
        for tc in msg["tool_calls"]:
            try:
                args = orjson.loads((tc.get("function") or {}).get("arguments") or "{}")
            except orjson.JSONDecodeError:
                continue
            city = args.get("city") if isinstance(args, dict) else None
            if not city:
                continue
            if tc.get("id") == call_id:
                return str(city)
            fallback = fallback or str(city)
        if fallback:
            return fallback
    return fallback or _DEFAULT_CITY


def script_reply(req: dict[str, Any]) -> tuple[str | None, list[dict[str, Any]], str]:
    """Chat request dict -> (content, tool_calls, finish_reason) according to the script."""
    messages: list[dict[str, Any]] = req.get("messages") or []
    tools = req.get("tools") or []
    names = _tool_names(tools)
    last = messages[-1] if messages else {}
    last_user = ""
    for msg in reversed(messages):
        if msg.get("role") == "user":
            last_user = _text_of(msg.get("content"))
            break

    tool_choice = req.get("tool_choice")
    forced: str | None = None
    if isinstance(tool_choice, dict):
        forced = (tool_choice.get("function") or {}).get("name") or tool_choice.get("name")
    elif tool_choice == "required" and names:
        forced = "get_weather" if "get_weather" in names else names[0]
    if forced:
        args = {"city": _city_from(last_user)} if forced == "get_weather" else {}
        return None, [_tool_call(forced, args)], "tool_calls"

    if tool_choice != "none" and "get_weather" in names and last.get("role") == "user":
        return None, [_tool_call("get_weather", {"city": _city_from(last_user)})], "tool_calls"

    if last.get("role") == "tool":
        text = f"The weather in {_city_for_tool_result(messages)}: {_text_of(last.get('content'))}"
    elif (idx := last_user.find(_REVERSE_MARKER)) != -1:
        text = last_user[idx + len(_REVERSE_MARKER) :].strip()[::-1]
    else:
        text = f"You said: {last_user}"

    finish = "stop"
    max_tokens = req.get("max_tokens")
    if max_tokens is None:
        max_tokens = req.get("max_completion_tokens")
    if isinstance(max_tokens, int):
        words = text.split()
        if len(words) > max_tokens:
            text = " ".join(words[: max(max_tokens, 0)])
            finish = "length"
    return text, [], finish


def build_completion(req: dict[str, Any], *, token_info: bool, seed: int) -> dict[str, Any]:
    """Chat request dict -> vLLM-shaped ChatCompletion dict."""
    content, tool_calls, finish = script_reply(req)
    prompt_bytes = render_prompt(req.get("messages") or [], req.get("tools")).encode()
    gen_bytes = _assistant_body(content, tool_calls).encode()
    n_prompt, n_gen = len(prompt_bytes), len(gen_bytes)  # one toy token per byte

    want_tokens = token_info or bool(req.get("logprobs")) or bool(req.get("return_token_ids"))
    prompt_ids: list[int] | None = None
    gen_ids: list[int] | None = None
    logprobs = None
    if want_tokens:
        prompt_ids = [b + 3 for b in prompt_bytes]
        gen_ids = [b + 3 for b in gen_bytes]
        logprobs = {
            "content": [
                {
                    "token": f"token_id:{tid}",
                    "logprob": _logprob(seed, pos, tid),
                    "bytes": [tid - 3],
                    "top_logprobs": [],
                }
                for pos, tid in enumerate(gen_ids)
            ]
        }

    return {
        "id": f"chatcmpl-{secrets.token_hex(16)}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": req.get("model") or "scripted",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": content,
                    "tool_calls": tool_calls,
                    "reasoning_content": None,
                },
                "logprobs": logprobs,
                "finish_reason": finish,
                "stop_reason": None,
                "token_ids": gen_ids,
            }
        ],
        "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen},
        "prompt_token_ids": prompt_ids,
        "prompt_logprobs": None,
        "system_fingerprint": None,
    }


async def _health(_: web.Request) -> web.Response:
    return web.Response(body=_HEALTH_BODY, content_type=_JSON)


async def _models(_: web.Request) -> web.Response:
    return web.Response(body=_MODELS_BODY, content_type=_JSON)


async def _chat_completions(request: web.Request) -> web.Response:
    """POST /v1/chat/completions: latency, failure injection, then the scripted reply."""
    app = request.app
    cfg = app[_CONFIG]
    rng = app[_RNG]
    try:
        req = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        return _error(400, f"malformed JSON body: {exc}", "invalid_request_error")
    if not isinstance(req, dict) or not isinstance(req.get("messages"), list):
        return _error(400, "body must be a JSON object with a 'messages' list", "invalid_request_error")

    if cfg["latency_s"] > 0:
        await asyncio.sleep(cfg["latency_s"])
    # Draw both numbers every time so the failure pattern depends only on seed and request order.
    fail_draw, hang_draw = rng.random(), rng.random()
    if fail_draw < cfg["fail_rate"]:
        status = rng.choice(_FAILURE_STATUSES)
        return _error(status, f"scripted failure ({status})", _FAILURE_TYPES[status])
    if hang_draw < cfg["hang_rate"]:
        await asyncio.sleep(_HANG_SECONDS)

    return _json_response(build_completion(req, token_info=cfg["token_info"], seed=cfg["seed"]))


def build_app(
    latency_ms: float = 0.0,
    fail_rate: float = 0.0,
    hang_rate: float = 0.0,
    seed: int = 0,
    token_info: bool = False,
) -> web.Application:
    """Backend settings -> aiohttp Application serving the scripted routes."""
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[_CONFIG] = {
        "latency_s": latency_ms / 1000.0,
        "fail_rate": fail_rate,
        "hang_rate": hang_rate,
        "seed": seed,
        "token_info": token_info,
    }
    app[_RNG] = random.Random(seed)
    app.router.add_get("/health", _health)
    app.router.add_get("/v1/models", _models)
    app.router.add_post("/v1/chat/completions", _chat_completions)
    return app


def _write_port_file(path: str, port: int) -> None:
    """Write the port atomically so a poller never reads a partial file."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        fh.write(f"{port}\n")
    os.replace(tmp, path)


async def _serve(args: argparse.Namespace) -> None:
    """Start the server, announce the port, run until SIGINT/SIGTERM."""
    app = build_app(args.latency_ms, args.fail_rate, args.hang_rate, args.seed, args.token_info)
    # access_log=None: no per-request logging on a benchmark path; handler_cancellation
    # frees hung handlers once the client gives up.
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port, backlog=4096, shutdown_timeout=1.0)
    await site.start()
    port = runner.addresses[0][1]
    if args.port_file:
        _write_port_file(args.port_file, port)
    print(f"scripted backend listening on http://{args.host}:{port}", flush=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    """Parse CLI args and serve forever."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--port-file", default=None, help="file to write the bound port to once listening")
    parser.add_argument("--latency-ms", type=float, default=0.0)
    parser.add_argument("--fail-rate", type=float, default=0.0)
    parser.add_argument("--hang-rate", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--token-info", action="store_true", help="always return token ids and logprobs")
    args = parser.parse_args(argv)
    try:
        import uvloop
    except ImportError:
        asyncio.run(_serve(args))
    else:
        uvloop.run(_serve(args))


if __name__ == "__main__":
    sys.exit(main())
