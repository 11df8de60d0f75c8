"""Prompts for the transformers model server: the tokenizer's chat template, and the Hermes tool-call
text for templates that know no tools.

A template that references `tools` gets the tools and messages natively. Otherwise (SmolLM2's
template is plain ChatML) the conversation is lowered as the embedded model lowers it, so that both
servers show a model the same text: the tools go into the system message as `# Tools` + `<tools>`
one JSON tool per line `</tools>` + the instruction to answer with
`<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>`; an assistant
message's tool calls become such blocks after its content; each run of `tool` messages becomes one
user turn of `<tool_response>` blocks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def resolve_tool_choice(tools: Sequence[Mapping[str, Any]] | None,
                        tool_choice: Any) -> tuple[list[Mapping[str, Any]], str | None]:
    """(tools to advertise, the forced opening of the answer or None) for a chat `tool_choice`.

    "required" and a named function start the answer with the call's fixed text (`<tool_call>\\n{"name": "`;
    when one function is possible, its name, `", "arguments": {`, its first required argument's name and, for a
    string, the opening quote); once the call's JSON object closes, `\\n</tool_call>` and the end of the turn
    are forced too (engine.py). Forced tokens are not sampled, and the item says so (`generation_forced`).
    ValueError for a choice that names no offered tool."""
    tools = [t for t in (tools or []) if t.get("type", "function") == "function"]
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none" or not tools:
        if choice == "required" or isinstance(choice, Mapping):
            raise ValueError("tool_choice requires tools, but no function tools were given")
        return [], None
    if choice == "auto":
        return tools, None
    if choice == "required":
        names = [t["function"]["name"] for t in tools]
    elif isinstance(choice, Mapping):
        name = (choice.get("function") or {}).get("name") or choice.get("name")
        names = [t["function"]["name"] for t in tools if t["function"].get("name") == name]
        if not names:
            raise ValueError(f"tool_choice names function {name!r}, which is not in tools")
    else:
        raise ValueError(f"invalid tool_choice {tool_choice!r}")
    opening = '<tool_call>\n{"name": "'
    if len(names) > 1:
        return tools, opening
    opening += f'{names[0]}", "arguments": {{'
    # The first required argument's name too: a small model then writes its value rather than a new schema.
    function = next(t["function"] for t in tools if t["function"]["name"] == names[0])
    parameters = function.get("parameters") or {}
    required = parameters.get("required") or []
    if not required or not isinstance(required[0], str):
        return tools, opening
    opening += f'"{required[0]}":'
    kind = ((parameters.get("properties") or {}).get(required[0]) or {}).get("type")
    return tools, opening + (' "' if kind == "string" else "")


def call_closed(text: str) -> bool:
    """Whether the JSON object after `<tool_call>` in generated text is complete (braces balanced outside strings)."""
    start = text.find("{", text.find("<tool_call>") + 1 if "<tool_call>" in text else 0)
    if start < 0:
        return False
    depth, in_string, escaped = 0, False, False
    for char in text[start:]:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return True
    return False


__all__ = ["call_closed", "resolve_tool_choice"]
