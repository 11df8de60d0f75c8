"""The statistics of an evaluation: pass@k, mean reward with a 95 % interval, paired comparisons.

The unit of every interval is the *task*, not the rollout: the repeats of one task share its
difficulty, so they are not independent samples, and treating 4 repeats of 50 tasks as 200 draws
makes an interval about twice too narrow. Each task is reduced to its own mean (or its own pass@k
estimate) first, and the intervals are taken over those T task values.

Rewards in [0, 1] (the usual case) get *score* intervals, which stay inside [0, 1] and never have
zero width: the set of means μ that a score test at 5 % would not reject,

    (p̂ - μ)² ≤ k² · μ(1 - μ) / n          (Wilson 1927)

- **pass/fail tasks** (every task value 0 or 1): the Wilson interval itself, n = T, k = z(0.975) = 1.96.
  The variance under each μ is μ(1 - μ), so nothing is estimated: 0 of 6 tasks gives [0, 0.390],
  6 of 6 gives [0.610, 1].
- **graded values** (means over repeats, partial credit): the same interval at the *effective sample
  size* n = p̂(1 - p̂) / se², where se = sd(task values) / √T is the standard error clustered by task
  (Kish's design effect), with k = t(0.975, T-1) because se is estimated from T tasks (Korn & Graubard
  1998). se² is never taken below var(rewards) / N, what the N rollouts would give if they were
  independent (a design effect of at least 1; for pass/fail rewards, n ≤ N); rollouts that do not vary
  at all count as N pass/fail draws, so six tasks that all score 0.5 get an interval, not a point.
  pass@k estimates take their N rollouts as pass/fail draws.

A comparison of two models pairs them task by task (the same tasks, so their difficulty cancels):
the per-task differences d = b - a lie in [-1, 1], and their interval is Tango's (1998) score interval
for a paired difference, the set of Δ with

    (d̄ - Δ)² ≤ k² · V(Δ) / n,    V(Δ) = p₊ + p₋ - Δ²

where p₊, p₋ (the shares of tasks B wins and loses) are their maximum-likelihood values under Δ given
the observed shares (B's gains and losses summed over tasks, divided by T). For pass/fail tasks (d is
-1, 0 or 1) n = T and k = z; otherwise n = V(d̄) / se² with k = t(0.975, T-1), se² never below the
part the rollouts' own sampling noise contributes (Σ var(task's rewards) / n / T² for both models),
and n = T when neither shows any spread. Two models that tie on all of 6 pass/fail tasks get
[-0.390, +0.390], not [0, 0]. The p-value is the same score test at Δ = 0 (McNemar's test for pass/fail
tasks), so a difference is beyond noise (p < 0.05) exactly when its interval leaves out 0.

Rewards outside [0, 1] have no bound to score against: their interval is Student's t over the task
values, mean ± t(0.975, T-1) · sd / √T, and when every task has the same value there is no interval.
With one task there is none either.

Failed rollouts (timeouts, crashes, a model that did not answer) are not rewards: they are counted
apart and left out of every figure here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from statistics import NormalDist
from typing import Iterable, Mapping, Sequence

LEVEL = 0.95
METHOD = ("Wilson score interval over tasks, 95 % (partial credit: at the effective sample size; rewards outside "
          "[0, 1]: Student t)")
PAIRED_METHOD = ("Tango's score interval over the tasks both finished, 95 % (partial credit: at the effective sample "
                 "size; rewards outside [0, 1]: paired t)")


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
    """A mean over tasks and its 95 % interval, and the interval's method (`wilson`, `wilson-effective-n`,
    `student-t`); low/high None with one task, or with equal values outside [0, 1]."""

    value: float
    low: float | None
    high: float | None
    tasks: int
    method: str | None = None

    def to_json(self) -> dict[str, float | int | str | None]:
        return {"value": self.value, "low": self.low, "high": self.high, "tasks": self.tasks, "method": self.method}


def mean_interval(values: Sequence[float], level: float = LEVEL, naive_se2: float | None = None) -> Estimate | None:
    """The mean of `values` (one per task) with its interval (see the module doc); None for no values.
    `naive_se2`: the squared standard error of the mean were every rollout behind the values independent
    (`naive_variance`), the least the clustered one is taken to be; default: each value one pass/fail draw."""
    count = len(values)
    if count == 0:
        return None
    mean = math.fsum(values) / count
    if count < 2:
        return Estimate(mean, None, None, count)
    if all(v in (0.0, 1.0) for v in values):
        return Estimate(mean, *wilson_interval(mean, count, normal_quantile(level)), count, "wilson")
    sd = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (count - 1))
    t = t_quantile(0.5 + level / 2, count - 1)
    if all(0.0 <= v <= 1.0 for v in values):  # graded: some value strictly inside, so 0 < mean < 1
        variance = mean * (1.0 - mean)
        effective = _effective_size(variance, sd * sd / count, variance / count if naive_se2 is None else naive_se2,
                                    count)
        return Estimate(mean, *wilson_interval(mean, effective, t), count, "wilson-effective-n")
    if sd == 0:  # equal values and no bound: nothing says how far the mean may be
        return Estimate(mean, None, None, count, "student-t")
    half = t * sd / math.sqrt(count)
    return Estimate(mean, mean - half, mean + half, count, "student-t")


def wilson_interval(p: float, n: float, k: float) -> tuple[float, float]:
    """Wilson's score interval for a proportion p of n trials at quantile k (n may be an effective size)."""
    c = k * k / n
    centre = (p + c / 2) / (1 + c)
    half = math.sqrt(c * p * (1 - p) + c * c / 4) / (1 + c)
    return (0.0 if p == 0 else max(0.0, centre - half)), (1.0 if p == 1 else min(1.0, centre + half))


def _effective_size(variance: float, se2: float, floor: float, tasks: int) -> float:
    """Kish's effective sample size variance / se², se² taken at least `floor`; the T tasks when neither
    measures any spread."""
    se2 = max(se2, floor)
    return variance / se2 if se2 > 0 else float(tasks)


def naive_variance(tasks: Sequence[TaskResult], mean: float) -> float:
    """The squared standard error of a mean over these tasks were all their finished rollouts independent:
    var(rewards) / N. Rollouts whose rewards do not vary at all count as N pass/fail draws at `mean`."""
    rewards = [reward for task in tasks for reward in task.rewards]
    if not rewards:
        return 0.0
    centre = math.fsum(rewards) / len(rewards)
    variance = math.fsum((reward - centre) ** 2 for reward in rewards) / len(rewards)
    return (variance or mean * (1.0 - mean)) / len(rewards)


def mean_reward(tasks: Iterable[TaskResult]) -> Estimate | None:
    """Mean reward: each task's mean over its finished rollouts, averaged over the tasks that have one."""
    scored = [task for task in tasks if task.n]
    values = [task.mean for task in scored]
    mean = math.fsum(values) / len(values) if values else 0.0
    return mean_interval(values, naive_se2=naive_variance(scored, mean))


def pass_at_k_estimate(tasks: Iterable[TaskResult], k: int, threshold: float) -> Estimate | None:
    """pass@k averaged over the tasks with at least k finished rollouts, with its interval over tasks (whose
    rollouts count at most as that many independent pass/fail draws)."""
    enough = [task for task in tasks if task.n >= k]
    values = [pass_at_k(task.n, task.passes(threshold), k) for task in enough]
    mean = math.fsum(values) / len(values) if values else 0.0
    return mean_interval(values, naive_se2=mean * (1.0 - mean) / max(1, sum(task.n for task in enough)))


@dataclass(frozen=True)
class Comparison:
    """B - A on the tasks both finished: the mean difference, its interval, a two-sided p-value, and the
    method (`tango`, `tango-effective-n`, `student-t`)."""

    difference: float
    low: float | None
    high: float | None
    p_value: float | None
    tasks: int
    method: str | None = None

    @property
    def beyond_noise(self) -> bool | None:
        """True when the interval leaves out 0; None when there is no interval (one task, or equal
        differences of rewards outside [0, 1])."""
        if self.low is None or self.high is None:
            return None
        return self.low > 0 or self.high < 0

    def to_json(self) -> dict[str, float | int | str | bool | None]:
        return {"difference": self.difference, "low": self.low, "high": self.high, "p_value": self.p_value,
                "tasks": self.tasks, "beyond_noise": self.beyond_noise, "method": self.method}


def paired_comparison(a: Mapping[str, float], b: Mapping[str, float], level: float = LEVEL,
                      noise_se2: float = 0.0) -> Comparison | None:
    """Compare two models' per-task values (task → value), paired over the tasks both have (see the module
    doc). `noise_se2`: the part of the mean difference's squared standard error that the rollouts' own
    sampling noise accounts for (`sampling_noise`), the least the paired one is taken to be."""
    shared = sorted(set(a) & set(b))
    if not shared:
        return None
    differences = [b[task] - a[task] for task in shared]
    count = len(differences)
    mean = math.fsum(differences) / count
    if count < 2:
        return Comparison(mean, None, None, None, count)
    sd = math.sqrt(math.fsum((d - mean) ** 2 for d in differences) / (count - 1))
    if all(0.0 <= a[task] <= 1.0 and 0.0 <= b[task] <= 1.0 for task in shared):
        gains = math.fsum(d for d in differences if d > 0) / count
        losses = -math.fsum(d for d in differences if d < 0) / count
        if all(d in (-1.0, 0.0, 1.0) for d in differences):  # pass/fail: Tango's interval as published
            n, quantile, method, df = float(count), normal_quantile(level), "tango", None
        else:  # graded: some |d| strictly inside (0, 1), so the variance at the mean is positive
            n = _effective_size(_tango_variance(mean, gains, losses), sd * sd / count, noise_se2, count)
            quantile, method, df = t_quantile(0.5 + level / 2, count - 1), "tango-effective-n", count - 1
        low, high = _tango_interval(mean, gains, losses, n, quantile)
        if gains + losses == 0:  # every task tied
            p_value = 1.0
        else:
            statistic = abs(mean) / math.sqrt((gains + losses) / n)  # the score at Δ = 0
            p_value = math.erfc(statistic / math.sqrt(2)) if df is None else 2.0 * (1.0 - t_cdf(statistic, df))
        return Comparison(mean, low, high, min(1.0, p_value), count, method)
    if sd == 0:
        return Comparison(mean, None, None, None, count, "student-t")
    half = t_quantile(0.5 + level / 2, count - 1) * sd / math.sqrt(count)
    statistic = abs(mean) / (sd / math.sqrt(count))
    return Comparison(mean, mean - half, mean + half, 2.0 * (1.0 - t_cdf(statistic, count - 1)), count, "student-t")


def compare_tasks(a: Mapping[str, TaskResult], b: Mapping[str, TaskResult],
                  level: float = LEVEL) -> Comparison | None:
    """B - A over the tasks both scored (task → its result), the rollouts' sampling noise as the floor."""
    shared = [task for task in set(a) & set(b) if a[task].n and b[task].n]
    noise = sampling_noise([a[task] for task in shared]) + sampling_noise([b[task] for task in shared])
    return paired_comparison({task: a[task].mean for task in shared}, {task: b[task].mean for task in shared},
                             level, noise)


def sampling_noise(tasks: Sequence[TaskResult]) -> float:
    """The squared standard error that a mean of these tasks' means owes to their rollouts' own spread,
    Σ var(task's rewards) / n / T² (a task with one rollout shows none)."""
    total = 0.0
    for task in tasks:
        if task.n > 1:
            centre = task.mean
            total += math.fsum((r - centre) ** 2 for r in task.rewards) / (task.n - 1) / task.n
    return total / len(tasks) ** 2 if tasks else 0.0


def _tango_variance(delta: float, gains: float, losses: float) -> float:
    """V(Δ) = p₊ + p₋ - Δ², with p₋ the maximum-likelihood share of losses given Δ = p₊ - p₋ and the
    observed shares of gains and losses (Tango 1998), and p₊ = p₋ + Δ."""
    if delta < 0:  # the mirror image: B's losses are A's gains
        return _tango_variance(-delta, losses, gains)
    b = (gains + losses) * (1 - delta) - 2 * delta * (1 - gains)
    q = (b + math.sqrt(max(0.0, b * b + 8 * losses * delta * (1 - delta)))) / 4
    return max(0.0, 2 * q + delta - delta * delta)


def _tango_interval(mean: float, gains: float, losses: float, n: float, k: float) -> tuple[float, float]:
    """The Δ in [-1, 1] whose score n(mean - Δ)² / V(Δ) stays within k², by bisection from the mean outwards."""
    def outside(delta: float) -> bool:
        return n * (mean - delta) ** 2 > k * k * _tango_variance(delta, gains, losses)

    bounds = []
    for edge in (-1.0, 1.0):
        if not outside(edge):
            bounds.append(edge)
            continue
        inside, out = mean, edge
        for _ in range(100):
            middle = (inside + out) / 2
            if outside(middle):
                out = middle
            else:
                inside = middle
        bounds.append(inside)
    return bounds[0], bounds[1]


@lru_cache(maxsize=64)
def normal_quantile(level: float) -> float:
    """The two-sided normal quantile of `level` (1.959964 for 0.95)."""
    return NormalDist().inv_cdf(0.5 + level / 2)


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


__all__ = ["Comparison", "Estimate", "LEVEL", "METHOD", "PAIRED_METHOD", "TaskResult", "compare_tasks",
           "mean_interval", "mean_reward", "naive_variance", "normal_quantile", "paired_comparison", "pass_at_k",
           "pass_at_k_estimate", "sampling_noise", "t_cdf", "t_quantile", "wilson_interval"]
