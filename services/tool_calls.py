"""The one parser of Hermes / Qwen tool calls in generated text, shared by every model server.

`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks become OpenAI chat tool calls. The
arguments are kept as the model generated them (byte for byte when they came as JSON text), so a
trainer that re-renders the call sees the tokens that were sampled, not a re-serialisation.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_UNCLOSED_TOOL_CALL = re.compile(r"<tool_call>(.*)$", re.DOTALL)
_NAME_FIRST = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_.-]*)\s*\n(.*)$", re.DOTALL)


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


def parse_hermes_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
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


__all__ = ["parse_hermes_tool_calls"]
