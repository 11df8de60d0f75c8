"""What each step's history line says: rollouts/s, rewards, dropped groups, staleness, waits, and how
busy the rollout slots were (measured by the client the rollouts go through)."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import Counter
from typing import Any

from ...client import ServerClient

DROP_REASONS = ("failed", "stale", "easy", "hard")


class Occupancy:
    """Time-weighted mean of the rollout slots in use, as a fraction of all slots, per interval."""

    def __init__(self) -> None:
        self.slots = 1
        self.in_use = 0
        self.area = 0.0
        self.since = self.last = time.monotonic()

    def start(self, slots: int) -> None:
        self.slots, self.area = slots, 0.0
        self.since = self.last = time.monotonic()

    def change(self, delta: int) -> None:
        now = time.monotonic()
        self.area += self.in_use * (now - self.last)
        self.in_use, self.last = self.in_use + delta, now

    def take(self) -> float:
        """The mean occupancy since the last take."""
        self.change(0)
        elapsed = self.last - self.since
        value = self.area / (elapsed * self.slots) if elapsed > 0 else 0.0
        self.area, self.since = 0.0, self.last
        return value


class SlotClient:
    """The client rollouts go through: a slot is held per attempt (not while a rollout backs off), and
    the time slots are in use is measured."""

    def __init__(self, client: ServerClient, slots: asyncio.Semaphore, busy: Occupancy) -> None:
        self.client, self.slots, self.busy = client, slots, busy

    async def post(self, *args: Any, **kwargs: Any) -> Any:
        async with self.slots:
            self.busy.change(+1)
            try:
                return await self.client.post(*args, **kwargs)
            finally:
                self.busy.change(-1)


def step_metrics(step: int, rollouts: list[dict[str, Any]], envs: list[str], *, policy_version: int,
                 dropped: Counter[str], failure_statuses: Counter[str], generated: int, inference_wait: float,
                 previous_ready: float, ready: float, trainer_done: float | None, slots_busy: float) -> dict[str, Any]:
    """The history line of batch `step`: `rollouts` as annotated (reward, policy_lag), `envs` one name
    per group, times from time.monotonic() (`trainer_done`: when the previous step finished)."""
    rewards = [float(r["reward"]) for r in rollouts]
    interval = max(ready - previous_ready, 1e-9)
    return {
        "step": step,
        "time": time.time(),
        "policy_version": policy_version,
        "rollouts": len(rollouts),
        "groups": len(envs),
        "interval_s": round(interval, 4),
        "rollouts_per_s": round(len(rollouts) / interval, 3),
        "generated_per_s": round(generated / interval, 3),
        "reward_mean": statistics.fmean(rewards),
        "reward_std": statistics.pstdev(rewards),
        "reward_min": min(rewards),
        "reward_max": max(rewards),
        "dropped": {reason: dropped.get(reason, 0) for reason in DROP_REASONS},
        "failures": dict(sorted(failure_statuses.items())),
        "staleness": {str(lag): count for lag, count in sorted(Counter(r["policy_lag"] for r in rollouts).items())},
        **token_staleness(rollouts),
        "envs": dict(Counter(envs)),
        "trainer_wait_s": round(max(0.0, ready - trainer_done), 4) if trainer_done is not None else 0.0,
        "inference_wait_s": round(inference_wait, 4),
        "slots_busy": round(slots_busy, 4),
    }


def token_staleness(rollouts: list[dict[str, Any]]) -> dict[str, Any]:
    """Policy lag counted by rollout (that of its oldest token) and by token: `policy_lag_mean` and
    `policy_lag_max` over the rollouts, `token_staleness` (generated tokens per lag), `off_policy_token_share`
    (the share of them sampled by a version older than the step's policy) and `mixed_version_rollouts` (those
    whose tokens more than one version sampled: a generation continued across a weight update)."""
    lags = [int(r["policy_lag"]) for r in rollouts]
    tokens: Counter[int] = Counter()
    for rollout in rollouts:
        for lag, count in (rollout.get("token_lags") or {}).items():
            tokens[int(lag)] += int(count)
    total = sum(tokens.values())
    return {"policy_lag_mean": round(statistics.fmean(lags), 4) if lags else 0.0,
            "policy_lag_max": max(lags, default=0),
            "token_staleness": {str(lag): count for lag, count in sorted(tokens.items())},
            "off_policy_token_share": round(sum(c for lag, c in tokens.items() if lag > 0) / total, 4) if total else 0.0,
            "mixed_version_rollouts": sum(1 for r in rollouts if len(r.get("token_lags") or {}) > 1)}


def filter_metrics(rollouts: list[dict[str, Any]]) -> dict[str, Any]:
    """What the degenerate-generation filters did to a batch: rollouts each filter type flagged (enforced or
    not), and those an enforced one keeps out of training (still in their groups' advantages)."""
    flagged = Counter(kind for rollout in rollouts for kind in rollout.get("flagged") or [])
    return {"flagged": dict(sorted(flagged.items())),
            "filtered_rollouts": sum(1 for rollout in rollouts if rollout.get("filtered"))}


__all__ = ["DROP_REASONS", "Occupancy", "SlotClient", "filter_metrics", "step_metrics", "token_staleness"]
