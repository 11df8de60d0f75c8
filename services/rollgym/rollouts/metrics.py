"""Summary metrics of a rollout collection: mean reward, pass@k, statuses, tokens, latency."""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any, Iterable


@dataclass(frozen=True)
class RolloutRecord:
    """The few fields of a finished rollout that the summary needs (kept in memory, not the rollout)."""

    group_id: str
    reward: float | None  # None: verification skipped (never counted as 0)
    status: str
    input_tokens: int
    output_tokens: int
    latency_s: float

    @classmethod
    def from_rollout(cls, rollout: dict[str, Any]) -> "RolloutRecord":
        metrics = rollout.get("metrics") or {}
        reward = rollout.get("reward")
        return cls(
            group_id=str(rollout.get("group_id")),
            reward=None if reward is None else float(reward),
            status=str(rollout.get("status", "ok")),
            input_tokens=int(metrics.get("input_tokens", 0)),
            output_tokens=int(metrics.get("output_tokens", 0)),
            latency_s=float(metrics.get("latency_s", 0.0)),
        )


def pass_at_k(n: int, correct: int, k: int) -> float:
    """The unbiased pass@k estimate for one task with n samples of which `correct` passed."""
    if n - correct < k:
        return 1.0
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile q (0..100) of an already sorted list."""
    if not sorted_values:
        return None
    position = (len(sorted_values) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


def k_values(max_k: int) -> list[int]:
    """1, 2, 4, ... up to max_k, and max_k itself."""
    ks, k = [], 1
    while k < max_k:
        ks.append(k)
        k *= 2
    ks.append(max_k)
    return sorted(set(ks))


def summarize(
    records: Iterable[RolloutRecord],
    *,
    repeats: int,
    pass_threshold: float = 1.0,
    failed: int = 0,
    failure_statuses: Counter | None = None,
) -> dict[str, Any]:
    """Metrics over finished rollouts. Failed rollouts are counted, never averaged in as reward 0; so are
    rollouts whose verification was skipped (`unverified`): reward, its spread and pass@k are the verified ones'."""
    records = list(records)
    by_group: dict[str, list[float]] = defaultdict(list)
    for record in records:
        if record.reward is not None:
            by_group[record.group_id].append(record.reward)
    rewards = [r.reward for r in records if r.reward is not None]
    latencies = sorted(r.latency_s for r in records)
    statuses = Counter(r.status for r in records)
    if failure_statuses:
        statuses.update(failure_statuses)
    pass_k: dict[str, float] = {}
    for k in k_values(max(1, repeats)):
        estimates = [
            pass_at_k(len(group), sum(1 for r in group if r >= pass_threshold), k)
            for group in by_group.values() if len(group) >= k
        ]
        if estimates:
            pass_k[f"pass@{k}"] = sum(estimates) / len(estimates)
    total_in = sum(r.input_tokens for r in records)
    total_out = sum(r.output_tokens for r in records)
    count = len(records)
    return {
        "rollouts": count,
        "groups": len(by_group),
        "failed": failed,
        **({"unverified": count - len(rewards)} if len(rewards) < count else {}),
        "mean_reward": sum(rewards) / len(rewards) if rewards else None,
        "reward_std": _std(rewards),
        "pass_threshold": pass_threshold,
        **pass_k,
        "status_counts": dict(sorted(statuses.items())),
        "tokens": {
            "input_total": total_in,
            "output_total": total_out,
            "input_mean": total_in / count if count else None,
            "output_mean": total_out / count if count else None,
        },
        "latency_s": {
            "p50": percentile(latencies, 50),
            "p95": percentile(latencies, 95),
            "p99": percentile(latencies, 99),
            "max": latencies[-1] if latencies else None,
        },
    }


def _std(values: list[float]) -> float | None:
    if not values:
        return None
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
