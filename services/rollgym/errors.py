"""Validation errors as users read them: `field 'input[2].call_id': Field required`.

Kept apart from the server so the collector and CLI can phrase errors without importing the web stack.
"""

from __future__ import annotations

import re
from typing import Any


def format_location(loc: tuple[Any, ...] | list[Any]) -> str:
    """`('body', 'input', 2, 'call_id')` → `input[2].call_id`, dropping union-branch names."""
    parts: list[str] = []
    for element in loc:
        if element == "body" and not parts:
            continue
        if isinstance(element, int):
            parts.append(f"[{element}]")
            continue
        text = str(element)
        # pydantic names the branch it tried in unions ("function_call", "list[...]", "str", or a
        # model class such as "ResponseInputText"); users did not write those, so they are left out.
        if "[" in text or "(" in text or text in _UNION_BRANCHES or _CLASS_NAME.match(text):
            continue
        parts.append(f".{text}" if parts else text)
    return "".join(parts) or "body"


_CLASS_NAME = re.compile(r"^[A-Z][a-z0-9]+(?:[A-Z][a-z0-9]*)+$")
_UNION_BRANCHES = {
    "str", "int", "float", "bool", "dict", "list", "message", "output_message", "function_call",
    "function_call_output", "reasoning", "ToolChoiceFunction",
}


def validation_errors(errors: list[dict[str, Any]], prefix: str = "") -> list[dict[str, str]]:
    """Validation errors as [{field, message}], deepest location first (the most specific)."""
    items = []
    for error in sorted(errors, key=lambda e: -len(e.get("loc", ()))):
        field = format_location(error.get("loc", ()))
        if prefix:
            field = f"{prefix}.{field}" if field != "body" else prefix
        message = error.get("msg", "invalid")
        if error.get("type") == "json_invalid":
            field, message = "body", f"body is not valid JSON: {error.get('ctx', {}).get('error', message)}"
        items.append({"field": field, "message": message})
    # One error per field: unions report the same field once per branch.
    seen: set[str] = set()
    unique = []
    for item in items:
        if item["field"] not in seen:
            seen.add(item["field"])
            unique.append(item)
    return unique


class ServerStartError(Exception):
    """A server refuses to start with this configuration."""


class LaunchError(Exception):
    """A server of the stack did not come up, or died (raised by rollgym.stack.launcher)."""


class ConfigError(Exception):
    """A stack configuration problem, phrased for the user (file and key included)."""


class ContextLengthError(ValueError):
    """A prompt that leaves no room for one generated token in a model's context window (an in-process
    model server answers a Responses request `status: incomplete`, a chat request 422 naming `messages`)."""

    def __init__(self, prompt_tokens: int, n_ctx: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.n_ctx = n_ctx
        super().__init__(
            f"prompt is {prompt_tokens} tokens but the context window is {n_ctx} tokens "
            f"(at most {n_ctx - 1} prompt tokens leave room for one generated token)"
        )
