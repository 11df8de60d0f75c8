"""Tool-call and reasoning parsers of the model families people train, on text in each family's
documented format. Every family: its calls are read (several per answer, nested JSON, quotes and
unicode in arguments, text around them), parse -> render -> parse gives the same calls and content,
and a malformed call stays in the content as text and counts as one parse failure, never an error."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from models.chat_completions.app import ChatCompletionsConfig
from models.chat_completions.parsers import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    TOOL_RENDERERS,
    parse_generation,
    parse_harmony,
    render_deepseek_v3,
    render_harmony,
    render_mistral,
)

NESTED = {"query": 'say "hi" to Zoë', "filters": {"tags": ["a", "b"], "limit": 3, "exact": True}, "note": None}


def calls_of(calls: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def parse(family: str, text: str) -> tuple[str, list[tuple[str, Any]], int]:
    content, calls, failures = TOOL_PARSERS[family](text)
    return content, calls_of(calls), failures


def round_trips(family: str, text: str, *, exact: bool = False) -> None:
    """parse -> render -> parse: the same content and calls, nothing failing; `exact`: the rendering
    is the documented text itself, byte for byte."""
    content, calls, failures = TOOL_PARSERS[family](text)
    assert failures == 0 and calls
    rendered = TOOL_RENDERERS[family](content, calls)
    assert parse(family, rendered) == (content, calls_of(calls), 0)
    if exact:
        assert rendered == text


def test_every_family_is_selectable_by_name_and_has_a_renderer() -> None:
    for family in ("hermes", "llama3_json", "mistral", "qwen3_coder", "deepseek_v3", "glm45", "harmony"):
        assert ChatCompletionsConfig(base_url="http://127.0.0.1:1/v1", model="m", tool_parser=family).tool_parser == family
        assert family in TOOL_RENDERERS
    for reasoning in ("think", "deepseek_r1", "harmony"):
        ChatCompletionsConfig(base_url="http://127.0.0.1:1/v1", model="m", reasoning_parser=reasoning)
    with pytest.raises(ValidationError, match="unknown parser 'llama3'.*llama3_json"):
        ChatCompletionsConfig(base_url="http://127.0.0.1:1/v1", model="m", tool_parser="llama3")


# --- Hermes (Qwen2.5 / Qwen3): failures are counted too ----------------------------------------------


def test_hermes_counts_the_blocks_it_cannot_read() -> None:
    text = ('<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
            '<tool_call>\n{"name": "b", "arguments": {oops}\n</tool_call>')
    content, calls, failures = parse("hermes", text)
    assert calls == [("a", {})] and failures == 1 and content.startswith("<tool_call>") and "oops" in content
    round_trips("hermes", '<tool_call>\n{"name": "f", "arguments": ' + json.dumps(NESTED) + '}\n</tool_call>')


# --- Llama 3.x JSON --------------------------------------------------------------------------------
# Sources: the Llama 3.1 chat template (meta-llama/llama-models models/llama3/prompt_templates/
# system_prompts.py, JsonCustomToolGenerator: 'Respond in the format {"name": function name,
# "parameters": dictionary of argument name and its value}'); vLLM
# vllm/entrypoints/openai/tool_parsers/llama_tool_parser.py (`<|python_tag|>` prefix, several calls
# joined by `;`, "arguments" accepted for "parameters"); SGLang python/sglang/srt/function_call/llama32_detector.py.


def test_llama3_json_calls() -> None:
    assert parse("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}') == (
        "", [("get_weather", {"city": "Paris"})], 0)
    text = ('<|python_tag|>{"name": "search", "parameters": ' + json.dumps(NESTED, ensure_ascii=False)
            + '}; {"name": "get_time", "arguments": {"tz": "Europe/Zürich"}}<|eom_id|>')
    assert parse("llama3_json", text) == ("", [("search", NESTED), ("get_time", {"tz": "Europe/Zürich"})], 0)
    # Text before the call (or its tag) and after it is the content.
    text = 'Let me look.\n\n{"name": "get_weather", "parameters": {"city": "Lima"}}\nOne moment.'
    assert parse("llama3_json", text) == ("Let me look.\nOne moment.", [("get_weather", {"city": "Lima"})], 0)
    assert parse("llama3_json", 'Checking.<|python_tag|>{"name": "f", "parameters": {}}') == ("Checking.", [("f", {})], 0)
    assert parse("llama3_json", "It is sunny in Paris.") == ("It is sunny in Paris.", [], 0)


def test_llama3_json_round_trip_and_malformed() -> None:
    round_trips("llama3_json", 'Sure.\n{"name": "a", "parameters": ' + json.dumps(NESTED) + '}; {"name": "b", "parameters": {}}')
    for bad in ('{"name": "get_weather", "parameters": {"city": "Paris"',  # cut off
                '<|python_tag|>{"name": "get_weather", "parameters": "Paris"}',  # arguments not an object
                '{"name": "get_weather"}',  # no arguments at all
                '<|python_tag|>brave_search.call(query="x")'):  # a built-in tool, not JSON
        assert parse("llama3_json", bad) == (bad, [], 1)


# --- Mistral [TOOL_CALLS] --------------------------------------------------------------------------
# Sources: mistralai/mistral-common src/mistral_common/tokens/tokenizers/tools.py (decode_tool_calls:
# v2-v7 `[TOOL_CALLS][{"name", "arguments", "id"?}, ...]`, v11+ `[TOOL_CALLS]name[ARGS]{...}` and
# `[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}`); vLLM vllm/entrypoints/openai/tool_parsers/mistral_tool_parser.py
# (`[TOOL_CALLS]add{"a": 3.5, "b": 4}` when [ARGS] is decoded away); SGLang python/sglang/srt/function_call/mistral_detector.py.


def test_mistral_calls_in_every_tokenizer_version() -> None:
    legacy = ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1b2c3d4e"}, '
              '{"name": "search", "arguments": ' + json.dumps(NESTED, ensure_ascii=False) + '}]')
    content, calls, failures = TOOL_PARSERS["mistral"](legacy)
    assert (content, calls_of(calls), failures) == ("", [("get_weather", {"city": "Paris"}), ("search", NESTED)], 0)
    assert calls[0]["id"] == "a1b2c3d4e"
    v11 = ('I will check both.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
           '[TOOL_CALLS]search[CALL_ID]Xy12Ab34C[ARGS]' + json.dumps(NESTED, ensure_ascii=False))
    content, calls, failures = TOOL_PARSERS["mistral"](v11)
    assert (content, calls_of(calls), failures) == ("I will check both.", [("get_weather", {"city": "Paris"}), ("search", NESTED)], 0)
    assert calls[1]["id"] == "Xy12Ab34C"
    assert calls[0]["function"]["arguments"] == '{"city": "Paris"}'  # the generated bytes
    assert parse("mistral", '[TOOL_CALLS]add{"a": 3.5, "b": 4}') == ("", [("add", {"a": 3.5, "b": 4})], 0)
    assert parse("mistral", "No tools needed: 4.") == ("No tools needed: 4.", [], 0)


def test_mistral_round_trip_and_malformed() -> None:
    text = 'Ok.[TOOL_CALLS]a[ARGS]' + json.dumps(NESTED) + '[TOOL_CALLS]b[ARGS]{}'
    round_trips("mistral", text, exact=True)
    content, calls, _ = TOOL_PARSERS["mistral"](text)
    assert parse("mistral", render_mistral(content, calls, legacy=True)) == (content, calls_of(calls), 0)
    assert parse("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Par') == ('[TOOL_CALLS]get_weather[ARGS]{"city": "Par', [], 1)
    assert parse("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": "x"}]') == ('[TOOL_CALLS] [{"name": "f", "arguments": "x"}]', [], 1)
    # One good call and one broken: the good one is kept, the broken one stays as text.
    assert parse("mistral", '[TOOL_CALLS]a[ARGS]{}[TOOL_CALLS]b[ARGS]{oops}') == ("[TOOL_CALLS]b[ARGS]{oops}", [("a", {})], 1)


# --- Qwen3-Coder XML -------------------------------------------------------------------------------
# Sources: Qwen3-Coder's chat template (Qwen/Qwen3-Coder-30B-A3B-Instruct chat_template.jinja:
# `<tool_call>\n<function=NAME>\n<parameter=ARG>\nVALUE\n</parameter>\n</function>\n</tool_call>`,
# mappings and lists as JSON); vLLM vllm/entrypoints/openai/tool_parsers/qwen3coder_tool_parser.py;
# SGLang python/sglang/srt/function_call/qwen3_coder_detector.py.

QWEN3_CODER = """I'll write the file, then run it.

<tool_call>
<function=write_file>
<parameter=path>
src/main.py
</parameter>
<parameter=content>
def greet(name):
    print(f"Hello, {name}! \\u00e9 — ünïcode")
</parameter>
</function>
</tool_call>
<tool_call>
<function=run>
<parameter=argv>
["python", "-c", "print('ok')"]
</parameter>
<parameter=options>
{"timeout": 30, "env": {"A": "1"}}
</parameter>
<parameter=retries>
2
</parameter>
</function>
</tool_call>"""


def test_qwen3_coder_calls() -> None:
    content, calls, failures = parse("qwen3_coder", QWEN3_CODER)
    assert content == "I'll write the file, then run it." and failures == 0
    assert calls == [
        ("write_file", {"path": "src/main.py",
                        "content": 'def greet(name):\n    print(f"Hello, {name}! \\u00e9 — ünïcode")'}),
        ("run", {"argv": ["python", "-c", "print('ok')"], "options": {"timeout": 30, "env": {"A": "1"}}, "retries": 2}),
    ]
    # Cut off after </function>: still a call. No parameters: an empty object.
    assert parse("qwen3_coder", "<tool_call>\n<function=list_files>\n</function>\n") == ("", [("list_files", {})], 0)


def test_qwen3_coder_round_trip_and_malformed() -> None:
    round_trips("qwen3_coder", QWEN3_CODER, exact=True)
    for bad in ("<tool_call>\n<function=write_file>\n<parameter=path>\nsrc/main.py\n</parameter>\n",  # cut off
                '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',  # Hermes JSON, not this format
                "<tool_call>\n<function=f>\nstray text\n</function>\n</tool_call>"):
        assert parse("qwen3_coder", bad) == (bad, [], 1)
    text = "<tool_call>\n<function=a>\n</function>\n</tool_call>\n<tool_call>\n<function=>\n</function>\n</tool_call>"
    assert parse("qwen3_coder", text) == ("<tool_call>\n<function=>\n</function>\n</tool_call>", [("a", {})], 1)


# --- DeepSeek V3 / V3.1 / R1 -----------------------------------------------------------------------
# Sources: vLLM vllm/entrypoints/openai/tool_parsers/deepseekv3_tool_parser.py (the docstring's
# '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_current_weather\n```json\n
# {"location": "Beijing"}\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>') and deepseekv31_tool_parser.py
# (`NAME<｜tool▁sep｜>ARGS`); SGLang python/sglang/srt/function_call/deepseekv3_detector.py and
# deepseekv31_detector.py; R1's reasoning is `<think>` (vLLM reasoning parser deepseek_r1; its template
# opens the block, so the text starts inside it).

DEEPSEEK_V3 = ("Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_current_weather\n"
               '```json\n{"location": "Beijing"}\n```<｜tool▁call▁end｜>\n'
               "<｜tool▁call▁begin｜>function<｜tool▁sep｜>search\n```json\n" + json.dumps(NESTED, ensure_ascii=False)
               + "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>")


def test_deepseek_v3_and_v31_calls() -> None:
    content, calls, failures = TOOL_PARSERS["deepseek_v3"](DEEPSEEK_V3)
    assert (content, calls_of(calls), failures) == (
        "Let me check.", [("get_current_weather", {"location": "Beijing"}), ("search", NESTED)], 0)
    assert calls[0]["function"]["arguments"] == '{"location": "Beijing"}'
    v31 = ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "東京"}<｜tool▁call▁end｜>'
           '<｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
    assert parse("deepseek_v3", v31) == ("", [("get_weather", {"city": "東京"}), ("get_time", {})], 0)


def test_deepseek_r1_reasoning_then_a_call() -> None:
    text = ("The user wants Beijing's weather; call the tool.\n</think>\n\n" + DEEPSEEK_V3)
    message = parse_generation(text, tools_offered=True, tool_parser=TOOL_PARSERS["deepseek_v3"],
                               reasoning_parser=REASONING_PARSERS["deepseek_r1"])
    assert message["reasoning_content"] == "The user wants Beijing's weather; call the tool."
    assert message["content"] == "Let me check." and message["parse_failures"] == 0
    assert calls_of(message["tool_calls"]) == [("get_current_weather", {"location": "Beijing"}), ("search", NESTED)]


def test_deepseek_round_trip_and_malformed() -> None:
    round_trips("deepseek_v3", DEEPSEEK_V3)
    round_trips("deepseek_v3", DEEPSEEK_V3.removesuffix("<｜end▁of▁sentence｜>"), exact=True)
    content, calls, _ = TOOL_PARSERS["deepseek_v3"](DEEPSEEK_V3)
    assert parse("deepseek_v3", render_deepseek_v3(content, calls, v31=True)) == (content, calls_of(calls), 0)
    cut = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": "
    assert parse("deepseek_v3", cut) == (cut, [], 1)
    bad_json = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>a\n```json\n{}\n```<｜tool▁call▁end｜>"
                "<｜tool▁call▁begin｜>function<｜tool▁sep｜>b\n```json\n{'x': 1}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
    content, calls, failures = parse("deepseek_v3", bad_json)
    assert calls == [("a", {})] and failures == 1 and "{'x': 1}" in content


# --- GLM-4.5 ---------------------------------------------------------------------------------------
# Sources: GLM-4.5's chat template (zai-org/GLM-4.5 chat_template.jinja: '\n<tool_call>' + name, then per
# argument '<arg_key>k</arg_key>\n<arg_value>{{ v | tojson if v is not string else v }}</arg_value>\n');
# vLLM vllm/entrypoints/openai/tool_parsers/glm4_moe_tool_parser.py; SGLang
# python/sglang/srt/function_call/glm4_moe_detector.py; reasoning is `<think>` (vLLM reasoning parser glm45).

GLM45 = ("I'll search and then fetch.\n<tool_call>web_search\n<arg_key>query</arg_key>\n"
         "<arg_value>\"quoted\" news — 日本</arg_value>\n<arg_key>options</arg_key>\n"
         "<arg_value>{\"limit\": 5, \"sites\": [\"a.org\"]}</arg_value>\n</tool_call>"
         "\n<tool_call>fetch\n<arg_key>url</arg_key>\n<arg_value>https://a.org/x?q=1</arg_value>\n"
         "<arg_key>verbose</arg_key>\n<arg_value>false</arg_value>\n</tool_call>")


def test_glm45_calls_with_reasoning() -> None:
    message = parse_generation("<think>Two steps.</think>" + GLM45, tools_offered=True,
                               tool_parser=TOOL_PARSERS["glm45"], reasoning_parser=REASONING_PARSERS["think"])
    assert message["reasoning_content"] == "Two steps." and message["content"] == "I'll search and then fetch."
    assert calls_of(message["tool_calls"]) == [
        ("web_search", {"query": '"quoted" news — 日本', "options": {"limit": 5, "sites": ["a.org"]}}),
        ("fetch", {"url": "https://a.org/x?q=1", "verbose": False}),
    ]
    assert parse("glm45", "<tool_call>get_time\n</tool_call>") == ("", [("get_time", {})], 0)


def test_glm45_round_trip_and_malformed() -> None:
    round_trips("glm45", GLM45, exact=True)
    for bad in ("<tool_call>fetch\n<arg_key>url</arg_key>\n<arg_value>https://a.org",  # cut off
                "<tool_call>fetch\n<arg_key>url</arg_key>\n</tool_call>",  # a key without its value
                '<tool_call>{"name": "fetch", "arguments": {}}</tool_call>'):  # Hermes JSON
        assert parse("glm45", bad) == (bad, [], 1)


# --- gpt-oss harmony -------------------------------------------------------------------------------
# Sources: openai/harmony docs/format.md ("Receiving tool calls": '<|channel|>analysis<|message|>Need to use
# function get_weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather
# <|constrain|>json<|message|>{"location":"San Francisco"}<|call|>'; the recipient may be in the role or
# the channel part of the header; preambles on commentary; final answers on `final`); vLLM
# vllm/entrypoints/openai/tool_parsers/openai_tool_parser.py; SGLang python/sglang/srt/function_call/gpt_oss_detector.py.

HARMONY_CALL = ('<|channel|>analysis<|message|>Need to use function get_weather.<|end|><|start|>assistant'
                '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"location":"San Francisco"}<|call|>')
HARMONY_FINAL = ('<|channel|>analysis<|message|>User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.<|end|>'
                 '<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>')


def test_harmony_reasoning_and_calls() -> None:
    reasoning, content, calls, failures = parse_harmony(HARMONY_CALL)
    assert (reasoning, content, calls_of(calls), failures) == (
        "Need to use function get_weather.", "", [("get_weather", {"location": "San Francisco"})], 0)
    assert parse_harmony(HARMONY_FINAL)[:2] == ('User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.', "2 + 2 = 4.")
    # A preamble, then two calls, the recipient once in the role part; the stop tokens stripped by the server.
    text = ('<|channel|>analysis<|message|>Plan: two lookups.<|end|><|start|>assistant<|channel|>commentary<|message|>'
            'Checking both cities.<|end|><|start|>assistant<|channel|>commentary to=functions.search <|constrain|>json'
            '<|message|>' + json.dumps(NESTED, ensure_ascii=False) + '<|call|><|start|>assistant to=functions.get_weather'
            '<|channel|>commentary json<|message|>{"location": "Zürich"}')
    reasoning, content, calls, failures = parse_harmony(text)
    assert (reasoning, content, failures) == ("Plan: two lookups.", "Checking both cities.", 0)
    assert calls_of(calls) == [("search", NESTED), ("get_weather", {"location": "Zürich"})]


def test_harmony_through_both_parsers() -> None:
    def generation(text: str, tools: bool = True) -> dict[str, Any]:
        return parse_generation(text, tools_offered=tools, tool_parser=TOOL_PARSERS["harmony"],
                                reasoning_parser=REASONING_PARSERS["harmony"])

    message = generation(HARMONY_CALL)
    assert message["reasoning_content"] == "Need to use function get_weather." and message["content"] == ""
    assert calls_of(message["tool_calls"]) == [("get_weather", {"location": "San Francisco"})]
    message = generation(HARMONY_FINAL, tools=False)
    assert message["content"] == "2 + 2 = 4." and message["tool_calls"] == []
    assert generation("plain text, no channels") == {"role": "assistant", "content": "plain text, no channels",
                                                     "tool_calls": [], "reasoning_content": None, "parse_failures": 0}


def test_harmony_round_trip_and_malformed() -> None:
    for text in (HARMONY_CALL, HARMONY_FINAL):
        reasoning, content, calls, _ = parse_harmony(text)
        again = parse_harmony(render_harmony(content, calls, reasoning))
        assert (again[0], again[1], calls_of(again[2]), again[3]) == (reasoning, content, calls_of(calls), 0)
    bad = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"location": "San Fr'
    reasoning, content, calls, failures = parse_harmony(bad)
    assert (calls, failures) == ([], 1) and '{"location": "San Fr' in content
    message = parse_generation("<|channel|>analysis<|message|>x<|end|>" + bad.replace("<|channel|>", "<|start|>assistant<|channel|>", 1),
                               tools_offered=True, tool_parser=TOOL_PARSERS["harmony"],
                               reasoning_parser=REASONING_PARSERS["harmony"])
    assert message["tool_calls"] == [] and message["parse_failures"] == 1 and "San Fr" in message["content"]


def test_no_parser_raises_on_hostile_text() -> None:
    """Every family on every other family's text, cut at every length: an answer, never an exception."""
    samples = [QWEN3_CODER, DEEPSEEK_V3, GLM45, HARMONY_CALL, '[TOOL_CALLS]a[ARGS]{"x": [1, {"y": "}"}]}',
               '<|python_tag|>{"name": "a", "parameters": {"b": "{"}}']
    for parser in TOOL_PARSERS.values():
        for sample in samples:
            for cut in range(0, len(sample), 7):
                result = parser(sample[:cut])
                assert isinstance(result[0], str) and all(c["function"]["name"] for c in result[1])
    for parser in REASONING_PARSERS.values():
        for sample in samples:
            for cut in range(0, len(sample), 7):
                parser(sample[:cut])
