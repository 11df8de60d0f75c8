"""Unit tests for the Responses <-> Chat Completions converter."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
from openai.types.responses import (
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseReasoningItem,
    ResponseUsage,
)


def _load_module():
    """The converter module: the installed package if present, else loaded by file path."""
    try:
        from rollgym import chat_conversion  # type: ignore[import-not-found]

        return chat_conversion
    except ImportError:
        pass
    name = "_rollgym_chat_conversion_under_test"
    if name in sys.modules:
        return sys.modules[name]
    path = Path(__file__).resolve().parents[2] / "services" / "rollgym" / "chat_conversion.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look the module up while building the class
    spec.loader.exec_module(module)
    return module


cc = _load_module()
ConversionError = cc.ConversionError

WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "strict": True,
}
CHAT_WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
# WEATHER_TOOL as a chat tool: its strict: true goes along (false, the default, would be left out).
STRICT_CHAT_WEATHER_TOOL = {"type": "function", "function": {**CHAT_WEATHER_TOOL["function"], "strict": True}}


def _validate_item(item: dict) -> None:
    """Validate one output item with the matching openai model."""
    model = {
        "message": ResponseOutputMessage,
        "function_call": ResponseFunctionToolCall,
        "reasoning": ResponseReasoningItem,
    }[item["type"]]
    model.model_validate(item)


# ---------------------------------------------------------------------------
# responses_to_chat_request
# ---------------------------------------------------------------------------


def test_string_input_becomes_one_user_message():
    body = cc.responses_to_chat_request({"model": "m", "input": "hi"})
    assert body == {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_model_argument_overrides_params_and_none_model_is_omitted():
    assert cc.responses_to_chat_request({"model": "m", "input": "x"}, model="served")["model"] == "served"
    assert "model" not in cc.responses_to_chat_request({"input": "x"})


def test_instructions_and_message_roles():
    params = {
        "instructions": "Be brief.",
        "input": [
            {"role": "developer", "content": "Dev note."},
            {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "Sys."}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
            {"role": "assistant", "content": "plain assistant"},
        ],
    }
    assert cc.responses_to_chat_request(params)["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Dev note."},
        {"role": "system", "content": "Sys."},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "plain assistant"},
    ]
    dev = cc.responses_to_chat_request(params, system_role="developer")["messages"]
    assert [m["role"] for m in dev] == ["developer", "developer", "developer", "user", "assistant"]


def test_empty_instructions_add_no_message():
    assert cc.responses_to_chat_request({"instructions": "", "input": "x"})["messages"] == [{"role": "user", "content": "x"}]


def test_output_style_assistant_message_and_extra_keys_ignored():
    params = {
        "input": [
            {"role": "user", "content": "q", "prompt_token_ids": [1, 2]},
            {
                "type": "message",
                "role": "assistant",
                "id": "msg_1",
                "status": "completed",
                "content": [{"type": "output_text", "text": "answer", "annotations": []}],
                "prompt_token_ids": [1, 2],
                "generation_token_ids": [3],
                "generation_log_probs": [-0.1],
            },
        ]
    }
    assert cc.responses_to_chat_request(params)["messages"] == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "answer"},
    ]


def test_one_model_turn_merges_into_one_assistant_message():
    params = {
        "input": [
            {"role": "user", "content": "weather in Paris and Rome?"},
            {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "need tools"}]},
            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
             "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
            {"type": "function_call", "id": "fc_1", "call_id": "call_a", "name": "get_weather", "arguments": '{"city":"Paris"}'},
            {"type": "function_call", "id": "fc_2", "call_id": "call_b", "name": "get_weather", "arguments": '{"city":"Rome"}'},
            {"type": "function_call_output", "call_id": "call_a", "output": "sunny"},
            {"type": "function_call_output", "call_id": "call_b", "output": [{"type": "input_text", "text": "rain"}]},
        ]
    }
    assert cc.responses_to_chat_request(params)["messages"] == [
        {"role": "user", "content": "weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
                {"id": "call_b", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'}},
            ],
            "reasoning_content": "need tools",
        },
        {"role": "tool", "tool_call_id": "call_a", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_b", "content": "rain"},
    ]


def test_function_call_without_text_has_none_content():
    params = {
        "input": [
            {"role": "user", "content": "q"},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "r"},
        ]
    }
    assert cc.responses_to_chat_request(params)["messages"][1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
    }


def test_reasoning_starts_a_new_turn_after_tool_calls():
    # Two model turns back to back (no tool output between): they must not merge.
    params = {
        "input": [
            {"role": "user", "content": "q"},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "r1"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "r2"}],
             "content": [{"type": "reasoning_text", "text": "full r2"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "done"}]},
        ]
    }
    msgs = cc.responses_to_chat_request(params)["messages"]
    assert msgs[1:] == [
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
         "reasoning_content": "r1"},
        # reasoning_text content wins over the summary
        {"role": "assistant", "content": "done", "reasoning_content": "full r2"},
    ]


def test_text_after_tool_calls_starts_a_new_assistant_message():
    params = {
        "input": [
            {"role": "user", "content": "q"},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"role": "assistant", "content": "later"},
        ]
    }
    assert cc.responses_to_chat_request(params)["messages"][1:] == [
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "assistant", "content": "later"},
    ]


def test_reasoning_only_turn_gets_empty_content():
    params = {
        "input": [
            {"role": "user", "content": "q"},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "thinking..."}]},
            {"role": "user", "content": "go on"},
        ]
    }
    assert cc.responses_to_chat_request(params)["messages"] == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "reasoning_content": "thinking..."},
        {"role": "user", "content": "go on"},
    ]


def test_tools_tool_choice_and_sampling_params():
    params = {
        "model": "m",
        "input": "q",
        "tools": [WEATHER_TOOL, {"type": "function", "name": "noop"}],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "max_output_tokens": 64,
        "temperature": 0.7,
        "top_p": 0.9,
        "parallel_tool_calls": False,
        "seed": 3,
        "stop": ["\n\n"],
        "metadata": {"a": "b"},
        "store": False,
        "previous_response_id": None,
        "reasoning": {"effort": "low"},
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
    }
    assert cc.responses_to_chat_request(params) == {
        "model": "m",
        "messages": [{"role": "user", "content": "q"}],
        "tools": [STRICT_CHAT_WEATHER_TOOL, {"type": "function", "function": {"name": "noop"}}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": 64,
        "temperature": 0.7,
        "top_p": 0.9,
        "parallel_tool_calls": False,
        "seed": 3,
        "stop": ["\n\n"],
    }


@pytest.mark.parametrize("choice", ["auto", "none", "required"])
def test_string_tool_choice_passes_through(choice):
    body = cc.responses_to_chat_request({"input": "q", "tools": [WEATHER_TOOL], "tool_choice": choice})
    assert body["tool_choice"] == choice


def test_none_sampling_values_and_tool_choice_without_tools_are_dropped():
    body = cc.responses_to_chat_request(
        {"input": "q", "temperature": None, "top_p": None, "max_output_tokens": None, "tools": [], "tool_choice": "auto"}
    )
    assert body == {"messages": [{"role": "user", "content": "q"}]}


def test_non_function_tool_is_rejected_with_field():
    with pytest.raises(ConversionError) as err:
        cc.responses_to_chat_request({"input": "q", "tools": [WEATHER_TOOL, WEATHER_TOOL, {"type": "web_search"}]})
    assert err.value.field == "tools[2].type"
    assert isinstance(err.value, ValueError)


def test_unissued_call_id_is_rejected_with_field():
    params = {
        "input": [
            {"role": "user", "content": "q"},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"},
            {"type": "function_call_output", "call_id": "nope", "output": "x"},
        ]
    }
    with pytest.raises(ConversionError) as err:
        cc.responses_to_chat_request(params)
    assert err.value.field == "input[3].call_id"


def test_unknown_item_type_is_rejected_with_field():
    params = {"input": [{"role": "user", "content": "q"}, {"type": "item_reference", "id": "x"}]}
    with pytest.raises(ConversionError) as err:
        cc.responses_to_chat_request(params)
    assert err.value.field == "input[1].type"


def test_unknown_role_and_image_part_and_bad_tool_choice_are_rejected():
    with pytest.raises(ConversionError) as err:
        cc.responses_to_chat_request({"input": [{"role": "critic", "content": "x"}]})
    assert err.value.field == "input[0].role"
    with pytest.raises(ConversionError) as err:
        cc.responses_to_chat_request(
            {"input": [{"role": "user", "content": [{"type": "input_text", "text": "x"}, {"type": "input_image", "image_url": "u"}]}]}
        )
    assert err.value.field == "input[0].content[1].type"
    with pytest.raises(ConversionError) as err:
        cc.responses_to_chat_request({"input": "q", "tools": [WEATHER_TOOL], "tool_choice": {"type": "web_search"}})
    assert err.value.field == "tool_choice"


# ---------------------------------------------------------------------------
# chat_response_to_output
# ---------------------------------------------------------------------------


def _chat(message: dict, finish_reason: str = "stop", usage: dict | None = None) -> dict:
    body = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 0,
        "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", **message}, "logprobs": None, "finish_reason": finish_reason}],
    }
    if usage is not None:
        body["usage"] = usage
    return body


def test_text_response_to_output():
    out = cc.chat_response_to_output(
        _chat({"content": "Hello", "tool_calls": [], "reasoning_content": None},
              usage={"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12})
    )
    assert out.status == "completed"
    assert out.incomplete_details is None
    assert len(out.output) == 1
    msg = out.output[0]
    assert re.fullmatch(r"msg_[0-9a-f]{24}", msg["id"])
    assert msg == {
        "type": "message",
        "id": msg["id"],
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": "Hello", "annotations": []}],
    }
    assert out.usage == {
        "input_tokens": 10,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": 2,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 12,
    }
    ResponseUsage.model_validate(out.usage)
    _validate_item(msg)


def test_tool_calls_and_reasoning_to_output():
    out = cc.chat_response_to_output(
        _chat(
            {
                "content": None,
                "reasoning_content": "Need the weather.",
                "tool_calls": [
                    {"id": "call_x", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
                    {"id": "", "type": "function", "function": {"name": "noop", "arguments": {"a": 1}}},
                ],
            },
            finish_reason="tool_calls",
        )
    )
    assert [item["type"] for item in out.output] == ["reasoning", "function_call", "function_call"]
    rs, fc1, fc2 = out.output
    assert re.fullmatch(r"rs_[0-9a-f]{24}", rs["id"])
    assert rs == {"type": "reasoning", "id": rs["id"], "summary": [{"type": "summary_text", "text": "Need the weather."}]}
    assert re.fullmatch(r"fc_[0-9a-f]{24}", fc1["id"])
    assert fc1 == {
        "type": "function_call",
        "id": fc1["id"],
        "call_id": "call_x",
        "name": "get_weather",
        "arguments": '{"city": "Oslo"}',
        "status": "completed",
    }
    assert re.fullmatch(r"call_[0-9a-f]{24}", fc2["call_id"])  # missing id -> generated
    assert fc2["arguments"] == '{"a": 1}'
    assert out.usage["total_tokens"] == 0  # no usage in the chat body
    for item in out.output:
        _validate_item(item)
    ResponseUsage.model_validate(out.usage)


def test_reasoning_field_alias_and_usage_details():
    out = cc.chat_response_to_output(
        _chat(
            {"content": "ok", "reasoning": "via reasoning"},
            usage={"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12,
                   "prompt_tokens_details": {"cached_tokens": 3}, "completion_tokens_details": {"reasoning_tokens": 4}},
        )
    )
    assert out.output[0]["summary"] == [{"type": "summary_text", "text": "via reasoning"}]
    assert out.output[1]["content"][0]["text"] == "ok"
    assert out.usage["input_tokens_details"] == {"cached_tokens": 3, "cache_write_tokens": 0}
    ResponseUsage.model_validate(out.usage)
    assert out.usage["output_tokens_details"] == {"reasoning_tokens": 4}


@pytest.mark.parametrize(
    ("content", "reasoning", "text"),
    [
        ("<think>\nstep 1\n</think>\n\nAnswer: 4", "step 1", "Answer: 4"),
        ("step 1\n</think>\n\nAnswer: 4", "step 1", "Answer: 4"),  # template opened the block
        ("<think>still going", "still going", None),  # cut off while thinking
        ("<think></think>Just text", None, "Just text"),
        ("No tags here", None, "No tags here"),
    ],
)
def test_think_tag_parsing(content, reasoning, text):
    out = cc.chat_response_to_output(_chat({"content": content}, finish_reason="stop"))
    reasoning_items = [i for i in out.output if i["type"] == "reasoning"]
    messages = [i for i in out.output if i["type"] == "message"]
    if reasoning is None:
        assert reasoning_items == []
    else:
        assert [i["summary"][0]["text"] for i in reasoning_items] == [reasoning]
        assert out.output[0]["type"] == "reasoning"
    if text is None:
        assert messages == []
    else:
        assert [m["content"][0]["text"] for m in messages] == [text]
    for item in out.output:
        _validate_item(item)


def test_think_tags_kept_when_parsing_disabled():
    out = cc.chat_response_to_output(_chat({"content": "<think>x</think>y"}), parse_think_tags=False)
    assert [i["type"] for i in out.output] == ["message"]
    assert out.output[0]["content"][0]["text"] == "<think>x</think>y"


def test_think_tags_combine_with_reasoning_field():
    out = cc.chat_response_to_output(_chat({"content": "<think>b</think>c", "reasoning_content": "a"}))
    assert out.output[0]["summary"][0]["text"] == "a\n\nb"


def test_length_finish_is_incomplete():
    out = cc.chat_response_to_output(_chat({"content": "cut"}, finish_reason="length"))
    assert out.status == "incomplete"
    assert out.incomplete_details == {"reason": "max_output_tokens"}


def test_whitespace_only_content_gives_no_message_and_refusal_is_kept():
    out = cc.chat_response_to_output(
        _chat({"content": "\n\n", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]})
    )
    assert [i["type"] for i in out.output] == ["function_call"]
    out = cc.chat_response_to_output(_chat({"content": None, "refusal": "I can't."}))
    assert out.output[0]["content"] == [{"type": "refusal", "refusal": "I can't."}]
    _validate_item(out.output[0])


def test_no_choices_is_an_error():
    with pytest.raises(ConversionError) as err:
        cc.chat_response_to_output({"choices": []})
    assert err.value.field == "choices"


def test_output_ids_are_unique():
    ids = {cc.chat_response_to_output(_chat({"content": "x"})).output[0]["id"] for _ in range(50)}
    assert len(ids) == 50


# ---------------------------------------------------------------------------
# reverse direction
# ---------------------------------------------------------------------------


def test_chat_tools_to_responses_tools():
    assert cc.chat_tools_to_responses_tools(
        [CHAT_WEATHER_TOOL, {"type": "function", "function": {"name": "noop", "strict": True}}]
    ) == [
        {"type": "function", "name": "get_weather", "description": "Current weather for a city.",
         "parameters": CHAT_WEATHER_TOOL["function"]["parameters"], "strict": None},
        {"type": "function", "name": "noop", "parameters": None, "strict": True},
    ]
    with pytest.raises(ConversionError) as err:
        cc.chat_tools_to_responses_tools([CHAT_WEATHER_TOOL, {"type": "custom", "custom": {"name": "x"}}])
    assert err.value.field == "tools[1].type"


def test_chat_tool_choice_to_responses():
    assert cc.chat_tool_choice_to_responses("auto") == "auto"
    assert cc.chat_tool_choice_to_responses({"type": "function", "function": {"name": "f"}}) == {"type": "function", "name": "f"}
    with pytest.raises(ConversionError):
        cc.chat_tool_choice_to_responses("sometimes")


def test_chat_messages_to_responses_input():
    messages = [
        {"role": "system", "content": "S"},
        {"role": "developer", "content": "D"},
        {"role": "user", "content": [{"type": "text", "text": "weather "}, {"type": "text", "text": "in Oslo?"}]},
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "use the tool",
         "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "cold"},
        {"role": "assistant", "content": "It is cold."},
    ]
    items = cc.chat_messages_to_responses_input(messages)
    assert re.fullmatch(r"rs_[0-9a-f]{24}", items[3]["id"])
    assert items == [
        {"type": "message", "role": "system", "content": "S"},
        {"type": "message", "role": "developer", "content": "D"},
        {"type": "message", "role": "user", "content": "weather in Oslo?"},
        {"type": "reasoning", "id": items[3]["id"], "summary": [{"type": "summary_text", "text": "use the tool"}]},
        {"type": "message", "role": "assistant", "content": "Let me check."},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Oslo"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "cold"},
        {"type": "message", "role": "assistant", "content": "It is cold."},
    ]
    ResponseReasoningItem.model_validate(items[3])
    ResponseFunctionToolCall.model_validate(items[5])


def test_chat_messages_errors():
    with pytest.raises(ConversionError) as err:
        cc.chat_messages_to_responses_input([{"role": "user", "content": "x"}, {"role": "function", "content": "y"}])
    assert err.value.field == "messages[1].role"
    with pytest.raises(ConversionError) as err:
        cc.chat_messages_to_responses_input([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}])
    assert err.value.field == "messages[0].content[0].type"
    with pytest.raises(ConversionError) as err:
        cc.chat_messages_to_responses_input([{"role": "tool", "content": "x"}])
    assert err.value.field == "messages[0].tool_call_id"


# ---------------------------------------------------------------------------
# round trips and multi-turn
# ---------------------------------------------------------------------------


def test_round_trip_responses_input_to_chat_and_back():
    items = [
        {"type": "message", "role": "system", "content": "S"},
        {"type": "message", "role": "user", "content": "weather in Oslo?"},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "use the tool"}]},
        {"type": "message", "role": "assistant", "content": "Checking."},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Oslo"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "cold"},
        {"type": "message", "role": "assistant", "content": "It is cold."},
    ]
    chat = cc.responses_to_chat_request({"input": items})
    back = cc.chat_messages_to_responses_input(chat["messages"])
    assert back[2]["id"].startswith("rs_")
    back[2]["id"] = "rs_1"
    assert back == items
    # and chat -> responses -> chat is the identity on the chat side
    assert cc.responses_to_chat_request({"input": back})["messages"] == chat["messages"]


def test_round_trip_tools():
    chat_tools = cc.responses_to_chat_request({"input": "q", "tools": [WEATHER_TOOL]})["tools"]
    assert chat_tools == [STRICT_CHAT_WEATHER_TOOL]
    assert cc.chat_tools_to_responses_tools(chat_tools) == [WEATHER_TOOL]


def test_multi_turn_tool_conversation_feeds_output_back_as_input():
    tools = [WEATHER_TOOL]
    conversation: list[dict] = [{"role": "user", "content": "What's the weather in Oslo?"}]

    # turn 1: model reasons and calls the tool
    req1 = cc.responses_to_chat_request({"model": "m", "input": conversation, "tools": tools})
    assert req1["messages"] == [{"role": "user", "content": "What's the weather in Oslo?"}]
    out1 = cc.chat_response_to_output(
        _chat(
            {"content": "<think>call get_weather</think>",
             "tool_calls": [{"id": "call_w", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}]},
            finish_reason="tool_calls",
            usage={"prompt_tokens": 20, "completion_tokens": 9, "total_tokens": 29},
        )
    )
    assert [i["type"] for i in out1.output] == ["reasoning", "function_call"]
    for item in out1.output:
        _validate_item(item)

    # the environment answers the call; output items go back verbatim (ids, status and all)
    conversation += out1.output
    conversation.append({"type": "function_call_output", "call_id": "call_w", "output": "-3C, snow"})
    req2 = cc.responses_to_chat_request({"model": "m", "input": conversation, "tools": tools})
    assert req2["messages"] == [
        {"role": "user", "content": "What's the weather in Oslo?"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "call_w", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}],
         "reasoning_content": "call get_weather"},
        {"role": "tool", "tool_call_id": "call_w", "content": "-3C, snow"},
    ]

    # turn 2: final answer
    out2 = cc.chat_response_to_output(_chat({"content": "It is -3C with snow in Oslo."}))
    conversation += out2.output
    conversation.append({"role": "user", "content": "Thanks!"})
    req3 = cc.responses_to_chat_request({"model": "m", "input": conversation, "tools": tools})
    assert req3["messages"][3:] == [
        {"role": "assistant", "content": "It is -3C with snow in Oslo."},
        {"role": "user", "content": "Thanks!"},
    ]
