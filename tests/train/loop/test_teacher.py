"""The loop's teacher (on-policy distillation) over real HTTP: every curated sequence gets the teacher's
logprob of each completion token, in epochs mode and in every batch of mode: async; a failed call fails
with its cause (never a zero), a plan's teacher keys are checked by name, and two tokenizers that disagree
are told apart."""

from __future__ import annotations

import pytest

import orjson

from rollgym.client import ServerAddress
from rollgym.data.jsonl import read_whole_lines
from rollgym.scoring import PROBE_TEXT, tokenizer_problem
from rollgym.testing import serve_in_thread
from rollgym.testing.scripted_vllm import _logprob
from rollgym.train.loop.errors import TrainError
from rollgym.train.loop.plan import Plan
from rollgym.train.loop.teacher import TeacherConfig, TeacherError, score_records

from models.chat_completions.tests.test_app import make_model, scripted_backend
from tests.train.loop.test_async_segments import TASKS, registry_file, run_async  # noqa: F401 (a fixture)


def records() -> list[dict]:
    sequence = {"prompt_ids": [72, 105, 10], "completion_ids": [79, 107, 33, 4], "completion_mask": [1, 1, 0, 1],
                "completion_logprobs": [-0.5, -1.0, 0.0, -0.2]}
    return [{"group_id": "g", "rollouts": [{"rollout_id": "r0", "sequence": dict(sequence)},
                                           {"rollout_id": "r1", "sequences": [dict(sequence), dict(sequence)]}]}]


def test_every_sequence_is_scored_and_a_failure_names_its_cause() -> None:
    with scripted_backend("--token-info") as backend, serve_in_thread(make_model(backend, return_token_ids=True)) as url:
        registry = {"policy_model": ServerAddress(url=url), "teacher_model": ServerAddress(url=url)}
        data = records()
        summary = score_records(data, TeacherConfig(server="teacher_model", concurrency=2), registry)
        expected = [_logprob(0, 3 + j, t) for j, t in enumerate([79, 107, 33, 4])]
        sequences = [data[0]["rollouts"][0]["sequence"], *data[0]["rollouts"][1]["sequences"]]
        assert all(sequence["teacher_logprobs"] == expected for sequence in sequences)
        assert summary["sequences"] == 3 and summary["tokens"] == 9  # the environment's token is not counted
        gaps = [s - t for s, t, keep in zip([-0.5, -1.0, 0.0, -0.2], expected, [1, 1, 0, 1]) if keep]
        assert summary["teacher_kl_sampled"] == pytest.approx(sum(gaps) / len(gaps))
        # Tokens a grammar restricted are scored but outside the sampled KL (grpo_loss says why).
        opened = records()
        for member in opened[0]["rollouts"]:
            for sequence in member.get("sequences") or [member["sequence"]]:
                sequence["completion_constrained"] = [1, 0, 0, 0]
        summary = score_records(opened, TeacherConfig(server="teacher_model"), registry)
        gaps = [s - t for s, t in zip([-1.0, -0.2], expected[1::2])]
        assert summary["tokens"] == 6 and summary["teacher_kl_sampled"] == pytest.approx(sum(gaps) / len(gaps))
        bad = records()
        bad[0]["rollouts"][0]["sequence"]["completion_ids"] = [79, 107]  # the scored answer is checked
        bad[0]["rollouts"][0]["sequence"]["prompt_ids"] = []
        with pytest.raises(TeacherError, match="teacher teacher_model: rollout r0: HTTP 422.*prompt_token_ids"):
            score_records(bad, TeacherConfig(server="teacher_model"), registry)
    with pytest.raises(TeacherError, match="teacher check: http://127.0.0.1:9 did not answer"):
        score_records(records(), TeacherConfig(server="http://127.0.0.1:9", timeout_s=2), {})


def test_tokenizers_that_disagree_are_named() -> None:
    assert tokenizer_problem([1, 2, 3], [1, 2, 3]) is None
    assert "first different at token 1" in tokenizer_problem([1, 2, 3], [1, 5, 3])
    assert "3 tokens for the student and 2" in tokenizer_problem([1, 2, 3], [1, 2])
    assert "São Paulo" in PROBE_TEXT


def test_a_plan_checks_its_teacher_by_key(tmp_path) -> None:
    stage = {"name": "distill", "collect": {"input": "tasks.jsonl"}, "curate": {"keep_flat_groups": True},
             "optimize": {"trainer": "grpo", "args": {"loss": {"adv_tau": 0.0, "teacher_tau": 1.0}}},
             "teacher": {"server": "teacher_model"}}
    base = {"output": str(tmp_path / "run"), "stack": {"configs": ["x.yaml"]}}
    assert Plan.model_validate({**base, "stages": [stage]}).stages[0].teacher.server == "teacher_model"
    with pytest.raises(ValueError, match=r"stages\[0\].optimize.args.loss.teacher_tau 1.0 needs stages\[0\].teacher"):
        Plan.model_validate({**base, "stages": [{**stage, "teacher": None}]})
    with pytest.raises(ValueError, match=r"stages\[0\].teacher: set stages\[0\].optimize.args.loss.teacher_tau"):
        Plan.model_validate({**base, "stages": [{**stage, "optimize": {"trainer": "grpo"}}]})
    with pytest.raises(ValueError, match="concurrency"):
        Plan.model_validate({**base, "stages": [{**stage, "teacher": {"server": "t", "concurrency": 0}}]})


def test_an_async_run_has_every_batch_scored_by_its_teacher(tmp_path, registry_file, importable_toys) -> None:
    # The teacher is the stack's own model server: its scores are the scripted backend's prompt logprobs.
    run = run_async(tmp_path, registry_file, 2, teacher={"server": "policy_model", "concurrency": 3})
    history = [orjson.loads(line) for line in (run / "history.jsonl").read_bytes().splitlines()]
    assert [line["step"] for line in history] == [1, 2]
    for line in history:
        sequences = [sequence for group in read_whole_lines(run / f"step-{line['step']:03d}" / "curated.jsonl")
                     for member in group["rollouts"] for sequence in member.get("sequences") or [member["sequence"]]]
        assert len(sequences) == 12  # 4 rollouts of 3 segments, every one scored
        for sequence in sequences:
            start = len(sequence["prompt_ids"])
            assert sequence["teacher_logprobs"] == [_logprob(0, start + j, token)
                                                    for j, token in enumerate(sequence["completion_ids"])]
        scored = line["curated"]["teacher"]
        assert scored["server"] == "policy_model" and scored["sequences"] == 12
        assert scored["tokens"] == sum(sum(s["completion_mask"]) for s in sequences)
    # A teacher that does not answer stops the run at its first step, with the cause, before any training.
    (tmp_path / "down").mkdir()
    with pytest.raises(TrainError, match=r"step 1 curate: teacher check: http://127.0.0.1:9 did not answer"):
        run_async(tmp_path / "down", registry_file, 1, teacher={"server": "http://127.0.0.1:9", "timeout_s": 2})
    assert not (tmp_path / "down" / "run" / "calls.log").exists()


def test_an_async_plan_checks_its_teacher_by_key(tmp_path, registry_file) -> None:
    base = {"output": str(tmp_path / "run"), "stack": {"registry_file": str(registry_file)}, "mode": "async",
            "orchestrator": {"batch_size": 4, "rollouts_per_example": 2, "envs": [{"name": "w", "input": str(TASKS)}]}}
    distill = {"trainer": "grpo", "args": {"loss": {"adv_tau": 0.0, "teacher_tau": 1.0}}}
    plan = Plan.model_validate({**base, "optimize": distill, "teacher": {"server": "policy_model"}})
    assert plan.teacher.server == "policy_model"
    with pytest.raises(ValueError, match=r"optimize.args.loss.teacher_tau 1.0 needs teacher \(a model server"):
        Plan.model_validate({**base, "optimize": distill})
    with pytest.raises(ValueError, match=r"teacher: set optimize.args.loss.teacher_tau above 0"):
        Plan.model_validate({**base, "optimize": {"trainer": "grpo"}, "teacher": {"server": "policy_model"}})
    with pytest.raises(ValueError, match=r"teacher: only the grpo trainer .*optimize.trainer is trl_sft"):
        Plan.model_validate({**base, "optimize": {"trainer": "trl_sft"}, "teacher": {"server": "policy_model"}})
    stage = {"name": "s", "collect": {"input": str(TASKS)}, "optimize": distill, "teacher": {"server": "t"}}
    with pytest.raises(ValueError, match=r"teacher: mode: epochs sets it stage by stage \(stages\[i\].teacher\)"):
        Plan.model_validate({**base, "mode": "epochs", "orchestrator": None, "stages": [stage],
                             "teacher": {"server": "t"}})
