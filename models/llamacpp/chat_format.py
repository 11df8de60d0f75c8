"""The chat format of the embedded model: prompt templates and the Hermes tool-call text.

Prompts are rendered with the GGUF's own jinja chat template. Tool-call prompt format, for templates
without native tool support (SmolLM2's is plain ChatML): the tools are appended to the system message
(a new system message is created if there is none) as ``# Tools`` + ``<tools>`` one JSON tool per line
``</tools>`` + the instruction to answer with
``<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>``.
History is lowered to plain text the same way: an assistant message's tool calls become such blocks
after its content, and each run of consecutive ``tool`` messages becomes ONE user turn of
``<tool_response>\n...\n</tool_response>`` blocks. Templates that reference ``tools`` get the tools
and messages natively instead. A forced tool call is a llama.cpp GBNF grammar.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.sandbox
from llama_cpp.llama_grammar import SchemaConverter


# Used only when a GGUF carries no chat template at all.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Hermes / Qwen2.5 tool prompt, appended to the system message for templates that
# have no native tool support (SmolLM2's template is plain ChatML).
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

# End-of-turn tokens of common chat formats (ChatML, Llama 3, Gemma), most likely first.
END_OF_TURN_TEXTS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>")

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"


# --------------------------------------------------------------------------- templates


def _raise_exception(message: str) -> None:
    """Jinja global used by HF chat templates to reject bad conversations."""
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """Jinja ``tojson`` filter with transformers' semantics (no HTML escaping)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def compile_template(source: str) -> tuple[jinja2.Template, bool]:
    """Compile a chat template the way transformers does.

    Returns the template and whether it references ``tools`` (native tool support).
    """
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    uses_tools = "tools" in jinja2.meta.find_undeclared_variables(env.parse(source))
    return env.from_string(source), uses_tools


def _content_text(content: Any) -> str:
    """Flatten OpenAI message content (str, None or list of parts) to text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") if isinstance(part, Mapping) else str(part) for part in content)
    return str(content)


def _arguments_object(arguments: Any) -> Any:
    """Tool-call arguments as a JSON value (OpenAI sends a JSON string)."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments  # rendered verbatim; a template must not crash on it
    return arguments if arguments is not None else {}


def _tool_call_text(call: Mapping[str, Any]) -> str:
    """Render one OpenAI tool call as a Hermes ``<tool_call>`` block."""
    function = call.get("function", call)
    payload = {"name": function.get("name", ""), "arguments": _arguments_object(function.get("arguments"))}
    return f"{TOOL_CALL_OPEN}\n{json.dumps(payload, ensure_ascii=False)}\n{TOOL_CALL_CLOSE}"


def _tools_system_text(tools: Sequence[Mapping[str, Any]]) -> str:
    """The Hermes/Qwen tool block that goes into the system prompt."""
    lines = "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools)
    return TOOLS_SYSTEM_HEADER + lines + TOOLS_SYSTEM_FOOTER


def messages_for_plain_template(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
) -> list[dict[str, str]]:
    """Lower tool-related chat messages to plain ChatML-able text messages.

    In: OpenAI chat messages, and the tools to advertise (None = no tools).
    Out: messages with only ``role``/``content`` strings:
    tools go into the (possibly new) system message, assistant tool calls become
    ``<tool_call>`` blocks after the content, and each run of consecutive ``tool``
    messages becomes ONE user turn of ``<tool_response>`` blocks (Qwen2.5 style;
    SmolLM2 never saw a "tool" role, and a user turn renders cleanly with any
    ChatML template).
    """
    out: list[dict[str, str]] = []
    for index, message in enumerate(messages):
        role = message.get("role", "user")
        content = _content_text(message.get("content"))
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            previous = messages[index - 1].get("role") if index > 0 else None
            if previous == "tool" and out:
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
            continue
        if role == "assistant" and message.get("tool_calls"):
            parts = [content] if content else []
            parts += [_tool_call_text(call) for call in message["tool_calls"]]
            content = "\n".join(parts)
        if role == "developer":
            role = "system"
        out.append({"role": role, "content": content})
    if tools:
        tool_text = _tools_system_text(tools)
        if out and out[0]["role"] == "system":
            base = out[0]["content"]
            out[0] = {"role": "system", "content": f"{base}\n\n{tool_text}" if base else tool_text}
        else:
            out.insert(0, {"role": "system", "content": tool_text})
    return out


def messages_for_tool_template(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Copy messages for a template with native tool support.

    Content is flattened to text and tool-call arguments are parsed to objects,
    as transformers expects (templates apply ``tojson`` to them).
    """
    out: list[dict[str, Any]] = []
    for message in messages:
        copy = dict(message)
        copy["content"] = _content_text(message.get("content"))
        if message.get("tool_calls"):
            calls = []
            for call in message["tool_calls"]:
                function = dict(call.get("function", {}))
                function["arguments"] = _arguments_object(function.get("arguments"))
                calls.append({**call, "function": function})
            copy["tool_calls"] = calls
        out.append(copy)
    return out


# --------------------------------------------------------------------------- forced tool calls


def tool_call_grammar(tools: Sequence[Mapping[str, Any]]) -> str:
    """GBNF forcing exactly one ``<tool_call>`` of one of ``tools`` (chat format).

    In: the allowed tools. Out: grammar text whose ``root`` is
    ``"<tool_call>\\n" {"name": <allowed name>, "arguments": <params schema>} "\\n</tool_call>"``.
    After the root completes, llama.cpp's grammar sampler only admits
    end-of-generation tokens (a token reference such as ``<[2]>`` to an EOG token
    is rejected by the sampler and aborts the process, so the end is left implicit).
    """
    alternatives = []
    for tool in tools:
        function = tool["function"]
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        alternatives.append(
            {
                "type": "object",
                "properties": {"name": {"const": function["name"]}, "arguments": parameters},
                "required": ["name", "arguments"],
            }
        )
    schema: dict[str, Any] = alternatives[0] if len(alternatives) == 1 else {"oneOf": alternatives}
    converter = SchemaConverter(
        prop_order={"name": 0, "arguments": 1}, allow_fetch=False, dotall=False, raw_pattern=False
    )
    schema = converter.resolve_refs(schema, "tools")
    body_rule = converter.visit(schema, "tool-call-json")
    root = f'root ::= "{TOOL_CALL_OPEN}\\n" {body_rule} "\\n{TOOL_CALL_CLOSE}"'
    return root + "\n" + converter.format_grammar() + "\n"
