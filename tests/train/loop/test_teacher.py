"""The loop's teacher (on-policy distillation) over real HTTP: every curated sequence gets the teacher's
logprob of each completion token, a failed call fails with its cause (never a zero), a plan's teacher keys
are checked by name, and two tokenizers that disagree are told apart."""

from __future__ import annotations

import pytest

from rollgym.client import ServerAddress
from rollgym.scoring import PROBE_TEXT, tokenizer_problem
from rollgym.testing import serve_in_thread
from rollgym.testing.scripted_vllm import _logprob
from rollgym.train.loop.plan import Plan
from rollgym.train.loop.teacher import TeacherConfig, TeacherError, score_records

from models.chat_completions.tests.test_app import make_model, scripted_backend


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
