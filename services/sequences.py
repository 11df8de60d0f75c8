"""The merged token view of a rollout that RL trainers consume.

Each model call leaves (prompt_token_ids, generation_token_ids, generation_log_probs) on one of the
items it generated. When a call's prompt extends the previous call's prompt + generation exactly,
the tokens in between (tool results, chat-template glue) were added by the environment: they join
the completion with mask 0. When it does not extend them, the rollout's tokens drifted: a new
sequence starts and `prefix_ok` is False, so a trainer can see it instead of learning from it.
"""

from __future__ import annotations

from typing import Any, Iterable


def token_records(items: Iterable[dict[str, Any]]) -> list[tuple[list[int], list[int], list[float]]]:
    """The (prompt ids, generation ids, logprobs) triple of every model call, in order."""
    records = []
    for item in items:
        if item.get("generation_token_ids") is not None and item.get("prompt_token_ids") is not None:
            records.append((item["prompt_token_ids"], item["generation_token_ids"], item["generation_log_probs"]))
    return records


def merge_sequences(items: Iterable[dict[str, Any]]) -> tuple[list[dict[str, list]], bool | None]:
    """Merge a rollout's output items into trainer sequences.

    Returns (sequences, prefix_ok): each sequence has prompt_ids, completion_ids, completion_mask
    (1 = sampled by the model, 0 = added by the environment) and completion_logprobs (0.0 where
    masked). prefix_ok is None when no item carried tokens, False when any turn failed to extend
    the tokens before it.
    """
    records = token_records(items)
    if not records:
        return [], None
    sequences: list[dict[str, list]] = []
    prefix_ok = True
    current: dict[str, list] | None = None
    for prompt, generation, logprobs in records:
        if current is not None:
            context = current["prompt_ids"] + current["completion_ids"]
            if len(prompt) >= len(context) and prompt[: len(context)] == context:
                added = prompt[len(context):]
                current["completion_ids"].extend(added)
                current["completion_mask"].extend([0] * len(added))
                current["completion_logprobs"].extend([0.0] * len(added))
                current["completion_ids"].extend(generation)
                current["completion_mask"].extend([1] * len(generation))
                current["completion_logprobs"].extend(float(x) for x in logprobs)
                continue
            prefix_ok = False
        current = {
            "prompt_ids": list(prompt),
            "completion_ids": list(generation),
            "completion_mask": [1] * len(generation),
            "completion_logprobs": [float(x) for x in logprobs],
        }
        sequences.append(current)
    return sequences, prefix_ok


def first_divergence(expected: list[int], actual: list[int]) -> int | None:
    """The first index where `actual` stops extending `expected`, or None if it extends it."""
    for index, token in enumerate(expected):
        if index >= len(actual) or actual[index] != token:
            return index
    return None
