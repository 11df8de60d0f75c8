"""Rollouts as OpenTelemetry traces: what an agent server emits when its config sets `tracing`.

    tracing: {otlp_endpoint: http://127.0.0.1:6006, project: weather}

Each `POST /run` becomes one trace, written after the rollout finished (nothing runs on the rollout's
path while it runs): a root span (OpenInference kind AGENT: the task's input, the final answer, reward,
status, rollout and group ids), one LLM span per model call with the exact token ids, sampling logprobs
and `model_version` the model server returned, one TOOL span per tool call, and the reward as an
EVALUATOR span. The attribute names are those rollgym.traces reads back (`trace://phoenix/...`), so a
rollout traced here trains token-exact. Without `tracing` nothing is imported or done (the default).
The OpenTelemetry SDK is the `traces` extra.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

# rollgym's own span attributes (rollgym.traces.conventions reads and writes the same).
EPISODE_ID, EPISODE_TASK = "rollgym.episode.id", "rollgym.episode.task"
PROMPT_IDS, COMPLETION_IDS = "rollgym.prompt_token_ids", "rollgym.completion_token_ids"
LOGPROBS, MODEL_VERSION = "rollgym.completion_logprobs", "rollgym.model_version"
REWARD_VALUE, REWARD_SOURCE, REWARD_NAME = "rollgym.reward.value", "rollgym.reward.source", "rollgym.reward.name"


class TracingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    otlp_endpoint: str = Field(description="an OTLP/HTTP endpoint (Phoenix: http://host:6006; a collector: "
                                           "http://host:4318; LangFuse: https://host/api/public/otel)")
    project: str | None = Field(default=None, description="the Phoenix project (resource openinference.project.name)")
    headers: dict[str, str] = Field(default_factory=dict, description="sent with every export (e.g. LangFuse's "
                                                                      "Authorization: Basic ...)")


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return "" if content is None else json.dumps(content)


def chat_messages(items: list[Any]) -> list[dict[str, Any]]:
    """Responses items (input or output) as chat messages, for a model call's input/output attributes."""
    messages: list[dict[str, Any]] = []
    for item in items:
        if not isinstance(item, dict):
            continue
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item.get("role", "user"), "content": _text(item.get("content"))})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "content": _text(item.get("output")), "tool_call_id": item.get("call_id")})
    return messages


def _message_attributes(prefix: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i, message in enumerate(messages):
        base = f"{prefix}.{i}.message"
        out[f"{base}.role"] = str(message.get("role"))
        if message.get("content") is not None:
            out[f"{base}.content"] = str(message["content"])
        for j, call in enumerate(message.get("tool_calls") or []):
            out[f"{base}.tool_calls.{j}.tool_call.function.name"] = str(call["function"]["name"])
            out[f"{base}.tool_calls.{j}.tool_call.function.arguments"] = str(call["function"]["arguments"])
    return out


class RolloutTracer:
    """One trace per finished rollout, exported in a background thread (BatchSpanProcessor)."""

    def __init__(self, config: TracingConfig, service_name: str) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        endpoint = config.otlp_endpoint.rstrip("/")
        endpoint = endpoint if endpoint.endswith("/v1/traces") else endpoint + "/v1/traces"
        attributes = {"service.name": service_name}
        if config.project:
            attributes["openinference.project.name"] = config.project
        self.provider = TracerProvider(resource=Resource.create(attributes))
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint,
                                                                             headers=config.headers or None)))
        self.tracer = self.provider.get_tracer("rollgym.agent")

    def record(self, task: dict[str, Any], result: dict[str, Any], start_ns: int, end_ns: int) -> None:
        from opentelemetry import trace
        from opentelemetry.trace import Status, StatusCode

        params = task.get("responses_create_params") or {}
        given = params.get("input")
        prompt = chat_messages([{"type": "message", "role": "user", "content": given}] if isinstance(given, str)
                               else list(given or []))
        response = result.get("response") if isinstance(result.get("response"), dict) else {}
        output = [item for item in response.get("output") or [] if isinstance(item, dict)]
        answer = chat_messages(output)
        status = str(result.get("status") or "ok")
        root_attrs: dict[str, Any] = {"openinference.span.kind": "AGENT", "input.value": json.dumps(prompt),
                                      "output.value": _text(answer[-1]["content"]) if answer else "",
                                      "rollgym.status": status}
        for key, attr in (("rollout_id", EPISODE_ID), ("group_id", "rollgym.group_id")):
            if result.get(key) or task.get(key):
                root_attrs[attr] = str(result.get(key) or task.get(key))
        root = self.tracer.start_span("rollout", attributes=root_attrs, start_time=start_ns)
        context = trace.set_span_in_context(root)
        spans: list[tuple[str, dict[str, Any]]] = []
        for i, item in enumerate(output):
            if item.get("generation_token_ids") is not None:  # a model call (its message or function call)
                attrs = {"openinference.span.kind": "LLM", "gen_ai.operation.name": "chat",
                         PROMPT_IDS: list(item.get("prompt_token_ids") or []),
                         COMPLETION_IDS: list(item["generation_token_ids"]),
                         LOGPROBS: [float(x) for x in item.get("generation_log_probs") or []],
                         **_message_attributes("llm.input_messages", prompt + chat_messages(output[:i])),
                         **_message_attributes("llm.output_messages", chat_messages([item]))}
                for j, tool in enumerate(params.get("tools") or []):  # OpenInference's record of the offered tools
                    attrs[f"llm.tools.{j}.tool.json_schema"] = json.dumps(tool)
                if item.get("model_version"):
                    attrs[MODEL_VERSION] = str(item["model_version"])
                if response.get("model"):
                    attrs["llm.model_name"] = attrs["gen_ai.request.model"] = str(response["model"])
                spans.append(("chat", attrs))
            if item.get("type") == "function_call":
                attrs = {"openinference.span.kind": "TOOL", "tool.name": str(item.get("name")),
                         "input.value": str(item.get("arguments")), "tool.parameters": str(item.get("arguments"))}
                result_item = next((o for o in output if o.get("type") == "function_call_output"
                                    and o.get("call_id") == item.get("call_id")), None)
                if result_item is not None:
                    attrs["output.value"] = _text(result_item.get("output"))
                spans.append((str(item.get("name")), attrs))
        step = max((end_ns - start_ns) // max(len(spans), 1), 1)  # the order is known, not each call's time
        for n, (name, attrs) in enumerate(spans):
            span = self.tracer.start_span(name, context=context, attributes=attrs, start_time=start_ns + n * step)
            span.end(end_time=start_ns + (n + 1) * step)
        if result.get("reward") is not None:
            span = self.tracer.start_span("reward", context=context, start_time=end_ns, attributes={
                "openinference.span.kind": "EVALUATOR", REWARD_VALUE: float(result["reward"]),
                REWARD_SOURCE: "verify", REWARD_NAME: "reward"})
            span.end(end_time=end_ns)
        root.set_status(Status(StatusCode.OK) if status == "ok" else Status(StatusCode.ERROR, str(result.get("error"))))
        root.end(end_time=end_ns)


def rollout_tracer(config: Any, service_name: str) -> RolloutTracer | None:
    """The server's tracer when its config sets `tracing`, else None (and nothing imported)."""
    tracing = getattr(config, "tracing", None)
    return RolloutTracer(tracing, service_name) if tracing is not None else None


__all__ = ["RolloutTracer", "TracingConfig", "chat_messages", "rollout_tracer"]
