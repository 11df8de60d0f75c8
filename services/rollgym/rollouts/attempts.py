"""One rollout, tried until it succeeds or its budget is spent: the one policy of the local collector,
the Ray collector shards and `RolloutClient`.

- **Ids.** A task's `group_id` is the row's own `group_id`, else `L{n:06d}-{hash}`: `n` is the row's
  1-based line in its task file (for `RolloutClient`, its 1-based position in `rows`), `hash` the first
  8 hex digits of the SHA-1 of the row's JSON with sorted keys, so an edited row gets new ids. Repeat
  `k` of the task is the rollout `{group_id}-r{k}`.
- **Agent.** A row goes to the agent its `agent_ref` names (`{"name": ...}`, as prepare-data stamps
  it, or a bare string), else to the default agent. Every `agent_ref` is checked against the stack
  before anything is sent (`check_agent_refs`). A run told to use one agent (`--agent NAME`, an agent
  URL) sends every row there, whatever its `agent_ref` says (rows written for another stack).
- **Payload.** The row, with the run's `params` merged into `responses_create_params`, plus
  `rollout_id` and `group_id`, and `skip_verification: true` when the run skips `/verify` (a row's own
  `skip_verification` is dropped: whether rollouts are verified is the run's choice).
- **One attempt** is one `POST /run`, classified (`attempt_run`). Only a policy status with a numeric
  reward is a rollout (or, when the run asked to skip verification, one with `reward: null` and
  `verification: "skipped"`); anything else is a failure status, never a reward.
- **Retries.** A rollout is attempted at most `max_attempts` times, each attempt for at most
  `timeout_s`; with `budget_s`, all its attempts and waits together get that many seconds (an attempt's
  timeout is then what is left, and none starts once it is spent). Between attempts the wait is
  `backoff_s * 2**(attempt-1)`, capped at `backoff_max_s`, with jitter. A refused row (`rejected`), a prompt too long for the model (`context_overflow`) or an
  unknown agent is not retried. `/run` itself is not retried
  at the HTTP layer on 5xx or 429 (only when it could not be delivered): the model server has already
  retried its backend, so a failed `/run` is one failed attempt, not several.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import orjson

from ..client import ServerCallError, ServerClient
from ..data.routing import UnknownAgent, agent_for, agent_ref_name, agents_of, check_agent_refs
from ..statuses import FAILURE_STATUSES, FINAL_STATUSES


def group_id_for(row: Mapping[str, Any], position: int) -> str:
    """The row's own `group_id`, else `L{position:06d}-{hash of the row}` (see the module doc)."""
    own = row.get("group_id")
    if own:
        return str(own)
    digest = hashlib.sha1(orjson.dumps(row, option=orjson.OPT_SORT_KEYS)).hexdigest()[:8]
    return f"L{position:06d}-{digest}"


def rollout_id_for(group_id: str, repeat: int) -> str:
    return f"{group_id}-r{repeat}"


def build_payload(row: Mapping[str, Any], params: Mapping[str, Any], group_id: str, rollout_id: str, *,
                  skip_verification: bool = False) -> dict[str, Any]:
    """The body of `POST /run` for one rollout of `row` (`skip_verification`: the agent does not call /verify)."""
    payload = dict(row)
    if params:
        payload["responses_create_params"] = {**row["responses_create_params"], **params}
    payload["rollout_id"] = rollout_id
    payload["group_id"] = group_id
    if skip_verification:
        payload["skip_verification"] = True
    elif "skip_verification" in payload:
        del payload["skip_verification"]  # the run's option, not a task's: a row cannot skip on its own
    return payload


@dataclass
class Attempt:
    """One POST /run, classified: a verified rollout, or a failure's status and cause."""

    rollout: dict[str, Any] | None
    status: str
    error: str | None = None
    retryable: bool = True


async def attempt_run(client: ServerClient, agent: str, payload: dict[str, Any], timeout_s: float) -> Attempt:
    """Send one task row to an agent's /run and say what came back.

    A rollout counts only with a policy status and a numeric reward; an infrastructure status, an
    unreachable or failing agent, or an answer without a reward is a failure (never a reward of 0).
    A 4xx means the task row itself was refused ("rejected"): retrying cannot help.
    """
    try:
        reply = await client.post(agent, "/run", json=payload, timeout_s=timeout_s, retry_statuses=())
    except ServerCallError as exc:
        return Attempt(None, "timeout" if exc.kind == "timeout" else "agent_error", str(exc),
                       retryable=exc.kind != "unknown_server")
    if not reply.ok:
        status = "rejected" if 400 <= reply.status < 500 else "agent_error"
        return Attempt(None, status, f"HTTP {reply.status}: {reply.error_message()}", retryable=status != "rejected")
    rollout = reply.json()
    status = str(rollout.get("status", "ok"))
    if status in FAILURE_STATUSES:
        return Attempt(None, status, rollout.get("error"), retryable=status not in FINAL_STATUSES)
    if not isinstance(rollout.get("reward"), (int, float)):
        if rollout.get("verification") == "skipped" and payload.get("skip_verification") is True \
                and rollout.get("reward") is None:
            return Attempt(rollout, status)  # asked for: no reward, and none made up
        return Attempt(None, "agent_error", f"the agent answered status {status!r} without a reward")
    return Attempt(rollout, status)


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how long one rollout is tried (see the module doc)."""

    max_attempts: int = 3
    timeout_s: float = 3600.0
    backoff_s: float = 0.5
    backoff_max_s: float = 10.0
    budget_s: float | None = None

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if self.timeout_s <= 0 or (self.budget_s is not None and self.budget_s <= 0):
            raise ValueError("timeout_s and budget_s must be positive")

    def wait_s(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number `attempt` (1-based), jittered to spread retries."""
        return random.uniform(0.5, 1.0) * min(self.backoff_max_s, self.backoff_s * 2 ** (attempt - 1))


@dataclass
class FailedAttempt:
    """One failed attempt of one rollout, as the failures file records it."""

    rollout_id: str
    group_id: str
    attempt: int
    final: bool
    status: str
    error: str | None
    where: dict[str, Any]  # the task's place in its input: {"line": n} or {"index": i, "repeat": k}

    def to_json(self) -> dict[str, Any]:
        return {"rollout_id": self.rollout_id, "group_id": self.group_id, **self.where, "attempt": self.attempt,
                "final": self.final, "status": self.status, "error": self.error, "time": time.time()}


async def run_rollout(client: ServerClient, agent: str, payload: dict[str, Any], policy: RetryPolicy, *,
                      where: Mapping[str, Any], on_failure: Callable[[FailedAttempt], None]
                      ) -> tuple[dict[str, Any] | None, FailedAttempt | None]:
    """One rollout under `policy`: (the rollout, None) or (None, its final failed attempt).

    Every failed attempt, the final one included, goes to `on_failure` as it happens.
    """
    rollout_id, group_id = payload["rollout_id"], payload["group_id"]
    deadline = None if policy.budget_s is None else time.monotonic() + policy.budget_s
    attempt = 0
    while True:
        attempt += 1
        timeout_s = policy.timeout_s if deadline is None else min(policy.timeout_s, deadline - time.monotonic())
        outcome = await attempt_run(client, agent, payload, max(0.001, timeout_s))
        if outcome.rollout is not None:
            outcome.rollout["rollout_id"], outcome.rollout["group_id"] = rollout_id, group_id
            return outcome.rollout, None
        wait = policy.wait_s(attempt)
        final = (attempt >= policy.max_attempts or not outcome.retryable
                 or (deadline is not None and time.monotonic() + wait >= deadline))
        failed = FailedAttempt(rollout_id, group_id, attempt, final, outcome.status, outcome.error, dict(where))
        on_failure(failed)
        if final:
            return None, failed
        await asyncio.sleep(wait)


__all__ = ["Attempt", "FailedAttempt", "RetryPolicy", "UnknownAgent", "agent_for", "agent_ref_name", "agents_of",
           "attempt_run", "build_payload", "check_agent_refs", "group_id_for", "rollout_id_for", "run_rollout"]
