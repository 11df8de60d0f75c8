"""Rollout statuses: which are the policy's own outcomes and which are infrastructure failures."""

from __future__ import annotations

from typing import Literal

RolloutStatus = Literal["ok", "truncated", "max_steps", "model_error", "env_error", "timeout", "context_overflow",
                        "agent_error"]

# The policy produced the trajectory: it was verified and its reward is real.
POLICY_STATUSES: frozenset[str] = frozenset({"ok", "truncated", "max_steps"})
# No reward: infrastructure failed, or (context_overflow) the prompt did not fit the model's context,
# so nothing was generated, or (agent_error) an external agent run by agents/proxy_agent crashed or
# exited non-zero. The collector records these and retries the infrastructure failures.
FAILURE_STATUSES: frozenset[str] = frozenset({"model_error", "env_error", "timeout", "context_overflow", "agent_error"})
# Failures a retry of the same row cannot fix.
FINAL_STATUSES: frozenset[str] = frozenset({"context_overflow"})
