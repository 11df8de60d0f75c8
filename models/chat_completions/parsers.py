"""Parsers for raw generated text: what a chat endpoint's tool and reasoning parsers would do.

When the model server sends a token-id prompt to a completions endpoint (to extend the previous
turn's tokens exactly), the backend parses nothing: the answer is raw text. These parsers turn it
into (content, tool_calls, reasoning). They are picked by name in the config (`tool_parser`,
`reasoning_parser`), or given as `package.module:function` for a model with another format:

    tool_parser(text: str) -> (content: str, tool_calls: list[chat tool call dict])
    reasoning_parser(text: str) -> (reasoning: str | None, content: str)
"""

from __future__ import annotations

import importlib
import json
import re
import secrets
from typing import Any, Callable

ToolParser = Callable[[str], "tuple[str, list[dict[str, Any]]]"]
ReasoningParser = Callable[[str], "tuple[str | None, str]"]

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_UNCLOSED_TOOL_CALL = re.compile(r"<tool_call>(.*)$", re.DOTALL)
_NAME_FIRST = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_.-]*)\s*\n(.*)$", re.DOTALL)
_THINK_OPEN = "<think>"
_THINK_CLOSE = "</think>"


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _parse_call_body(body: str) -> dict[str, Any] | None:
    """One <tool_call> body -> a chat tool call, or None when it is not one.

    Accepts Hermes JSON (`{"name": ..., "arguments": {...}}`, also `parameters`, also arguments
    given as a JSON string) and the compact `NAME\\n{json arguments}` form. Arguments that come as
    JSON text are kept byte for byte, so re-rendering the call reproduces the generated text.
    """
    stripped = body.strip()
    try:
        payload = json.loads(stripped)
    except json.JSONDecodeError:
        payload = None
    if isinstance(payload, dict) and isinstance(payload.get("name"), str):
        arguments = payload.get("arguments", payload.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                json.loads(arguments)
            except json.JSONDecodeError:
                return None
            return _call(payload["name"], arguments)
        return _call(payload["name"], json.dumps(arguments, ensure_ascii=False))
    match = _NAME_FIRST.match(body)
    if match:
        raw = match.group(2).strip()
        try:
            json.loads(raw)
        except json.JSONDecodeError:
            return None
        return _call(match.group(1), raw)
    return None


def hermes_tool_parser(text: str) -> tuple[str, list[dict[str, Any]]]:
    """`<tool_call>...</tool_call>` blocks (Hermes / Qwen format) -> (remaining content, tool calls).

    Blocks that do not parse stay in the content (the model made a mistake the agent should see);
    a trailing block without its closing tag (cut off by the token limit) is accepted when its JSON
    is complete. Never raises.
    """
    calls: list[dict[str, Any]] = []

    def convert(match: re.Match[str]) -> str:
        call = _parse_call_body(match.group(1))
        if call is None:
            return match.group(0)
        calls.append(call)
        return ""

    rest = _TOOL_CALL.sub(convert, text)
    rest = _UNCLOSED_TOOL_CALL.sub(convert, rest)
    return (rest.strip() if calls else rest), calls


def no_tool_parser(text: str) -> tuple[str, list[dict[str, Any]]]:
    return text, []


def think_reasoning_parser(text: str) -> tuple[str | None, str]:
    """`<think>...</think>` -> (reasoning, content). Handles a block opened by the chat template
    (only `</think>` in the text) and an unclosed block (generation cut off while thinking)."""
    close = text.find(_THINK_CLOSE)
    open_ = text.find(_THINK_OPEN)
    if open_ != -1 and (close == -1 or open_ < close):
        start = open_ + len(_THINK_OPEN)
        if close == -1:
            return text[start:].strip() or None, text[:open_]
        return text[start:close].strip() or None, text[:open_] + text[close + len(_THINK_CLOSE):].lstrip()
    if close != -1:
        return text[:close].strip() or None, text[close + len(_THINK_CLOSE):].lstrip()
    return None, text


def no_reasoning_parser(text: str) -> tuple[str | None, str]:
    return None, text


TOOL_PARSERS: dict[str, ToolParser] = {"hermes": hermes_tool_parser, "none": no_tool_parser}
REASONING_PARSERS: dict[str, ReasoningParser] = {"think": think_reasoning_parser, "none": no_reasoning_parser}


def load_parser(name: str, registry: dict[str, Callable]) -> Callable:
    """A parser by registry name, or `package.module:function`; ValueError naming the choices."""
    if name in registry:
        return registry[name]
    module_name, sep, attribute = name.partition(":")
    if not sep:
        raise ValueError(f"unknown parser {name!r}; use one of {', '.join(sorted(registry))} or 'module:function'")
    try:
        parser = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load parser {name!r}: {exc}") from None
    if not callable(parser):
        raise ValueError(f"parser {name!r} is not callable")
    return parser


def parse_generation(
    text: str, *, tools_offered: bool, tool_parser: ToolParser, reasoning_parser: ReasoningParser
) -> dict[str, Any]:
    """Raw generated text -> a chat `message` dict (content, tool_calls, reasoning_content)."""
    reasoning, rest = reasoning_parser(text)
    tool_calls: list[dict[str, Any]] = []
    if tools_offered:
        rest, tool_calls = tool_parser(rest)
    return {"role": "assistant", "content": rest, "tool_calls": tool_calls, "reasoning_content": reasoning}
