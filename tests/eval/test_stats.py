"""rollgym.eval.stats against independent references: pass@k by brute-force enumeration; Student's t, the
paired t-test, Wilson's interval, McNemar's test and Tango's interval by scipy/statsmodels when they are
installed (else the values they gave, written below, with the closed forms that can be checked by hand);
the intervals' coverage by simulation."""

from __future__ import annotations

import itertools
import math
import random
import statistics

import pytest

from rollgym.eval.stats import (
    TaskResult,
    compare_tasks,
    mean_interval,
    mean_reward,
    naive_variance,
    paired_comparison,
    pass_at_k,
    pass_at_k_estimate,
    t_cdf,
    t_quantile,
)

try:
    from scipy import optimize as scipy_optimize
    from scipy import stats as scipy_stats
except ImportError:  # the hand-checked values below stand in for it
    scipy_optimize = scipy_stats = None
try:
    from statsmodels.stats.contingency_tables import mcnemar
    from statsmodels.stats.proportion import proportion_confint
except ImportError:  # likewise
    mcnemar = proportion_confint = None

# t(0.975, df) from a printed table (Student's t, two-sided 95 %)
T_975 = {1: 12.7062, 2: 4.3027, 3: 3.1824, 4: 2.7764, 5: 2.5706, 9: 2.2622, 29: 2.0452, 120: 1.9799}
Z = 1.959963984540054  # the normal 0.975 quantile


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


def wilson(count: float, n: float, z: float = Z) -> tuple[float, float]:
    """Wilson's interval as printed in textbooks: (p + z²/2n ± z·√(p(1-p)/n + z²/4n²)) / (1 + z²/n);
    statsmodels' own when it is installed."""
    if proportion_confint:
        return proportion_confint(count, n, alpha=0.05, method="wilson")
    p = count / n
    centre, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (centre - half) / (1 + z * z / n), (centre + half) / (1 + z * z / n)


# statsmodels' proportion_confint(c, n, method="wilson") for these pass counts c of n tasks
WILSON = {(0, 6): (0.0, 0.390334), (6, 6): (0.609666, 1.0), (1, 6): (0.030053, 0.563503),
          (3, 4): (0.300642, 0.954413), (7, 20): (0.181192, 0.567146), (0, 2): (0.0, 0.657620)}


def test_pass_fail_tasks_get_wilsons_interval_which_never_has_zero_width() -> None:
    for (passed, n), (low, high) in WILSON.items():
        estimate = mean_interval([1.0] * passed + [0.0] * (n - passed))
        assert (estimate.value, estimate.tasks, estimate.method) == (passed / n, n, "wilson")
        assert (estimate.low, estimate.high) == (pytest.approx(low, abs=1e-6), pytest.approx(high, abs=1e-6))
        assert (estimate.low, estimate.high) == (pytest.approx(wilson(passed, n)[0], abs=1e-9),
                                                 pytest.approx(wilson(passed, n)[1], abs=1e-9))
    # 0 of n: the upper bound is z²/(n + z²), the largest pass rate under which seeing no pass is not
    # rejected by the score test, and never 0; n of n mirrors it.
    for n in (2, 6, 50):
        none, every = mean_interval([0.0] * n), mean_interval([1.0] * n)
        assert none.low == 0.0 and none.high == pytest.approx(Z * Z / (n + Z * Z), abs=1e-12) and none.high > 0
        assert every.high == 1.0 and every.low == pytest.approx(n / (n + Z * Z), abs=1e-12) and every.low < 1
    assert mean_interval([0.0] * 6).high == pytest.approx(0.3903, abs=1e-4)  # the 6 tasks that all scored 0


def effective_reference(values: list[float], rollouts: float) -> tuple[float, float]:
    """Wilson at Kish's effective sample size p(1-p)/se² (at most `rollouts` independent pass/fail draws)
    with the t(T-1) quantile: Korn & Graubard's df-adjusted n* = n_eff·(z/t)² fed to an ordinary Wilson
    interval."""
    p, count = statistics.fmean(values), len(values)
    se2 = statistics.variance(values) / count
    effective = min(p * (1 - p) / se2, rollouts) if se2 > 0 else rollouts
    t = scipy_stats.t.ppf(0.975, count - 1) if scipy_stats else T_975[count - 1]
    n = effective * (Z / t) ** 2
    return wilson(p * n, n)


# (task values, independent pass/fail draws they are worth at most): statsmodels' Wilson at n* from scipy's t
EFFECTIVE = [
    ([0.0, 0.25, 0.5, 0.75, 1.0, 0.5], 24, (0.202044, 0.797956)),  # n_eff = 0.25 / (0.125 / 6) = 12
    ([0.5] * 6, 24, (0.267681, 0.732319)),  # no spread: n = the 24 rollouts, not infinity
    ([0.0, 0.0, 0.0, 0.0, 0.0, 0.25], 24, (0.004763, 0.283152)),  # one pass in 24 rollouts: n_eff = 23
    ([0.1, 0.3, 0.2, 0.6, 0.4], 1000, (0.141531, 0.573242)),  # n_eff = 29.4
    ([0.1, 0.3, 0.2, 0.6, 0.4], 5, (0.049828, 0.808536)),  # five draws: n = 5 (the default, one a value)
]


@pytest.mark.parametrize("values, rollouts, reference", EFFECTIVE)
def test_graded_values_get_wilson_at_the_effective_sample_size(values, rollouts, reference) -> None:
    p = statistics.fmean(values)
    estimate = mean_interval(values, naive_se2=p * (1 - p) / rollouts)  # `rollouts` pass/fail draws
    assert estimate.method == "wilson-effective-n" and estimate.value == pytest.approx(statistics.fmean(values))
    assert (estimate.low, estimate.high) == (pytest.approx(reference[0], abs=1e-6),
                                             pytest.approx(reference[1], abs=1e-6))
    low, high = effective_reference(values, rollouts)
    assert (estimate.low, estimate.high) == (pytest.approx(low, abs=1e-4), pytest.approx(high, abs=1e-4))
    assert 0.0 <= estimate.low < estimate.value < estimate.high <= 1.0
    if rollouts == len(values):
        assert mean_interval(values) == estimate


def test_partial_credit_counts_its_rollouts_by_their_own_spread() -> None:
    """The clustered variance is never taken below the one the rollouts would give if independent
    (var(rewards) / N); graded rewards that vary little are worth more than pass/fail draws."""
    steady = [TaskResult(f"t{i}", (0.40 + 0.01 * i, 0.42 + 0.01 * i)) for i in range(5)]  # means .41 to .45
    flat = [TaskResult(f"t{i}", (0.43, 0.43)) for i in range(5)]
    rewards = [r for task in steady for r in task.rewards]
    assert naive_variance(steady, 0.43) == pytest.approx(statistics.pvariance(rewards) / 10)
    assert naive_variance(flat, 0.43) == pytest.approx(0.43 * 0.57 / 10)  # no spread: 10 pass/fail draws
    estimate = mean_reward(steady)
    assert estimate.value == pytest.approx(0.43) and estimate.method == "wilson-effective-n"
    # se² = var(0.41..0.45)/5 = 0.00005 is below var(rewards)/10 = 0.00021: n_eff = 0.2451/0.00021 = 1167
    reference = effective_reference([task.mean for task in steady], 0.43 * 0.57 / (statistics.pvariance(rewards) / 10))
    assert (estimate.low, estimate.high) == (pytest.approx(reference[0], abs=1e-4),
                                             pytest.approx(reference[1], abs=1e-4))
    assert 0.40 < estimate.low and estimate.high < 0.46
    still = mean_reward(flat)  # every rollout 0.43: not a zero width, the interval of 10 pass/fail draws
    assert (still.low, still.high) == (pytest.approx(effective_reference([0.43] * 5, 10)[0], abs=1e-4),
                                       pytest.approx(effective_reference([0.43] * 5, 10)[1], abs=1e-4))


def test_rewards_outside_0_1_get_students_t() -> None:
    estimate = mean_interval([0.0, 2.0, 2.0, 2.0])  # mean 1.5, sd 1, se 0.5, t(0.975, 3) = 3.1824
    assert estimate.value == 1.5 and estimate.tasks == 4 and estimate.method == "student-t"
    assert estimate.low == pytest.approx(1.5 - 3.1824 * 0.5, abs=1e-4)
    assert estimate.high == pytest.approx(1.5 + 3.1824 * 0.5, abs=1e-4)
    flat = mean_interval([-100.0] * 5)  # no bound and no spread: no interval rather than a zero-width one
    assert (flat.value, flat.low, flat.high) == (-100.0, None, None)
    single = mean_interval([0.4])
    assert (single.value, single.low, single.high) == (0.4, None, None)  # one task: no spread to measure
    assert mean_interval([]) is None


def test_repeats_are_clustered_into_their_task() -> None:
    # Two tasks, 4 repeats each: two observations of the difficulty, not eight of the reward.
    tasks = [TaskResult("easy", (1.0,) * 4), TaskResult("hard", (0.0,) * 4), TaskResult("gone", (), failed=4)]
    estimate = mean_reward(tasks)
    assert estimate.tasks == 2 and estimate.value == 0.5  # the task whose rollouts all failed is not a 0
    assert (estimate.low, estimate.high) == (pytest.approx(wilson(1, 2)[0]), pytest.approx(wilson(1, 2)[1]))
    assert estimate.high - estimate.low > wilson(4, 8)[1] - wilson(4, 8)[0]  # wider than 8 draws would be


def simulate(tasks: int, repeats: int, difficulty: tuple[float, float], trials: int, seed: int) -> float:
    """How often mean_reward's interval holds the true mean: tasks of uniform difficulty, Bernoulli repeats."""
    rng, covered, true_mean = random.Random(seed), 0, sum(difficulty) / 2
    for _ in range(trials):
        results = []
        for t in range(tasks):
            p = rng.uniform(*difficulty)
            results.append(TaskResult(str(t), tuple(float(rng.random() < p) for _ in range(repeats))))
        estimate = mean_reward(results)
        covered += estimate.low <= true_mean <= estimate.high
    return covered / trials


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



def test_near_the_edges_the_interval_still_covers() -> None:
    """Hard tasks (pass rates uniform on [0, 0.1]), few of them: many samples score all 0. Student's t
    over the task means covered the true mean 0.05 in 71 % (6 tasks × 4) and 27 % (6 × 1) of these
    trials; the score interval holds at least its level."""
    assert simulate(6, 4, (0.0, 0.1), 1500, 11) >= 0.95
    assert simulate(6, 1, (0.0, 0.1), 1500, 12) >= 0.95
    assert simulate(10, 4, (0.9, 1.0), 1500, 13) >= 0.95


def pairs(losses: int, gains: int, tasks: int) -> tuple[dict[str, float], dict[str, float]]:
    """Pass/fail tasks of two models: B loses `losses` of them to A, wins `gains`, ties the rest."""
    a, b = {}, {}
    for i in range(tasks):
        task = f"t{i}"
        a[task], b[task] = (1.0, 0.0) if i < losses else (0.0, 1.0) if i < losses + gains else (i % 2, i % 2)
    return a, b


def tango_reference(gains: float, losses: float, n: float, k: float) -> tuple[float, float]:
    """Tango's interval from its definition, with scipy: the likelihood of (p₊, p₋) maximized numerically
    under each Δ, and the two Δ where the score reaches k found by Brent's method."""
    def variance(delta: float) -> float:
        ties = 1 - gains - losses
        low, high = max(0.0, -delta) + 1e-15, (1 - delta) / 2 - 1e-15
        if high <= low:  # Δ = ±1: all wins or all losses, no variance left
            return 0.0

        def minus_log_likelihood(q: float) -> float:
            return -sum(w * math.log(x) for w, x in ((gains, q + delta), (losses, q), (ties, 1 - 2 * q - delta))
                        if w > 0)

        q = scipy_optimize.minimize_scalar(minus_log_likelihood, bounds=(low, high), method="bounded",
                                           options={"xatol": 1e-13}).x
        return 2 * q + delta - delta * delta

    mean = gains - losses
    score = lambda delta: n * (mean - delta) ** 2 - k * k * variance(delta)  # noqa: E731
    inner = min(max(mean, -1 + 1e-9), 1 - 1e-9)  # a bracket end where the score is within k
    low = -1.0 if score(-1 + 1e-12) <= 0 else scipy_optimize.brentq(score, -1 + 1e-12, inner, xtol=1e-12)
    high = 1.0 if score(1 - 1e-12) <= 0 else scipy_optimize.brentq(score, inner, 1 - 1e-12, xtol=1e-12)
    return low, high


# (B's losses, gains, tasks): Tango's interval (tango_reference) and McNemar's p (statsmodels)
TANGO = {(0, 0, 6): (-0.390334, 0.390334, 1.0), (0, 6, 6): (0.219331, 1.0, 0.014306),
         (1, 7, 21): (0.026003, 0.517232, 0.033895), (40, 20, 160): (-0.218064, -0.030865, 0.009823),
         (0, 4, 6): (0.016110, 0.903229, 0.045500), (2, 5, 12): (-0.187677, 0.596646, 0.256839)}


@pytest.mark.parametrize("losses, gains, tasks", list(TANGO))
def test_pass_fail_comparisons_get_tangos_interval_and_mcnemars_test(losses: int, gains: int, tasks: int) -> None:
    comparison = paired_comparison(*pairs(losses, gains, tasks))
    low, high, p_value = TANGO[losses, gains, tasks]
    assert comparison.method == "tango" and comparison.tasks == tasks
    assert comparison.difference == pytest.approx((gains - losses) / tasks)
    assert (comparison.low, comparison.high) == (pytest.approx(low, abs=2e-6), pytest.approx(high, abs=2e-6))
    # McNemar's statistic (gains - losses) / √(gains + losses), two-sided normal p
    by_hand = math.erfc(abs(gains - losses) / math.sqrt(gains + losses) / math.sqrt(2)) if gains + losses else 1.0
    assert comparison.p_value == pytest.approx(p_value, abs=1e-6) and comparison.p_value == pytest.approx(by_hand)
    if mcnemar and gains + losses:
        reference = mcnemar([[0, losses], [gains, 0]], exact=False, correction=False).pvalue
        assert comparison.p_value == pytest.approx(reference, rel=1e-9)
    if scipy_optimize:
        reference = tango_reference(gains / tasks, losses / tasks, tasks, Z)
        assert (comparison.low, comparison.high) == (pytest.approx(reference[0], abs=1e-7),
                                                     pytest.approx(reference[1], abs=1e-7))
    assert comparison.beyond_noise is (comparison.p_value < 0.05)  # the same score test at Δ = 0


def test_identical_values_do_not_make_a_comparison_certain() -> None:
    # Both models scored 0 on all of 6 tasks: ties say the difference is small, not that it is 0. The
    # bounds are ±z²/(n + z²), those of each model's own interval [0, 0.390].
    zeros = {f"t{i}": 0.0 for i in range(6)}
    tied = paired_comparison(zeros, dict(zeros))
    assert (tied.difference, tied.p_value, tied.beyond_noise) == (0.0, 1.0, False)
    assert -tied.low == tied.high == pytest.approx(Z * Z / (6 + Z * Z))
    assert tied.high == pytest.approx(0.3903, abs=1e-4)
    varied = {f"t{i}": float(i % 2) for i in range(6)}  # a model against itself: the same interval
    assert (paired_comparison(varied, dict(varied)).low, paired_comparison(varied, dict(varied)).high) == \
        (tied.low, tied.high)
    # B won every task: Δ = 1 is in, and the lower bound is (n - z²)/(n + z²), short of certainty.
    swept = paired_comparison(zeros, {task: 1.0 for task in zeros})
    assert swept.high == 1.0 and swept.low == pytest.approx((6 - Z * Z) / (6 + Z * Z))
    assert swept.p_value == pytest.approx(math.erfc(math.sqrt(6) / math.sqrt(2))) and swept.p_value > 0
    # Graded values all moved by exactly 0.25: three tasks of 4 rollouts are not proof (p 0.23).
    quarters = {"t1": 0.0, "t2": 0.25, "t3": 0.5}
    shifted = paired_comparison(quarters, {task: value + 0.25 for task, value in quarters.items()},
                                noise_se2=(0.25 - 0.25 ** 2) / 12)  # V(d̄) = 0.1875: n_eff at most 12
    assert shifted.method == "tango-effective-n" and shifted.beyond_noise is False
    assert (shifted.low, shifted.high, shifted.p_value) == (pytest.approx(-0.508403, abs=1e-6),
                                                            pytest.approx(0.771502, abs=1e-6),
                                                            pytest.approx(0.225403, abs=1e-6))


def test_graded_comparison_at_the_effective_sample_size() -> None:
    a = {"t1": 0.2, "t2": 0.5, "t3": 0.9, "t4": 0.4, "t5": 0.6}
    b = {"t1": 0.3, "t2": 0.7, "t3": 1.0, "t4": 0.45, "t5": 0.8, "only_b": 1.0}
    comparison = paired_comparison(a, b, noise_se2=(0.13 - 0.13 ** 2) / 80)
    differences = [0.1, 0.2, 0.1, 0.05, 0.2]
    assert comparison.tasks == 5 and comparison.difference == pytest.approx(sum(differences) / 5)
    # gains 0.13 a task, no losses: V(d̄) = 0.13 - 0.13² = 0.1131, se² = 0.0045 / 5, so n_eff = 125.7,
    # held to 80 by a sampling noise of V(d̄)/80; k = t(0.975, 4)
    assert comparison.method == "tango-effective-n" and comparison.beyond_noise is True
    assert (comparison.low, comparison.high, comparison.p_value) == (pytest.approx(0.030685, abs=1e-6),
                                                                     pytest.approx(0.267389, abs=1e-6),
                                                                     pytest.approx(0.032131, abs=1e-6))
    if scipy_optimize:
        reference = tango_reference(0.13, 0.0, 80, scipy_stats.t.ppf(0.975, 4))
        assert (comparison.low, comparison.high) == (pytest.approx(reference[0], abs=1e-7),
                                                     pytest.approx(reference[1], abs=1e-7))
    unheld = paired_comparison(a, b)  # without sampling noise: n_eff = 125.7
    assert unheld.beyond_noise is True and comparison.low < unheld.low
    noisy = paired_comparison({"x": 0.0, "y": 1.0, "z": 0.5}, {"x": 1.0, "y": 0.0, "z": 0.6})
    assert noisy.beyond_noise is False and noisy.low < 0 < noisy.high
    assert paired_comparison({"x": 0.0}, {"x": 1.0}).beyond_noise is None  # one task: cannot tell
    assert paired_comparison({"x": 0.0}, {"y": 1.0}) is None


def test_rewards_outside_0_1_are_compared_by_paired_t() -> None:
    a = {"t1": 2.0, "t2": 5.0, "t3": 9.0, "t4": 4.0, "t5": 6.0}
    b = {"t1": 3.0, "t2": 7.0, "t3": 10.0, "t4": 4.5, "t5": 8.0}
    comparison = paired_comparison(a, b)
    assert comparison.method == "student-t" and comparison.difference == pytest.approx(1.3)
    if scipy_stats:
        shared = sorted(a)
        reference = scipy_stats.ttest_rel([b[t] for t in shared], [a[t] for t in shared])
        assert comparison.p_value == pytest.approx(reference.pvalue, rel=1e-8)
        low, high = reference.confidence_interval(0.95)
        assert (comparison.low, comparison.high) == (pytest.approx(low), pytest.approx(high))
    else:  # mean 1.3, sd 0.6708, se 0.3, t(0.975, 4) = 2.7764
        assert comparison.low == pytest.approx(1.3 - 2.7764 * 0.300, abs=2e-3)
    steps = {"t1": -13.0, "t2": -17.0}
    constant = paired_comparison(steps, {task: value - 1 for task, value in steps.items()})
    assert (constant.low, constant.p_value, constant.beyond_noise) == (None, None, None)  # no bound, no spread


def test_comparisons_hold_their_level() -> None:
    """Two models of the same skill on hard tasks (pass rates uniform on [0, 0.2], 8 tasks × 4): a
    difference beyond noise is a false alarm, at most 5 % of the time; on tasks of middling difficulty
    where B is 0.1 better on each, the interval holds the true difference at least 95 % of the time, and
    not much more (the rollouts' own noise, the floor of the paired variance, binds about half the time
    when every task gains alike)."""
    def trial(rng: random.Random, tasks: int, repeats: int, rates: tuple[float, float], shift: float):
        a, b = {}, {}
        for t in range(tasks):
            p = rng.uniform(*rates)
            a[t] = sum(rng.random() < p for _ in range(repeats)) / repeats
            b[t] = sum(rng.random() < p + shift for _ in range(repeats)) / repeats
        results = [{t: TaskResult(str(t), (1.0,) * round(v * repeats) + (0.0,) * (repeats - round(v * repeats)))
                    for t, v in side.items()} for side in (a, b)]
        return compare_tasks(*results)

    rng = random.Random(3)
    alarms = sum(bool(trial(rng, 8, 4, (0.0, 0.2), 0.0).beyond_noise) for _ in range(1000))
    assert alarms <= 50
    covered = 0
    for _ in range(1000):
        comparison = trial(rng, 20, 4, (0.1, 0.8), 0.1)
        covered += comparison.low <= 0.1 <= comparison.high
    assert 0.945 <= covered / 1000 <= 0.985
