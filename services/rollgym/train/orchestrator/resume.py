"""Where a killed orchestrator continues, read from the step folders it published.

Published steps are kept (never generated again), half-written ones are removed, the tasks continue
from the state the last published step saved, and the adapter of the last finished step is the one
to load again before anything generates.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ...data.jsonl import read_whole_lines, write_jsonl_atomic
from .transports.folders import StepFolders


class ResumeError(RuntimeError):
    """The step folders cannot be continued from; the message says why."""


@dataclass
class ResumePoint:
    published: list[int]  # 1..last
    finished: int  # the steps the trainer finished
    state: dict[str, Any] = field(default_factory=dict)  # the last published step's orchestrator state
    adapter: str | None = None  # the last finished step's adapter (None: no step loaded new weights)

    @property
    def last(self) -> int:
        return self.published[-1] if self.published else 0


def resume_point(folders: StepFolders, finished: int | None = None,
                 log: Callable[[str], None] = print) -> ResumePoint:
    """Read the folders (removing unfinished ones); `finished` overrides how many steps count as finished
    (else: those the trainer wrote an ADAPTER for, in order)."""
    for removed in folders.discard_partial():
        log(f"removed the unfinished step folder {removed}")
    published = folders.published()
    if published != list(range(1, len(published) + 1)):
        raise ResumeError(f"{folders.root}: published steps {published} have gaps; cannot resume")
    last = published[-1] if published else 0
    if finished is None:
        finished = 0
        while finished < last and folders.finished(finished + 1) is not None:
            finished += 1
    elif not 0 <= finished <= last:
        raise ResumeError(f"{folders.root}: steps 1..{finished} are finished but only {last} published; cannot resume")
    if not published:
        return ResumePoint([], 0)
    adapter = next((folders.finished(s) for s in range(finished, 0, -1) if folders.finished(s)), None)
    return ResumePoint(published, finished, folders.meta(last).get("state", {}), adapter)


def repair_history(path: Path, folders: StepFolders, published: list[int]) -> None:
    """history.jsonl gets one line per published step (a kill may have come between the two writes)."""
    have = {line["step"]: line for line in read_whole_lines(path)
            if isinstance(line, dict) and isinstance(line.get("step"), int)}
    write_jsonl_atomic(path, [have.get(step) or folders.meta(step)["metrics"] for step in published])


__all__ = ["ResumeError", "ResumePoint", "repair_history", "resume_point"]
