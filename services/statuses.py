"""Rollout statuses: which are the policy's own outcomes and which are infrastructure failures."""

from __future__ import annotations

from typing import Literal

RolloutStatus = Literal["ok", "truncated", "max_steps", "model_error", "env_error", "timeout"]

# The policy produced the trajectory: it was verified and its reward is real.
POLICY_STATUSES: frozenset[str] = frozenset({"ok", "truncated", "max_steps"})
# Infrastructure failed: no reward; the collector records and retries these.
FAILURE_STATUSES: frozenset[str] = frozenset({"model_error", "env_error", "timeout"})
