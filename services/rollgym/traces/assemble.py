"""Spans → one Trace per episode, with every reward joined to its episode by id.

A span belongs to the episode its `rollgym.episode.id` names, else to the episode of its trace (the id
one of the trace's spans names, else the trace id). So a reward emitted later in its own trace, a Phoenix
trace annotation (by trace id) and a LangFuse score (by trace id) all land on the same episode.
"""

from __future__ import annotations

import json
from typing import Any, Iterable

from . import conventions as cv
from .otlp import SpanRecord
from .schema import Episode, Reward, Trace


def _loads(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def episode_ids(spans: list[SpanRecord]) -> dict[str, str]:
    """trace id -> its episode's id (a root span's rollgym.episode.id first, any span's next)."""
    out: dict[str, str] = {}
    for span in sorted(spans, key=lambda s: s.parent_id is not None):
        named = span.attributes.get(cv.EPISODE_ID)
        if named and span.trace_id not in out:
            out[span.trace_id] = str(named)
    return out


def assemble(spans: Iterable[SpanRecord], rewards: Iterable[tuple[str, Reward]] = ()) -> list[Trace]:
    """The episodes of `spans`, in order of their first span, with `rewards` ((episode or trace id, Reward))
    joined; an episode whose root span failed has ok False."""
    spans = list(spans)
    by_trace = episode_ids(spans)
    groups: dict[str, list[SpanRecord]] = {}
    for span in spans:
        key = str(span.attributes.get(cv.EPISODE_ID) or by_trace.get(span.trace_id) or span.trace_id)
        groups.setdefault(key, []).append(span)
    alias = {trace_id: episode for trace_id, episode in by_trace.items()}
    traces: dict[str, Trace] = {}
    for key, members in sorted(groups.items(), key=lambda kv: min(s.start_ns for s in kv[1])):
        trace = build(key, members)
        if trace is not None:
            traces[key] = trace
    for target, reward in rewards:
        found = traces.get(target) or traces.get(alias.get(target, ""))
        if found is not None:
            found.rewards.append(reward)
    return list(traces.values())


def build(key: str, spans: list[SpanRecord]) -> Trace | None:
    """One episode of its spans; None when it has neither a step nor a root (only late rewards)."""
    spans = sorted(spans, key=lambda s: (s.start_ns, s.end_ns))
    ids = {s.span_id for s in spans}
    parents = {s.parent_id for s in spans if s.parent_id}
    parentless = [s for s in spans if (s.parent_id is None or s.parent_id not in ids)
                  and cv.REWARD_VALUE not in s.attributes and not s.attributes.get("rollgym.final_answer")]
    # the agent's run: a parentless AGENT span, else a parentless span with children (an instrumented framework's)
    roots = [s for s in parentless if cv.span_kind(s.attributes, s.name) == "AGENT"] or [
        s for s in parentless if s.span_id in parents]
    root = roots[0] if roots else None
    trace = Trace(episode=Episode(id=key))
    rewards: list[tuple[int, Reward]] = []
    for span in spans:
        attrs = span.attributes
        if cv.REWARD_VALUE in attrs:
            rewards.append((span.end_ns, Reward(value=float(attrs[cv.REWARD_VALUE]),
                                                source=str(attrs.get(cv.REWARD_SOURCE) or "auto-metric"),
                                                name=str(attrs.get(cv.REWARD_NAME) or "reward"),
                                                comment=attrs.get(cv.OUTPUT))))
            continue
        trace.tags += [t for t in attrs.get(cv.TAGS) or [] if t not in trace.tags]
        if span is root:
            continue
        lat = (span.end_ns - span.start_ns) // 1_000_000 if span.end_ns >= span.start_ns else None
        error = span.status_message or None if span.status == "ERROR" else None
        step = cv.step_from(attrs, span.name, len(trace.steps), span.status != "ERROR", error, lat)
        if attrs.get("rollgym.final_answer"):
            trace.final_answer = _loads(attrs.get(cv.OUTPUT))
        if step is not None:
            trace.steps.append(step)
    if root is None and not trace.steps:
        return None
    if root is not None:
        attrs = root.attributes
        trace.episode.task = attrs.get(cv.EPISODE_TASK)
        metadata = _loads(attrs.get(cv.METADATA))
        trace.episode.metadata = metadata if isinstance(metadata, dict) else {}
        trace.input = _loads(attrs.get(cv.INPUT))
        if attrs.get(cv.OUTPUT) is not None:
            trace.final_answer = _loads(attrs.get(cv.OUTPUT))
        trace.ok = root.status != "ERROR"
    if trace.final_answer is None and trace.llm_steps():
        last = (trace.llm_steps()[-1].output.get("messages") or [{}])[-1]
        trace.final_answer = last.get("content")
    if trace.input is None and trace.llm_steps():
        users = [m for m in trace.llm_steps()[0].input.get("messages") or [] if m.get("role") == "user"]
        trace.input = users[0].get("content") if users else None
    trace.rewards = [r for _, r in sorted(rewards, key=lambda pair: pair[0])]
    return trace


__all__ = ["assemble", "build", "episode_ids"]
