"""Parsers for raw generated text: what a chat endpoint's tool and reasoning parsers would do.

When the model server sends a token-id prompt to a completions endpoint (to extend the previous
turn's tokens exactly), the backend parses nothing: the answer is raw text. These parsers turn it
into (content, tool_calls, reasoning). They are picked by name in the config (`tool_parser`,
`reasoning_parser`), or given as `package.module:function` for a model with another format:

    tool_parser(text: str) -> (content: str, tool_calls: list[chat tool call dict])
                            or (content, tool_calls, failures: int)
    reasoning_parser(text: str) -> (reasoning: str | None, content: str)

A call the model got wrong (bad JSON, a broken block) is never an error: its text stays in the
content, as the agent and the trainer should see it, and it counts as one parse failure
(`parse_failures` on the message `parse_generation` returns). Each tool format has a renderer
(`TOOL_RENDERERS`, `render_harmony`), the inverse of its parser: parse -> render -> parse gives the
same calls, which is how the formats are tested and how SFT data in a model's own format is written.
"""

from __future__ import annotations

import importlib
import json
import re
import secrets
from typing import Any, Callable

# The Hermes parser is the kernel's, shared with models/llamacpp (it keeps the generated argument bytes).
from rollgym.tool_calls import parse_hermes_tool_calls as hermes_tool_parser

ToolParser = Callable[[str], "tuple[str, list[dict[str, Any]]] | tuple[str, list[dict[str, Any]], int]"]
ReasoningParser = Callable[[str], "tuple[str | None, str]"]
ToolRenderer = Callable[[str, "list[dict[str, Any]]"], str]

_THINK_OPEN = "<think>"
_THINK_CLOSE = "</think>"
_DECODER = json.JSONDecoder()


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


# --- shared pieces ---------------------------------------------------------------------------------


def _tool_call(name: str, arguments: str, call_id: str | None = None) -> dict[str, Any]:
    return {"id": call_id or f"call_{secrets.token_hex(12)}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _arguments_text(value: Any) -> str | None:
    """Arguments as JSON object text: a dict is serialised, a string must already be a JSON object."""
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, str):
        try:
            return value if isinstance(json.loads(value), dict) else None
        except json.JSONDecodeError:
            return None
    return None


def _arguments_object(call: dict[str, Any]) -> dict[str, Any]:
    """A chat tool call's arguments as a dict (for formats that write one key at a time)."""
    raw = call["function"].get("arguments") or "{}"
    value = json.loads(raw) if isinstance(raw, str) else raw
    return value if isinstance(value, dict) else {}


def _joined(*parts: str) -> str:
    return "\n".join(part.strip() for part in parts if part and part.strip())


def _xml_value(raw: str) -> Any:
    """A parameter value written as text: JSON when it reads as a non-string JSON value (numbers,
    booleans, null, objects, arrays), else the text itself. Without the tool's schema this is the
    one reading that round-trips: the renderers write strings as they are and the rest as JSON."""
    try:
        value = json.loads(raw)
    except (json.JSONDecodeError, ValueError):
        return raw
    return raw if isinstance(value, str) else value


def _xml_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _name_ok(name: str) -> bool:
    return bool(name) and not any(c.isspace() or c in "<>{}\"'" for c in name)


def _counting_hermes(text: str) -> tuple[str, list[dict[str, Any]], int]:
    """The Hermes parser, with every `<tool_call>` block it left in the content counted."""
    content, calls = hermes_tool_parser(text)
    return content, calls, content.count("<tool_call>")


def render_hermes(content: str, tool_calls: list[dict[str, Any]]) -> str:
    """Qwen2.5/Qwen3 chat template: `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>` per call."""
    blocks = [f'<tool_call>\n{{"name": {json.dumps(c["function"]["name"], ensure_ascii=False)}, '
              f'"arguments": {c["function"]["arguments"] or "{}"}}}\n</tool_call>' for c in tool_calls]
    return "\n".join(part for part in [content.strip(), *blocks] if part)


# --- Llama 3.x JSON --------------------------------------------------------------------------------

_PYTHON_TAG = "<|python_tag|>"
_LLAMA_END = ("<|eom_id|>", "<|eot_id|>")
_LLAMA_CALL_START = re.compile(r'\{\s*"name"\s*:')


def _llama_sequence(text: str, start: int) -> tuple[list[dict[str, Any]], int] | None:
    """JSON calls from `start`, separated by `;`: (calls, end offset), or None when one is not a call."""
    calls, pos = [], start
    while True:
        try:
            obj, pos = _DECODER.raw_decode(text, pos)
        except json.JSONDecodeError:
            return None
        name = obj.get("name") if isinstance(obj, dict) else None
        arguments = _arguments_text(obj.get("parameters", obj.get("arguments"))) if isinstance(obj, dict) else None
        if not isinstance(name, str) or not _name_ok(name) or arguments is None:
            return None
        calls.append(_tool_call(name, arguments))
        after = len(text) - len(text[pos:].lstrip())
        if after < len(text) and text[after] == ";":
            pos = len(text) - len(text[after + 1:].lstrip())
            continue
        return calls, pos


def llama3_json_tool_parser(text: str) -> tuple[str, list[dict[str, Any]], int]:
    """Llama 3.1-3.3 custom tool calls: `{"name": ..., "parameters": {...}}` (several joined by `;`),
    alone or after `<|python_tag|>`; text before the call (or the tag) is the content."""
    body = text
    for end in _LLAMA_END:
        body = body.removesuffix(end)
    tag = body.find(_PYTHON_TAG)
    if tag != -1:
        before, start = body[:tag], tag + len(_PYTHON_TAG)
        start = len(body) - len(body[start:].lstrip())
    else:
        match = _LLAMA_CALL_START.search(body)
        if match is None:
            return text, [], 0
        before, start = body[:match.start()], match.start()
    parsed = _llama_sequence(body, start)
    if parsed is None:
        return text, [], 1
    calls, end = parsed
    return _joined(before, body[end:]), calls, 0


def render_llama3_json(content: str, tool_calls: list[dict[str, Any]]) -> str:
    """Llama 3.1 JSON tool calling as its chat template writes an assistant call."""
    calls = "; ".join(f'{{"name": {json.dumps(c["function"]["name"], ensure_ascii=False)}, '
                      f'"parameters": {c["function"]["arguments"] or "{}"}}}' for c in tool_calls)
    return _joined(content, calls)


# --- Mistral ---------------------------------------------------------------------------------------

_TOOL_CALLS = "[TOOL_CALLS]"
_MISTRAL_V11 = re.compile(r"([A-Za-z0-9_.-]+)(?:\[CALL_ID\]([A-Za-z0-9]+))?(?:\[ARGS\])?(?=\{)")


def _mistral_segment(segment: str) -> tuple[list[dict[str, Any]], str] | None:
    """One `[TOOL_CALLS]` segment -> (calls, text after them), or None when it is not well formed."""
    body = segment.lstrip()
    offset = len(segment) - len(body)
    if body.startswith("["):  # tokenizer v2-v7: a JSON list of {"name", "arguments", "id"?}
        try:
            items, end = _DECODER.raw_decode(segment, offset)
        except json.JSONDecodeError:
            return None
        if not isinstance(items, list) or not items:
            return None
        calls = []
        for item in items:
            name = item.get("name") if isinstance(item, dict) else None
            arguments = _arguments_text(item.get("arguments")) if isinstance(item, dict) else None
            if not isinstance(name, str) or not _name_ok(name) or arguments is None:
                return None
            call_id = item.get("id")
            calls.append(_tool_call(name, arguments, call_id if isinstance(call_id, str) and call_id != "null" else None))
        return calls, segment[end:]
    match = _MISTRAL_V11.match(segment, offset)  # v11+: NAME[CALL_ID]ID[ARGS]{...} (both markers optional)
    if match is None:
        return None
    try:
        arguments, end = _DECODER.raw_decode(segment, match.end())
    except json.JSONDecodeError:
        return None
    if not isinstance(arguments, dict):
        return None
    return [_tool_call(match.group(1), segment[match.end():end], match.group(2))], segment[end:]


def mistral_tool_parser(text: str) -> tuple[str, list[dict[str, Any]], int]:
    """Mistral `[TOOL_CALLS]`: a JSON list (tokenizer v2-v7) or `NAME[ARGS]{json}` per call (v11+,
    with `[CALL_ID]ID` when present). Text before the first marker is the content."""
    if _TOOL_CALLS not in text:
        return text, [], 0
    head, *segments = text.split(_TOOL_CALLS)
    calls: list[dict[str, Any]] = []
    kept, failures = [head], 0
    for segment in segments:
        parsed = _mistral_segment(segment)
        if parsed is None:
            kept.append(_TOOL_CALLS + segment)
            failures += 1
            continue
        calls.extend(parsed[0])
        kept.append(parsed[1])
    content = "".join(kept)
    return (_joined(content) if calls else content), calls, failures


def render_mistral(content: str, tool_calls: list[dict[str, Any]], *, legacy: bool = False) -> str:
    """v11+ `[TOOL_CALLS]NAME[ARGS]{json}` per call; `legacy`: v2-v7's one `[TOOL_CALLS][{...}, ...]`."""
    if legacy and tool_calls:
        items = ", ".join(f'{{"name": {json.dumps(c["function"]["name"], ensure_ascii=False)}, '
                          f'"arguments": {c["function"]["arguments"] or "{}"}}}' for c in tool_calls)
        return f"{content}{_TOOL_CALLS}[{items}]"
    return content + "".join(f'{_TOOL_CALLS}{c["function"]["name"]}[ARGS]{c["function"]["arguments"] or "{}"}'
                             for c in tool_calls)


# --- Qwen3-Coder XML -------------------------------------------------------------------------------

_QWEN_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>((?:(?!<tool_call>).)*)$", re.DOTALL)
_QWEN_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*$", re.DOTALL)
_QWEN_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def _qwen3_coder_call(body: str) -> dict[str, Any] | None:
    match = _QWEN_FUNCTION.match(body)
    if match is None or not _name_ok(match.group(1).strip()):
        return None
    arguments: dict[str, Any] = {}
    for key, raw in _QWEN_PARAMETER.findall(match.group(2)):
        value = raw[1:] if raw.startswith("\n") else raw
        arguments[key.strip()] = _xml_value(value[:-1] if value.endswith("\n") else value)
    if _QWEN_PARAMETER.sub("", match.group(2)).strip():
        return None  # text between the parameters: not what the template writes
    return _tool_call(match.group(1).strip(), json.dumps(arguments, ensure_ascii=False))


def _blocks(pattern: re.Pattern[str], text: str, parse: Callable[[str], dict[str, Any] | None],
            ) -> tuple[str, list[dict[str, Any]], int]:
    """Replace each block `pattern` finds by nothing when `parse` reads it as a call; count the rest."""
    calls: list[dict[str, Any]] = []
    failures = 0

    def convert(match: re.Match[str]) -> str:
        nonlocal failures
        body = match.group(1) if match.group(1) is not None else match.group(2)
        call = parse(body)
        if call is None:
            failures += 1
            return match.group(0)
        calls.append(call)
        return ""

    rest = pattern.sub(convert, text)
    return (_joined(rest) if calls else rest), calls, failures


def qwen3_coder_tool_parser(text: str) -> tuple[str, list[dict[str, Any]], int]:
    """Qwen3-Coder: `<tool_call><function=NAME><parameter=ARG>value</parameter></function></tool_call>`.
    Values are text; one that reads as a JSON number, boolean, null, object or array becomes that."""
    return _blocks(_QWEN_BLOCK, text, _qwen3_coder_call)


def render_qwen3_coder(content: str, tool_calls: list[dict[str, Any]]) -> str:
    """As Qwen3-Coder's chat template writes calls (strings as they are, other values as JSON)."""
    blocks = []
    for call in tool_calls:
        params = "".join(f"<parameter={key}>\n{_xml_text(value)}\n</parameter>\n"
                         for key, value in _arguments_object(call).items())
        blocks.append(f"<tool_call>\n<function={call['function']['name']}>\n{params}</function>\n</tool_call>")
    text = "\n".join(blocks)
    return f"{content.strip()}\n\n{text}" if content.strip() and text else content.strip() or text


# --- DeepSeek V3 / V3.1 / R1 -----------------------------------------------------------------------

_DS_CALLS_BEGIN, _DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
_DS_CALL_BEGIN, _DS_CALL_END, _DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_DS_EOS = "<｜end▁of▁sentence｜>"
_DS_CALL = re.compile(re.escape(_DS_CALL_BEGIN) + r"(.*?)" + re.escape(_DS_CALL_END), re.DOTALL)
_DS_V3_BODY = re.compile(r"(\w+)" + re.escape(_DS_SEP) + r"(.+?)\n```json\n(.*)\n```\s*$", re.DOTALL)
_DS_V31_BODY = re.compile(r"([^\s<>]+?)" + re.escape(_DS_SEP) + r"(.*)$", re.DOTALL)


def _deepseek_call(body: str) -> dict[str, Any] | None:
    match = _DS_V3_BODY.match(body)  # V3 / R1-0528: TYPE<sep>NAME\n```json\nARGS\n```
    if match:
        name, arguments = match.group(2).strip(), match.group(3).strip()
    else:
        match = _DS_V31_BODY.match(body)  # V3.1: NAME<sep>ARGS
        if match is None:
            return None
        name, arguments = match.group(1), match.group(2).strip()
    if not _name_ok(name) or _arguments_text(arguments) is None:
        return None
    return _tool_call(name, arguments)


def deepseek_v3_tool_parser(text: str) -> tuple[str, list[dict[str, Any]], int]:
    """DeepSeek V3, R1 and V3.1 calls between `<｜tool▁calls▁begin｜>` and `<｜tool▁calls▁end｜>`:
    V3/R1 write `function<｜tool▁sep｜>NAME` and the arguments in a ```json fence, V3.1
    `NAME<｜tool▁sep｜>ARGS`. Text before the section is the content, text after it too."""
    begin = text.find(_DS_CALLS_BEGIN)
    if begin == -1:
        return text, [], 0
    start = begin + len(_DS_CALLS_BEGIN)
    end = text.find(_DS_CALLS_END, start)
    section, after = (text[start:], "") if end == -1 else (text[start:end], text[end + len(_DS_CALLS_END):])
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    failures = 0
    for match in _DS_CALL.finditer(section):
        call = _deepseek_call(match.group(1))
        if call is None:
            failures += 1
            kept.append(match.group(0))
        else:
            calls.append(call)
    if _DS_CALL.sub("", section).strip():  # a call cut off or text that is no call
        failures += 1
        kept.append(_DS_CALL.sub("", section).strip())
    after = after.replace(_DS_EOS, "")
    if not calls:
        return text, [], failures
    return _joined(text[:begin], *kept, after), calls, failures


def render_deepseek_v3(content: str, tool_calls: list[dict[str, Any]], *, v31: bool = False) -> str:
    """As DeepSeek V3's chat template writes calls (`v31`: V3.1's shorter form)."""
    if not tool_calls:
        return content
    if v31:
        calls = "".join(f"{_DS_CALL_BEGIN}{c['function']['name']}{_DS_SEP}{c['function']['arguments'] or '{}'}"
                        f"{_DS_CALL_END}" for c in tool_calls)
    else:
        calls = "\n".join(f"{_DS_CALL_BEGIN}function{_DS_SEP}{c['function']['name']}\n```json\n"
                          f"{c['function']['arguments'] or '{}'}\n```{_DS_CALL_END}" for c in tool_calls)
    return f"{content}{_DS_CALLS_BEGIN}{calls}{_DS_CALLS_END}"


# --- GLM-4.5 ---------------------------------------------------------------------------------------

_GLM_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>((?:(?!<tool_call>).)*)$", re.DOTALL)
_GLM_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def _glm_call(body: str) -> dict[str, Any] | None:
    first_arg = body.find("<arg_key>")
    name = (body if first_arg == -1 else body[:first_arg]).strip()
    if not _name_ok(name):
        return None
    args = "" if first_arg == -1 else body[first_arg:]
    if _GLM_PAIR.sub("", args).strip():
        return None
    arguments = {key.strip(): _xml_value(value.strip()) for key, value in _GLM_PAIR.findall(args)}
    return _tool_call(name, json.dumps(arguments, ensure_ascii=False))


def glm45_tool_parser(text: str) -> tuple[str, list[dict[str, Any]], int]:
    """GLM-4.5/4.6: `<tool_call>NAME\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>...</tool_call>`.
    Values are text; one that reads as a JSON number, boolean, null, object or array becomes that."""
    return _blocks(_GLM_BLOCK, text, _glm_call)


def render_glm45(content: str, tool_calls: list[dict[str, Any]]) -> str:
    """As GLM-4.5's chat template writes calls (strings as they are, other values as JSON)."""
    blocks = "".join(
        f"\n<tool_call>{c['function']['name']}\n"
        + "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{_xml_text(v)}</arg_value>\n" for k, v in _arguments_object(c).items())
        + "</tool_call>" for c in tool_calls)
    return (content.strip() + blocks) if content.strip() else blocks.lstrip("\n")


# --- gpt-oss (harmony) -----------------------------------------------------------------------------

_H_START, _H_CHANNEL, _H_MESSAGE, _H_CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
_H_STOPS = ("<|end|>", "<|call|>", "<|return|>")
_H_MESSAGE_RE = re.compile(r"<\|start\|>(.*?)<\|message\|>(.*?)(<\|end\|>|<\|call\|>|<\|return\|>|(?=<\|start\|>)|$)",
                           re.DOTALL)
_H_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


def _harmony_messages(text: str) -> tuple[list[dict[str, str]], str] | None:
    """Harmony text -> its messages ({channel, recipient, content, raw}) and the text outside any,
    or None when it is not harmony at all. Generation starts inside `<|start|>assistant`, so a
    leading `<|channel|>` opens the first message."""
    body = text.strip()
    if not (body.startswith(_H_CHANNEL) or body.startswith(_H_START)):
        return None
    if body.startswith(_H_CHANNEL):
        body = _H_START + "assistant" + body
    messages, outside, pos = [], [], 0
    for match in _H_MESSAGE_RE.finditer(body):
        outside.append(body[pos:match.start()])
        pos = match.end()
        header = match.group(1)
        channel = header.split(_H_CHANNEL, 1)[1] if _H_CHANNEL in header else ""
        recipient = _H_RECIPIENT.search(header)
        messages.append({"channel": (channel.split() or [""])[0].split("<|")[0],
                         "recipient": recipient.group(1) if recipient else "",
                         "content": match.group(2), "raw": match.group(0)})
    outside.append(body[pos:])
    return messages, "".join(outside).strip()


def parse_harmony(text: str) -> tuple[str | None, str, list[dict[str, Any]], int]:
    """gpt-oss harmony output -> (reasoning, content, tool calls, failures).

    `analysis` messages are the reasoning; a message to `functions.NAME` (on `commentary`, the
    recipient in the role or the channel part of the header) is a call whose content is its JSON
    arguments; `final` messages and `commentary` preambles are the content. A call whose arguments
    are not a JSON object stays in the content as its raw message and counts as a failure; text that
    is not harmony is all content.
    """
    parsed = _harmony_messages(text)
    if parsed is None:
        return None, text, [], 0
    messages, outside = parsed
    reasoning, content, calls, failures = [], [], [], 0
    for message in messages:
        recipient = message["recipient"]
        if recipient:
            name = recipient.removeprefix("functions.")
            arguments = message["content"].strip()
            if _name_ok(name) and _arguments_text(arguments) is not None:
                calls.append(_tool_call(name, arguments))
            else:
                failures += 1
                content.append(message["raw"])
        elif message["channel"] == "analysis":
            reasoning.append(message["content"].strip())
        else:
            content.append(message["content"])
    if outside:
        failures += 1
        content.append(outside)
    return _joined(*reasoning) or None, _joined(*content), calls, failures


def harmony_reasoning_parser(text: str) -> tuple[str | None, str]:
    """The `analysis` channel as reasoning; the rest stays harmony when it holds calls (for the
    `harmony` tool parser), else it is the plain content."""
    reasoning, content, calls, failures = parse_harmony(text)
    if not calls and not failures:
        return reasoning, content
    parsed = _harmony_messages(text)
    assert parsed is not None  # calls or failures imply harmony text
    rest = "".join(m["raw"] for m in parsed[0] if m["recipient"] or m["channel"] != "analysis") + parsed[1]
    return reasoning, rest


def harmony_tool_parser(text: str) -> tuple[str, list[dict[str, Any]], int]:
    """Calls to `functions.NAME`; any `analysis` left in the text (another reasoning parser) is content."""
    reasoning, content, calls, failures = parse_harmony(text)
    return _joined(reasoning or "", content), calls, failures


def render_harmony(content: str, tool_calls: list[dict[str, Any]], reasoning: str | None = None) -> str:
    """What gpt-oss generates after `<|start|>assistant`: analysis, then a preamble and calls on
    `commentary` (each ending `<|call|>`), or the `final` answer."""
    messages = []
    if reasoning:
        messages.append(f"{_H_CHANNEL}analysis{_H_MESSAGE}{reasoning}<|end|>")
    if tool_calls:
        if content:
            messages.append(f"{_H_CHANNEL}commentary{_H_MESSAGE}{content}<|end|>")
        messages.extend(f"{_H_CHANNEL}commentary to=functions.{c['function']['name']} {_H_CONSTRAIN}json"
                        f"{_H_MESSAGE}{c['function']['arguments'] or '{}'}<|call|>" for c in tool_calls)
    elif content:
        messages.append(f"{_H_CHANNEL}final{_H_MESSAGE}{content}<|return|>")
    return (_H_START + "assistant").join(messages)


# --- registries ------------------------------------------------------------------------------------

TOOL_PARSERS: dict[str, ToolParser] = {
    "hermes": _counting_hermes,
    "llama3_json": llama3_json_tool_parser,
    "mistral": mistral_tool_parser,
    "qwen3_coder": qwen3_coder_tool_parser,
    "deepseek_v3": deepseek_v3_tool_parser,
    "glm45": glm45_tool_parser,
    "harmony": harmony_tool_parser,
    "none": no_tool_parser,
}
# `think` is also DeepSeek-R1's, Qwen3's and GLM-4.5's format (their templates may open the block).
REASONING_PARSERS: dict[str, ReasoningParser] = {
    "think": think_reasoning_parser,
    "deepseek_r1": think_reasoning_parser,
    "harmony": harmony_reasoning_parser,
    "none": no_reasoning_parser,
}
TOOL_RENDERERS: dict[str, ToolRenderer] = {
    "hermes": render_hermes,
    "llama3_json": render_llama3_json,
    "mistral": render_mistral,
    "qwen3_coder": render_qwen3_coder,
    "deepseek_v3": render_deepseek_v3,
    "glm45": render_glm45,
    "harmony": render_harmony,
}


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
    """Raw generated text -> a chat `message` dict (content, tool_calls, reasoning_content) with
    `parse_failures`: how many tool calls the tool parser could not read (left in the content)."""
    reasoning, rest = reasoning_parser(text)
    tool_calls: list[dict[str, Any]] = []
    failures = 0
    if tools_offered:
        parsed = tool_parser(rest)
        rest, tool_calls = parsed[0], parsed[1]
        failures = parsed[2] if len(parsed) > 2 else 0
    return {"role": "assistant", "content": rest, "tool_calls": tool_calls, "reasoning_content": reasoning,
            "parse_failures": failures}
