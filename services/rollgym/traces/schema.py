"""The learning-event schema, the stable core every store, source and transform shares.

Episode / Step / Reward / Event as the mahsm.tuning specification sketches them: an agent emits events
(episode start and end, node start and end, tool calls, the final answer, rewards); a store keeps them as
OpenTelemetry spans; a source reads spans back and assembles one `Trace` per episode, to which rewards
that arrive later (a user's feedback, a judge's grade) are joined by the episode's id.

`TokenRecord` is what a model call that rollgym served carries (its exact token ids, sampling logprobs,
the weights' `model_version`); a foreign trace has none, and its records are re-tokenized and say so
(`token_source: retokenized`).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

StepKind = Literal["llm", "tool", "node", "answer"]
EventKind = Literal["episode_start", "episode_end", "node_start", "node_end", "tool_call", "llm_call",
                    "final_answer", "reward"]
TokenSource = Literal["served", "retokenized"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Episode(_Model):
    id: str = Field(description="the episode's id; as a trace: the OpenTelemetry trace id or rollgym.episode.id")
    task: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)


class TokenRecord(_Model):
    """One model call's exact tokens, when rollgym served it."""

    prompt_ids: list[int]
    completion_ids: list[int]
    completion_logprobs: list[float] | None = None
    model_version: str | None = None


class Step(_Model):
    idx: int = 0
    kind: StepKind = "node"
    name: str | None = Field(default=None, description="the node, tool or model name")
    input: dict[str, Any] = Field(default_factory=dict, description="llm: {messages: [...], tools?: [...] (chat "
                                                                    "form, as advertised)}; tool: its arguments")
    output: dict[str, Any] = Field(default_factory=dict, description="llm: {messages: [...]}; tool: {value: ...}")
    tool_calls: list[dict[str, Any]] = Field(default_factory=list, description="{name, arguments, id} the step made")
    ok: bool = Field(default=True, description="false: the node or tool raised (its span's status is ERROR)")
    error: str | None = None
    lat_ms: int | None = None
    tokens: TokenRecord | None = None


class Reward(_Model):
    value: float
    source: str = Field(default="user", description="who gave it: user, auto-metric, rm, judge, ...")
    name: str = Field(default="reward", description="the score's name (a Phoenix annotation's, a LangFuse score's)")
    comment: str | None = None


class Event(_Model):
    episode_id: str
    kind: EventKind = "node_end"
    step: Step | None = None
    reward: Reward | None = None
    tags: list[str] = Field(default_factory=list)
    ts: float = Field(default_factory=time.time)


class Trace(_Model):
    """One episode assembled from its spans, with every reward joined to it."""

    episode: Episode
    steps: list[Step] = Field(default_factory=list)
    rewards: list[Reward] = Field(default_factory=list)
    tags: list[str] = Field(default_factory=list)
    input: Any = None
    final_answer: Any = None
    ok: bool = True

    def reward(self, name: str | None = None) -> float | None:
        """The last reward of that name (any name when None), None when it has none."""
        values = [r.value for r in self.rewards if name is None or r.name == name]
        return values[-1] if values else None

    def llm_steps(self) -> list[Step]:
        return [step for step in self.steps if step.kind == "llm"]

    def messages(self) -> list[dict[str, Any]]:
        """The conversation: the last model call's input messages and its output ones."""
        calls = self.llm_steps()
        if not calls:
            return []
        last = calls[-1]
        return list(last.input.get("messages") or []) + list(last.output.get("messages") or [])

    def tools(self) -> list[dict[str, Any]]:
        """The tools the last model call advertised (chat form), which its prompt rendered."""
        calls = self.llm_steps()
        return list(calls[-1].input.get("tools") or []) if calls else []

    @property
    def token_source(self) -> TokenSource:
        calls = self.llm_steps()
        return "served" if calls and all(step.tokens is not None for step in calls) else "retokenized"


__all__ = ["Episode", "Event", "EventKind", "Reward", "Step", "StepKind", "TokenRecord", "TokenSource", "Trace"]
