"""The contract between the orchestrator and a trainer in another process (or on another machine).

A step's `Batch` is published once, whole, and never changed; the trainer reads it, trains, and says the
step is finished with the adapter it produced (None: the step changed no served weights). Steps finish
in order, and saying it again with the same adapter is a no-op, so either side may retry after a crash.

`BatchTransport` is what a transport gives both ends; `folders.StepFolders` is the one that stores the
batches (a shared disk), and the step server (`http.py`) carries the "finished" half over HTTP on top of
it, writing what the folder's ADAPTER file would say, so a run resumes whichever way its trainer signals.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Protocol


@dataclass
class Batch:
    """One training step's batch: `rollouts` in whole groups, each rollout carrying its `advantage`."""

    step: int
    rollouts: list[dict[str, Any]]
    metrics: dict[str, Any] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)  # what a resumed orchestrator continues from

    def groups(self) -> list[list[dict[str, Any]]]:
        """The rollouts grouped by `group_id`, in batch order."""
        out: dict[str, list[dict[str, Any]]] = {}
        for rollout in self.rollouts:
            out.setdefault(str(rollout.get("group_id")), []).append(rollout)
        return list(out.values())


class BatchTransport(Protocol):
    """Both ends of a batch transport."""

    def publish(self, batch: Batch) -> Any:
        """The orchestrator's side: hand out a batch, atomically; a step is published once."""

    def published(self) -> list[int]:
        """The steps handed out so far, ascending."""

    def read(self, step: int) -> Batch:
        """The trainer's side: the published batch of `step`."""

    def iter(self, start: int = 1, timeout_s: float | None = None, poll_s: float = 0.1) -> Iterator[Batch]:
        """The trainer's main loop: batches from step `start` on, each as soon as it is published."""

    def finish(self, step: int, adapter_path: str | Path | None) -> None:
        """The trainer's side: `step` is trained; the adapter it produced (None: no new weights)."""

    def finished(self, step: int) -> str | None:
        """The orchestrator's side: the adapter the trainer reported for `step` ('' for none), or None yet."""


__all__ = ["Batch", "BatchTransport"]
