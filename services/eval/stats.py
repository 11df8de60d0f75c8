"""The statistics of an evaluation: pass@k, mean reward with a 95 % interval, paired comparisons.

The unit of every interval is the *task*, not the rollout: the repeats of one task share its
difficulty, so they are not independent samples, and treating 4 repeats of 50 tasks as 200 draws
makes an interval about twice too narrow. Each task is reduced to its own mean (or its own pass@k
estimate) first; the interval is then Student's t over those task values,

    mean ± t(0.975, T-1) · sd(task values) / √T

which is the cluster-robust (clustered by task) standard error when every task has the same number
of rollouts, with the t quantile instead of 1.96 so that a handful of tasks is not over-trusted.
A comparison of two models pairs them task by task (the same tasks, so the tasks' own difficulty
cancels) and applies the same interval to the per-task differences; the difference is beyond noise
when that interval leaves out zero.

Failed rollouts (timeouts, crashes, a model that did not answer) are not rewards: they are counted
apart and left out of every figure here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterable, Mapping, Sequence

LEVEL = 0.95
METHOD = "Student t over per-task means (clustered by task), 95 %"
PAIRED_METHOD = "paired Student t over per-task differences (tasks both models finished), 95 %"


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al.'s unbiased pass@k for one task: n samples, c of them passed: 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass(frozen=True)
class TaskResult:
    """One task's finished rollouts (their rewards) and how many of its rollouts failed."""

    task: str
    rewards: tuple[float, ...]
    failed: int = 0

    @property
    def n(self) -> int:
        return len(self.rewards)

    @property
    def mean(self) -> float:
        return sum(self.rewards) / len(self.rewards)

    def passes(self, threshold: float) -> int:
        return sum(1 for reward in self.rewards if reward >= threshold)


@dataclass(frozen=True)
class Estimate:
    """A mean over tasks and its 95 % interval (None when fewer than two tasks give no spread to measure)."""

    value: float
    low: float | None
    high: float | None
    tasks: int

    def to_json(self) -> dict[str, float | int | None]:
        return {"value": self.value, "low": self.low, "high": self.high, "tasks": self.tasks}


def mean_interval(values: Sequence[float], level: float = LEVEL) -> Estimate | None:
    """The mean of `values` (one per task) with its Student-t interval; None for no values."""
    count = len(values)
    if count == 0:
        return None
    mean = math.fsum(values) / count
    if count < 2:
        return Estimate(mean, None, None, count)
    sd = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (count - 1))
    half = t_quantile(0.5 + level / 2, count - 1) * sd / math.sqrt(count)
    return Estimate(mean, mean - half, mean + half, count)


def mean_reward(tasks: Iterable[TaskResult]) -> Estimate | None:
    """Mean reward: each task's mean over its finished rollouts, averaged over the tasks that have one."""
    return mean_interval([task.mean for task in tasks if task.n])


def pass_at_k_estimate(tasks: Iterable[TaskResult], k: int, threshold: float) -> Estimate | None:
    """pass@k averaged over the tasks with at least k finished rollouts, with its interval over tasks."""
    return mean_interval([pass_at_k(task.n, task.passes(threshold), k) for task in tasks if task.n >= k])


@dataclass(frozen=True)
class Comparison:
    """B - A on the tasks both finished: the mean difference, its interval, a two-sided p-value."""

    difference: float
    low: float | None
    high: float | None
    p_value: float | None
    tasks: int

    @property
    def beyond_noise(self) -> bool | None:
        """True when the interval leaves out 0; None when there are too few tasks to tell."""
        if self.low is None or self.high is None:
            return None
        return self.low > 0 or self.high < 0

    def to_json(self) -> dict[str, float | int | bool | None]:
        return {"difference": self.difference, "low": self.low, "high": self.high, "p_value": self.p_value,
                "tasks": self.tasks, "beyond_noise": self.beyond_noise}


def paired_comparison(a: Mapping[str, float], b: Mapping[str, float], level: float = LEVEL) -> Comparison | None:
    """Compare two models' per-task values (task → value), paired over the tasks both have."""
    shared = sorted(set(a) & set(b))
    differences = [b[task] - a[task] for task in shared]
    estimate = mean_interval(differences, level)
    if estimate is None:
        return None
    p_value = None
    if len(differences) >= 2:
        sd = math.sqrt(math.fsum((d - estimate.value) ** 2 for d in differences) / (len(differences) - 1))
        if sd == 0:  # every task moved by exactly the same amount
            p_value = 1.0 if estimate.value == 0 else 0.0
        else:
            statistic = abs(estimate.value) / (sd / math.sqrt(len(differences)))
            p_value = 2.0 * (1.0 - t_cdf(statistic, len(differences) - 1))
    return Comparison(estimate.value, estimate.low, estimate.high, p_value, len(shared))


# --- Student's t, without scipy ------------------------------------------------------------------


def t_cdf(x: float, df: float) -> float:
    """P(T <= x) for Student's t with `df` degrees of freedom (through the regularized incomplete beta)."""
    if df <= 0:
        raise ValueError(f"degrees of freedom must be positive, got {df}")
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + x * x))
    return 1.0 - tail if x >= 0 else tail


@lru_cache(maxsize=256)
def t_quantile(p: float, df: float) -> float:
    """The x with P(T <= x) = p, by bisection on t_cdf (exact to ~1e-12)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    low, high = 0.0, 1.0
    while t_cdf(high, df) < p:
        high *= 2.0
    for _ in range(200):
        middle = (low + high) / 2.0
        if t_cdf(middle, df) < p:
            low = middle
        else:
            high = middle
        if high - low < 1e-13 * max(1.0, high):
            break
    return (low + high) / 2.0


def _betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta I_x(a, b), by Lentz's continued fraction (Numerical Recipes 6.4)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):  # the fraction converges fast on this side; else use the symmetry
        return front * _beta_fraction(a, b, x) / a
    return 1.0 - front * _beta_fraction(b, a, 1.0 - x) / b


def _beta_fraction(a: float, b: float, x: float) -> float:
    tiny, eps = 1e-300, 1e-15
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    result = d
    for m in range(1, 1000):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            result *= c * d
        if abs(c * d - 1.0) < eps:
            break
    return result


__all__ = ["Comparison", "Estimate", "LEVEL", "METHOD", "PAIRED_METHOD", "TaskResult", "mean_interval",
           "mean_reward", "paired_comparison", "pass_at_k", "pass_at_k_estimate", "t_cdf", "t_quantile"]
