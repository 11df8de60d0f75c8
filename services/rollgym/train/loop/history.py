"""Where each finished epoch's (async: step's) line goes: history.jsonl first, then whoever watches.

Appending the line (with the run's state beside it, `RunFolder.append_history`) is the one write that
must succeed: it is what a resumed run reads back. The rest is best-effort, so that a plot or a tracker
never stops training: the line's numbers go to the experiment tracker (`tracking.py`), which reports a
failing backend once and drops it, and the pictures (`plots.py`) are drawn again, a failure logged.
"""

from __future__ import annotations

from typing import Any, Callable

from .run_folder import RunFolder
from .tracking import Tracker, TrackingConfig


class History:
    """A run's history: `record(line, state)` after each epoch (step), `lines()` to read it, `close()` at the end."""

    def __init__(self, folder: RunFolder, tracking: TrackingConfig, log: Callable[[str], None], *,
                 step_plots: bool = False) -> None:
        self.folder = folder
        self.tracking = tracking
        self.log = log
        self.step_plots = step_plots  # async runs: steps.png beside reward.png
        self.tracker: Tracker | None = None

    def lines(self) -> list[dict[str, Any]]:
        return self.folder.history()

    def record(self, line: dict[str, Any], state: dict[str, Any]) -> None:
        self.folder.append_history(line, state)
        if self.tracker is None:
            self.tracker = Tracker(self.tracking, self.folder.root, self.log)
        self.tracker.log(line)
        self.draw()

    def draw(self) -> None:
        """reward.png (and steps.png) from the history as it stands; a failure is logged, never raised."""
        from .plots import plot_history, plot_steps

        lines = self.lines()
        pictures = [("reward.png", lambda path: plot_history(lines, path))]
        if self.step_plots:
            pictures.append(("steps.png", lambda path: plot_steps([h for h in lines if h.get("orchestrator")], path)))
        for name, draw in pictures:
            try:
                draw(self.folder.root / name)
            except Exception as exc:  # noqa: BLE001 - a plot must never stop training
                self.log(f"{name} not drawn: {type(exc).__name__}: {exc}")

    def close(self) -> None:
        if self.tracker is not None:
            self.tracker.close()
            self.tracker = None


__all__ = ["History"]
