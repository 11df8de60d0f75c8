"""A rollout whose turns do not extend each other trains every segment: built with the real
`sequences.merge_sequences` from model calls whose prompts a Qwen3-style template rewrote (the earlier
`<think>` stripped at each new user turn), curated into GRPO groups, turned into the trainer's
TrainSequences and run through the real loss on a tiny random model. Every model token is trained
exactly once with its own sampling logprob; sequence_mean weighs rollouts, not segments."""

from __future__ import annotations

from typing import Any

import pytest

from rollgym.sequences import merge_sequences
from rollgym.train.loop.curation import CurateConfig, curate

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

from rollgym.train.trainers.grpo_config import GRPOConfig  # noqa: E402
from rollgym.train.trainers.grpo_loss import LossConfig, sequence_scales  # noqa: E402
from rollgym.train.trainers.grpo_trainer import (  # noqa: E402
    PolicyTrainer, mini_batch_parts, rollout_keys, sequences_of)

THINK, END_THINK, EOT = 20, 21, 39  # <think>, </think>, <|im_end|> in a 40-token vocabulary
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "logprobs": "processed"}


def call(prompt: list[int], generation: list[int], base: float) -> dict[str, Any]:
    """An assistant item carrying one model call's tokens, with logprobs distinct per token."""
    return {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": f"t{base}"}],
            "prompt_token_ids": prompt, "generation_token_ids": generation,
            "generation_log_probs": [-(base + k / 10) for k in range(len(generation))]}


def qwen3_calls(user_turns: int) -> list[dict[str, Any]]:
    """Model calls of a multi-turn chat under a template that drops each earlier turn's reasoning once the
    next user turn arrives: within a turn the next prompt extends the tokens (a tool result appended),
    across a user turn it does not."""
    system_user = [1, 2, 3]
    history: list[int] = list(system_user)  # the conversation as the template renders it now
    calls = []
    for turn in range(user_turns):
        if turn:
            history += [4, 5 + turn]  # the next user message
        reasoning = [THINK, 10 + turn, 11 + turn, END_THINK]
        tool_call = [25 + turn, EOT]
        prompt = list(history)
        calls.append(call(prompt, reasoning + tool_call, 0.5 + turn))
        tool_result = [6, 7, 8]
        # Within the turn the template keeps the reasoning: the next prompt extends prompt + generation.
        second_prompt = prompt + reasoning + tool_call + tool_result
        answer = [30 + turn, EOT]
        calls.append(call(second_prompt, answer, 2.5 + turn))
        # The next user turn renders this turn without its reasoning: the prefix breaks there.
        history = prompt + tool_call + tool_result + answer
    return calls


def rollout(group: str, index: int, reward: float, user_turns: int) -> dict[str, Any]:
    calls = qwen3_calls(user_turns)
    sequences, prefix_ok = merge_sequences(calls)
    return {"rollout_id": f"{group}-r{index}", "group_id": group, "reward": reward, "status": "ok",
            "responses_create_params": {"input": [{"role": "user", "content": "plan a trip"}]},
            "response": {"model": "policy", "output": [{**c, "sampling": SAMPLING} for c in calls]},
            "sequences": sequences, "prefix_ok": prefix_ok, "_calls": calls}


def batch() -> list[dict[str, Any]]:
    # Three user turns (three segments), two (two segments), and one (one sequence: today's shape).
    return [rollout("g", 0, 1.0, 3), rollout("g", 1, 0.0, 2), rollout("g", 2, 0.5, 1)]


def test_the_template_breaks_the_prefix_at_each_user_turn() -> None:
    rows = batch()
    assert [len(r["sequences"]) for r in rows] == [3, 2, 1]
    assert [r["prefix_ok"] for r in rows] == [False, False, True]


def test_every_model_token_trains_once_with_its_own_logprob() -> None:
    rows = batch()
    curated = curate(rows, "groups", CurateConfig(), group_size=3)
    summary = curated.summary()
    assert summary["rollouts_kept"] == 3 and summary["dropped"] == {}
    assert summary["segments"] == 6 and summary["segments_per_rollout"] == 2.0
    assert summary["dropped_prefix_broken"] == 0 and summary["segments_left_out"] == 0
    [record] = curated.records
    members = record["rollouts"]
    assert [s["segment"] for s in members[0]["sequences"]] == [0, 1, 2]
    assert members[0]["sequence"] == members[0]["sequences"][-1]
    assert "sequences" not in members[2]  # one sequence: the record as before
    [trained] = sequences_of([record])
    assert len(trained) == 6
    for number, (member, row) in enumerate(zip(members, rows)):
        mine = [seq for seq in trained if seq.rollout == number]
        assert len(mine) == len(row["sequences"])
        assert {seq.advantage for seq in mine} == {member["advantage"]}
        loss_tokens = [(token, logprob) for seq in mine
                       for token, bit, logprob in zip(seq.completion_ids, seq.loss_mask, seq.sampling_logprobs) if bit]
        sampled = [(token, logprob) for c in row["_calls"]
                   for token, logprob in zip(c["generation_token_ids"], c["generation_log_probs"])]
        assert loss_tokens == sampled  # each sampled token once, in order, with the logprob it was sampled with
        # The reasoning a later prompt dropped is in the loss once (its segment), never in a later prompt.
        assert sum(seq.prompt_ids.count(THINK) for seq in mine) == 0


def test_sequence_mean_weighs_rollouts_not_segments() -> None:
    [record] = curate(batch(), "groups", CurateConfig(), group_size=3).records
    [trained] = sequences_of([record])
    counts = [seq.loss_tokens for seq in trained]
    scales = sequence_scales(counts, LossConfig(aggregation="sequence_mean"), rollout_keys(trained))
    per_rollout = {}
    for seq in trained:
        per_rollout[seq.rollout] = per_rollout.get(seq.rollout, 0) + seq.loss_tokens
    assert per_rollout == {0: 24, 1: 16, 2: 8}  # 8 sampled tokens per user turn
    for seq, scale in zip(trained, scales):
        assert scale == pytest.approx(1 / (3 * per_rollout[seq.rollout]))
    # Each rollout's tokens weigh 1/N in all, whatever its segment count.
    for number in per_rollout:
        assert sum(s * seq.loss_tokens for s, seq in zip(scales, trained) if seq.rollout == number) == pytest.approx(1 / 3)
    # Without the tags every segment would be a rollout of its own (what today's trainer did to none).
    assert sequence_scales(counts, LossConfig(aggregation="sequence_mean"))[0] == pytest.approx(1 / (6 * counts[0]))


def test_mini_batches_keep_a_rollouts_segments_together() -> None:
    [record] = curate(batch(), "groups", CurateConfig(), group_size=3).records
    [trained] = sequences_of([record])
    parts = mini_batch_parts(trained, 2)
    assert sorted(i for part in parts for i in part) == list(range(6))
    assert [{trained[i].rollout for i in part} for part in parts] == [{0, 2}, {1}]


def test_the_async_batch_trains_every_segment_with_the_orchestrators_advantage() -> None:
    from rollgym.train.orchestrator.config import OrchestratorConfig
    from rollgym.train.orchestrator.groups import Group, annotate
    from rollgym.train.orchestrator.sources import SourceTask

    config = OrchestratorConfig(batch_size=3, rollouts_per_example=3, envs=[{"name": "chat", "input": "tasks.jsonl"}])
    group = Group("chat", SourceTask("chat", "g", {}), "g", tag=1, dispatch_version=0, rollouts=batch(),
                  sampled=[0, 0, 0])
    rows = annotate(1, [group], config)
    # As the async driver curates a batch: its defaults, the orchestrator's advantages kept.
    [record] = curate(rows, "groups", CurateConfig(), group_size=3, keep_advantages=True).records
    [trained] = sequences_of([record])
    assert [sum(seq.rollout == n for seq in trained) for n in range(3)] == [3, 2, 1]
    for number, row in enumerate(rows):
        assert {seq.advantage for seq in trained if seq.rollout == number} == {row["advantage"]}


@pytest.mark.parametrize("aggregation", ["sequence_mean", "token_mean"])
def test_the_loss_of_a_step_is_over_every_segment_weighed_per_rollout(tiny_model, aggregation) -> None:
    [record] = curate(batch(), "groups", CurateConfig(), group_size=3).records
    args = GRPOConfig(learning_rate=1e-2, lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
                      loss={"aggregation": aggregation, "mask_low": None, "mask_high": None})
    trainer = PolicyTrainer(args, tiny_model, seed=1)
    trainer.load(None)
    [trained] = sequences_of([record], 1.0)
    current = trainer._logprobs_no_grad(trained)  # the policy's logprobs of every segment's loss tokens
    totals = {}
    for seq in trained:
        totals[seq.rollout] = totals.get(seq.rollout, 0) + seq.loss_tokens
    all_tokens = sum(totals.values())
    expected = 0.0
    for seq, logprobs in zip(trained, current):
        sampled = torch.tensor([lp for lp, bit in zip(seq.sampling_logprobs, seq.loss_mask) if bit], dtype=torch.float64)
        assert logprobs.numel() == seq.loss_tokens
        weight = (logprobs.double() - sampled).exp().clamp(max=args.loss.tis_cap)  # r = 1 on the first step
        scale = 1 / (3 * totals[seq.rollout]) if aggregation == "sequence_mean" else 1 / all_tokens
        expected += float((-weight * seq.advantage).sum()) * scale
    metrics = trainer.train_batch(trained)
    assert metrics["tokens"] == all_tokens == 48
    assert metrics["loss"] == pytest.approx(expected, rel=1e-4, abs=1e-6)
    assert trainer.step == 1
