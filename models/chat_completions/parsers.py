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
from typing import Any, Callable

# The Hermes parser is the kernel's, shared with models/llamacpp (it keeps the generated argument bytes).
from rollgym.tool_calls import parse_hermes_tool_calls as hermes_tool_parser

ToolParser = Callable[[str], "tuple[str, list[dict[str, Any]]]"]
ReasoningParser = Callable[[str], "tuple[str | None, str]"]

_THINK_OPEN = "<think>"
_THINK_CLOSE = "</think>"


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
