"""Scripted OpenAI-compatible backend: a stand-in for vLLM (or SGLang) in tests and benchmarks.

Run: ``python -m rollgym.testing.scripted_vllm --host 127.0.0.1 --port 0 --port-file PATH
[--latency-ms 0] [--fail-rate 0.0] [--hang-rate 0.0] [--seed 0] [--token-info]
[--shape vllm|sglang] [--drift] [--template chatml|qwen3] [--max-model-len 0] [--weight-version V]``.
With ``--port 0`` a free port is bound and written to ``--port-file`` once listening.
In-process use: ``build_app(...)`` returns the aiohttp application.

Routes: ``GET /health``, ``GET /v1/models``, ``POST /v1/chat/completions``,
``POST /v1/completions`` (token-id or text prompts), ``POST /tokenize``, ``POST /detokenize``
(SGLang shape: also ``/v1/tokenize`` and ``/v1/detokenize``), and for tests
``GET /scripted/requests`` (the last 500 request bodies, with their paths) and
``POST /scripted/clear``.

Full weights, vLLM shape (its dev-mode routes, ``VLLM_SERVER_DEV_MODE=1``): ``POST /pause?mode=...``
(generations wait until ``POST /resume``; ``GET /is_paused``), ``POST /collective_rpc {"method":
"reload_weights", "kwargs": {"weights_path": DIR, "is_checkpoint_format": true}}`` (a folder without
``*.safetensors`` is 500; ``--fail-reloads N``: the first N reloads fail with 500, a worker that died;
``--reload-latency-ms``: how long one takes),
``POST /update_weight_version {"new_version"}`` and ``GET /weight_info``, answered as vLLM 0.32 answers them.
SGLang shape: ``POST /update_weights_from_disk`` and ``GET /get_model_info`` (its ``weight_version``).

LoRA adapters, as vLLM (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``) and SGLang load them at run time:
vLLM shape ``POST /v1/load_lora_adapter`` ``{lora_name, lora_path, load_inplace}`` (200 with a
sentence; 400 when the name is taken without ``load_inplace``; 404 when the path does not exist) and
``/v1/unload_lora_adapter`` (404 for an unknown name); SGLang shape ``POST /load_lora_adapter`` and
``/unload_lora_adapter`` answering ``{success, error_message, loaded_adapters}``. ``GET /v1/models``
lists them. A request selects one with ``model: NAME`` (vLLM) or ``model: BASE:NAME`` (SGLang); the
toy model then answers ``[NAME] `` before its scripted text (tool calls are unchanged) and its
logprobs are drawn with another seed, so a test can see which weights answered.

Script for ``/v1/chat/completions`` (first match wins):
1. ``tool_choice`` forcing ``{"type":"function","function":{"name":N}}`` -> a call to N
   (``{"city": CITY}`` for get_weather, else ``{}``). ``"required"`` calls get_weather if
   offered, else the first tool.
2. Tools offered incl. ``get_weather``, last message from the user, tool_choice not "none"
   -> a get_weather call with ``{"city": CITY}`` (CITY parsed from "weather in/for X", default Paris).
3. Last message is a tool result -> ``The weather in {city}: {tool content}``.
4. Last user message contains ``Reverse this text:`` -> the text after it, reversed.
5. Otherwise ``You said: {last user content}``.
When the last user message contains ``malformed tool call``, the calls of rules 1 and 2 come out as text
no parser can read (``<tool_call>NAME\n{ARGS`` with the arguments' closing brace missing, then
``</tool_call>``): the chat answer has them in ``content`` with no ``tool_calls`` and ``finish_reason:
"stop"``, as vLLM answers when its tool parser fails; a completion's text is the same.
``max_tokens`` (or ``max_completion_tokens``) cuts the reply text to that many
whitespace-separated words with ``finish_reason: "length"``.
When a system or user message contains ``Think first`` the toy model also "reasons": it
generates ``<think>{THOUGHT}</think>`` before its reply; the chat answer carries the thought in
``message.reasoning`` (vLLM shape: vLLM >= 0.11 names it ``reasoning``, earlier versions
``reasoning_content``) or ``message.reasoning_content`` (SGLang shape).

The vLLM shape is vLLM 0.32's, key for key (tests/e2e/test_real_vllm.py compares them with a real server's):
the fields that carry no data here are there with vLLM's values (``refusal``, ``routed_experts``,
``kv_transfer_params``, ... null; ``tool_calls`` only when there are calls), ``/health`` is an empty 200.

Token info (``--token-info``, or a request with ``"logprobs": true`` or
``"return_token_ids": true``) mimics vLLM's OpenAI server (>= 0.10.2) shapes:
- top-level ``prompt_token_ids: [int]`` (vLLM: request ``return_token_ids: true``),
- ``choices[0].token_ids: [int]`` (the generated ids),
- ``choices[0].logprobs = {"content": [{"token": "token_id:<id>", "logprob": <float < 0>,
  "bytes": [...], "top_logprobs": []}, ...]}`` (vLLM: ``return_tokens_as_token_ids: true``).
Without token info these fields are null, as in vLLM.
With ``--shape sglang`` the chat answer follows SGLang's OpenAI server instead
(python/sglang/srt/entrypoints/openai/protocol.py): ``choices[0].prompt_token_ids`` when asked
with ``return_prompt_token_ids``, ``choices[0].token_ids`` with ``return_token_ids``, logprob
entries carry the token text (SGLang has no ``return_tokens_as_token_ids``), a request may carry
``input_ids`` (the prompt as token ids; the messages are then only used for the script), and
``return_meta_info: true`` adds ``choices[0].meta_info`` (with ``weight_version`` when
``--weight-version`` is set).

``/v1/completions`` follows vLLM's CompletionResponse: ``prompt`` may be a list of token ids;
with ``return_token_ids`` the choice carries ``prompt_token_ids`` and ``token_ids``; with
``logprobs: N`` it carries ``logprobs = {text_offset, token_logprobs, tokens, top_logprobs}``
(``tokens`` as ``token_id:<id>`` with ``return_tokens_as_token_ids``). The prompt text is parsed
back into chat messages (the rendering below) to run the same script; the text is the raw
generation (``<tool_call>...</tool_call>``, ``<think>...</think>`` included), since a
completions endpoint parses nothing.
``/tokenize`` takes ``{"prompt": text}`` or ``{"messages", "tools", "add_generation_prompt"
(default true), "continue_final_message"}`` and answers vLLM's ``{"count", "max_model_len",
"tokens", "token_strs"}`` (SGLang: ``{"tokens", "count", "max_model_len"}``, and like SGLang it
always adds the generation prompt unless ``continue_final_message``); ``/detokenize`` takes
``{"tokens"}`` and answers ``{"prompt": text}`` (SGLang: ``{"text": text}``).
With ``--shape sglang``, SGLang's native ``/generate`` takes ``input_ids``, ``sampling_params``
(``max_new_tokens``), ``return_logprob`` and ``logprob_start_len``, and answers ``{text, output_ids,
meta_info: {input_token_logprobs, output_token_logprobs, ...}}``: one ``[logprob, token_id, None]`` per
input position from ``logprob_start_len`` (None at position 0, which has no context), as SGLang does.
``--no-token-routes`` leaves out ``/v1/completions``, ``/generate``, ``/tokenize`` and ``/detokenize``,
like a plain OpenAI-compatible server.

Toy tokenizer: every UTF-8 byte b of the text is token id ``b + 3`` (decode:
``bytes(i - 3 for i in ids)``). The prompt text is a chatml-like rendering:
``<|im_start|>tools\\n{tools json}<|im_end|>\\n`` (if tools), then per message
``<|im_start|>{role}\\n{body}<|im_end|>\\n``, then ``<|im_start|>assistant\\n``. An assistant
body is ``<think>{reasoning}</think>`` (if any), its content, then
``<tool_call>{name}\\n{arguments}</tool_call>`` per tool call;
the generated ids are exactly the body of the reply, so a follow-up turn's prompt ids
extend the previous prompt ids + generated ids. ``usage`` counts these toy tokens (so
``completion_tokens`` can exceed ``max_tokens``, which counts words).
``--drift`` makes the tokenizer drift like real BPE re-tokenization: when an assistant message is
rendered from messages (chat prompts, ``/tokenize``), the byte pairs in ``MERGES`` of its body
become single tokens (ids ``MERGE_BASE + k``), while generation stays byte-level, so a chat prompt
no longer extends the previous turn's tokens. Raw text (``/tokenize`` with ``prompt``, generated
text) is never merged.
``--template qwen3`` renders like Qwen3's chat template (and DeepSeek-R1's): an assistant message's
``<think>`` block is kept only after the last user message, so each new user turn drops the earlier
reasoning and the prompt no longer extends the tokens the model sampled before it (a rollout then has
one token sequence per user turn); within a turn (tool calls and results) the reasoning stays.
Logprobs are deterministic negative floats computed from (seed, position, token id).
``--max-model-len N``: a prompt whose tokens plus ``max_tokens`` exceed N gets HTTP 400 with the
backend's context-length message.

In-flight weight updates on those routes: while paused, a generation waits for ``/resume``; ``mode=abort``
ends every ``/v1/completions`` generation still in its latency at once with ``finish_reason: "abort"`` and the
share of its tokens that the elapsed share of the latency covers (0 included; ``&scripted_keep=N``: N of
them), as vLLM answers it, and ``mode=wait`` waits for them. A request whose prompt is an aborted one's
prompt + those tokens gets the rest of that generation (token-exact), and after ``/update_weight_version``
the logprobs are drawn as from other weights. ``GET /scripted/running`` says how many generations are under way.

Failure injection uses ``random.Random(seed)``: with probability ``--fail-rate`` a generation
request (chat or completions) gets 500, 503 or 429 with a JSON error body; with probability
``--hang-rate`` it sleeps 3600 s (the caller's timeout must fire).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import random
import re
import secrets
import signal
import sys
import time
import zlib
from typing import Any

import orjson
from aiohttp import web

_CITY_RE = re.compile(r"(?i)weather (?:in|for) ([A-Za-z][A-Za-z .'-]*?)(?:[?.!,]|$)")
_REVERSE_MARKER = "Reverse this text:"
_THINK_MARKER = "think first"
_MALFORMED_MARKER = "malformed tool call"
_DEFAULT_CITY = "Paris"
_FAILURE_STATUSES = (500, 503, 429)
_FAILURE_TYPES = {500: "server_error", 503: "service_unavailable", 429: "rate_limit_error"}
_HANG_SECONDS = 3600.0
_JSON = "application/json"

_HEALTH_BODY = orjson.dumps({"status": "ok"})  # SGLang's shape; vLLM answers 200 with an empty body
# What vLLM 0.32 puts in every answer beside the fields that carry data (tests/e2e/test_real_vllm.py compares).
VLLM_VERSION = "0.32.0"
_VLLM_EXTRAS = {"service_tier": None, "system_fingerprint": f"vllm-{VLLM_VERSION}-scripted",
                "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}
_PERMISSION_KEYS = ("allow_create_engine", "allow_sampling", "allow_logprobs", "allow_search_indices", "allow_view",
                    "allow_fine_tuning")


def _usage(n_prompt: int, n_gen: int, shape: str) -> dict[str, Any]:
    usage: dict[str, Any] = {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen}
    if shape != "sglang":
        usage.update(prompt_tokens_details=None, completion_tokens_details=None)
    return usage


def _model_card(name: str, root: str, parent: str | None, max_model_len: int) -> dict[str, Any]:
    """One entry of vLLM's /v1/models: the base model, or an adapter (its path as root, the base as parent)."""
    created = int(time.time())
    permission = {"id": f"modelperm-{secrets.token_hex(8)}", "object": "model_permission", "created": created,
                  **{key: key in ("allow_sampling", "allow_logprobs", "allow_view") for key in _PERMISSION_KEYS},
                  "organization": "*", "group": None, "is_blocking": False}
    return {"id": name, "object": "model", "created": created, "owned_by": "vllm", "root": root, "parent": parent,
            "max_model_len": max_model_len, "permission": [permission]}

# Byte pairs the --drift tokenizer merges into one token when it re-encodes assistant text.
MERGES = ("th", "he", "in", "er", "an", "ea", "ou", "ar", "on", "es")
MERGE_BASE = 259  # ids 3..258 are the 256 bytes
_MERGE_IDS = {pair.encode(): MERGE_BASE + k for k, pair in enumerate(MERGES)}
_MERGE_BYTES = {MERGE_BASE + k: pair.encode() for k, pair in enumerate(MERGES)}

TEMPLATES = ("chatml", "qwen3")

# App keys (aiohttp warns on plain string keys).
_CONFIG = web.AppKey("scripted_config", dict)
_RNG = web.AppKey("scripted_rng", random.Random)
_LOG = web.AppKey("scripted_log", collections.deque)
_ADAPTERS = web.AppKey("scripted_adapters", dict)
_PAUSED = web.AppKey("scripted_not_paused", asyncio.Event)  # set while generation runs (vLLM's /pause clears it)
# In-flight updates: "running" (an abort event per completion under way), "aborted" (prompt + partial ids -> the
# rest of an aborted generation), "keep" (tokens an abort leaves, for tests), "version" (set at run time).
_PAUSE = web.AppKey("scripted_pause", dict)


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


def _assistant_body(content: str | None, tool_calls: list[dict[str, Any]] | None, reasoning: str | None = None) -> str:
    """Assistant turn -> the text the toy model 'generates' for it (thought + content + tool calls)."""
    body = f"<think>{reasoning}</think>" if reasoning else ""
    body += content or ""
    for tc in tool_calls or ():
        fn = tc.get("function") or {}
        args = fn.get("arguments")
        if not isinstance(args, str):
            args = orjson.dumps(args).decode() if args is not None else "{}"
        body += f"<tool_call>{fn.get('name', '')}\n{args}</tool_call>"
    return body


def _message_reasoning(msg: dict[str, Any]) -> str | None:
    return msg.get("reasoning_content") or msg.get("reasoning") or None


def render_segments(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template: str = "chatml",
) -> list[tuple[str, bool]]:
    """Chat messages + tools -> [(text, is_assistant_body)] of the chatml-like prompt (`template`
    qwen3: reasoning only on the assistant messages after the last user message)."""
    parts: list[tuple[str, bool]] = []
    if tools:
        parts.append((f"<|im_start|>tools\n{orjson.dumps(tools).decode()}<|im_end|>\n", False))
    last_user = max((i for i, m in enumerate(messages) if m.get("role", "user") == "user"), default=-1)
    for index, msg in enumerate(messages):
        role = msg.get("role", "user")
        if role == "assistant":
            reasoning = _message_reasoning(msg) if template != "qwen3" or index > last_user else None
            body = _assistant_body(_text_of(msg.get("content")), msg.get("tool_calls"), reasoning)
            parts.append(("<|im_start|>assistant\n", False))
            parts.append((body, True))
            if continue_final_message and index == len(messages) - 1:
                return parts
            parts.append(("<|im_end|>\n", False))
        else:
            parts.append((f"<|im_start|>{role}\n{_text_of(msg.get('content'))}<|im_end|>\n", False))
    if add_generation_prompt:
        parts.append(("<|im_start|>assistant\n", False))
    return parts


def render_prompt(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    """Chat messages + tools -> chatml-like prompt text ending with the assistant header."""
    return "".join(text for text, _ in render_segments(messages, tools))


def tokenize(text: str) -> list[int]:
    """Text -> toy token ids (UTF-8 byte + 3)."""
    return [b + 3 for b in text.encode()]


def encode(text: str, *, merge: bool = False) -> list[int]:
    """Text -> toy ids; with ``merge`` the byte pairs of MERGES become single tokens (left to right)."""
    data = text.encode()
    if not merge:
        return [b + 3 for b in data]
    ids: list[int] = []
    i = 0
    while i < len(data):
        pair = _MERGE_IDS.get(data[i : i + 2])
        if pair is not None:
            ids.append(pair)
            i += 2
        else:
            ids.append(data[i] + 3)
            i += 1
    return ids


def token_bytes(token_id: int) -> bytes:
    """One toy token -> its bytes."""
    if token_id in _MERGE_BYTES:
        return _MERGE_BYTES[token_id]
    if 3 <= token_id < MERGE_BASE:
        return bytes([token_id - 3])
    return b""


def decode(ids: list[int]) -> str:
    """Toy ids (bytes or merged pairs) -> text."""
    return b"".join(token_bytes(int(i)) for i in ids).decode("utf-8", errors="replace")


def prompt_token_ids(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    *,
    drift: bool = False,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template: str = "chatml",
) -> list[int]:
    """The toy prompt ids of a conversation; with ``drift`` assistant bodies are re-encoded with merges."""
    ids: list[int] = []
    for text, is_body in render_segments(
        messages, tools, add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
        template=template,
    ):
        ids.extend(encode(text, merge=drift and is_body))
    return ids


_TURN_RE = re.compile(r"<\|im_start\|>([a-z_]+)\n(.*?)<\|im_end\|>\n", re.DOTALL)
_TOOL_CALL_RE = re.compile(r"<tool_call>([^\n<]*)\n(.*?)</tool_call>", re.DOTALL)
_THINK_RE = re.compile(r"^<think>(.*?)</think>", re.DOTALL)


def parse_prompt(text: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Prompt text in the rendering above -> (chat messages, tools): what a completions prompt says."""
    messages: list[dict[str, Any]] = []
    tools: list[dict[str, Any]] | None = None
    calls = 0
    for match in _TURN_RE.finditer(text):
        role, body = match.group(1), match.group(2)
        if role == "tools":
            try:
                tools = orjson.loads(body)
            except orjson.JSONDecodeError:
                tools = None
            continue
        if role != "assistant":
            messages.append({"role": role, "content": body})
            continue
        message: dict[str, Any] = {"role": "assistant"}
        think = _THINK_RE.match(body)
        if think:
            message["reasoning_content"] = think.group(1)
            body = body[think.end():]
        tool_calls = []
        for call in _TOOL_CALL_RE.finditer(body):
            calls += 1
            tool_calls.append({"id": f"call_{calls}", "type": "function",
                               "function": {"name": call.group(1), "arguments": call.group(2)}})
        message["content"] = _TOOL_CALL_RE.sub("", body) or None
        message["tool_calls"] = tool_calls
        messages.append(message)
    return messages, tools


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
    call: dict[str, Any] | None = None
    if forced:
        call = _tool_call(forced, {"city": _city_from(last_user)} if forced == "get_weather" else {})
    elif tool_choice != "none" and "get_weather" in names and last.get("role") == "user":
        call = _tool_call("get_weather", {"city": _city_from(last_user)})
    if call is not None and _MALFORMED_MARKER in last_user.lower():
        function = call["function"]
        return f"<tool_call>{function['name']}\n{function['arguments'][:-1]}</tool_call>", [], "stop"
    if call is not None:
        return None, [call], "tool_calls"

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


def script_thought(messages: list[dict[str, Any]]) -> str | None:
    """The toy model's reasoning: only when a system or user message says 'Think first'."""
    asked = any(
        msg.get("role") in ("system", "developer", "user") and _THINK_MARKER in _text_of(msg.get("content")).lower()
        for msg in messages
    )
    if not asked:
        return None
    last = messages[-1] if messages else {}
    if last.get("role") == "tool":
        return "The tool answered; now I can reply."
    return "The user needs an answer; let me work it out."


def _context_error(cfg: dict[str, Any], prompt_len: int, max_tokens: Any) -> web.Response | None:
    """A context-length 400 in the backend's words, or None when the request fits."""
    limit = cfg["max_model_len"]
    requested = prompt_len + (max_tokens if isinstance(max_tokens, int) else 0)
    if not limit or requested <= limit:
        return None
    if cfg["shape"] == "sglang":
        message = (f"The input ({prompt_len} tokens) is longer than the model's context length ({limit} tokens).")
        return _json_response({"object": "error", "message": message, "type": "BadRequestError",
                               "param": None, "code": 400}, 400)
    if prompt_len > limit:  # vLLM 0.32's words
        message = (f"This model's maximum context length is {limit} tokens. However, your prompt contains "
                   f"{prompt_len} input tokens, which exceeds this limit even without any output tokens. Please "
                   f"reduce the length of the input prompt. (parameter=input_tokens, value={prompt_len})")
        return _json_response({"error": {"message": message, "type": "BadRequestError", "param": "input_tokens",
                                         "code": 400}}, 400)
    # Older vLLM's, when the prompt fits but not with max_tokens (0.32 then shortens the generation instead).
    message = (f"This model's maximum context length is {limit} tokens. However, you requested {requested} tokens "
               f"({prompt_len} in the messages, {requested - prompt_len} in the completion). Please reduce the "
               "length of the messages or completion.")
    return _error(400, message, "BadRequestError")


def _chat_logprob_entries(gen_ids: list[int], seed: int, as_ids: bool,
                          forced: range = range(0)) -> list[dict[str, Any]]:
    entries = []
    for pos, tid in enumerate(gen_ids):
        raw = token_bytes(tid)
        entries.append({
            "token": f"token_id:{tid}" if as_ids else raw.decode("utf-8", errors="replace"),
            "logprob": 0.0 if pos in forced else _logprob(seed, pos, tid),
            "bytes": list(raw),
            "top_logprobs": [],
        })
    return entries


def with_adapter(content: str | None, seed: int, adapter: str | None) -> tuple[str | None, int]:
    """What an adapter changes in the toy model: its name before the text, and the logprob seed."""
    if adapter is None:
        return content, seed
    return (f"[{adapter}] {content}" if content else content), seed + zlib.crc32(adapter.encode())


def _grammar_forced(req: dict[str, Any], content: str | None, tool_calls: list[dict[str, Any]],
                    reasoning: str | None) -> range:
    """The generated positions a grammar admitted alone: with a named or required tool choice, the call's
    opening up to its name (`<tool_call>NAME\\n`), which the backend then reports at logprob 0.0, as vLLM
    does for the tokens its structured output forces."""
    choice = req.get("tool_choice")
    if not tool_calls or not (isinstance(choice, dict) or choice == "required"):
        return range(0)
    start = len(tokenize(_assistant_body(content, None, reasoning)))
    name = (tool_calls[0].get("function") or {}).get("name", "")
    return range(start, start + len(tokenize(f"<tool_call>{name}\n")))


def build_completion(
    req: dict[str, Any], *, token_info: bool, seed: int, shape: str = "vllm", drift: bool = False,
    weight_version: str | None = None, prompt_ids: list[int] | None = None, adapter: str | None = None,
    template: str = "chatml",
) -> dict[str, Any]:
    """Chat request dict -> vLLM-shaped (or SGLang-shaped) ChatCompletion dict.

    ``prompt_ids`` (SGLang's ``input_ids``) replaces the rendered prompt; the script then reads
    the conversation from those tokens, as a model would.
    """
    if prompt_ids is None:
        prompt_ids = prompt_token_ids(req.get("messages") or [], req.get("tools"), drift=drift, template=template)
        script_req = req
    else:
        messages, tools = parse_prompt(decode(prompt_ids))
        script_req = {**req, "messages": messages, "tools": tools}
    content, tool_calls, finish = script_reply(script_req)
    content, seed = with_adapter(content, seed, adapter)
    thought = script_thought(script_req.get("messages") or [])
    gen_ids = tokenize(_assistant_body(content, tool_calls, thought))
    n_prompt, n_gen = len(prompt_ids), len(gen_ids)
    forced = _grammar_forced(req, content, tool_calls, thought)

    if shape == "sglang":
        message = {"role": "assistant", "content": content, "reasoning_content": thought,
                   "tool_calls": tool_calls or None}
        choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish,
                                  "matched_stop": None}
        if token_info or req.get("logprobs"):
            choice["logprobs"] = {"content": _chat_logprob_entries(gen_ids, seed, as_ids=False, forced=forced)}
        if token_info or req.get("return_prompt_token_ids"):
            choice["prompt_token_ids"] = prompt_ids
        if token_info or req.get("return_token_ids"):
            choice["token_ids"] = gen_ids
        if req.get("return_meta_info"):
            choice["meta_info"] = {"prompt_tokens": n_prompt, "completion_tokens": n_gen,
                                   **({"weight_version": weight_version} if weight_version else {})}
        return {
            "id": secrets.token_hex(16),
            "object": "chat.completion",
            "created": int(time.time()),
            "model": req.get("model") or "scripted",
            "choices": [choice],
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen},
        }

    want_tokens = token_info or bool(req.get("logprobs")) or bool(req.get("return_token_ids"))
    logprobs = {"content": _chat_logprob_entries(gen_ids, seed, as_ids=True, forced=forced)} if want_tokens else None
    # vLLM 0.32's message: `reasoning` (older versions: reasoning_content), tool_calls only when there are some.
    # A forced call (named or required tool_choice) comes with empty content, as vLLM's does.
    forced_call = bool(tool_calls) and (isinstance(req.get("tool_choice"), dict) or req.get("tool_choice") == "required")
    message: dict[str, Any] = {"role": "assistant", "content": "" if forced_call and content is None else content,
                               "refusal": None, "annotations": None, "audio": None, "function_call": None,
                               "reasoning": thought}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {
        "id": f"chatcmpl-{secrets.token_hex(16)}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": req.get("model") or "scripted",
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": finish,
                "stop_reason": None,
                "token_ids": gen_ids if want_tokens else None,
                "routed_experts": None,
            }
        ],
        "usage": _usage(n_prompt, n_gen, shape),
        "prompt_token_ids": prompt_ids if want_tokens else None,
        "prompt_logprobs": None,
        "prompt_text": None,
        **_VLLM_EXTRAS,
    }


def build_text_completion(req: dict[str, Any], prompt_ids: list[int], *, seed: int, shape: str,
                          adapter: str | None = None, rest: tuple[list[int], int, str] | None = None) -> dict[str, Any]:
    """A /v1/completions request whose prompt is ``prompt_ids`` -> vLLM's CompletionResponse dict. ``rest``
    (ids, position, finish_reason): the prompt continues an aborted generation, which goes on with these ids
    from this position."""
    if rest is None:
        messages, tools = parse_prompt(decode(prompt_ids))
        max_tokens = req.get("max_tokens", 16)  # vLLM's default for completions
        content, tool_calls, finish = script_reply({"messages": messages, "tools": tools, "max_tokens": max_tokens})
        content, seed = with_adapter(content, seed, adapter)
        if finish == "tool_calls":
            finish = "stop"  # a completions endpoint parses nothing
        text = _assistant_body(content, tool_calls, script_thought(messages))
        gen_ids, start = tokenize(text), 0
    else:
        gen_ids, start, finish = rest
        text = decode(gen_ids)
    choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    if shape != "sglang":
        choice.update(stop_reason=None, prompt_logprobs=None, token_ids=None, prompt_token_ids=None, routed_experts=None)
    n_logprobs = req.get("logprobs")
    if isinstance(n_logprobs, int) and not isinstance(n_logprobs, bool):
        as_ids = bool(req.get("return_tokens_as_token_ids")) and shape != "sglang"
        tokens, lps, offsets, tops = [], [], [], []
        offset = 0
        for pos, tid in enumerate(gen_ids, start):
            piece = token_bytes(tid).decode("utf-8", errors="replace")
            name = f"token_id:{tid}" if as_ids else piece
            lp = _logprob(seed, pos, tid)
            tokens.append(name)
            lps.append(lp)
            offsets.append(offset)
            tops.append({name: lp})
            offset += len(piece)
        choice["logprobs"] = {"text_offset": offsets, "token_logprobs": lps, "tokens": tokens, "top_logprobs": tops}
    if req.get("return_token_ids"):
        choice["token_ids"] = gen_ids
        choice["prompt_token_ids"] = list(prompt_ids)
    if req.get("prompt_logprobs") is not None and shape != "sglang":  # vLLM's: None, then {id: Logprob} per token
        choice["prompt_logprobs"] = [None] + [
            {str(tid): {"logprob": _logprob(0, pos, tid), "rank": 1,
                        "decoded_token": token_bytes(tid).decode("utf-8", errors="replace")}}
            for pos, tid in enumerate(prompt_ids) if pos > 0]
    n_prompt, n_gen = len(prompt_ids), len(gen_ids)
    return {
        "id": f"cmpl-{secrets.token_hex(16)}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": req.get("model") or "scripted",
        "choices": [choice],
        "usage": _usage(n_prompt, n_gen, shape),
        **(_VLLM_EXTRAS if shape != "sglang" else {}),
    }


async def _health(request: web.Request) -> web.Response:
    if request.app[_CONFIG]["shape"] == "sglang":
        return web.Response(body=_HEALTH_BODY, content_type=_JSON)
    return web.Response(status=200)


async def _models(request: web.Request) -> web.Response:
    cfg = request.app[_CONFIG]
    adapters = request.app[_ADAPTERS]
    limit = cfg["max_model_len"] or 32768
    if cfg["shape"] == "sglang":
        cards = [{"id": "scripted", "object": "model", "owned_by": "rollgym"},
                 *({"id": name, "object": "model", "owned_by": "rollgym", "root": path, "parent": "scripted"}
                   for name, path in adapters.items())]
    else:
        cards = [_model_card("scripted", "scripted", None, limit),
                 *(_model_card(name, path, "scripted", limit) for name, path in adapters.items())]
    return _json_response({"object": "list", "data": cards})


def _adapter_of(app: web.Application, model: Any) -> str | None:
    """The loaded adapter a request's ``model`` names (vLLM: NAME, SGLang: BASE:NAME), else None."""
    if not isinstance(model, str):
        return None
    name = model.rsplit(":", 1)[-1] if app[_CONFIG]["shape"] == "sglang" else model
    return name if name in app[_ADAPTERS] else None


async def _load_lora_adapter(request: web.Request) -> web.Response:
    """vLLM's or SGLang's runtime LoRA loading: the path must exist; a taken name needs load_inplace."""
    req, error = await _read(request)
    if error is not None:
        return error
    sglang = request.app[_CONFIG]["shape"] == "sglang"
    adapters = request.app[_ADAPTERS]
    name = req.get("lora_name") if isinstance(req, dict) else None
    path = req.get("lora_path") if isinstance(req, dict) else None

    def refuse(status: int, message: str, err_type: str) -> web.Response:
        if sglang:
            return _json_response({"success": False, "error_message": message, "loaded_adapters": adapters},
                                  status=400)
        return _error(status, message, err_type)

    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        return refuse(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
    if name in adapters and not req.get("load_inplace"):
        return refuse(400, f"The lora adapter '{name}' has already been loaded.", "InvalidUserInput")
    if not os.path.exists(path):
        return refuse(404, f"Loading lora {name} failed: No adapter found for {path}", "NotFoundError")
    adapters[name] = path
    if sglang:
        return _json_response({"success": True, "error_message": "", "loaded_adapters": adapters})
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def _unload_lora_adapter(request: web.Request) -> web.Response:
    req, error = await _read(request)
    if error is not None:
        return error
    adapters = request.app[_ADAPTERS]
    name = req.get("lora_name") if isinstance(req, dict) else None
    if name not in adapters:
        message = f"The lora adapter '{name}' cannot be found."
        if request.app[_CONFIG]["shape"] == "sglang":
            return _json_response({"success": False, "error_message": message, "loaded_adapters": adapters},
                                  status=400)
        return _error(404, message, "NotFoundError")
    del adapters[name]
    if request.app[_CONFIG]["shape"] == "sglang":
        return _json_response({"success": True, "error_message": "", "loaded_adapters": adapters})
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


async def _update_weights_from_disk(request: web.Request) -> web.Response:
    """SGLang's full-weight reload: `{model_path, weight_version?}`; later answers report the new
    weight_version (the path when none is given). A path that does not exist is refused, as SGLang does."""
    req, error = await _read(request)
    if error is not None:
        return error
    path = req.get("model_path") if isinstance(req, dict) else None
    if not isinstance(path, str) or not os.path.exists(path):
        return _json_response({"success": False, "message": f"Failed to update weights: no model at {path!r}"},
                              status=400)
    request.app[_CONFIG]["weight_version"] = str(req.get("weight_version") or path)
    return _json_response({"success": True, "message": "Succeeded to update model weights."})


def _bad_request(param: str, kind: str, message: str, value: Any) -> web.Response:
    """vLLM's answer to a request its route's validation refuses (400, the parameter named)."""
    detail = {"type": kind, "loc": param, "msg": message, "input": value}
    return _json_response({"error": {"message": f"1 validation error:\n  {detail}", "type": "Bad Request",
                                     "param": param, "code": 400}}, status=400)


def _worker_failed(error: str) -> web.Response:
    """vLLM's answer when a collective_rpc failed in its worker (the server itself goes on serving)."""
    return _json_response({"error": {"message": f"Call to collective_rpc method failed: Worker failed with error "
                                                f"'{error}', please check the stack trace above for the root cause",
                                     "type": "InternalServerError", "param": None, "code": 500}}, status=500)


async def _pause(request: web.Request) -> web.Response:
    """vLLM's `POST /pause?mode=abort|wait|keep`: new generations wait until `/resume`; `abort` ends the
    completions under way at once, `wait` waits for them; an unknown mode is 400, as vLLM's PauseMode is."""
    request.app[_LOG].append({"path": request.path, "body": dict(request.query)})
    mode = request.query.get("mode", "abort")
    if mode not in ("abort", "wait", "keep"):
        return _bad_request("query.mode", "literal_error", "Input should be 'abort', 'wait' or 'keep'", mode)
    pause = request.app[_PAUSE]
    # The scripted backend's own knob, for tests: the tokens every aborted generation keeps (else its share).
    keep = request.query.get("scripted_keep")
    pause["keep"] = int(keep) if keep is not None and keep.isdigit() else None
    request.app[_PAUSED].clear()
    if mode == "abort":
        for abort in list(pause["running"]):
            abort.set()
    while mode == "wait" and pause["running"]:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.02)  # as vLLM: the aborted answers go out before the pause returns
    return _json_response({"status": "paused"})


async def _resume(request: web.Request) -> web.Response:
    request.app[_LOG].append({"path": request.path, "body": None})
    request.app[_PAUSED].set()
    return _json_response({"status": "resumed"})


async def _reset_prefix_cache(request: web.Request) -> web.Response:
    """vLLM's dev-mode `POST /reset_prefix_cache` -> `{"success": true}` (this backend caches nothing)."""
    request.app[_LOG].append({"path": request.path, "body": None})
    return _json_response({"success": True})


async def _is_paused(request: web.Request) -> web.Response:
    return _json_response({"is_paused": not request.app[_PAUSED].is_set()})


async def _collective_rpc(request: web.Request) -> web.Response:
    """vLLM's dev-mode `POST /collective_rpc {method, args?, kwargs?}`; `reload_weights` with `kwargs.weights_path`
    reloads from a folder of *.safetensors (one worker: `{"results": [null]}`). A folder without them is 500
    with vLLM's error body; `--fail-reloads N` makes the first N reloads fail with 500 (a worker that died)."""
    req, error = await _read(request)
    if error is not None:
        return error
    if not isinstance(req, dict) or req.get("method") is None:
        return _json_response({"detail": "Missing 'method' in request body"}, status=400)
    if req["method"] != "reload_weights":
        return _json_response({"results": [None]})
    config = request.app[_CONFIG]
    path = str((req.get("kwargs") or {}).get("weights_path") or "")
    if config["fail_reloads"] > 0:
        config["fail_reloads"] -= 1
        return _worker_failed("scripted reload failure")
    if not os.path.isdir(path) or not any(name.endswith(".safetensors") for name in os.listdir(path)):
        return _worker_failed("Cannot find any model weights with `<path>`")
    await asyncio.sleep(config["reload_latency_s"])
    config["reloaded_from"] = path
    return _json_response({"results": [None]})


async def _update_weight_version(request: web.Request) -> web.Response:
    """vLLM's `POST /update_weight_version {new_version}` (embedded body) -> `{success, new_version}`."""
    req, error = await _read(request)
    if error is not None:
        return error
    version = req.get("new_version") if isinstance(req, dict) else None
    if not isinstance(version, str):
        return _bad_request("body.new_version", "missing", "Field required", "None")
    request.app[_CONFIG]["weight_version"] = version
    request.app[_PAUSE]["version"] = version  # later completions' logprobs: as from other weights
    return _json_response({"success": True, "new_version": version})


async def _weight_info(request: web.Request) -> web.Response:
    """vLLM's `GET /weight_info` -> `{weight_version}` ("default" until one is set)."""
    return _json_response({"weight_version": request.app[_CONFIG]["weight_version"] or "default"})


async def _get_model_info(request: web.Request) -> web.Response:
    """SGLang's `GET /get_model_info` -> `{model_path, tokenizer_path, is_generation, preferred_sampling_params,
    weight_version}` ("default" until a reload names one)."""
    model = "scripted"  # the name it answers under
    return _json_response({"model_path": model, "tokenizer_path": model, "is_generation": True,
                           "preferred_sampling_params": None,
                           "weight_version": request.app[_CONFIG]["weight_version"] or "default"})


async def _read(request: web.Request) -> tuple[Any, web.Response | None]:
    """The JSON body (logged for tests), or an error response."""
    try:
        req = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        return None, _error(400, f"malformed JSON body: {exc}", "invalid_request_error")
    request.app[_LOG].append({"path": request.path, "body": req})
    return req, None


async def _inject(app: web.Application, scheduled: bool = False) -> web.Response | None:
    """The wait for /resume and the latency (unless the generation was `scheduled` already: `_generating`), then
    the scripted failures: an error response, a hang, or None to go on."""
    cfg = app[_CONFIG]
    rng = app[_RNG]
    if not scheduled:
        await app[_PAUSED].wait()  # a paused engine schedules nothing new until /resume
    if not scheduled and cfg["latency_s"] > 0:
        await asyncio.sleep(cfg["latency_s"])
    # Draw both numbers every time so the failure pattern depends only on seed and request order.
    fail_draw, hang_draw = rng.random(), rng.random()
    if fail_draw < cfg["fail_rate"]:
        status = rng.choice(_FAILURE_STATUSES)
        return _error(status, f"scripted failure ({status})", _FAILURE_TYPES[status])
    if hang_draw < cfg["hang_rate"]:
        await asyncio.sleep(_HANG_SECONDS)
    return None


def _token_list(value: Any) -> list[int] | None:
    if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        return value
    return None


async def _chat_completions(request: web.Request) -> web.Response:
    """POST /v1/chat/completions: latency, failure injection, then the scripted reply."""
    cfg = request.app[_CONFIG]
    req, error = await _read(request)
    if error is not None:
        return error
    if not isinstance(req, dict) or not isinstance(req.get("messages"), list):
        return _error(400, "body must be a JSON object with a 'messages' list", "invalid_request_error")
    if not all(isinstance(message, dict) for message in req["messages"]):
        return _error(400, "each message must be a JSON object", "invalid_request_error")
    input_ids = None
    if cfg["shape"] == "sglang" and req.get("input_ids") is not None:
        input_ids = _token_list(req["input_ids"])
        if input_ids is None:
            return _error(400, "input_ids must be a list of token ids", "invalid_request_error")

    failure = await _inject(request.app)
    if failure is not None:
        return failure
    prompt_len = len(input_ids) if input_ids is not None else len(
        prompt_token_ids(req["messages"], req.get("tools"), drift=cfg["drift"], template=cfg["template"]))
    too_long = _context_error(cfg, prompt_len, req.get("max_tokens", req.get("max_completion_tokens")))
    if too_long is not None:
        return too_long
    return _json_response(build_completion(
        req, token_info=cfg["token_info"], seed=cfg["seed"], shape=cfg["shape"], drift=cfg["drift"],
        weight_version=cfg["weight_version"], prompt_ids=input_ids, adapter=_adapter_of(request.app, req.get("model")),
        template=cfg["template"],
    ))


async def _completions(request: web.Request) -> web.Response:
    """POST /v1/completions: a text or token-id prompt, the scripted generation as raw text."""
    cfg = request.app[_CONFIG]
    req, error = await _read(request)
    if error is not None:
        return error
    if not isinstance(req, dict):
        return _error(400, "body must be a JSON object", "invalid_request_error")
    prompt = req.get("prompt")
    if isinstance(prompt, str) and prompt:
        prompt_ids = encode(prompt)
    else:
        prompt_ids = _token_list(prompt)
        if not prompt_ids:
            return _error(400, "Either prompt or prompt_embeds must be provided and non-empty.", "BadRequestError")
    pause = request.app[_PAUSE]
    aborted_at = await _generating(request.app)
    failure = await _inject(request.app, scheduled=True)
    if failure is not None:
        return failure
    too_long = _context_error(cfg, len(prompt_ids), req.get("max_tokens", 16))
    if too_long is not None:
        return too_long
    seed = cfg["seed"] + (zlib.crc32(pause["version"].encode()) % 1000 if pause["version"] else 0)
    rest = pause["aborted"].pop(tuple(prompt_ids), None)
    completion = build_text_completion(req, prompt_ids, seed=seed, shape=cfg["shape"],
                                       adapter=_adapter_of(request.app, req.get("model")), rest=rest)
    if aborted_at is not None:
        _cut(completion, aborted_at, prompt_ids, rest[1] if rest else 0, pause["aborted"], pause["keep"])
    return _json_response(completion)


async def _generating(app: web.Application) -> float | None:
    """A generation's latency, as vLLM runs it: not before the engine is resumed, and cut short by
    /pause?mode=abort. None when it ran to its end, else the share of the latency that had passed."""
    cfg, pause = app[_CONFIG], app[_PAUSE]
    await app[_PAUSED].wait()  # vLLM holds new requests while it is paused
    abort = asyncio.Event()
    pause["running"].add(abort)
    started = time.monotonic()
    try:
        if cfg["latency_s"] > 0:
            await asyncio.wait_for(abort.wait(), cfg["latency_s"])
    except TimeoutError:
        return None
    finally:
        pause["running"].discard(abort)
    return (time.monotonic() - started) / cfg["latency_s"] if abort.is_set() else None


def _cut(completion: dict[str, Any], share: float, prompt_ids: list[int], start: int,
         aborted: dict[tuple[int, ...], tuple[list[int], int, str]], keep: int | None) -> None:
    """Cut a completion as vLLM's abort leaves it (the tokens generated in `share` of its time, or `keep` of
    them, finish_reason "abort"), and keep the rest for the request that continues it from prompt + those."""
    choice = completion["choices"][0]
    gen_ids = tokenize(choice["text"])
    kept = min(len(gen_ids) - 1, int(len(gen_ids) * share) if keep is None else keep) if gen_ids else 0
    aborted[tuple(prompt_ids + gen_ids[:kept])] = (gen_ids[kept:], start + kept, choice["finish_reason"])
    choice.update(text=decode(gen_ids[:kept]), finish_reason="abort")
    if choice.get("token_ids") is not None:
        choice["token_ids"] = choice["token_ids"][:kept]
    if choice.get("logprobs"):
        choice["logprobs"] = {key: values[:kept] for key, values in choice["logprobs"].items()}
    usage = completion["usage"]
    usage.update(completion_tokens=kept, total_tokens=usage["prompt_tokens"] + kept)


async def _running(request: web.Request) -> web.Response:
    """GET /scripted/running: how many generations are under way (what a test waits for before pausing)."""
    return _json_response({"running": len(request.app[_PAUSE]["running"])})


async def _generate(request: web.Request) -> web.Response:
    """POST /generate (SGLang's native route): token ids in, the scripted generation's first
    ``max_new_tokens`` ids out, with the input's logprobs from ``logprob_start_len`` when asked."""
    cfg = request.app[_CONFIG]
    req, error = await _read(request)
    if error is not None:
        return error
    input_ids = _token_list(req.get("input_ids")) if isinstance(req, dict) else None
    if not input_ids:
        return _error(400, "input_ids must be a non-empty list of token ids", "BadRequestError")
    params = req.get("sampling_params") or {}
    start = req.get("logprob_start_len", -1)
    if not isinstance(start, int) or start >= len(input_ids):
        return _error(400, f"logprob_start_len ({start}) must be below the input's {len(input_ids)} tokens",
                      "BadRequestError")
    failure = await _inject(request.app)
    if failure is not None:
        return failure
    lora = req.get("lora_path")
    if lora is not None and lora not in request.app[_ADAPTERS]:
        return _error(400, f"lora_path {lora!r} is not loaded", "BadRequestError")
    reply = build_text_completion({"max_tokens": int(params.get("max_new_tokens", 16))}, input_ids,
                                  seed=cfg["seed"], shape="sglang", adapter=lora)["choices"][0]
    output_ids = tokenize(reply["text"])[: int(params.get("max_new_tokens", 16))]
    meta: dict[str, Any] = {"id": secrets.token_hex(16), "finish_reason": {"type": "length"},
                            "prompt_tokens": len(input_ids), "completion_tokens": len(output_ids)}
    if req.get("return_logprob"):
        meta["input_token_logprobs"] = [[_logprob(0, pos, tid) if pos else None, tid, None]
                                        for pos, tid in enumerate(input_ids) if pos >= max(start, 0)]
        meta["output_token_logprobs"] = [[_logprob(cfg["seed"], pos, tid), tid, None]
                                         for pos, tid in enumerate(output_ids)]
    return _json_response({"text": decode(output_ids), "output_ids": output_ids, "meta_info": meta})


async def _tokenize(request: web.Request) -> web.Response:
    """POST /tokenize: text or a chat conversation -> toy ids (drifting like the chat prompt)."""
    cfg = request.app[_CONFIG]
    req, error = await _read(request)
    if error is not None:
        return error
    if not isinstance(req, dict) or (req.get("prompt") is None) == (req.get("messages") is None):
        return _error(400, "exactly one of 'prompt' or 'messages' must be given", "BadRequestError")
    if req.get("messages") is not None:
        if not isinstance(req["messages"], list):
            return _error(400, "messages must be a list", "BadRequestError")
        continue_final = bool(req.get("continue_final_message"))
        if cfg["shape"] == "sglang":
            add_generation_prompt = not continue_final  # SGLang renders like a chat request
        else:
            add_generation_prompt = bool(req.get("add_generation_prompt", True))
        ids = prompt_token_ids(req["messages"], req.get("tools"), drift=cfg["drift"], template=cfg["template"],
                               add_generation_prompt=add_generation_prompt, continue_final_message=continue_final)
    else:
        if not isinstance(req["prompt"], str):
            return _error(400, "prompt must be a string", "BadRequestError")
        ids = encode(req["prompt"])
    limit = cfg["max_model_len"] or 32768
    if cfg["shape"] == "sglang":
        return _json_response({"tokens": ids, "count": len(ids), "max_model_len": limit})
    return _json_response({"count": len(ids), "max_model_len": limit, "tokens": ids, "token_strs": None})


async def _detokenize(request: web.Request) -> web.Response:
    """POST /detokenize: toy ids -> text."""
    cfg = request.app[_CONFIG]
    req, error = await _read(request)
    if error is not None:
        return error
    tokens = _token_list(req.get("tokens")) if isinstance(req, dict) else None
    if tokens is None:
        return _error(400, "tokens must be a list of token ids", "BadRequestError")
    text = decode(tokens)
    return _json_response({"text": text} if cfg["shape"] == "sglang" else {"prompt": text})


async def _requests_log(request: web.Request) -> web.Response:
    return _json_response({"requests": list(request.app[_LOG])})


async def _clear_log(request: web.Request) -> web.Response:
    request.app[_LOG].clear()
    return _json_response({"cleared": True})


def build_app(
    latency_ms: float = 0.0,
    fail_rate: float = 0.0,
    hang_rate: float = 0.0,
    seed: int = 0,
    token_info: bool = False,
    *,
    shape: str = "vllm",
    drift: bool = False,
    max_model_len: int = 0,
    weight_version: str | None = None,
    token_routes: bool = True,
    template: str = "chatml",
    fail_reloads: int = 0,
    reload_latency_ms: float = 0.0,
) -> web.Application:
    """Backend settings -> aiohttp Application serving the scripted routes."""
    if shape not in ("vllm", "sglang"):
        raise ValueError(f"shape must be 'vllm' or 'sglang', not {shape!r}")
    if template not in TEMPLATES:
        raise ValueError(f"template must be one of {', '.join(TEMPLATES)}, not {template!r}")
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[_CONFIG] = {
        "latency_s": latency_ms / 1000.0,
        "fail_rate": fail_rate,
        "hang_rate": hang_rate,
        "seed": seed,
        "token_info": token_info,
        "shape": shape,
        "drift": drift,
        "template": template,
        "max_model_len": max_model_len,
        "weight_version": weight_version,
        "fail_reloads": fail_reloads,
        "reload_latency_s": reload_latency_ms / 1000.0,
    }
    app[_PAUSED] = asyncio.Event()
    app[_PAUSED].set()
    app[_RNG] = random.Random(seed)
    app[_LOG] = collections.deque(maxlen=500)
    app[_ADAPTERS] = {}
    app[_PAUSE] = {"running": set(), "aborted": {}, "version": "", "keep": None}
    if shape == "sglang":
        app.router.add_post("/load_lora_adapter", _load_lora_adapter)
        app.router.add_post("/unload_lora_adapter", _unload_lora_adapter)
        app.router.add_post("/update_weights_from_disk", _update_weights_from_disk)
        app.router.add_get("/get_model_info", _get_model_info)
    else:
        app.router.add_post("/v1/load_lora_adapter", _load_lora_adapter)
        app.router.add_post("/v1/unload_lora_adapter", _unload_lora_adapter)
        # vLLM's dev-mode routes for reinforcement learning (VLLM_SERVER_DEV_MODE=1)
        app.router.add_post("/pause", _pause)
        app.router.add_post("/resume", _resume)
        app.router.add_get("/is_paused", _is_paused)
        app.router.add_post("/collective_rpc", _collective_rpc)
        app.router.add_post("/reset_prefix_cache", _reset_prefix_cache)
        app.router.add_post("/update_weight_version", _update_weight_version)
        app.router.add_get("/weight_info", _weight_info)
    app.router.add_get("/health", _health)
    app.router.add_get("/v1/models", _models)
    app.router.add_post("/v1/chat/completions", _chat_completions)
    if not token_routes:  # a plain OpenAI-compatible server (OpenAI, llama.cpp server, older SGLang)
        app.router.add_get("/scripted/requests", _requests_log)
        app.router.add_post("/scripted/clear", _clear_log)
        return app
    app.router.add_post("/v1/completions", _completions)
    if shape == "vllm":
        app.router.add_get("/scripted/running", _running)
    app.router.add_post("/tokenize", _tokenize)
    app.router.add_post("/detokenize", _detokenize)
    if shape == "sglang":
        app.router.add_post("/generate", _generate)
        app.router.add_post("/v1/tokenize", _tokenize)
        app.router.add_post("/v1/detokenize", _detokenize)
    app.router.add_get("/scripted/requests", _requests_log)
    app.router.add_post("/scripted/clear", _clear_log)
    return app


def _write_port_file(path: str, port: int) -> None:
    """Write the port atomically so a poller never reads a partial file."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        fh.write(f"{port}\n")
    os.replace(tmp, path)


async def _serve(args: argparse.Namespace) -> None:
    """Start the server, announce the port, run until SIGINT/SIGTERM."""
    app = build_app(args.latency_ms, args.fail_rate, args.hang_rate, args.seed, args.token_info,
                    shape=args.shape, drift=args.drift, max_model_len=args.max_model_len,
                    weight_version=args.weight_version, token_routes=not args.no_token_routes,
                    template=args.template, fail_reloads=args.fail_reloads,
                    reload_latency_ms=args.reload_latency_ms)
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
    parser.add_argument("--shape", choices=("vllm", "sglang"), default="vllm", help="whose response shapes to mimic")
    parser.add_argument("--drift", action="store_true",
                        help="re-encode assistant text with merged byte pairs when rendering chat prompts")
    parser.add_argument("--template", choices=TEMPLATES, default="chatml",
                        help="qwen3: drop an assistant message's <think> once a later user message follows")
    parser.add_argument("--max-model-len", type=int, default=0, help="context length; 0 = unlimited")
    parser.add_argument("--weight-version", default=None, help="reported in SGLang-shaped meta_info")
    parser.add_argument("--fail-reloads", type=int, default=0,
                        help="vLLM shape: the first N /collective_rpc reload_weights calls fail with 500")
    parser.add_argument("--reload-latency-ms", type=float, default=0.0,
                        help="vLLM shape: how long a /collective_rpc reload_weights takes")
    parser.add_argument("--no-token-routes", action="store_true",
                        help="serve no /v1/completions, /tokenize, /detokenize (a plain chat backend)")
    args = parser.parse_args(argv)
    try:
        import uvloop
    except ImportError:
        asyncio.run(_serve(args))
    else:
        uvloop.run(_serve(args))


if __name__ == "__main__":
    sys.exit(main())
