"""rollgym.eval.stats against independent references: pass@k by brute-force enumeration, Student's t and
the paired t-test by scipy when it is installed (else values checked by hand in printed tables), and the
interval's coverage by simulation."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from rollgym.eval.stats import (
    TaskResult,
    mean_interval,
    mean_reward,
    paired_comparison,
    pass_at_k,
    pass_at_k_estimate,
    t_cdf,
    t_quantile,
)

try:
    from scipy import stats as scipy_stats
except ImportError:  # the hand-checked values below stand in for it
    scipy_stats = None

# t(0.975, df) from a printed table (Student's t, two-sided 95 %)
T_975 = {1: 12.7062, 2: 4.3027, 3: 3.1824, 4: 2.7764, 9: 2.2622, 29: 2.0452, 120: 1.9799}


def brute_pass_at_k(n: int, c: int, k: int) -> float:
    """The share of the k-subsets of n samples (the first c passing) that hold at least one pass."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in subset) for subset in subsets) / len(subsets)


def test_pass_at_k_is_the_share_of_k_subsets_with_a_pass() -> None:
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(n, c, k), abs=1e-12), (n, c, k)


@pytest.mark.parametrize("n, c, k", [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)])
def test_pass_at_k_refuses_impossible_counts(n: int, c: int, k: int) -> None:
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(n, c, k)


def test_pass_at_k_averages_per_task_over_tasks_with_enough_samples() -> None:
    tasks = [TaskResult("a", (1.0, 0.0, 0.0, 0.0)), TaskResult("b", (1.0, 1.0, 0.0, 0.0)),
             TaskResult("c", (0.0,), failed=3)]  # three of c's four rollouts failed: only k=1 sees it
    assert pass_at_k_estimate(tasks, 1, 1.0).value == pytest.approx((0.25 + 0.5 + 0.0) / 3)
    two = pass_at_k_estimate(tasks, 2, 1.0)
    assert two.tasks == 2 and two.value == pytest.approx((brute_pass_at_k(4, 1, 2) + brute_pass_at_k(4, 2, 2)) / 2)
    assert pass_at_k_estimate(tasks, 2, 0.0).value == 1.0  # the threshold decides what a pass is


def test_t_quantile_and_cdf_match_the_reference() -> None:
    for df, expected in T_975.items():
        reference = scipy_stats.t.ppf(0.975, df) if scipy_stats else expected
        assert t_quantile(0.975, df) == pytest.approx(reference, abs=1e-9 if scipy_stats else 1e-4)
        assert t_cdf(t_quantile(0.975, df), df) == pytest.approx(0.975, abs=1e-12)
    assert t_quantile(0.025, 4) == pytest.approx(-T_975[4], abs=1e-4)
    assert t_cdf(-1.0, 1) == pytest.approx(0.25)  # Cauchy: 1/2 + atan(x)/pi
    assert t_cdf(0.0, 7) == pytest.approx(0.5)
    assert t_cdf(2.0, 2) == pytest.approx(0.5 + 2.0 / (2 * math.sqrt(2.0 + 4.0)))  # the closed form for df=2
    if scipy_stats:
        for x, df in itertools.product((-3.5, -0.7, 0.3, 1.96, 4.0, 12.0), (1, 2.5, 5, 30, 1000)):
            assert t_cdf(x, df) == pytest.approx(scipy_stats.t.cdf(x, df), abs=1e-10)


def test_mean_interval_by_hand() -> None:
    estimate = mean_interval([0.0, 1.0, 1.0, 1.0])  # mean 0.75, sd 0.5, se 0.25, t(0.975, 3) = 3.1824
    assert estimate.value == 0.75 and estimate.tasks == 4
    assert estimate.low == pytest.approx(0.75 - 3.1824 * 0.25, abs=1e-4)
    assert estimate.high == pytest.approx(0.75 + 3.1824 * 0.25, abs=1e-4)
    single = mean_interval([0.4])
    assert (single.value, single.low, single.high) == (0.4, None, None)  # one task: no spread to measure
    assert mean_interval([]) is None


def test_repeats_are_clustered_into_their_task() -> None:
    # Two tasks, 4 repeats each: two observations of the difficulty, not eight of the reward.
    tasks = [TaskResult("easy", (1.0,) * 4), TaskResult("hard", (0.0,) * 4), TaskResult("gone", (), failed=4)]
    estimate = mean_reward(tasks)
    assert estimate.tasks == 2 and estimate.value == 0.5  # the task whose rollouts all failed is not a 0
    assert estimate.high - estimate.low == pytest.approx(2 * T_975[1] * math.sqrt(0.5) / math.sqrt(2), abs=1e-3)


def test_the_interval_covers_the_true_mean_95_percent_of_the_time() -> None:
    """Tasks of varying difficulty, Bernoulli repeats: the task-clustered interval holds its level, where
    one that took every rollout as independent would not."""
    rng = random.Random(7)
    trials, tasks, repeats, covered, naive_covered = 1500, 20, 4, 0, 0
    true_mean = 0.5  # difficulties uniform on [0.1, 0.9]
    for _ in range(trials):
        results = []
        for t in range(tasks):
            p = rng.uniform(0.1, 0.9)
            results.append(TaskResult(str(t), tuple(float(rng.random() < p) for _ in range(repeats))))
        estimate = mean_reward(results)
        covered += estimate.low <= true_mean <= estimate.high
        flat = [r for result in results for r in result.rewards]
        naive = mean_interval(flat)
        naive_covered += naive.low <= true_mean <= naive.high
    assert 0.93 <= covered / trials <= 0.97
    assert naive_covered < covered  # the rollout-level interval is too narrow here


def test_paired_comparison() -> None:
    a = {"t1": 0.2, "t2": 0.5, "t3": 0.9, "t4": 0.4, "t5": 0.6}
    b = {"t1": 0.3, "t2": 0.7, "t3": 1.0, "t4": 0.45, "t5": 0.8, "only_b": 1.0}
    comparison = paired_comparison(a, b)
    differences = [0.1, 0.2, 0.1, 0.05, 0.2]
    assert comparison.tasks == 5 and comparison.difference == pytest.approx(sum(differences) / 5)
    assert comparison.beyond_noise is True
    if scipy_stats:
        shared = sorted(a)
        reference = scipy_stats.ttest_rel([b[t] for t in shared], [a[t] for t in shared])
        assert comparison.p_value == pytest.approx(reference.pvalue, rel=1e-8)
        low, high = reference.confidence_interval(0.95)
        assert (comparison.low, comparison.high) == (pytest.approx(low), pytest.approx(high))
    else:  # mean 0.13, sd 0.06708, se 0.03, t(0.975, 4) = 2.7764
        assert comparison.low == pytest.approx(0.13 - 2.7764 * 0.0300, abs=2e-4)

    noisy = paired_comparison({"x": 0.0, "y": 1.0, "z": 0.5}, {"x": 1.0, "y": 0.0, "z": 0.6})
    assert noisy.beyond_noise is False and noisy.low < 0 < noisy.high
    same = paired_comparison(a, dict(a))
    assert (same.difference, same.p_value, same.beyond_noise) == (0.0, 1.0, False)
    quarters = {"t1": 0.0, "t2": 0.25, "t3": 0.5}  # exact in binary: every difference is exactly 0.25
    shifted = paired_comparison(quarters, {task: value + 0.25 for task, value in quarters.items()})
    assert shifted.beyond_noise is True and shifted.p_value == 0.0  # every task moved alike
    assert paired_comparison({"x": 0.0}, {"x": 1.0}).beyond_noise is None  # one task: cannot tell
    assert paired_comparison({"x": 0.0}, {"y": 1.0}) is None
