"""What the pages show of rollouts: a table row, a group side by side, a rollout's tokens."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..data.advantages import grpo_advantages
from ..data.records import output_items
from .index import environment_of, model_version_of
from .segments import Pieces, id_pieces, segment_start
from .tokens import Vocabulary


def _final_text(row: dict[str, Any]) -> str:
    for item in reversed(output_items(row)):
        if isinstance(item, dict) and item.get("type") == "message":
            parts = item.get("content") or []
            if isinstance(parts, str):
                return parts
            return "".join(p.get("text", "") for p in parts if isinstance(p, dict))
        if isinstance(item, dict) and item.get("type") == "function_call":
            return f"{item.get('name')}({item.get('arguments', '')})"
    return ""


def table_row(line: int, row: dict[str, Any]) -> dict[str, Any]:
    """What the rollouts table shows of one rollout."""
    metrics = row.get("metrics") if isinstance(row.get("metrics"), dict) else {}
    error = row.get("error")
    return {
        "line": line, "rollout_id": row.get("rollout_id"), "group_id": row.get("group_id"),
        "env": environment_of(row), "reward": row.get("reward"), "status": row.get("status", "ok"),
        "error": str(error)[:300] if error else None, "prefix_ok": row.get("prefix_ok"),
        "model_version": model_version_of(row), "turns": metrics.get("turns"),
        "tool_calls": metrics.get("tool_calls"), "output_tokens": metrics.get("output_tokens"),
        "latency_s": metrics.get("latency_s"), "answer": _final_text(row)[:200],
    }


def group_view(group_id: str, rows: list[tuple[int, dict[str, Any]]]) -> dict[str, Any]:
    """A group's rollouts side by side, with the GRPO advantages `rollgym export --format grpo` gives."""
    scored = [(line, row) for line, row in rows if isinstance(row.get("reward"), (int, float))]
    mean = std = None
    by_line: dict[int, tuple[float, float]] = {}
    if scored:
        mean, std, normalized, centered = grpo_advantages([float(row["reward"]) for _, row in scored])
        by_line = {line: (n, c) for (line, _), n, c in zip(scored, normalized, centered)}
    members = []
    for line, row in rows:
        member = table_row(line, row)
        member["advantage"], member["advantage_mean_only"] = by_line.get(line, (None, None))
        member["answer"] = _final_text(row)[:2000]
        members.append(member)
    prompt = rows[0][1].get("responses_create_params") if rows else None
    return {"group_id": group_id, "reward_mean": mean, "reward_std": std, "rollouts": members, "prompt": prompt}


def token_view(row: dict[str, Any], vocabulary: Vocabulary | None) -> dict[str, Any]:
    """Each sequence's tokens for the page: ids, text pieces when the vocabulary is the rollout's,
    sampling logprobs, mask, where each model turn starts, the model version of each turn, and where the
    segment begins and why (`start`: `segments.segment_start`)."""
    sequences = row.get("sequences") if isinstance(row.get("sequences"), list) else []
    response = row.get("response") if isinstance(row.get("response"), dict) else {}
    model = response.get("model")
    decode = vocabulary is not None and vocabulary.applies_to(model)
    views, malformed = [], 0
    for index, sequence in enumerate(sequences):
        view = _sequence_view(sequence)
        if view is None:
            malformed += 1
            continue
        view["prompt_text"] = vocabulary.pieces(view["prompt_ids"]) if decode else None
        view["completion_text"] = vocabulary.pieces(view["completion_ids"]) if decode else None
        view["start"] = segment_start(index, sequence, view, views[-1] if views else None,
                                      _shown_pieces(vocabulary) if decode else id_pieces)
        views.append(view)
    reason = None
    if not sequences:
        reason = "this rollout has no token sequences (the model server returned no token ids)"
    elif vocabulary is None:
        reason = "token ids only: no tokenizer (install the llamacpp extra, or pass --tokenizer MODEL.gguf)"
    elif not decode:
        sampler = f"sampled by '{model}'" if model else "the response names no model"
        reason = f"token ids only: {sampler}, not {vocabulary.model_name} (--tokenizer PATH to force)"
    elif vocabulary.error:
        reason = f"token ids only: the tokenizer could not be loaded ({vocabulary.error})"
    if malformed:
        reason = f"{malformed} sequence(s) not shown: ids, mask or logprobs are not lists of numbers of one length" \
            + (f"; {reason}" if reason else "")
    return {"sequences": views, "prefix_ok": row.get("prefix_ok"), "decoded": decode and not vocabulary.error,
            "note": reason}


def _shown_pieces(vocabulary: Vocabulary) -> Pieces:
    def shown(ids: list[int]) -> list[str]:
        pieces = vocabulary.pieces(ids)
        return [repr(piece) for piece in pieces] if pieces is not None else id_pieces(ids)
    return shown


def _sequence_view(sequence: Any) -> dict[str, Any] | None:
    """One sequence's ids, mask, logprobs and turn starts; None when it is malformed."""
    if not isinstance(sequence, dict):
        return None
    try:
        prompt = [int(i) for i in sequence.get("prompt_ids") or []]
        completion = [int(i) for i in sequence.get("completion_ids") or []]
        mask = [int(m) for m in sequence.get("completion_mask") or [1] * len(completion)]
        logprobs = [float(x) for x in sequence.get("completion_logprobs") or []]
    except (TypeError, ValueError):
        return None
    if len(mask) != len(completion) or (logprobs and len(logprobs) != len(completion)):
        return None
    marks = np.diff(np.concatenate([[0], np.asarray(mask, dtype=np.int8)]))
    return {"prompt_ids": prompt, "completion_ids": completion, "mask": mask, "logprobs": logprobs,
            "turn_starts": np.flatnonzero(marks == 1).tolist(), "model_versions": sequence.get("model_versions")}
