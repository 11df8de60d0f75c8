"""Step folders: the batch transport over a shared disk (`base.BatchTransport`).

    ROOT/step_1/batch.jsonl   one rollout per line, each with its `advantage` (see docs/train-async.md)
    ROOT/step_1/meta.json     the step's number, metrics and the orchestrator's resume state
    ROOT/step_1/READY         the marker, written last: the folder is complete
    ROOT/step_1/ADAPTER       written by the trainer when it has trained on the step: the path of the
                              adapter it produced (empty: the step changed no served weights)

A step is assembled in a hidden `ROOT/.step_N.tmp/`, flushed to disk, marked, and only then renamed to
`step_N`, so a consumer that sees `step_N/READY` reads a whole batch, never half of one. The trainer
writes `ADAPTER` the same way (a temporary file renamed into place), so the orchestrator never reads a
half-written path.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Iterator

import orjson

from ....data.jsonl import fsync_folder, write_atomic
from .base import Batch

MARKER = "READY"
ADAPTER = "ADAPTER"
BATCH = "batch.jsonl"
META = "meta.json"
_STEP = re.compile(r"^step_(\d+)$")


class StepFolders:
    """Both ends of the step-folder protocol over one root folder."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def path(self, step: int) -> Path:
        return self.root / f"step_{step}"

    # ------------------------------------------------------------------ the orchestrator's side

    def publish(self, batch: Batch) -> Path:
        """Publish a batch atomically; refuses to overwrite a published step."""
        final = self.path(batch.step)
        if final.exists():
            raise FileExistsError(f"{final} already exists: step {batch.step} was published before")
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".step_{batch.step}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        write_atomic(tmp / BATCH, b"".join(orjson.dumps(r, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n"
                                           for r in batch.rollouts))
        write_atomic(tmp / META, orjson.dumps({"step": batch.step, "metrics": batch.metrics, "state": batch.state},
                                              option=orjson.OPT_INDENT_2))
        write_atomic(tmp / MARKER, b"")
        os.replace(tmp, final)
        fsync_folder(self.root)
        return final

    def published(self) -> list[int]:
        """Steps whose folder is complete, ascending."""
        steps = []
        if self.root.is_dir():
            for entry in self.root.iterdir():
                match = _STEP.match(entry.name)
                if match and (entry / MARKER).exists():
                    steps.append(int(match.group(1)))
        return sorted(steps)

    def discard_partial(self) -> list[Path]:
        """Remove step folders that were never completed (a kill mid-write); returns what was removed."""
        removed = []
        if self.root.is_dir():
            for entry in self.root.iterdir():
                partial = entry.name.startswith(".step_") and entry.name.endswith(".tmp")
                unmarked = _STEP.match(entry.name) is not None and not (entry / MARKER).exists()
                if entry.is_dir() and (partial or unmarked):
                    shutil.rmtree(entry)
                    removed.append(entry)
        return removed

    def finished(self, step: int) -> str | None:
        """The adapter path the trainer wrote for `step` ('' for a step without new weights), or None."""
        try:
            return (self.path(step) / ADAPTER).read_text().strip()
        except FileNotFoundError:
            return None

    def meta(self, step: int) -> dict[str, Any]:
        return orjson.loads((self.path(step) / META).read_bytes())

    # ------------------------------------------------------------------ the trainer's side

    def read(self, step: int) -> Batch:
        """The published batch of `step`; FileNotFoundError if it is not complete yet."""
        folder = self.path(step)
        if not (folder / MARKER).exists():
            raise FileNotFoundError(f"{folder} is not published (no {MARKER} marker)")
        rollouts = [orjson.loads(line) for line in (folder / BATCH).read_bytes().splitlines() if line.strip()]
        meta = self.meta(step)
        return Batch(step, rollouts, meta.get("metrics", {}), meta.get("state", {}))

    def wait(self, step: int, timeout_s: float | None = None, poll_s: float = 0.1) -> Batch:
        """Block until `step` is published and return it; TimeoutError after `timeout_s`."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not (self.path(step) / MARKER).exists():
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"step {step} was not published in {self.root} within {timeout_s:g} s")
            time.sleep(poll_s)
        return self.read(step)

    def iter(self, start: int = 1, timeout_s: float | None = None, poll_s: float = 0.1) -> Iterator[Batch]:
        """Batches from step `start` on, each as soon as it is published (a trainer's main loop)."""
        step = start
        while True:
            yield self.wait(step, timeout_s, poll_s)
            step += 1

    def finish(self, step: int, adapter_path: str | Path | None) -> None:
        """Say the trainer is done with `step`: the adapter it produced (None: no new weights)."""
        folder = self.path(step)
        if not (folder / MARKER).exists():
            raise FileNotFoundError(f"{folder} is not published: cannot finish step {step}")
        write_atomic(folder / ADAPTER, b"" if adapter_path is None else str(adapter_path).encode() + b"\n")


__all__ = ["ADAPTER", "BATCH", "Batch", "MARKER", "META", "StepFolders"]
