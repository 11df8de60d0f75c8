"""`dataset://hf/<name>[:split]`: a Hugging Face dataset as traces, through `datasets`.

<name> is a folder written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`, or a dataset name read
from the local cache only (HF_DATASETS_OFFLINE: nothing is downloaded; a dataset that is in neither place
is a SourceError naming it). Rows become Traces, so every transform and filter applies:
`messages` (a chat: the first assistant message onwards is the answer), `prompt` + `chosen` + `rejected`
(a preference: two traces of one prompt, rewards 1 and 0), `prompt` + `completion`, or `question` + `answer`;
a `reward` or `score` column is the reward.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .schema import Episode, Reward, Step, Trace


class DatasetError(ValueError):
    """A dataset that is not there or has no known columns; the message names it."""


def load_rows(name: str, split: str | None) -> list[dict[str, Any]]:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import datasets
    except ImportError:
        raise DatasetError(f"dataset://hf/{name}: reading datasets needs the `datasets` package "
                           "(pip install 'rollgym[traces]')") from None
    where = f"dataset://hf/{name}{':' + split if split else ''}"
    folder = Path(name)
    try:
        if folder.is_dir():
            loaded = datasets.load_from_disk(str(folder))
        else:
            loaded = datasets.load_dataset(name, split=split)
    except Exception as exc:  # noqa: BLE001 - datasets raises many kinds for "not there"
        raise DatasetError(f"{where}: no such dataset in a save_to_disk folder or the offline Hugging Face cache "
                           f"({type(exc).__name__}: {str(exc)[:200]})") from None
    if isinstance(loaded, datasets.DatasetDict):
        chosen = split or ("train" if "train" in loaded else next(iter(loaded), None))
        if chosen not in loaded:
            raise DatasetError(f"{where}: no split {chosen!r} (splits: {', '.join(loaded)})")
        loaded = loaded[chosen]
    return [dict(row) for row in loaded]


def _messages(value: Any, role: str) -> list[dict[str, Any]]:
    if isinstance(value, list):
        return [dict(m) for m in value]
    return [{"role": role, "content": str(value)}]


def _trace(key: str, prompt: list[dict[str, Any]], answer: list[dict[str, Any]], reward: Any) -> Trace:
    step = Step(kind="llm", input={"messages": prompt}, output={"messages": answer})
    users = [m for m in prompt if m.get("role") == "user"]
    return Trace(episode=Episode(id=key), steps=[step], input=users[-1]["content"] if users else None,
                 final_answer=answer[-1].get("content") if answer else None,
                 rewards=[Reward(value=float(reward), source="dataset")] if reward is not None else [])


def rows_to_traces(rows: list[dict[str, Any]], where: str) -> list[Trace]:
    out: list[Trace] = []
    for i, row in enumerate(rows):
        reward = row.get("reward", row.get("score"))
        key = str(row.get("id", i))
        if "messages" in row:
            messages = _messages(row["messages"], "user")
            first = next((j for j, m in enumerate(messages) if m.get("role") == "assistant"), len(messages))
            out.append(_trace(key, messages[:first], messages[first:], reward))
        elif {"prompt", "chosen", "rejected"} <= set(row):
            prompt = _messages(row["prompt"], "user")
            out.append(_trace(f"{key}-chosen", prompt, _messages(row["chosen"], "assistant"), 1.0))
            out.append(_trace(f"{key}-rejected", prompt, _messages(row["rejected"], "assistant"), 0.0))
        elif {"prompt", "completion"} <= set(row):
            out.append(_trace(key, _messages(row["prompt"], "user"), _messages(row["completion"], "assistant"), reward))
        elif {"question", "answer"} <= set(row):
            out.append(_trace(key, _messages(row["question"], "user"), _messages(row["answer"], "assistant"), reward))
        else:
            raise DatasetError(f"{where}: row {i} has none of the known column sets (messages; prompt, chosen, "
                               f"rejected; prompt, completion; question, answer): {sorted(row)}")
    return out


def dataset_traces(spec: str) -> list[Trace]:
    """The traces of `<name>[:split]`."""
    name, _, split = spec.rpartition(":") if ":" in spec and not Path(spec).exists() else (spec, "", "")
    return rows_to_traces(load_rows(name, split or None), f"dataset://hf/{spec}")


__all__ = ["DatasetError", "dataset_traces", "load_rows", "rows_to_traces"]
