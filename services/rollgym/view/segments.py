"""Where each segment of a rollout begins, and why, for the token view.

A rollout's `sequences` are its segments, shown one under another. For every segment after the first
the page says why it began: the label the agent recorded (`conversation` and `segment_reason`, which
agents/proxy_agent writes: a new conversation, the history rewritten, the tokens drifted) and what the
tokens themselves show where its prompt stops extending the segment above (`rollgym.sequences.
boundary_reason`, the reading `rollgym check-tokens` gives), with the tokens around that point.
"""

from __future__ import annotations

from typing import Any, Callable

from ..sequences import SEGMENT_REASONS, boundary_reason, divergence_span, first_divergence, make_divergence

Pieces = Callable[[list[int]], list[str]]  # ids -> each token as shown: repr of its text, or `#id`


def id_pieces(ids: list[int]) -> list[str]:
    return [f"#{token}" for token in ids]


def segment_start(index: int, sequence: dict[str, Any], view: dict[str, Any], above: dict[str, Any] | None,
                  pieces: Pieces = id_pieces) -> dict[str, Any]:
    """What the page says where segment `index` begins. `view` and `above` are the token views
    (`prompt_ids`, `completion_ids`, `turn_starts`) of this segment and of the one shown above it (None for
    the first); `sequence` is the rollout's own, for the labels an agent recorded on it."""
    conversation = sequence.get("conversation")
    reason = sequence.get("segment_reason")
    start: dict[str, Any] = {"index": index, "conversation": conversation if isinstance(conversation, int) else None,
                             "reason": reason if reason in SEGMENT_REASONS else None}
    start["reason_text"] = SEGMENT_REASONS.get(start["reason"]) if start["reason"] else None
    if above is None:
        return start
    expected = above["prompt_ids"] + above["completion_ids"]
    actual = view["prompt_ids"]
    at = first_divergence(expected, actual)
    if at is None:
        start["tokens"] = "its prompt extends the tokens of the segment above (a branch from its end)"
        return start
    # The last model call of the segment above began after its prompt and the completion before its last turn.
    previous_prompt = len(above["prompt_ids"]) + (above["turn_starts"][-1] if above["turn_starts"] else 0)
    lo, hi = divergence_span(at)
    divergence = make_divergence(expected, actual, at, pieces(expected[lo:hi]), pieces(actual[lo:hi]))
    start["tokens"] = boundary_reason(previous_prompt, divergence)
    start["divergence"] = {"index": at, "above": divergence.expected, "this": divergence.actual}
    return start
