"""The orchestrator's task sources: the environment mixer, task dedupe and order, easy/hard pools."""

from __future__ import annotations

import orjson
import pytest

from rollgym.train.orchestrator.sources import EnvMixer, SourceExhausted, SourceTask, TaskSource, task_hash


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
