"""The merged token view of a rollout that RL trainers consume, and the token arithmetic behind it.

Each model call leaves (prompt_token_ids, generation_token_ids, generation_log_probs) on one of the
items it generated, and optionally the `model_version` of the weights that sampled them. When a
call's prompt extends the previous call's prompt + generation exactly, the tokens in between (tool
results, chat-template glue) were added by the environment: they join the completion with mask 0.
When it does not extend them, the rollout's tokens drifted: a new sequence starts and `prefix_ok`
is False, so a trainer can see it instead of learning from it.

`extend_tokens` is the other half: how a model server builds the next prompt so that it does
extend the previous tokens (see models/chat_completions).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from .chat_conversion import responses_to_chat_request


@dataclass(frozen=True)
class TokenRecord:
    """One model call's tokens, as carried by the item it generated."""

    prompt: list[int]
    generation: list[int]
    logprobs: list[float]
    model_version: str | None = None
    forced: list[int] | None = None  # 1 where a grammar admitted no other token (`generation_forced`)
    constrained: list[int] | None = None  # 1 where a grammar restricted the choice (`generation_constrained`)
    # (version, tokens) in order when the generation went on across weight updates (`model_version_spans`)
    version_spans: list[tuple[str | None, int]] | None = None

    def spans(self) -> list[tuple[str | None, int]]:
        """Which version sampled how many of the generated tokens: the recorded spans, else one span."""
        if self.version_spans is not None:
            return self.version_spans
        return [(self.model_version, len(self.generation))] if self.generation else []


def _int_list(value: Any) -> list[int] | None:
    # set(map(type, ...)) runs in C: token lists run to thousands of ids, checked on every call. (A bool's
    # type is bool, not int, so bools are refused as before.)
    if not isinstance(value, list) or not set(map(type, value)) <= {int}:
        return None
    return value


def token_record(item: Any) -> TokenRecord | None:
    """The token record on one item, or None when it carries none (or a malformed one)."""
    if not isinstance(item, dict):
        return None
    prompt = _int_list(item.get("prompt_token_ids"))
    generation = _int_list(item.get("generation_token_ids"))
    logprobs = item.get("generation_log_probs")
    if prompt is None or generation is None or not isinstance(logprobs, list) or len(logprobs) != len(generation):
        return None
    try:
        values = list(map(float, logprobs))
    except (TypeError, ValueError):
        return None
    version = item.get("model_version")
    forced = _int_list(item.get("generation_forced"))
    constrained = _int_list(item.get("generation_constrained"))
    return TokenRecord(list(prompt), list(generation), values, str(version) if version is not None else None,
                       forced if forced is not None and len(forced) == len(generation) else None,
                       constrained if constrained is not None and len(constrained) == len(generation) else None,
                       version_spans(item.get("model_version_spans"), len(generation)))


def version_spans(value: Any, tokens: int) -> list[tuple[str | None, int]] | None:
    """An item's `model_version_spans` as (version, tokens) pairs; None when absent or not covering exactly
    `tokens` generated tokens."""
    if not isinstance(value, list):
        return None
    spans = []
    for span in value:
        count = span.get("tokens") if isinstance(span, dict) else None
        if type(count) is not int or count < 1:
            return None
        version = span.get("model_version")
        spans.append((str(version) if version is not None else None, count))
    return spans if sum(count for _, count in spans) == tokens else None


def previous_turn(payload: dict[str, Any], system_role: str = "system") -> tuple[TokenRecord, list[dict[str, Any]]] | None:
    """The token record of the last generated turn in a Responses request's input, and the chat
    messages up to and including that turn's assistant message; None when no item carries tokens.

    A model server puts a call's tokens on the last item it generated, so converting the input up to
    that item gives the conversation the next prompt must extend token for token. Both model servers
    use this (models/chat_completions, models/llamacpp). Raises ConversionError on a bad input.
    """
    items = payload.get("input")
    if not isinstance(items, list):
        return None
    for index in range(len(items) - 1, -1, -1):
        record = token_record(items[index])
        if record is not None:
            head = responses_to_chat_request({**payload, "input": items[: index + 1]}, system_role=system_role)
            if not head["messages"] or head["messages"][-1].get("role") != "assistant":
                return None
            return record, head["messages"]
    return None


def token_records(items: Iterable[dict[str, Any]]) -> list[tuple[list[int], list[int], list[float]]]:
    """The (prompt ids, generation ids, logprobs) triple of every model call, in order."""
    return [(r.prompt, r.generation, r.logprobs) for r in (token_record(item) for item in items) if r is not None]


def merge_sequences(items: Iterable[dict[str, Any]]) -> tuple[list[dict[str, list]], bool | None]:
    """Merge a rollout's output items into trainer sequences.

    Returns (sequences, prefix_ok): each sequence has prompt_ids, completion_ids, completion_mask
    (1 = sampled by the model, 0 = added by the environment) and completion_logprobs (0.0 where
    masked); when any model call reported a `model_version`, also `model_versions` (one entry per
    model call merged into that sequence, in order, None where a call reported none); when any
    reported which tokens a grammar forced, also `completion_forced` (1 = forced, not sampled; 0 for
    environment tokens and calls that reported nothing), and likewise `completion_constrained` (1 where a
    grammar restricted the choice, `generation_constrained`); when any call's generation went on across weight
    updates (`model_version_spans`), also `completion_version_spans`: the version of every completion token as
    `{model_version, tokens}` spans in order (None for the environment's tokens). prefix_ok is
    None when no item carried tokens, False when any turn failed to extend the tokens before it.
    Items that say which named `policy` answered (rollgym.policies) give each sequence its `policy`, and a
    call of another policy begins a new sequence even where its prompt extends the tokens before it.
    Malformed token records are skipped; this never raises on odd input.
    """
    pairs = [(item, r) for item in items if (r := token_record(item)) is not None]
    records = [r for _, r in pairs]
    if not records:
        return [], None
    # Named policies (rollgym.policies): a segment is one policy's calls, so each trains only its own tokens.
    policies = [item.get("policy") if isinstance(item.get("policy"), str) else None for item, _ in pairs]
    with_policies = any(policy is not None for policy in policies)
    with_versions = any(r.model_version is not None for r in records)
    with_forced = any(r.forced is not None for r in records)
    with_constrained = any(r.constrained is not None for r in records)
    with_spans = any(r.version_spans is not None for r in records)
    sequences: list[dict[str, list]] = []
    prefix_ok = True
    current: dict[str, list] | None = None
    for record, policy in zip(records, policies):
        if current is not None:
            context = current["prompt_ids"] + current["completion_ids"]
            same_policy = not with_policies or current.get("policy") == policy
            if same_policy and len(record.prompt) >= len(context) and record.prompt[: len(context)] == context:
                added = record.prompt[len(context):]
                current["completion_ids"].extend(added)
                current["completion_mask"].extend([0] * len(added))
                current["completion_logprobs"].extend([0.0] * len(added))
                current["completion_ids"].extend(record.generation)
                current["completion_mask"].extend([1] * len(record.generation))
                current["completion_logprobs"].extend(record.logprobs)
                if with_versions:
                    current["model_versions"].append(record.model_version)
                if with_forced:
                    current["completion_forced"].extend([0] * len(added) + (record.forced or [0] * len(record.generation)))
                if with_constrained:
                    current["completion_constrained"].extend(
                        [0] * len(added) + (record.constrained or [0] * len(record.generation)))
                if with_spans:
                    current["completion_version_spans"] += _span_dicts([(None, len(added))] + record.spans())
                continue
            if same_policy:  # another policy's call that extends these tokens starts its own segment, no drift
                prefix_ok = False
        current = {
            "prompt_ids": list(record.prompt),
            "completion_ids": list(record.generation),
            "completion_mask": [1] * len(record.generation),
            "completion_logprobs": list(record.logprobs),
        }
        if with_policies:
            current["policy"] = policy
        if with_versions:
            current["model_versions"] = [record.model_version]
        if with_forced:
            current["completion_forced"] = list(record.forced or [0] * len(record.generation))
        if with_constrained:
            current["completion_constrained"] = list(record.constrained or [0] * len(record.generation))
        if with_spans:
            current["completion_version_spans"] = _span_dicts(record.spans())
        sequences.append(current)
    return sequences, prefix_ok


def _span_dicts(spans: list[tuple[str | None, int]]) -> list[dict[str, Any]]:
    return [{"model_version": version, "tokens": count} for version, count in spans if count]


def first_divergence(expected: list[int], actual: list[int]) -> int | None:
    """The first index where `actual` stops extending `expected`, or None if it extends it."""
    for index, token in enumerate(expected):
        if index >= len(actual) or actual[index] != token:
            return index
    return None


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    for index in range(n):
        if a[index] != b[index]:
            return index
    return n


def _suffix_overlap(tokens: Sequence[int], end: int, generation: Sequence[int]) -> int:
    """How many tokens before `end` in `tokens` equal the last tokens of `generation`."""
    length = 0
    while length < len(generation) and length < end and tokens[end - 1 - length] == generation[-1 - length]:
        length += 1
    return length


def extend_tokens(
    prompt: Sequence[int],
    generation: Sequence[int],
    head: Sequence[int],
    full: Sequence[int],
    *,
    base: Sequence[int] | None = None,
    window: int = 32,
) -> list[int] | None:
    """The next prompt: `prompt + generation` followed by exactly the tokens the new messages add.

    All three renders come from the backend's tokenizer and chat template:
    `base` is the conversation before the generated assistant turn, with the generation prompt
    (so it ends where the model started generating); `head` is the conversation up to and including
    that assistant turn (with or without a generation prompt after it); `full` is the conversation
    now, with the generation prompt. The template renders the turn as [header] [generation,
    re-tokenized] [end-of-turn glue], and the model may have produced part of the glue itself (its
    end-of-turn token). The cut is the position in `full` where the re-rendered generation ends:
    after the turn's start (the common prefix of `base` and `head`), within the prefix `head` and
    `full` share, the position whose preceding tokens match the most trailing tokens of
    `generation`. The new prompt is `prompt + generation + full[cut:]`: the sampled tokens stay as
    sampled (even where re-tokenizing their text would differ) and only the template's glue and the
    new messages are appended. Without `base`, the turn is assumed to start at most `window` tokens
    before the end of `head`.

    Returns None when no cut can be found (the template rewrote the history, e.g. stripped a
    thinking block, so `head` and `full` part inside the turn; or nothing matches): the caller then
    renders the conversation afresh and the drift shows as `prefix_ok: false`.
    """
    if not generation or not head:
        return None
    shared = common_prefix_length(head, full)
    start = common_prefix_length(base, head) + 1 if base is not None else len(head) - window
    best_cut, best_overlap = None, 0
    for cut in range(min(shared, len(head)), max(start, 1) - 1, -1):
        overlap = _suffix_overlap(full, cut, generation)
        if overlap > best_overlap:
            best_cut, best_overlap = cut, overlap
    if best_cut is None:
        return None
    return [*prompt, *generation, *full[best_cut:]]


# ---------------------------------------------------------------------- segment boundaries
# A rollout's `sequences` are its segments. Where one begins, `rollgym check-tokens` and the viewer say why
# from the tokens (`boundary_reason`); an agent that knows its conversations (agents/proxy_agent) also
# labels each segment with its `conversation` and one of these `segment_reason`s.
SEGMENT_REASONS = {
    "new_conversation": "a new conversation: its first message is no earlier segment's (a sub-agent, a parallel "
                        "call, another prompt)",
    "history_rewritten": "the same conversation with its history rewritten: it begins as an earlier segment does, "
                         "then differs (a summary, compaction, truncation)",
    "tokens_drifted": "the same conversation carried on, but its prompt does not extend the tokens sampled before "
                      "(the chat template re-rendered an earlier turn, e.g. dropped its reasoning)",
    "another_policy": "another named policy's call carrying the conversation on: the earlier segment's tokens are "
                      "its prompt, and each policy trains its own segments",
}
DIVERGENCE_WINDOW = 6  # tokens shown on each side of a divergence


@dataclass
class Divergence:
    """Where a prompt stops extending the tokens before it, with the decoded tokens around that point on
    both sides (`|` before the first differing token)."""

    index: int
    expected_len: int
    actual_len: int
    expected: str
    actual: str


def divergence_span(at: int) -> tuple[int, int]:
    """The [start, end) of the tokens shown around a divergence at `at` (on both sides)."""
    return max(0, at - DIVERGENCE_WINDOW), at + DIVERGENCE_WINDOW


def make_divergence(expected: Sequence[int], actual: Sequence[int], at: int,
                    expected_pieces: list[str], actual_pieces: list[str]) -> Divergence:
    """The Divergence at `at`, given the decoded pieces of both sides' `divergence_span(at)` (each piece
    as it should be shown: `repr` of the text, or `#id` when nothing decodes)."""
    lo, hi = divergence_span(at)
    return Divergence(at, len(expected), len(actual), _window(expected_pieces, at - lo, lo > 0, hi < len(expected)),
                      _window(actual_pieces, at - lo, lo > 0, hi < len(actual)))


def _window(pieces: list[str], mark: int, more_left: bool, more_right: bool) -> str:
    left = " ".join(pieces[:mark])
    right = " ".join(pieces[mark:])
    return f"{'… ' if more_left else ''}{left} | {right}{' …' if more_right else ''}".strip()


def boundary_reason(previous_prompt_tokens: int, divergence: Divergence) -> str:
    """Why a call's prompt stops extending the previous call's tokens, read from where it diverges:
    at the end of the new prompt (it goes back to an earlier point), inside the previous answer (the
    template wrote it back differently), or in the history before the previous answer (the context
    was rewritten, or the call belongs to another conversation)."""
    at, windows = divergence.index, divergence.expected + " " + divergence.actual
    if at == divergence.actual_len:
        return ("the prompt stops inside the previous tokens: it goes back to an earlier point of the conversation "
                "(a retry or a branch)")
    if at >= previous_prompt_tokens:
        # The first previous token the prompt lacks, as decoded (a repr'd piece, or `#id` without /detokenize).
        missing = divergence.expected.partition(" | ")[2].lstrip("'\"")
        if missing.startswith("<think>"):
            return ("the previous answer's reasoning is not in the history (the chat template drops earlier "
                    "<think> blocks, as Qwen3's does once a new user turn follows)")
        if "tool_call" in windows or "TOOL_CALLS" in windows or "tool▁call" in windows:
            return "the previous answer's tool call was written back differently (the chat template re-serialised it)"
        return ("the previous answer was written back differently, not as sampled (re-rendered or re-tokenized "
                f"from token {at - previous_prompt_tokens} of the answer)")
    return (f"the history before the previous answer changed after {at} of its {previous_prompt_tokens} tokens: the "
            "agent rewrote its context (a summary, compaction, truncation) or this call is another conversation "
            "(a sub-agent)")
