"""The orchestrator's pure parts: group advantages, the environment mixer, task dedupe and order."""

from __future__ import annotations

import orjson
import pytest

from rollgym.train.advantages import AdvantageConfig, completion_length, group_advantages
from rollgym.train.mixing import EnvMixer, SourceExhausted, SourceTask, TaskSource, task_hash


def scaled_by_length(rewards, lengths, scale=1.0):
    """A custom advantage function for the import-path test."""
    return [scale * r * n for r, n in zip(rewards, lengths)]


def one_value(rewards, lengths):
    return [0.0]


def test_group_advantages():
    rewards, lengths = [1.0, 0.0, 0.0, 1.0], [10, 30, 30, 10]
    assert group_advantages(rewards, lengths, AdvantageConfig(type="mean")) == [0.5, -0.5, -0.5, 0.5]
    normalized = group_advantages(rewards, lengths, AdvantageConfig(type="normalized"))
    assert normalized == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)
    # The token-weighted baseline is 20/80 = 0.25: short right answers gain more than with the plain mean.
    assert group_advantages(rewards, lengths, AdvantageConfig(type="length_weighted")) == [0.75, -0.25, -0.25, 0.75]
    assert group_advantages([0.5, 0.5], [1, 1], AdvantageConfig()) == [0.0, 0.0]
    custom = AdvantageConfig(type="custom", import_path=f"{__name__}:scaled_by_length", kwargs={"scale": 2.0})
    assert group_advantages([1.0, 0.5], [3, 4], custom) == [6.0, 4.0]


def test_advantage_config_errors_name_the_problem():
    with pytest.raises(ValueError, match="import_path is required with type: custom"):
        AdvantageConfig(type="custom")
    with pytest.raises(ValueError, match="No module named 'no_such_module'"):
        AdvantageConfig(type="custom", import_path="no_such_module:f")
    bad = AdvantageConfig(type="custom", import_path=f"{__name__}:one_value")
    with pytest.raises(ValueError, match="must return 2 finite numbers, got \\[0.0\\]"):
        group_advantages([1.0, 0.0], [1, 1], bad)


def test_completion_length_prefers_the_token_mask():
    # A rollout's `sequences` is a list (one sequence per unbroken token prefix), as /run returns it.
    real = {"sequences": [{"prompt_ids": [1], "completion_ids": [5, 6, 7, 8], "completion_mask": [1, 1, 0, 1],
                           "completion_logprobs": [-0.1, -0.2, 0.0, -0.3]}], "metrics": {"output_tokens": 9}}
    assert completion_length(real) == 3
    assert completion_length({**real, "sequences": real["sequences"] * 2}) == 6
    assert completion_length({"sequences": {"completion_mask": [1, 1, 0, 1]}, "metrics": {"output_tokens": 9}}) == 3
    assert completion_length({"metrics": {"output_tokens": 9}}) == 9
    assert completion_length({}) == 0


def test_env_ratios_hold_per_step_and_drift_less_than_one_group():
    ratios = {"math": 0.7, "code": 0.2, "weather": 0.1}
    mixer = EnvMixer(ratios, groups_per_step=4)
    totals = {name: 0 for name in ratios}
    worst = 0.0
    for step in range(1, 201):
        quota = mixer.quotas(step)
        assert sum(quota.values()) == 4
        for name, count in quota.items():
            totals[name] += count
            worst = max(worst, abs(totals[name] - ratios[name] * 4 * step))
    assert worst < 1.0  # bounded drift at every step boundary
    assert {name: totals[name] / 800 for name in totals} == pytest.approx(ratios)  # converges exactly
    assert mixer.quotas(7) == EnvMixer(ratios, 4).quotas(7)  # deterministic: a resumed run deals the same
    with pytest.raises(ValueError, match="not all zero"):
        EnvMixer({"a": 0.0}, 4)


def test_dedupe_keys_and_task_order():
    a = {"responses_create_params": {"input": "hi"}, "id": 1}
    b = {"responses_create_params": {"input": "hi"}, "id": 2}
    keys = ["responses_create_params.input"]
    assert task_hash(a, keys) == task_hash(b, keys)
    assert task_hash(a, ["id"]) != task_hash(b, ["id"])
    assert task_hash(a, ["missing"]) != task_hash(b, ["missing"])  # no key at all: the whole row counts
    tasks = [SourceTask("e", f"g{i}", {"i": i}) for i in range(5)]
    source = TaskSource("e", tasks, seed=1)
    first_epoch = [source.next().group_id for _ in range(5)]
    assert sorted(first_epoch) == [f"g{i}" for i in range(5)]  # every task once per epoch
    source.next()
    state = source.state()
    resumed = TaskSource("e", tasks, seed=1)
    resumed.restore(state)
    assert [resumed.next().group_id for _ in range(7)] == [source.next().group_id for _ in range(7)]


def test_rloo_baseline_leaves_the_rollout_out():
    advantages = group_advantages([1.0, 0.0, 0.0, 1.0], [1, 1, 1, 1], AdvantageConfig(type="rloo"))
    assert advantages == pytest.approx([1 - 1 / 3, -2 / 3, -2 / 3, 1 - 1 / 3])
    assert group_advantages([0.5], [3], AdvantageConfig(type="rloo")) == [0.0]


def test_pools_take_tasks_out_of_the_rotation_and_return_them_at_their_rate():
    tasks = [SourceTask("e", f"t{i}", {"i": i}) for i in range(6)]
    never = TaskSource("e", tasks, seed=0, promote={"easy": 0.0, "hard": 0.0})
    always = TaskSource("e", [SourceTask("e", t.group_id, t.row) for t in tasks], seed=0,
                        promote={"easy": 1.0, "hard": 0.0})
    hard = {}
    for source in (never, always):
        first_pass = [source.next() for _ in range(6)]
        for task in first_pass[:3]:
            source.retire(task, "easy")
        source.retire(first_pass[3], "hard")
        hard[id(source)] = first_pass[3]
    assert len({never.next().group_id for _ in range(20)}) == 2  # only the two never pooled
    second_pass = [always.next().group_id for _ in range(5)]  # the easy pool came back whole, the hard one not
    assert sorted(second_pass) == sorted(t.group_id for t in tasks if t.group_id != hard[id(always)].group_id)
    assert always.pools == {"easy": set(), "hard": {hard[id(always)].index}}


def test_a_source_state_keeps_pools_and_the_tasks_in_flight():
    tasks = [SourceTask("e", f"t{i}", {"i": i}) for i in range(8)]
    source = TaskSource("e", tasks, seed=3)
    taken = [source.next() for _ in range(5)]
    source.retire(taken[0], "hard")
    state = orjson.loads(orjson.dumps(source.state(pending=taken[3:])))  # two still in flight
    assert state["pending"] == [taken[3].index, taken[4].index] and state["hard"] == [taken[0].index]
    resumed = TaskSource("e", tasks, seed=3)
    resumed.restore(state)
    assert [resumed.next() for _ in range(2)] == taken[3:]  # in flight at the save: sent first
    assert [resumed.next() for _ in range(3)] == [source.next() for _ in range(3)]
    assert resumed.pools["hard"] == {taken[0].index}
    everything = TaskSource("e", tasks[:2], seed=0)
    for task in tasks[:2]:
        everything.retire(task, "easy")
    with pytest.raises(SourceExhausted, match="all 2 tasks are in the difficulty pools"):
        everything.next()
