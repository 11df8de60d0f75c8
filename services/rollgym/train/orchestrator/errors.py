"""What stops the orchestrator, and what it refuses from a trainer."""

from __future__ import annotations


class OrchestratorError(RuntimeError):
    """The orchestrator cannot go on (a batch cannot be filled, a hot-load failed); the message says why."""


class StepSignalError(ValueError):
    """A trainer's "step N is done" that cannot be taken: `reason` says why (`unknown_step`,
    `not_published`, `out_of_order`, `conflict`), `field` which part of the signal is wrong."""

    def __init__(self, message: str, reason: str, field: str = "step") -> None:
        super().__init__(message)
        self.reason, self.field = reason, field


__all__ = ["OrchestratorError", "StepSignalError"]
