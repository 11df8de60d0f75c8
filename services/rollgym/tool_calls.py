"""Hermes / Qwen tool calls in text, both ways, shared by every model server.

Parsing: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks become OpenAI chat tool
calls. The arguments are kept as the model generated them (byte for byte when they came as JSON text),
so a trainer that re-renders the call sees the tokens that were sampled, not a re-serialisation.

Rendering (the embedded models' prompts, for chat templates that know no tools): `plain_tool_messages`
lowers a conversation to role/content text, so both embedded servers show a model the same text: the
tools go into the system message as `# Tools` + `<tools>` one JSON tool per line `</tools>` + the
instruction to answer with `<tool_call>` blocks; an assistant message's tool calls become such blocks
after its content; each run of `tool` messages becomes one user turn of `<tool_response>` blocks
(Qwen2.5 style: a user turn renders cleanly with any ChatML template). `native_tool_messages` prepares a
conversation for a template that does know tools.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
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




TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
TOOLS_SYSTEM_HEADER = (
    "# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>"
)
TOOLS_SYSTEM_FOOTER = (
    "\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n"
    "<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call>"
)


def content_text(content: Any) -> str:
    """OpenAI message content (str, None or a list of parts) as text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") if isinstance(part, Mapping) else str(part) for part in content)
    return str(content)


def arguments_object(arguments: Any) -> Any:
    """Tool-call arguments as a JSON value (OpenAI sends a JSON string; a broken one stays text, rendered
    verbatim: a template must not crash on it)."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments if arguments is not None else {}


def tool_call_text(call: Mapping[str, Any]) -> str:
    """One OpenAI tool call as a Hermes `<tool_call>` block."""
    function = call.get("function", call)
    payload = {"name": function.get("name", ""), "arguments": arguments_object(function.get("arguments"))}
    return f"{TOOL_CALL_OPEN}\n{json.dumps(payload, ensure_ascii=False)}\n{TOOL_CALL_CLOSE}"


def plain_tool_messages(messages: Sequence[Mapping[str, Any]],
                        tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, str]]:
    """OpenAI chat messages (and the tools to advertise; None: none) lowered to role/content text messages."""
    out: list[dict[str, str]] = []
    for index, message in enumerate(messages):
        role = message.get("role", "user")
        content = content_text(message.get("content"))
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if index > 0 and messages[index - 1].get("role") == "tool" and out:
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
            continue
        if role == "assistant" and message.get("tool_calls"):
            content = "\n".join([content] * bool(content) + [tool_call_text(call) for call in message["tool_calls"]])
        out.append({"role": "system" if role == "developer" else role, "content": content})
    if tools:
        text = TOOLS_SYSTEM_HEADER + "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools)
        text += TOOLS_SYSTEM_FOOTER
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{text}" if out[0]["content"] else text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def template_knows_tools(template: str | None) -> bool:
    """Whether a chat template renders `tools` itself (else the conversation is lowered: plain_tool_messages)."""
    return "tools" in (template or "")


def template_inputs(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
                    knows_tools: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) as a chat template gets them: natively when it knows tools, else lowered to text
    (tools in the system message, calls and results as Hermes blocks) with no tools argument."""
    if knows_tools:
        return native_tool_messages(messages), [dict(tool) for tool in tools] if tools else None
    return plain_tool_messages(messages, tools), None


def render_chat(tokenizer: Any, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
                add_generation_prompt: bool = True) -> str:
    """A conversation as prompt text through a Hugging Face tokenizer's chat template, exactly as the
    transformers model server renders it (and, for the same template, the embedded model)."""
    rendered, template_tools = template_inputs(messages, tools, template_knows_tools(tokenizer.chat_template))
    return tokenizer.apply_chat_template(rendered, tools=template_tools, add_generation_prompt=add_generation_prompt,
                                         tokenize=False)


def native_tool_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a template with tool support: content flattened to text, tool-call arguments parsed to
    objects (as transformers expects: templates apply `tojson` to them)."""
    out = []
    for message in messages:
        copy = {**message, "content": content_text(message.get("content"))}
        if message.get("tool_calls"):
            copy["tool_calls"] = [{**call, "function": {**call.get("function", {}), "arguments": arguments_object(
                call.get("function", {}).get("arguments"))}} for call in message["tool_calls"]]
        out.append(copy)
    return out


__all__ = ["TOOLS_SYSTEM_FOOTER", "TOOLS_SYSTEM_HEADER", "TOOL_CALL_CLOSE", "TOOL_CALL_OPEN", "arguments_object",
           "content_text", "native_tool_messages", "parse_hermes_tool_calls", "plain_tool_messages", "render_chat",
           "template_inputs", "template_knows_tools", "tool_call_text"]
