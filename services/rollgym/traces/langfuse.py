"""LangFuse as a trace store: Event ↔ observation / score in the `langfuse` SDK's own types, and a reader.

An Event's step is an observation (`ObservationV2`: llm → GENERATION, tool → TOOL, node → SPAN, the
final answer → EVENT, the episode's end → AGENT), in its episode's trace (trace id = episode id); a reward
is a numeric score on that trace (`ScoreV3_Numeric`, subject kind trace). What LangFuse has no field for
(step index, tool calls, token ids, the exact timestamp, the reward's source) rides in the observation's
or score's `metadata.rollgym`, so Event → observation → Event is the identity.

`traces(project, ...)` reads through the SDK's REST client (`LangfuseAPI`): `GET /api/public/v2/observations`
(cursor pages, with io, metadata, model, usage and trace_context) and `GET /api/public/v3/scores` per trace,
filtered by tag, trace name and a least score. The keys and host come from the environment as the SDK
reads them: LANGFUSE_PUBLIC_KEY, LANGFUSE_SECRET_KEY, LANGFUSE_BASE_URL (or LANGFUSE_HOST). A LangFuse
key pair belongs to one project, so `<project>` in `trace://langfuse/<project>` names the keys' project.
"""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from typing import Any

from .schema import Event, Reward, Step, TokenRecord, Trace

TYPES = {"llm": "GENERATION", "tool": "TOOL", "node": "SPAN", "answer": "EVENT"}
KINDS = {"GENERATION": "llm", "TOOL": "tool", "SPAN": "node", "EVENT": "answer", "AGENT": "node", "CHAIN": "node"}
SOURCES = {"user": "ANNOTATION", "human": "ANNOTATION", "judge": "EVAL", "rm": "EVAL", "auto-metric": "EVAL"}
FIELDS = "core,basic,time,io,metadata,model,usage,trace_context"


class LangfuseError(ValueError):
    """LangFuse could not be read; the message says what to set or what the server said."""


def _time(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, timezone.utc)


def _loads(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def observation_of(event: Event, *, observation_id: str, project_id: str = "rollgym") -> Any:
    """An Event with a step (any kind but reward) as the SDK's ObservationV2."""
    from langfuse.api import ObservationV2

    step = event.step or Step(kind="answer" if event.kind == "final_answer" else "node")
    meta = {"event": event.kind, "ts": event.ts, "idx": step.idx, "kind": step.kind, "ok": step.ok,
            "tool_calls": step.tool_calls, "lat_ms": step.lat_ms,
            "tokens": step.tokens.model_dump() if step.tokens else None}
    kind = "AGENT" if event.kind == "episode_end" else TYPES[step.kind]
    start = event.ts - (step.lat_ms or 0) / 1000
    return ObservationV2(
        id=observation_id, trace_id=event.episode_id, project_id=project_id, type=kind, name=step.name,
        start_time=_time(start), end_time=_time(event.ts), is_root_observation=event.kind == "episode_end",
        level="ERROR" if not step.ok else "DEFAULT", status_message=step.error,
        input=json.dumps(step.input), output=json.dumps(step.output), metadata={"rollgym": meta},
        model=step.name if step.kind == "llm" else None, tags=list(event.tags),
        usage_details={"input": len(step.tokens.prompt_ids), "output": len(step.tokens.completion_ids)}
        if step.tokens else None)


def score_of(event: Event, *, score_id: str, project_id: str = "rollgym") -> Any:
    """A reward Event as the SDK's numeric trace score (ScoreV3_Numeric)."""
    from langfuse.api import ScoreSubjectV3_Trace, ScoreV3_Numeric

    if event.reward is None:
        raise ValueError("event.reward: only a reward event is a score")
    reward = event.reward
    at = _time(event.ts)
    return ScoreV3_Numeric(id=score_id, project_id=project_id, name=reward.name, value=reward.value,
                           source=SOURCES.get(reward.source, "API"), timestamp=at, created_at=at, updated_at=at,
                           environment="default", comment=reward.comment,
                           metadata={"rollgym": {"source": reward.source, "ts": event.ts, "tags": event.tags}},
                           subject=ScoreSubjectV3_Trace(id=event.episode_id))


def event_of(item: Any) -> Event:
    """An observation or a score (SDK types, or their JSON) as an Event; a foreign one (no
    metadata.rollgym) is mapped from its type, input, output and times."""
    from langfuse.api import ObservationV2

    if not isinstance(item, ObservationV2) and getattr(item, "subject", None) is not None:
        meta = (item.metadata or {}).get("rollgym") or {}
        ts = meta.get("ts", item.timestamp.timestamp())
        return Event(episode_id=item.subject.id, kind="reward", ts=ts, tags=list(meta.get("tags") or []),
                     reward=Reward(value=float(item.value), name=item.name, comment=item.comment,
                                   source=meta.get("source") or str(getattr(item.source, "value", item.source)).lower()))
    meta = (item.metadata or {}).get("rollgym") if isinstance(item.metadata, dict) else None
    if isinstance(meta, str):  # a metadata value LangFuse truncated or kept as text
        meta = _loads(meta) if isinstance(_loads(meta), dict) else None
    end = item.end_time or item.start_time
    lat = int(round((end - item.start_time).total_seconds() * 1000)) if item.end_time else None
    raw_in, raw_out = _loads(item.input), _loads(item.output)
    if meta:
        kind = meta["kind"]
        step = Step(idx=meta["idx"], kind=kind, name=item.name, input=raw_in, output=raw_out,
                    tool_calls=meta.get("tool_calls") or [], ok=meta.get("ok", True), error=item.status_message,
                    lat_ms=meta.get("lat_ms"), tokens=TokenRecord(**meta["tokens"]) if meta.get("tokens") else None)
        return Event(episode_id=item.trace_id, kind=meta["event"], step=step, ts=meta["ts"], tags=list(item.tags or []))
    kind = KINDS.get(str(item.type).upper(), "node")
    if kind == "llm":  # a foreign generation: messages in, a message (or messages) out
        step_in = {"messages": raw_in if isinstance(raw_in, list) else [{"role": "user", "content": raw_in}]}
        out = raw_out if isinstance(raw_out, list) else [raw_out] if isinstance(raw_out, dict) and "role" in raw_out \
            else [{"role": "assistant", "content": raw_out}]
        step_out = {"messages": out}
    else:
        step_in = raw_in if isinstance(raw_in, dict) else {"value": raw_in}
        step_out = raw_out if isinstance(raw_out, dict) else {"value": raw_out}
    error = str(getattr(item.level, "value", item.level)) == "ERROR"
    step = Step(kind=kind, name=item.model if kind == "llm" and item.model else item.name, input=step_in,
                output=step_out, ok=not error, error=item.status_message if error else None, lat_ms=lat)
    root = bool(item.is_root_observation) or item.parent_observation_id is None
    return Event(episode_id=item.trace_id or "", kind="episode_end" if root and kind == "node" else
                 ("llm_call" if kind == "llm" else "tool_call" if kind == "tool" else "node_end"),
                 step=step, ts=end.timestamp(), tags=list(item.tags or []))


def traces_of(events: list[Event], names: dict[str, str] | None = None) -> list[Trace]:
    """Events grouped into one Trace per episode: the episode_end event gives its input, answer and tags."""
    from .schema import Episode

    out: dict[str, Trace] = {}
    for event in sorted(events, key=lambda e: e.ts):
        trace = out.setdefault(event.episode_id, Trace(episode=Episode(id=event.episode_id,
                                                                       task=(names or {}).get(event.episode_id))))
        trace.tags += [t for t in event.tags if t not in trace.tags]
        if event.kind == "reward" and event.reward is not None:
            trace.rewards.append(event.reward)
        elif event.kind == "episode_end" and event.step is not None:
            trace.input = event.step.input.get("value", event.step.input or None)
            trace.final_answer = event.step.output.get("value", event.step.output or None)
            trace.ok = event.step.ok
        elif event.step is not None:
            trace.steps.append(event.step.model_copy(update={"idx": len(trace.steps)}))
    return [t for t in out.values() if t.steps or t.input is not None]


def client(url: str | None = None) -> Any:
    from langfuse.api import LangfuseAPI

    public, secret = os.environ.get("LANGFUSE_PUBLIC_KEY"), os.environ.get("LANGFUSE_SECRET_KEY")
    base = url or os.environ.get("LANGFUSE_BASE_URL") or os.environ.get("LANGFUSE_HOST")
    if not (public and secret and base):
        raise LangfuseError("trace://langfuse: set LANGFUSE_PUBLIC_KEY, LANGFUSE_SECRET_KEY and LANGFUSE_BASE_URL "
                            "(the project's API keys and its server, e.g. https://cloud.langfuse.com)")
    return LangfuseAPI(base_url=base.rstrip("/"), username=public, password=secret, timeout=60)


def traces(project: str, *, tag: str | None = None, name: str | None = None, url: str | None = None) -> list[Trace]:
    """The project's traces (those with `tag`, of trace name `name`), with their scores as rewards."""
    api = client(url)
    observations: list[Any] = []
    cursor = None
    try:
        while True:
            page = api.observations.get_many(fields=FIELDS, expand_metadata="rollgym", limit=1000, cursor=cursor)
            observations += [o for o in page.data if (tag is None or tag in (o.tags or []))
                             and (name is None or o.trace_name == name)]
            cursor = page.meta.cursor if page.meta else None
            if not cursor or not page.data:
                break
        events = [event_of(o) for o in observations]
        for trace_id in sorted({o.trace_id for o in observations if o.trace_id}):
            cursor = None
            while True:
                page = api.scores.get_many(trace_id=trace_id, limit=100, cursor=cursor)
                events += [event_of(s) for s in page.data if str(getattr(s, "data_type", "")) in ("NUMERIC", "BOOLEAN")]
                cursor = page.meta.cursor if page.meta else None
                if not cursor or not page.data:
                    break
    except LangfuseError:
        raise
    except Exception as exc:  # noqa: BLE001 - the SDK raises its ApiError or httpx's errors
        raise LangfuseError(f"trace://langfuse/{project}: {type(exc).__name__}: {str(exc)[:300]}") from None
    return traces_of(events, {o.trace_id: o.trace_name for o in observations if o.trace_name})


__all__ = ["LangfuseError", "event_of", "observation_of", "score_of", "traces", "traces_of"]
