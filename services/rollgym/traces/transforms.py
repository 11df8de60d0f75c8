"""Traces → training records: to_sft, to_preferences, to_trajectories, and the filters they share.

    records = to_sft(traces, tokenizer=tok, filters=Filters(min_reward=0.5, tool_success_only=True))
    pairs = to_preferences(traces, tokenizer=tok, pair_by="feedback", score="thumbs")
    windows = to_trajectories(traces, window=4)

Filters (in this order, each optional): failed episodes out → `score`/`min_reward` → tool_success_only →
drop_unsafe (a callable of the user's: trace → True when unsafe, or a `judge:<url>` llm_judge server) →
dedupe (one episode per identical prompt, its best) → top_k by reward. Every record carries the trainer's
token fields (as `rollgym train`'s curation writes them), its episode's reward and `token_source`.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Literal

from .schema import Trace
from .tokens import TokenizeError, retokenize, served_sequences

PairBy = Literal["input", "reward_gap", "feedback"]
TOOL_ERROR_PREFIX = "Error:"  # how rollgym's agents phrase a tool call they could not make


@dataclass
class Filters:
    score: str | None = None  # the reward of this name (a Phoenix annotation's, a LangFuse score's); None: any
    min_reward: float | None = None
    top_k: int | None = None
    dedupe: bool = False
    tool_success_only: bool = False
    drop_unsafe: Callable[[Trace], bool] | None = None
    keep_failed: bool = False
    dropped: Counter = field(default_factory=Counter)


def prompt_messages(trace: Trace) -> list[dict[str, Any]]:
    """The messages before the first assistant one (what the episode was asked)."""
    messages = conversation(trace)
    first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), len(messages))
    return messages[:first]


def conversation(trace: Trace) -> list[dict[str, Any]]:
    """The recorded conversation; for an episode without model-call spans, its input and final answer."""
    messages = trace.messages()
    if messages:
        return messages
    if trace.input is None or trace.final_answer is None:
        return []
    text = lambda v: v if isinstance(v, str) else json.dumps(v)  # noqa: E731
    return [{"role": "user", "content": text(trace.input)}, {"role": "assistant", "content": text(trace.final_answer)}]


def prompt_key(trace: Trace) -> str:
    return json.dumps(prompt_messages(trace), sort_keys=True)


def group_of(trace: Trace) -> str:
    """The id of the traces that share this one's prompt (a group, as rollouts of one task are)."""
    return "p-" + hashlib.sha1(prompt_key(trace).encode()).hexdigest()[:16]


def tool_failed(trace: Trace) -> bool:
    return any(step.kind == "tool" and not step.ok for step in trace.steps) or any(
        m.get("role") == "tool" and str(m.get("content") or "").startswith(TOOL_ERROR_PREFIX)
        for m in conversation(trace))


def select(traces: Iterable[Trace], filters: Filters | None = None) -> list[Trace]:
    """The traces that pass `filters`; every dropped one counted in filters.dropped by reason."""
    f = filters or Filters()
    kept = []
    for trace in traces:
        reward = trace.reward(f.score)
        if not trace.ok and not f.keep_failed:
            f.dropped["failed"] += 1
        elif not conversation(trace):
            f.dropped["no_conversation"] += 1
        elif (f.min_reward is not None or f.top_k is not None) and reward is None:
            f.dropped["no_reward"] += 1
        elif f.min_reward is not None and reward < f.min_reward:
            f.dropped["below_min_reward"] += 1
        elif f.tool_success_only and tool_failed(trace):
            f.dropped["tool_error"] += 1
        elif f.drop_unsafe is not None and f.drop_unsafe(trace):
            f.dropped["unsafe"] += 1
        else:
            kept.append(trace)
    rank = lambda t: -(t.reward(f.score) if t.reward(f.score) is not None else float("-inf"))  # noqa: E731
    if f.dedupe:
        best: dict[str, Trace] = {}
        for trace in sorted(kept, key=rank):
            best.setdefault(prompt_key(trace), trace)
        f.dropped["duplicate_prompt"] += len(kept) - len(best)
        kept = [t for t in kept if best.get(prompt_key(t)) is t]
    if f.top_k is not None:
        chosen = {id(t) for t in sorted(kept, key=rank)[: f.top_k]}
        f.dropped["not_top_k"] += len(kept) - len(chosen)
        kept = [t for t in kept if id(t) in chosen]
    f.dropped = +f.dropped  # without the reasons that dropped nothing
    return kept


def tokens_of(trace: Trace, tokenizer: Any, messages: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The trace's token sequences with their source: the served ones, else its conversation re-tokenized with
    the tools its last model call advertised (`chat_template` says which template rendered it)."""
    if messages is None and trace.token_source == "served":
        return [{**s, "token_source": "served"} for s in served_sequences(trace)]
    if tokenizer is None:
        raise TokenizeError(f"episode {trace.episode.id} has no served token ids: re-tokenizing needs a tokenizer")
    tools = trace.tools() if messages is None else None  # a template of the user's is their own format
    return [{**retokenize(tokenizer, messages or conversation(trace), tools), "token_source": "retokenized"}]


def apply_template(trace: Trace, template: Any) -> list[dict[str, Any]] | None:
    """None (the recorded conversation), a callable trace → messages, or {system?, user, assistant} format
    strings over {input} and {answer}."""
    if template is None:
        return None
    if callable(template):
        return list(template(trace))
    values = {"input": trace.input if isinstance(trace.input, str) else json.dumps(trace.input),
              "answer": trace.final_answer if isinstance(trace.final_answer, str) else json.dumps(trace.final_answer)}
    messages = [{"role": "system", "content": template["system"].format(**values)}] if template.get("system") else []
    return messages + [{"role": "user", "content": template.get("user", "{input}").format(**values)},
                       {"role": "assistant", "content": template.get("assistant", "{answer}").format(**values)}]


def to_sft(traces: Iterable[Trace], *, tokenizer: Any = None, template: Any = None,
           filters: Filters | None = None) -> list[dict[str, Any]]:
    """One SFT record per token sequence of each selected trace: messages, tools (those the model call
    advertised, when any), prompt_ids, completion_ids, completion_mask (1 = the model's tokens), reward,
    token_source and chat_template (the template a re-tokenized record was rendered with; None: served)."""
    f = filters or Filters()
    records = []
    for trace in select(traces, f):
        messages = apply_template(trace, template)
        try:
            sequences = tokens_of(trace, tokenizer, messages)
        except TokenizeError:
            f.dropped["untokenizable"] += 1
            continue
        for sequence in sequences:
            tools = trace.tools() if messages is None else []
            records.append({"rollout_id": trace.episode.id, "group_id": group_of(trace),
                            "reward": trace.reward(f.score), "messages": messages or conversation(trace),
                            **({"tools": tools} if tools else {}),
                            "prompt_ids": sequence["prompt_ids"], "completion_ids": sequence["completion_ids"],
                            "completion_mask": sequence["completion_mask"], "token_source": sequence["token_source"],
                            "chat_template": sequence.get("chat_template")})
    return records


def to_preferences(traces: Iterable[Trace], *, tokenizer: Any = None, pair_by: PairBy = "input",
                   min_gap: float = 0.1, threshold: float = 0.5, filters: Filters | None = None) -> list[dict[str, Any]]:
    """Chosen/rejected pairs among traces of one prompt. pair_by `input`: best with worst, second best with
    second worst, ... while the reward gap is ≥ min_gap (each trace used once); `reward_gap`: every pair of
    the prompt whose gap is ≥ min_gap; `feedback`: every trace whose score (filters.score) is ≥ threshold
    with every one below it. Pairs whose prompts tokenize differently are no comparison and are left out."""
    f = filters or Filters()
    by_prompt: dict[str, list[Trace]] = {}
    for trace in select(traces, f):
        if trace.reward(f.score) is None:
            f.dropped["no_reward"] += 1
            continue
        by_prompt.setdefault(prompt_key(trace), []).append(trace)
    records = []
    for members in by_prompt.values():
        ranked = sorted(members, key=lambda t: -t.reward(f.score))
        pairs: list[tuple[Trace, Trace]] = []
        if pair_by == "input":
            best, worst = 0, len(ranked) - 1
            while best < worst and ranked[best].reward(f.score) - ranked[worst].reward(f.score) >= min_gap - 1e-9:
                pairs.append((ranked[best], ranked[worst]))
                best, worst = best + 1, worst - 1
        elif pair_by == "reward_gap":
            pairs = [(a, b) for i, a in enumerate(ranked) for b in ranked[i + 1:]
                     if a.reward(f.score) - b.reward(f.score) >= min_gap - 1e-9]
        elif pair_by == "feedback":
            good = [t for t in ranked if t.reward(f.score) >= threshold]
            pairs = [(a, b) for a in good for b in ranked if b.reward(f.score) < threshold]
        else:
            raise ValueError(f"pair_by: {pair_by!r} is not one of input, reward_gap, feedback")
        for chosen, rejected in pairs:
            record = preference(chosen, rejected, tokenizer, f.score)
            if record is None:
                f.dropped["pair_prompt_tokens_differ"] += 1
            else:
                records.append(record)
    return records


def preference(chosen: Trace, rejected: Trace, tokenizer: Any, score: str | None) -> dict[str, Any] | None:
    try:
        a, b = tokens_of(chosen, tokenizer)[0], tokens_of(rejected, tokenizer)[0]
    except TokenizeError:
        return None
    if a["prompt_ids"] != b["prompt_ids"]:
        return None
    source = "served" if a["token_source"] == b["token_source"] == "served" else "retokenized"
    return {"group_id": group_of(chosen), "chosen_rollout_id": chosen.episode.id,
            "rejected_rollout_id": rejected.episode.id, "prompt": prompt_messages(chosen),
            "chosen": conversation(chosen)[len(prompt_messages(chosen)):],
            "rejected": conversation(rejected)[len(prompt_messages(rejected)):],
            "quality_difference": chosen.reward(score) - rejected.reward(score),
            "prompt_ids": a["prompt_ids"], "chosen_ids": a["completion_ids"], "rejected_ids": b["completion_ids"],
            "chosen_mask": a["completion_mask"], "rejected_mask": b["completion_mask"], "token_source": source,
            "chat_template": a.get("chat_template") or b.get("chat_template")}


def to_trajectories(traces: Iterable[Trace], *, window: Literal["episode"] | int = "episode",
                    filters: Filters | None = None) -> list[dict[str, Any]]:
    """Trajectories: a whole episode's steps, or windows of `window` consecutive steps (n_steps), each with
    its episode's reward and whether its tokens were served."""
    if window != "episode" and (not isinstance(window, int) or window < 1):
        raise ValueError(f"window: 'episode' or a number of steps >= 1, not {window!r}")
    f = filters or Filters()
    out = []
    for trace in select(traces, f):
        steps = [s.model_dump() for s in trace.steps]
        size = len(steps) if window == "episode" else window
        for start in range(0, max(len(steps), 1), max(size, 1)):
            out.append({"episode_id": trace.episode.id, "task": trace.episode.task, "window": [start, start + size],
                        "steps": steps[start:start + size], "reward": trace.reward(f.score),
                        "final": start + size >= len(steps), "token_source": trace.token_source})
    return out


def to_rollouts(traces: Iterable[Trace], *, score: str | None = None) -> list[dict[str, Any]]:
    """Rollout rows as rollgym's collector writes them (reward, sequences with sampling logprobs), for the
    curation that makes GRPO groups; only served traces have sequences (token_source says which)."""
    rows = []
    for trace in traces:
        sequences = served_sequences(trace) if trace.token_source == "served" else []
        messages = conversation(trace)
        prompt = prompt_messages(trace)
        rows.append({"rollout_id": trace.episode.id, "group_id": group_of(trace), "reward": trace.reward(score),
                     "status": "ok" if trace.ok else "env_error", "responses_create_params": {"input": prompt},
                     "response": {"output": [{"type": "message", "role": m.get("role"), "content": [
                         {"type": "output_text", "text": str(m.get("content") or "")}]} for m in messages[len(prompt):]]},
                     "sequences": sequences, "prefix_ok": len(sequences) == 1 if sequences else None,
                     "token_source": trace.token_source})
    return rows


__all__ = ["Filters", "PairBy", "conversation", "prompt_messages", "select", "to_preferences", "to_rollouts",
           "to_sft", "to_trajectories", "tool_failed"]
