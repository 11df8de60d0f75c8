"""The chat format of the embedded model: prompt templates and the Hermes tool-call text.

Prompts are rendered with the GGUF's own jinja chat template, or the one the server's `chat_template`
names (:func:`template_source`: a built-in, a file, or the template text). Tool-call prompt format,
for templates without native tool support (SmolLM2's is plain ChatML): the tools are appended to the system message
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
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.sandbox
from llama_cpp.llama_grammar import SchemaConverter

# The lowering of tool messages is the kernel's (rollgym.tool_calls.template_inputs), shared with the
# transformers server and with traces re-tokenized for training.
from rollgym.tool_calls import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

# Used only when a GGUF carries no chat template at all.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

END_OF_TURN_TEXTS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>")

# Built-in templates for `chat_template`: plain ChatML, and ChatML that drops earlier reasoning at each
# new user turn as Qwen3's does (templates/qwen3_style.jinja says how).
TEMPLATES_DIR = Path(__file__).with_name("templates")
BUILTIN_TEMPLATES = ("chatml", "qwen3_style")
# What the server passes to every render: chat_template_kwargs may not set these.
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


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


def template_source(value: str) -> str:
    """`chat_template` -> the Jinja source it names: a built-in name (BUILTIN_TEMPLATES), the template
    text itself (anything with `{{` or `{%`), or the path of a file holding it. ValueError saying which
    of these `value` is not, or where the template fails to compile."""
    if value == "chatml":
        return CHATML_TEMPLATE
    if value in BUILTIN_TEMPLATES:
        return (TEMPLATES_DIR / f"{value}.jinja").read_text(encoding="utf-8")
    if "{{" in value or "{%" in value:
        source, origin = value, "the template text"
    else:
        path = Path(value).expanduser()
        if not path.is_file():
            raise ValueError(f"{value!r} is no built-in template ({', '.join(BUILTIN_TEMPLATES)}) and no file "
                             f"({'not found' if not path.exists() else 'not a file'}: {path.resolve()})")
        try:
            source, origin = path.read_text(encoding="utf-8"), str(path)
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read {path}: {exc}") from None
    try:
        compile_template(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"{origin} is no valid Jinja template: {exc.message} (line {exc.lineno})") from None
    return source


# --------------------------------------------------------------------------- forced tool calls


# SchemaConverter writes a bound `{0,n}` as n nested optional groups, which llama.cpp's grammar parser walks
# recursively: at 20 000 it overflows the stack and the process dies. Bounds above this many repetitions are
# looser than any output budget, so an upper one is dropped (the environment still validates the arguments)
# and a lower one is refused by name.
REPEAT_LIMIT = 1000
UPPER_BOUNDS = ("maxLength", "maxItems", "maxProperties")
LOWER_BOUNDS = ("minLength", "minItems", "minProperties")


def bounded_schema(schema: Any, where: str) -> Any:
    """`schema` with every upper repetition bound above REPEAT_LIMIT dropped; ValueError naming the keyword's
    place for a lower bound above it."""
    if isinstance(schema, list):
        return [bounded_schema(item, f"{where}[{i}]") for i, item in enumerate(schema)]
    if not isinstance(schema, Mapping):
        return schema
    out = {}
    for key, value in schema.items():
        if key in UPPER_BOUNDS and isinstance(value, int) and value > REPEAT_LIMIT:
            continue
        if key in LOWER_BOUNDS and isinstance(value, int) and value > REPEAT_LIMIT:
            raise ValueError(f"{where}.{key}: {value} is more than a forced tool call's grammar can require "
                             f"(at most {REPEAT_LIMIT})")
        out[key] = bounded_schema(value, f"{where}.{key}")
    return out


def tool_call_grammar(tools: Sequence[Mapping[str, Any]]) -> str:
    """GBNF forcing exactly one ``<tool_call>`` of one of ``tools`` (chat format).

    In: the allowed tools. Out: grammar text whose ``root`` is
    ``"<tool_call>\\n" {"name": <allowed name>, "arguments": <params schema>} "\\n</tool_call>"``.
    After the root completes, llama.cpp's grammar sampler only admits
    end-of-generation tokens (a token reference such as ``<[2]>`` to an EOG token
    is rejected by the sampler and aborts the process, so the end is left implicit).
    Repetition bounds above REPEAT_LIMIT: see bounded_schema.
    """
    alternatives = []
    for tool in tools:
        function = tool["function"]
        parameters = bounded_schema(function.get("parameters") or {"type": "object", "properties": {}},
                                    f"tools[{function['name']}].function.parameters")
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


__all__ = ["BUILTIN_TEMPLATES", "CHATML_TEMPLATE", "END_OF_TURN_TEXTS", "RESERVED_TEMPLATE_VARIABLES",
           "REPEAT_LIMIT", "bounded_schema", "compile_template", "template_source",
           "tool_call_grammar"]
