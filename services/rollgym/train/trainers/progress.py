"""A training step's progress, from the trainer's process to the loop's `optimize` line: one small JSON file
in the step's folder, replaced atomically after every optimizer step, which the loop reads while it waits.

    STEP/train/progress.json     {"step": 3, "steps": 10, "loss": 0.41, "tokens": 5120, "elapsed_s": 12.3}

A file, not a pipe: the trainer may be a child process (TRL's SFT and DPO, `jobs.py`), the run's long-lived
grpo process, or the co-located policy server, and the same file serves all three. The loop shows it as
`step 3/10, 416 tokens/s, loss 0.4100`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import orjson

from ...data.jsonl import write_atomic

PROGRESS_FILE = "progress.json"


class ProgressWriter:
    """Writes a step's progress file: `update(step, steps, loss, tokens)` after each optimizer step, `tokens`
    counting every token trained on so far."""

    def __init__(self, output_dir: str | Path) -> None:
        self.path = Path(output_dir) / PROGRESS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.started = time.perf_counter()

    def update(self, step: int, steps: int, loss: float | None = None, tokens: float | None = None) -> None:
        progress = {"step": int(step), "steps": int(steps), "loss": None if loss is None else float(loss),
                    "tokens": None if tokens is None else float(tokens),
                    "elapsed_s": round(time.perf_counter() - self.started, 3)}
        try:
            write_atomic(self.path, orjson.dumps(progress))
        except OSError:  # progress is for people watching; a full disk fails the step elsewhere, not here
            pass


def clear_progress(output_dir: str | Path) -> None:
    """Forget an earlier attempt's progress before a step starts."""
    (Path(output_dir) / PROGRESS_FILE).unlink(missing_ok=True)


def read_progress(output_dir: str | Path) -> dict[str, Any] | None:
    """The step's last reported progress, or None (none yet, or a file being replaced)."""
    try:
        data = orjson.loads((Path(output_dir) / PROGRESS_FILE).read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return None
    return data if isinstance(data, dict) and data.get("steps") else None


def describe(progress: dict[str, Any]) -> str:
    """`step 3/10, 416 tokens/s, loss 0.4100` (what is known of it)."""
    parts = [f"step {progress['step']}/{progress['steps']}"]
    tokens, elapsed, loss = progress.get("tokens"), progress.get("elapsed_s"), progress.get("loss")
    if tokens and elapsed:
        parts.append(f"{tokens / elapsed:.0f} tokens/s")
    if loss is not None:
        parts.append(f"loss {loss:.4f}")
    return ", ".join(parts)


def trl_callback(output_dir: str | Path, tokens_per_step: float) -> Any:
    """A TRL (transformers) `TrainerCallback` that reports each logged optimizer step to the progress file:
    the step of `max_steps`, the loss, and the tokens (TRL's `num_tokens` where it logs it, else `tokens_per_step`
    for each step: the batch's mean tokens)."""
    from transformers import TrainerCallback

    writer = ProgressWriter(output_dir)

    class ProgressCallback(TrainerCallback):  # type: ignore[misc]
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            writer.started = time.perf_counter()
            writer.update(0, state.max_steps)

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
                   **kwargs: Any) -> None:
            logs = logs or {}
            if "loss" not in logs:  # the summary at the end (train_loss, train_runtime) has no step of its own
                return
            tokens = logs.get("num_tokens", state.global_step * tokens_per_step)
            writer.update(state.global_step, state.max_steps, logs["loss"], tokens)

    return ProgressCallback()


__all__ = ["PROGRESS_FILE", "ProgressWriter", "clear_progress", "describe", "read_progress", "trl_callback"]
