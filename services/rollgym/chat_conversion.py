"""Conversion between the OpenAI Responses API and the Chat Completions API.

rollgym's model servers speak the Responses API; inference backends (vLLM, SGLang,
llama.cpp, OpenAI) speak Chat Completions. Every model server uses this one module:

- ``responses_to_chat_request``: Responses create-params -> chat completion request body (its tools:
  ``responses_tools_to_chat_tools``, the form every chat template is given).
- ``chat_response_to_output``: chat completion response -> Responses output items + usage.
- ``chat_messages_to_responses_input`` / ``chat_tools_to_responses_tools`` /
  ``chat_tool_choice_to_responses``: the reverse direction, for servers that receive
  ``/v1/chat/completions`` and route it through the Responses path.

Everything works on plain JSON-like dicts (no pydantic at runtime) because it sits on
the hot path of every rollout turn.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from secrets import token_hex
from typing import Any

__all__ = [
    "ChatOutput",
    "ConversionError",
    "chat_messages_to_responses_input",
    "chat_response_to_output",
    "chat_tool_choice_to_responses",
    "chat_tools_to_responses_tools",
    "responses_to_chat_request",
    "responses_tools_to_chat_tools",
]

# Sampling keys copied verbatim from Responses params to the chat request (when not None); min_tokens and
# repetition_penalty are vLLM's and SGLang's, refused by a model server that does not apply them (rollgym.model).
PASSTHROUGH_KEYS = ("temperature", "top_p", "parallel_tool_calls", "seed", "stop", "min_tokens", "repetition_penalty")

_THINK_OPEN = "<think>"
_THINK_CLOSE = "</think>"
_TEXT_PART_TYPES = frozenset(("input_text", "output_text", "text"))
_SYSTEM_ROLES = frozenset(("system", "developer"))


class ConversionError(ValueError):
    """A request or response that cannot be converted; ``field`` names the offending path
    (e.g. ``input[3].call_id``, ``tools[2].type``)."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(slots=True)
class ChatOutput:
    """Responses-shaped view of one chat completion choice.

    ``output``: Responses output items (reasoning, message, function_call dicts);
    ``status``: "completed" or "incomplete"; ``incomplete_details``: e.g.
    ``{"reason": "max_output_tokens"}`` or None; ``usage``: a ``ResponseUsage``-shaped dict.
    """

    output: list[dict[str, Any]]
    status: str
    incomplete_details: dict[str, Any] | None
    usage: dict[str, Any]


# ---------------------------------------------------------------------------
# Responses -> Chat Completions
# ---------------------------------------------------------------------------


def _join_text_parts(content: Any, field: str) -> str:
    """Str or list of text parts (input_text/output_text/text/refusal) -> one string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ConversionError(f"expected a string or a list of parts, got {type(content).__name__}", field)
    pieces: list[str] = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            pieces.append(part)
            continue
        if not isinstance(part, dict):
            raise ConversionError("content part must be an object", f"{field}[{j}]")
        ptype = part.get("type")
        if ptype in _TEXT_PART_TYPES:
            pieces.append(part.get("text") or "")
        elif ptype == "refusal":
            pieces.append(part.get("refusal") or "")
        else:
            # Images/files/audio have no string form; backends here are text-only.
            raise ConversionError(f"unsupported content part type {ptype!r}", f"{field}[{j}].type")
    return "".join(pieces)


def _reasoning_text(item: dict[str, Any], field: str) -> str:
    """Reasoning item -> its text: full ``content`` (reasoning_text) if present, else summaries."""
    content = item.get("content")
    if content:
        return "".join(p.get("text") or "" for p in content if isinstance(p, dict))
    summary = item.get("summary") or []
    if not isinstance(summary, list):
        raise ConversionError("summary must be a list", f"{field}.summary")
    return "\n\n".join(p.get("text") or "" for p in summary if isinstance(p, dict))


def responses_tools_to_chat_tools(tools: list[Any]) -> list[dict[str, Any]]:
    """Responses function tools -> chat tools; other tool types raise ConversionError."""
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            ttype = tool.get("type") if isinstance(tool, dict) else None
            raise ConversionError(f"only function tools can be sent to a chat backend, got {ttype!r}", f"tools[{i}].type")
        name = tool.get("name")
        if not name:
            raise ConversionError("function tool needs a name", f"tools[{i}].name")
        fn: dict[str, Any] = {"name": name}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        if tool.get("parameters") is not None:
            fn["parameters"] = tool["parameters"]
        # strict: true holds the backend to the schema (vLLM >= 0.32 pins the arguments by grammar); false is
        # the default, left out.
        if tool.get("strict") is True:
            fn["strict"] = True
        out.append({"type": "function", "function": fn})
    return out


def _convert_tool_choice(choice: Any) -> Any:
    """Responses tool_choice -> chat tool_choice."""
    if isinstance(choice, str):
        if choice in ("auto", "none", "required"):
            return choice
        raise ConversionError(f"unsupported tool_choice {choice!r}", "tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function" and choice.get("name"):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ConversionError(f"unsupported tool_choice {choice!r}", "tool_choice")


def responses_to_chat_request(
    params: dict[str, Any], *, model: str | None = None, system_role: str = "system"
) -> dict[str, Any]:
    """Responses create-params dict -> Chat Completions request body dict.

    ``model`` overrides ``params["model"]``. ``system_role`` is the chat role used for
    ``instructions`` and for system/developer input messages (backends without a
    developer role need "system"). Raises ConversionError (with ``field``) on input
    that has no chat equivalent.
    """
    messages: list[dict[str, Any]] = []
    instructions = params.get("instructions")
    if instructions:
        messages.append({"role": system_role, "content": instructions})

    raw_input = params.get("input")
    if isinstance(raw_input, str):
        messages.append({"role": "user", "content": raw_input})
    elif raw_input is not None:
        if not isinstance(raw_input, list):
            raise ConversionError("input must be a string or a list of items", "input")
        _convert_input_items(raw_input, messages, system_role)

    body: dict[str, Any] = {}
    chosen_model = model if model is not None else params.get("model")
    if chosen_model is not None:
        body["model"] = chosen_model
    body["messages"] = messages

    tools = params.get("tools")
    if tools:
        body["tools"] = responses_tools_to_chat_tools(tools)
        # tool_choice without tools is rejected by vLLM, so it only travels with tools.
        if params.get("tool_choice") is not None:
            body["tool_choice"] = _convert_tool_choice(params["tool_choice"])

    if params.get("max_output_tokens") is not None:
        body["max_tokens"] = params["max_output_tokens"]
    for key in PASSTHROUGH_KEYS:
        value = params.get(key)
        if value is not None:
            body[key] = value
    return body


def _convert_input_items(items: list[Any], messages: list[dict[str, Any]], system_role: str) -> None:
    """Append the chat messages for Responses input ``items`` to ``messages``.

    One model turn is [reasoning] [assistant message...] [function_call...]; those items
    are buffered in ``turn`` and flushed as ONE assistant message when the turn ends.
    """
    issued_call_ids: set[str] = set()
    turn: dict[str, Any] | None = None  # {"content": str|None, "tool_calls": list, "reasoning": str|None}

    def flush() -> None:
        nonlocal turn
        if turn is None:
            return
        content = turn["content"]
        tool_calls = turn["tool_calls"]
        if content is None and not tool_calls:
            content = ""  # a reasoning-only turn still needs a valid assistant message
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if tool_calls:
            msg["tool_calls"] = tool_calls
        if turn["reasoning"] is not None:
            msg["reasoning_content"] = turn["reasoning"]
        messages.append(msg)
        turn = None

    for i, item in enumerate(items):
        field = f"input[{i}]"
        if not isinstance(item, dict):
            raise ConversionError("input item must be an object", field)
        itype = item.get("type")

        if itype == "message" or (itype is None and "role" in item):
            role = item.get("role")
            if role == "assistant":
                text = _join_text_parts(item.get("content"), f"{field}.content")
                if turn is not None and turn["tool_calls"]:
                    flush()  # text after tool calls belongs to a new model turn
                if turn is None:
                    turn = {"content": None, "tool_calls": [], "reasoning": None}
                turn["content"] = text if turn["content"] is None else turn["content"] + text
                continue
            flush()
            if role == "user":
                chat_role = "user"
            elif role in _SYSTEM_ROLES:
                chat_role = system_role
            else:
                raise ConversionError(f"unsupported message role {role!r}", f"{field}.role")
            messages.append({"role": chat_role, "content": _join_text_parts(item.get("content"), f"{field}.content")})

        elif itype == "function_call":
            call_id = item.get("call_id")
            if not call_id:
                raise ConversionError("function_call needs a call_id", f"{field}.call_id")
            name = item.get("name")
            if not name:
                raise ConversionError("function_call needs a name", f"{field}.name")
            arguments = item.get("arguments")
            if not isinstance(arguments, str):
                # Some clients send parsed arguments; chat wants the JSON string.
                arguments = "{}" if arguments is None else json.dumps(arguments)
            if turn is None:
                turn = {"content": None, "tool_calls": [], "reasoning": None}
            turn["tool_calls"].append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            )
            issued_call_ids.add(call_id)

        elif itype == "reasoning":
            text = _reasoning_text(item, field)
            if turn is not None and (turn["content"] is not None or turn["tool_calls"]):
                flush()  # reasoning after output starts the next model turn
            if turn is None:
                turn = {"content": None, "tool_calls": [], "reasoning": None}
            turn["reasoning"] = text if turn["reasoning"] is None else turn["reasoning"] + "\n\n" + text

        elif itype == "function_call_output":
            flush()
            call_id = item.get("call_id")
            if call_id not in issued_call_ids:
                raise ConversionError(f"no earlier function_call has call_id {call_id!r}", f"{field}.call_id")
            output = _join_text_parts(item.get("output"), f"{field}.output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})

        else:
            raise ConversionError(f"unsupported input item type {itype!r}", f"{field}.type")
    flush()


# ---------------------------------------------------------------------------
# Chat Completions response -> Responses output
# ---------------------------------------------------------------------------


def _split_think(text: str) -> tuple[str | None, str]:
    """Text -> (reasoning or None, remaining text) using <think>...</think> tags.

    Handles a closed block anywhere, a block opened by the chat template (only
    ``</think>`` in the text) and an unclosed block (generation cut off while thinking).
    """
    close = text.find(_THINK_CLOSE)
    open_ = text.find(_THINK_OPEN)
    if open_ != -1 and (close == -1 or open_ < close):
        start = open_ + len(_THINK_OPEN)
        if close == -1:
            return text[start:].strip(), text[:open_]
        return text[start:close].strip(), text[:open_] + text[close + len(_THINK_CLOSE) :].lstrip()
    if close != -1:
        return text[:close].strip(), text[close + len(_THINK_CLOSE) :].lstrip()
    return None, text


def _arguments_string(arguments: Any) -> str:
    """Tool call arguments (JSON string, parsed object or None) -> JSON string."""
    if isinstance(arguments, str):
        return arguments
    if arguments is None:
        return "{}"
    return json.dumps(arguments)


def chat_response_to_output(chat: dict[str, Any], *, parse_think_tags: bool = True) -> ChatOutput:
    """Chat completion response dict -> ChatOutput (Responses output items, status, usage).

    Uses ``choices[0]``. Reasoning comes from ``message.reasoning_content`` /
    ``message.reasoning`` and, if ``parse_think_tags``, from ``<think>`` tags in the
    content. Whitespace-only content yields no message item.
    """
    choices = chat.get("choices")
    if not choices:
        raise ConversionError("chat response has no choices", "choices")
    choice = choices[0]
    message = choice.get("message") or {}

    reasoning = message.get("reasoning_content") or message.get("reasoning") or None
    content = message.get("content")
    text = content if isinstance(content, str) else _join_text_parts(content, "choices[0].message.content")
    if parse_think_tags and text and (_THINK_CLOSE in text or _THINK_OPEN in text):
        think, text = _split_think(text)
        if think:
            reasoning = think if reasoning is None else reasoning + "\n\n" + think

    output: list[dict[str, Any]] = []
    if reasoning:
        output.append(
            {"type": "reasoning", "id": f"rs_{token_hex(12)}", "summary": [{"type": "summary_text", "text": reasoning}]}
        )

    parts: list[dict[str, Any]] = []
    if text and not text.isspace():
        parts.append({"type": "output_text", "text": text, "annotations": []})
    if message.get("refusal"):
        parts.append({"type": "refusal", "refusal": message["refusal"]})
    if parts:
        output.append(
            {"type": "message", "id": f"msg_{token_hex(12)}", "role": "assistant", "status": "completed", "content": parts}
        )

    for i, tc in enumerate(message.get("tool_calls") or ()):
        fn = tc.get("function") or {}
        name = fn.get("name")
        if not name:
            raise ConversionError("tool call has no function name", f"choices[0].message.tool_calls[{i}].function.name")
        output.append(
            {
                "type": "function_call",
                "id": f"fc_{token_hex(12)}",
                "call_id": tc.get("id") or f"call_{token_hex(12)}",
                "name": name,
                "arguments": _arguments_string(fn.get("arguments")),
                "status": "completed",
            }
        )

    finish_reason = choice.get("finish_reason")
    if finish_reason == "length":
        status, incomplete = "incomplete", {"reason": "max_output_tokens"}
    elif finish_reason == "content_filter":
        status, incomplete = "incomplete", {"reason": "content_filter"}
    else:
        status, incomplete = "completed", None

    return ChatOutput(output=output, status=status, incomplete_details=incomplete, usage=_convert_usage(chat.get("usage")))


def _convert_usage(usage: dict[str, Any] | None) -> dict[str, Any]:
    """Chat usage (or None) -> ResponseUsage-shaped dict."""
    usage = usage or {}
    input_tokens = usage.get("prompt_tokens") or 0
    output_tokens = usage.get("completion_tokens") or 0
    total = usage.get("total_tokens")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    reasoning = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
    return {
        "input_tokens": input_tokens,
        # openai>=3.x's InputTokensDetails requires cache_write_tokens; backends never report it.
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": total if total is not None else input_tokens + output_tokens,
    }


# ---------------------------------------------------------------------------
# Chat Completions request -> Responses input (reverse direction)
# ---------------------------------------------------------------------------


def chat_tools_to_responses_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat tools ``{"type":"function","function":{...}}`` -> Responses function tools.

    The result always has ``parameters`` and ``strict`` (None when the chat tool has
    none) since Responses' FunctionTool requires both keys.
    """
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            ttype = tool.get("type") if isinstance(tool, dict) else None
            raise ConversionError(f"unsupported chat tool type {ttype!r}", f"tools[{i}].type")
        fn = tool.get("function") or {}
        if not fn.get("name"):
            raise ConversionError("function tool needs a name", f"tools[{i}].function.name")
        converted: dict[str, Any] = {"type": "function", "name": fn["name"]}
        if fn.get("description") is not None:
            converted["description"] = fn["description"]
        converted["parameters"] = fn.get("parameters")
        converted["strict"] = fn.get("strict")
        out.append(converted)
    return out


def chat_tool_choice_to_responses(tool_choice: Any) -> Any:
    """Chat tool_choice -> Responses tool_choice ("auto"/"none"/"required" or a function pick)."""
    if isinstance(tool_choice, str):
        if tool_choice in ("auto", "none", "required"):
            return tool_choice
    elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if name:
            return {"type": "function", "name": name}
    raise ConversionError(f"unsupported tool_choice {tool_choice!r}", "tool_choice")


def chat_messages_to_responses_input(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages -> Responses input items.

    system/developer/user -> ``message`` items with string content; assistant ->
    [reasoning item] [message item if it has text] [one function_call per tool call];
    tool -> ``function_call_output``.
    """
    items: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        field = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise ConversionError("message must be an object", field)
        role = msg.get("role")
        if role in ("system", "developer", "user"):
            items.append({"type": "message", "role": role, "content": _join_text_parts(msg.get("content"), f"{field}.content")})
        elif role == "assistant":
            reasoning = msg.get("reasoning_content") or msg.get("reasoning")
            if reasoning:
                items.append(
                    {"type": "reasoning", "id": f"rs_{token_hex(12)}", "summary": [{"type": "summary_text", "text": reasoning}]}
                )
            text = _join_text_parts(msg.get("content"), f"{field}.content")
            tool_calls = msg.get("tool_calls") or ()
            if text or not tool_calls:
                items.append({"type": "message", "role": "assistant", "content": text})
            for j, tc in enumerate(tool_calls):
                fn = tc.get("function") or {}
                if not tc.get("id"):
                    raise ConversionError("tool call needs an id", f"{field}.tool_calls[{j}].id")
                if not fn.get("name"):
                    raise ConversionError("tool call needs a function name", f"{field}.tool_calls[{j}].function.name")
                items.append(
                    {
                        "type": "function_call",
                        "call_id": tc["id"],
                        "name": fn["name"],
                        "arguments": _arguments_string(fn.get("arguments")),
                    }
                )
        elif role == "tool":
            call_id = msg.get("tool_call_id")
            if not call_id:
                raise ConversionError("tool message needs a tool_call_id", f"{field}.tool_call_id")
            items.append(
                {
                    "type": "function_call_output",
                    "call_id": call_id,
                    "output": _join_text_parts(msg.get("content"), f"{field}.content"),
                }
            )
        else:
            raise ConversionError(f"unsupported message role {role!r}", f"{field}.role")
    return items
