"""emit() and the in-process hooks: learning events written as OpenTelemetry spans.

    from rollgym import traces

    traces.configure(store="runs/traces")                 # the default; or otlp_endpoint=..., otlp_file=...
    with traces.episode(task="weather", input=question) as ep:
        with traces.node("plan", input={"question": question}) as node:
            node.output({"city": "Paris"})
        answer = get_weather(city="Paris")                 # a function decorated with @traces.tool
        ep.answer(answer)
    traces.emit(traces.Event(episode_id=ep.id, kind="reward", reward=traces.Reward(value=1.0, source="user")))

An episode is one trace (its root span, OpenInference kind AGENT); a node a CHAIN span, a tool a TOOL span,
a model call an LLM span, a reward an EVALUATOR span carrying `rollgym.reward.*`. A reward emitted later,
in another process, is its own trace that names the episode (`rollgym.episode.id`) and joins it when read.
Each Tracing has its own TracerProvider, so an application's global OpenTelemetry setup is left alone.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import json
import os

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

from . import conventions as cv
from .schema import Event, Reward, Step

DEFAULT_STORE = "runs/traces"
F = TypeVar("F", bound=Callable[..., Any])


def _json(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str)


def otlp_traces_url(endpoint: str) -> str:
    """An OTLP/HTTP endpoint as its traces URL (`http://host:4318` -> `http://host:4318/v1/traces`)."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith("/v1/traces") else endpoint + "/v1/traces"


class Tracing:
    """Where spans go: a local store folder (`spans.jsonl` in it), an OTLP/JSON file, an OTLP/HTTP endpoint."""

    def __init__(self, store: str | Path | None = DEFAULT_STORE, *, otlp_endpoint: str | None = None,
                 otlp_file: str | Path | None = None, headers: dict[str, str] | None = None,
                 service_name: str = "rollgym", project: str | None = None) -> None:
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        except ImportError as exc:  # the optional extra
            raise ImportError("rollgym.traces writes spans with the OpenTelemetry SDK: "
                              "pip install 'rollgym[traces]'") from exc
        from .otlp import OtlpFileExporter

        attributes = {"service.name": service_name}
        if project:  # Phoenix files spans under this project; LangFuse and others keep it as a resource attribute
            attributes["openinference.project.name"] = project
        self.provider = TracerProvider(resource=Resource.create(attributes))
        self.store = Path(store) if store else None
        if self.store is not None:
            self.provider.add_span_processor(SimpleSpanProcessor(OtlpFileExporter(self.store / "spans.jsonl")))
        if otlp_file:
            self.provider.add_span_processor(SimpleSpanProcessor(OtlpFileExporter(otlp_file)))
        if otlp_endpoint:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=otlp_traces_url(otlp_endpoint), headers=headers)
            self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("rollgym.traces")
        self._starts: dict[tuple[str, str | None], float] = {}

    def flush(self) -> None:
        self.provider.force_flush()

    def shutdown(self) -> None:
        self.provider.shutdown()

    # ---------------------------------------------------------------- events

    def emit(self, event: Event) -> None:
        """Write one learning event. Inside `episode()` of the same id, its span joins that trace."""
        current = _EPISODE.get()
        context = current.context if current is not None and current.id == event.episode_id else None
        if event.kind in ("node_start", "episode_start"):  # a span is written when it ends
            self._starts[(event.episode_id, event.step.name if event.step else None)] = event.ts
            return
        if event.kind == "reward":
            if event.reward is None:
                raise ValueError("event.reward: a reward event carries a reward")
            self._span("reward", cv.reward_attributes(event.reward, event.episode_id), event.ts, event.ts, context,
                       event.tags)
            return
        step = event.step or Step(kind="answer" if event.kind == "final_answer" else "node")
        if event.kind == "tool_call" and step.kind == "node":
            step = step.model_copy(update={"kind": "tool"})
        if event.kind == "llm_call":
            step = step.model_copy(update={"kind": "llm"})
        start = self._starts.pop((event.episode_id, step.name), None)
        if start is None:
            start = event.ts - (step.lat_ms or 0) / 1000
        attrs = cv.step_attributes(step)
        if event.kind in ("final_answer", "episode_end"):
            attrs[cv.KIND] = "AGENT" if event.kind == "episode_end" else attrs[cv.KIND]
            attrs["rollgym.final_answer"] = True
        self._span(step.name or event.kind, {**attrs, cv.EPISODE_ID: event.episode_id}, start, event.ts, context,
                   event.tags, None if step.ok else (step.error or "failed"))

    def _span(self, name: str, attrs: dict[str, Any], start: float, end: float, context: Any, tags: list[str],
              error: str | None = None) -> None:
        from opentelemetry.trace import Status, StatusCode

        if tags:
            attrs[cv.TAGS] = list(tags)
        span = self.tracer.start_span(name, context=context, attributes=attrs, start_time=int(start * 1e9))
        span.set_status(Status(StatusCode.ERROR, error) if error else Status(StatusCode.OK))
        span.end(end_time=int(end * 1e9))

    # ---------------------------------------------------------------- hooks

    @contextlib.contextmanager
    def episode(self, task: str | None = None, *, id: str | None = None, input: Any = None,
                tags: list[str] | tuple[str, ...] = (), metadata: dict[str, Any] | None = None) -> Iterator["EpisodeSpan"]:
        """One episode: a trace whose root span is the agent's run. Its id is `id`, else the trace id."""
        from opentelemetry import trace

        attrs: dict[str, Any] = {cv.KIND: "AGENT"}
        if task is not None:
            attrs[cv.EPISODE_TASK] = task
        if input is not None:
            attrs[cv.INPUT] = _json(input)
        if tags:
            attrs[cv.TAGS] = list(tags)
        if metadata:
            attrs[cv.METADATA] = _json(metadata)
        with self.tracer.start_as_current_span(f"episode {task}" if task else "episode", attributes=attrs,
                                               record_exception=True) as span:
            episode_id = id or f"{span.get_span_context().trace_id:032x}"
            span.set_attribute(cv.EPISODE_ID, episode_id)
            handle = EpisodeSpan(self, episode_id, span, trace.set_span_in_context(span))
            token = _EPISODE.set(handle)
            try:
                yield handle
            finally:
                _EPISODE.reset(token)

    @contextlib.contextmanager
    def node(self, name: str, *, input: Any = None, kind: str = "CHAIN") -> Iterator["NodeSpan"]:
        """One node of the agent's graph: a CHAIN span under the current episode."""
        attrs = {cv.KIND: kind, cv.STEP_IDX: _next_idx()}
        if input is not None:
            attrs[cv.INPUT], attrs[cv.INPUT_MIME] = _json(input), "application/json"
        with self.tracer.start_as_current_span(name, attributes=attrs, record_exception=True) as span:
            yield NodeSpan(span)

    def tool(self, function: F | None = None, *, name: str | None = None) -> Any:
        """A decorator: each call of the (sync or async) function is a TOOL span with its arguments and
        result; a raised exception marks the span ERROR (tool_success_only drops its episode)."""
        def wrap(func: F) -> F:
            tool_name = name or func.__name__
            signature = inspect.signature(func)

            def start(args: tuple, kwargs: dict) -> Any:
                bound = signature.bind_partial(*args, **kwargs)
                parameters = _json(dict(bound.arguments))
                attrs = {cv.KIND: "TOOL", "tool.name": tool_name, "tool.parameters": parameters,
                         cv.INPUT: parameters, cv.INPUT_MIME: "application/json", cv.STEP_IDX: _next_idx()}
                return self.tracer.start_as_current_span(tool_name, attributes=attrs, record_exception=True)

            if inspect.iscoroutinefunction(func):
                @functools.wraps(func)
                async def run_async(*args: Any, **kwargs: Any) -> Any:
                    with start(args, kwargs) as span:
                        result = await func(*args, **kwargs)
                        span.set_attribute(cv.OUTPUT, _json(result))
                        return result
                return run_async  # type: ignore[return-value]

            @functools.wraps(func)
            def run(*args: Any, **kwargs: Any) -> Any:
                with start(args, kwargs) as span:
                    result = func(*args, **kwargs)
                    span.set_attribute(cv.OUTPUT, _json(result))
                    return result
            return run  # type: ignore[return-value]

        return wrap(function) if function is not None else wrap


@dataclass
class EpisodeSpan:
    tracing: Tracing
    id: str
    span: Any
    context: Any
    steps: int = 0

    def answer(self, value: Any) -> None:
        """The episode's final answer: the root span's output."""
        self.span.set_attribute(cv.OUTPUT, _json(value))

    def reward(self, value: float, source: str = "auto-metric", name: str = "reward") -> None:
        self.tracing.emit(Event(episode_id=self.id, kind="reward", reward=Reward(value=value, source=source, name=name)))

    def llm_call(self, step: Step) -> None:
        """Record a model call the agent made without an instrumented client."""
        self.tracing.emit(Event(episode_id=self.id, kind="llm_call", step=step))


@dataclass
class NodeSpan:
    span: Any

    def output(self, value: Any) -> None:
        self.span.set_attribute(cv.OUTPUT, _json(value))
        self.span.set_attribute(cv.OUTPUT_MIME, "application/json")


_EPISODE: contextvars.ContextVar[EpisodeSpan | None] = contextvars.ContextVar("rollgym_episode", default=None)
_CURRENT: Tracing | None = None


def _next_idx() -> int:
    current = _EPISODE.get()
    if current is None:
        return 0
    current.steps += 1
    return current.steps


def configure(store: str | Path | None = DEFAULT_STORE, **options: Any) -> Tracing:
    """Set where this process's events go (Tracing's arguments); the one before is flushed and shut down."""
    global _CURRENT
    if _CURRENT is not None:
        _CURRENT.shutdown()
    _CURRENT = Tracing(store, **options)
    return _CURRENT


def current() -> Tracing:
    """The configured Tracing, else one writing to the local store ($ROLLGYM_TRACE_STORE or runs/traces)."""
    global _CURRENT
    if _CURRENT is None:
        _CURRENT = Tracing(os.environ.get("ROLLGYM_TRACE_STORE") or DEFAULT_STORE)
    return _CURRENT


def emit(event: Event) -> None:
    current().emit(event)


def episode(task: str | None = None, **options: Any) -> Any:
    return current().episode(task, **options)


def node(name: str, **options: Any) -> Any:
    return current().node(name, **options)


def tool(function: Callable[..., Any] | None = None, *, name: str | None = None) -> Any:
    """@tool or @tool(name=...): resolved at call time, so configure() may come after decorating."""
    def wrap(func: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.iscoroutinefunction(func):
            @functools.wraps(func)
            async def run_async(*args: Any, **kwargs: Any) -> Any:
                return await current().tool(func, name=name)(*args, **kwargs)
            return run_async

        @functools.wraps(func)
        def run(*args: Any, **kwargs: Any) -> Any:
            return current().tool(func, name=name)(*args, **kwargs)
        return run

    return wrap(function) if function is not None else wrap


__all__ = ["DEFAULT_STORE", "EpisodeSpan", "NodeSpan", "Tracing", "configure", "current", "emit", "episode", "node",
           "otlp_traces_url", "tool"]
