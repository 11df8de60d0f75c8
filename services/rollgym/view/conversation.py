"""What the conversation panel shows of a rollout: one conversation, or each segment with its own messages.

A rollout whose model calls do not all extend one conversation (sub-agents, parallel calls, a history
compacted or rewritten) is several segments. When its agent recorded each segment's calls (`calls` on
the sequence: each call's input items and its outputs, as agents/proxy_agent writes them), the panel
shows every segment under its own heading with those messages, so a sub-agent's answer is not listed
under the first call's question. Otherwise it shows the task's input and the rollout's output items.
"""

from __future__ import annotations

from typing import Any

from ..sequences import SEGMENT_REASONS


def _items(value: Any) -> list[dict[str, Any]]:
    return [item for item in value if isinstance(item, dict)] if isinstance(value, list) else []


def conversation_view(row: dict[str, Any]) -> dict[str, Any] | None:
    """The segments of a rollout with their own model calls: {segments: [{index, conversation, reason,
    reason_text, calls: [{input: [items], output: [items]}]}]}; None when it is one conversation or its
    sequences record no calls (the page then shows the task's input and every output item)."""
    sequences = row.get("sequences") if isinstance(row.get("sequences"), list) else []
    recorded = [s for s in sequences if isinstance(s, dict) and isinstance(s.get("calls"), list)]
    if len(sequences) < 2 or not recorded:
        return None
    segments = []
    for index, sequence in enumerate(sequences):
        sequence = sequence if isinstance(sequence, dict) else {}
        reason = sequence.get("segment_reason")
        reason = reason if reason in SEGMENT_REASONS else None
        conversation = sequence.get("conversation")
        calls = [{"input": _items(call.get("input")), "output": _items(call.get("output"))}
                 for call in sequence.get("calls") or [] if isinstance(call, dict)]
        segments.append({"index": index, "conversation": conversation if isinstance(conversation, int) else None,
                         "reason": reason, "reason_text": SEGMENT_REASONS.get(reason) if reason else None,
                         "calls": calls})
    return {"segments": segments}


__all__ = ["conversation_view"]
