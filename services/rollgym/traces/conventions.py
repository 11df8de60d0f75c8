"""Steps as span attributes and back, under the OpenInference and OpenTelemetry GenAI conventions.

Written: OpenInference's flat keys (`openinference.span.kind`, `llm.input_messages.0.message.role`,
`llm.tools.0.tool.json_schema`, `input.value`, `tool.name`, `tag.tags`, `metadata`), which Phoenix shows and LangFuse's OTLP endpoint maps,
plus GenAI's (`gen_ai.operation.name`, `gen_ai.request.model`, `gen_ai.usage.*`). Read: the same, and
GenAI's message and tool forms (`gen_ai.prompt.N.*` / `gen_ai.completion.N.*`, `gen_ai.input.messages` JSON,
`gen_ai.tool.definitions`), so
spans of agents instrumented by either family assemble alike. rollgym's own keys carry what only a
served call knows: token ids, sampling logprobs, the model version.
"""

from __future__ import annotations

import json
from typing import Any

from ..chat_conversion import ConversionError, chat_tools_to_responses_tools, responses_tools_to_chat_tools
from ..tracing import (  # the names the agent servers' rollout traces use too
    COMPLETION_IDS, EPISODE_ID, EPISODE_TASK, LOGPROBS, MODEL_VERSION, PROMPT_IDS, REWARD_NAME, REWARD_SOURCE,
    REWARD_VALUE,
)
from .schema import Reward, Step, TokenRecord

KIND = "openinference.span.kind"
INPUT, OUTPUT = "input.value", "output.value"
INPUT_MIME, OUTPUT_MIME = "input.mime_type", "output.mime_type"
TAGS, METADATA = "tag.tags", "metadata"
STEP_IDX = "rollgym.step.idx"
STEP_KINDS = {"llm": "LLM", "tool": "TOOL", "node": "CHAIN", "answer": "CHAIN"}
# The tools a model call advertised: OpenInference's `llm.tools.N.tool.json_schema` (each tool's JSON, as the
# openai instrumentation records the request's), GenAI's `gen_ai.tool.definitions` (one JSON list).
TOOLS, GENAI_TOOLS = "llm.tools", "gen_ai.tool.definitions"


def _json(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str)


def message_attributes(prefix: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """OpenInference's flat keys of a message list (`llm.input_messages.0.message.role`, ...)."""
    out: dict[str, Any] = {}
    for i, message in enumerate(messages):
        base = f"{prefix}.{i}.message"
        out[f"{base}.role"] = str(message.get("role", "user"))
        if message.get("content") is not None:
            out[f"{base}.content"] = _json(message["content"])
        if message.get("tool_call_id"):
            out[f"{base}.tool_call_id"] = str(message["tool_call_id"])
        for j, call in enumerate(message.get("tool_calls") or []):
            function = call.get("function") or call
            out[f"{base}.tool_calls.{j}.tool_call.function.name"] = str(function.get("name", ""))
            out[f"{base}.tool_calls.{j}.tool_call.function.arguments"] = _json(function.get("arguments", "{}"))
            if call.get("id"):
                out[f"{base}.tool_calls.{j}.tool_call.id"] = str(call["id"])
    return out


def tool_attributes(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """OpenInference's keys of the tools a model call advertised."""
    return {f"{TOOLS}.{i}.tool.json_schema": _json(tool) for i, tool in enumerate(tools)}


def chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A recorded tool (chat form `{type, function: {...}}`, or Responses' / GenAI's flat `{type, name, ...}`) as
    rollgym's model servers hand tools to a chat template (`responses_tools_to_chat_tools`: name, description,
    parameters); a tool that is no function tool stays as recorded."""
    try:
        flat = chat_tools_to_responses_tools([tool])[0] if isinstance(tool.get("function"), dict) else tool
        return responses_tools_to_chat_tools([flat])[0]
    except ConversionError:
        return tool


def tools_from(attrs: dict[str, Any]) -> list[dict[str, Any]]:
    """The tools a model call's span says it advertised, in the form its chat template got them."""
    found = [_maybe_json(fields.get("tool.json_schema")) for fields in _indexed(attrs, TOOLS).values()]
    if not found:
        whole = _maybe_json(attrs.get(GENAI_TOOLS))
        found = whole if isinstance(whole, list) else []
    return [chat_tool(tool) for tool in found if isinstance(tool, dict)]


def step_attributes(step: Step) -> dict[str, Any]:
    """The attributes of a step's span."""
    attrs: dict[str, Any] = {KIND: STEP_KINDS[step.kind], STEP_IDX: step.idx}
    if step.kind == "llm":
        attrs.update(message_attributes("llm.input_messages", step.input.get("messages") or []))
        attrs.update(message_attributes("llm.output_messages", step.output.get("messages") or []))
        attrs.update(tool_attributes(step.input.get("tools") or []))
        attrs["gen_ai.operation.name"] = "chat"
        if step.name:
            attrs["llm.model_name"] = attrs["gen_ai.request.model"] = step.name
        if step.tokens is not None:
            attrs[PROMPT_IDS] = list(step.tokens.prompt_ids)
            attrs[COMPLETION_IDS] = list(step.tokens.completion_ids)
            attrs["llm.token_count.prompt"] = attrs["gen_ai.usage.input_tokens"] = len(step.tokens.prompt_ids)
            attrs["llm.token_count.completion"] = attrs["gen_ai.usage.output_tokens"] = len(step.tokens.completion_ids)
            if step.tokens.completion_logprobs is not None:
                attrs[LOGPROBS] = [float(x) for x in step.tokens.completion_logprobs]
            if step.tokens.model_version:
                attrs[MODEL_VERSION] = step.tokens.model_version
    else:
        if step.kind == "tool" and step.name:
            attrs["tool.name"] = step.name
            attrs["tool.parameters"] = _json(step.input)
        attrs[INPUT], attrs[INPUT_MIME] = _json(step.input), "application/json"
        attrs[OUTPUT], attrs[OUTPUT_MIME] = _json(step.output), "application/json"
    for j, call in enumerate(step.tool_calls if step.kind != "llm" else []):
        attrs[f"rollgym.tool_calls.{j}.name"] = str(call.get("name", ""))
        attrs[f"rollgym.tool_calls.{j}.arguments"] = _json(call.get("arguments", {}))
    return attrs


def reward_attributes(reward: Reward, episode_id: str) -> dict[str, Any]:
    return {KIND: "EVALUATOR", EPISODE_ID: episode_id, REWARD_VALUE: float(reward.value),
            REWARD_SOURCE: reward.source, REWARD_NAME: reward.name,
            **({OUTPUT: reward.comment} if reward.comment else {})}


def _indexed(attrs: dict[str, Any], prefix: str) -> dict[int, dict[str, Any]]:
    """`prefix.N.rest` keys as {N: {rest: value}}."""
    found: dict[int, dict[str, Any]] = {}
    for key, value in attrs.items():
        if key.startswith(prefix + "."):
            index, _, rest = key[len(prefix) + 1:].partition(".")
            if index.isdigit():
                found.setdefault(int(index), {})[rest] = value
    return dict(sorted(found.items()))


def _maybe_json(value: Any) -> Any:
    if isinstance(value, str) and value[:1] in "{[":
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def messages_from(attrs: dict[str, Any], side: str) -> list[dict[str, Any]]:
    """A model call's input (side "input") or output messages, from whichever convention the span used."""
    oi = _indexed(attrs, f"llm.{side}_messages")
    if oi:
        messages = []
        for fields in oi.values():
            message: dict[str, Any] = {"role": fields.get("message.role", "user"),
                                       "content": fields.get("message.content")}
            if fields.get("message.tool_call_id"):
                message["tool_call_id"] = fields["message.tool_call_id"]
            calls = _indexed({k: v for k, v in fields.items() if k.startswith("message.tool_calls.")},
                             "message.tool_calls")
            if calls:
                message["tool_calls"] = [{"id": c.get("tool_call.id"), "type": "function", "function": {
                    "name": c.get("tool_call.function.name", ""),
                    "arguments": c.get("tool_call.function.arguments", "{}")}} for c in calls.values()]
            messages.append(message)
        return messages
    whole = attrs.get(f"gen_ai.{side}.messages")
    if isinstance(whole, str):
        parsed = _maybe_json(whole)
        if isinstance(parsed, list):
            return [genai_message(m) for m in parsed if isinstance(m, dict)]
    legacy = _indexed(attrs, "gen_ai.prompt" if side == "input" else "gen_ai.completion")
    return [{"role": f.get("role", "user" if side == "input" else "assistant"), "content": f.get("content")}
            for f in legacy.values()]


def genai_message(message: dict[str, Any]) -> dict[str, Any]:
    """A GenAI `gen_ai.*.messages` entry ({role, parts: [{type: text, content}, {type: tool_call, ...}]})."""
    if "parts" not in message:
        return message
    text = "".join(str(p.get("content", "")) for p in message["parts"] if p.get("type") == "text")
    out: dict[str, Any] = {"role": message.get("role", "user"), "content": text or None}
    calls = [p for p in message["parts"] if p.get("type") == "tool_call"]
    if calls:
        out["tool_calls"] = [{"id": c.get("id"), "type": "function", "function": {
            "name": c.get("name", ""), "arguments": _json(c.get("arguments", {}))}} for c in calls]
    responses = [p for p in message["parts"] if p.get("type") == "tool_call_response"]
    if responses:
        out["content"], out["tool_call_id"] = _json(responses[0].get("response")), responses[0].get("id")
    return out


def span_kind(attrs: dict[str, Any], name: str = "") -> str:
    kind = attrs.get(KIND)
    if kind:
        return str(kind).upper()
    operation = attrs.get("gen_ai.operation.name")
    if operation in ("chat", "text_completion", "generate_content"):
        return "LLM"
    if operation == "execute_tool":
        return "TOOL"
    if operation in ("invoke_agent", "create_agent"):
        return "AGENT"
    return "UNKNOWN"


def step_from(attrs: dict[str, Any], name: str, idx: int, ok: bool, error: str | None,
              lat_ms: int | None) -> Step | None:
    """The step a span records, or None for spans that are no step (the episode's root, an evaluator)."""
    kind = span_kind(attrs, name)
    if kind == "LLM":
        tokens = None
        if isinstance(attrs.get(PROMPT_IDS), list) and isinstance(attrs.get(COMPLETION_IDS), list):
            logprobs = attrs.get(LOGPROBS)
            tokens = TokenRecord(prompt_ids=attrs[PROMPT_IDS], completion_ids=attrs[COMPLETION_IDS],
                                 completion_logprobs=logprobs if isinstance(logprobs, list) else None,
                                 model_version=attrs.get(MODEL_VERSION))
        output = messages_from(attrs, "output")
        calls = [{"name": c["function"]["name"], "arguments": _maybe_json(c["function"]["arguments"]), "id": c.get("id")}
                 for m in output for c in m.get("tool_calls") or []]
        model = attrs.get("llm.model_name") or attrs.get("gen_ai.request.model") or attrs.get("gen_ai.response.model")
        tools = tools_from(attrs)
        return Step(idx=idx, kind="llm", name=model,
                    input={"messages": messages_from(attrs, "input"), **({"tools": tools} if tools else {})},
                    output={"messages": output}, tool_calls=calls, ok=ok, error=error, lat_ms=lat_ms, tokens=tokens)
    if kind in ("TOOL", "CHAIN"):
        tool = kind == "TOOL"
        raw_in = attrs.get("tool.parameters") if tool and INPUT not in attrs else attrs.get(INPUT)
        value_in, value_out = _maybe_json(raw_in), _maybe_json(attrs.get(OUTPUT))
        calls = [{"name": c.get("name"), "arguments": _maybe_json(c.get("arguments"))}
                 for c in _indexed(attrs, "rollgym.tool_calls").values()]
        return Step(idx=idx, kind="tool" if tool else "node",
                    name=str(attrs.get("tool.name") or attrs.get("gen_ai.tool.name") or name),
                    input=value_in if isinstance(value_in, dict) else {"value": value_in},
                    output=value_out if isinstance(value_out, dict) else {"value": value_out},
                    tool_calls=calls, ok=ok, error=error, lat_ms=lat_ms)
    return None


__all__ = ["EPISODE_ID", "EPISODE_TASK", "INPUT", "KIND", "METADATA", "OUTPUT", "REWARD_NAME", "REWARD_SOURCE",
           "REWARD_VALUE", "TAGS", "TOOLS", "chat_tool", "message_attributes", "messages_from", "reward_attributes",
           "span_kind", "step_attributes", "step_from", "tool_attributes", "tools_from"]
