"""Credit with several policies (rollgym.train.loop.policies): each policy trains on its own segments with its
own reward. Rollouts are built as a two-role program makes them (a caller's call, then an answerer's, the
answerer's prompt extending the caller's tokens, as one shared conversation does), merged by the real
`merge_sequences`, curated by the real curation into GRPO groups and turned into the grpo trainer's
TrainSequences: role A's reward never reaches role B's tokens, and the team setting gives both the episode's."""

from __future__ import annotations

from typing import Any

import pytest

from rollgym.sequences import merge_sequences
from rollgym.train.loop.curation import CurateConfig, curate
from rollgym.train.loop.policies import PolicyConfig, policy_rollouts, policy_summary

pytest.importorskip("torch")
from rollgym.train.trainers.grpo_trainer import sequences_of  # noqa: E402

SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "logprobs": "processed"}
CALLER, ANSWERER = PolicyConfig(name="caller"), PolicyConfig(name="answerer", roles=["reporter"])


def call(policy: str, prompt: list[int], generation: list[int]) -> dict[str, Any]:
    return {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": policy}],
            "prompt_token_ids": prompt, "generation_token_ids": generation,
            "generation_log_probs": [-0.5] * len(generation), "sampling": SAMPLING, "policy": policy,
            "model_version": f"{policy}@v1"}


def rollout(index: int, rewards: dict[str, float], reward: float) -> dict[str, Any]:
    """Rollout i's caller samples tokens 100+i and 110+i, its answerer (whose prompt extends them) 200+i and 210+i."""
    caller = call("caller", [1, 2, 3], [100 + index, 110 + index])
    answerer = call("answerer", [1, 2, 3, 100 + index, 110 + index, 7, 8], [200 + index, 210 + index])
    items = [caller, {"type": "function_call_output", "call_id": "c", "output": "4817"}, answerer]
    sequences, prefix_ok = merge_sequences(items)
    return {"rollout_id": f"r{index}", "group_id": "task-0", "reward": reward, "rewards": rewards,
            "status": "ok", "response": {"output": items}, "sequences": sequences, "prefix_ok": prefix_ok,
            "responses_create_params": {"input": [{"role": "user", "content": "code of Paris?"}]}}


def trained(policy: PolicyConfig, rollouts: list[dict[str, Any]], credit: str) -> dict[int, float]:
    """Each trained (loss) token of the policy's GRPO records -> the advantage it trains with."""
    views, left = policy_rollouts(rollouts, policy, credit)  # type: ignore[arg-type]
    assert left.get("not_this_policy", 0) == 0
    curated = curate(views, "groups", CurateConfig(), version=f"{policy.name}@v1", group_size=len(rollouts))
    out: dict[int, float] = {}
    for sequence in [s for group in sequences_of(curated.records) for s in group]:
        for token, mask in zip(sequence.completion_ids, sequence.loss_mask):
            if mask:
                out[token] = sequence.advantage
    return out


def test_merge_splits_a_shared_conversation_by_policy() -> None:
    row = rollout(0, {"caller": 1.0, "reporter": 0.0}, 0.5)
    assert [s["policy"] for s in row["sequences"]] == ["caller", "answerer"]
    assert row["prefix_ok"] is True  # another policy's call carrying the tokens on is not drift
    assert [s["completion_ids"] for s in row["sequences"]] == [[100, 110], [200, 210]]
    assert row["sequences"][1]["prompt_ids"] == [1, 2, 3, 100, 110, 7, 8]  # the caller's tokens: prompt here


def test_role_a_reward_never_reaches_role_b_tokens() -> None:
    # The caller does well where the answerer does badly and the other way round; the episode's reward is flat.
    rollouts = [rollout(0, {"caller": 1.0, "reporter": 0.0}, 0.5), rollout(1, {"caller": 0.0, "reporter": 1.0}, 0.5)]
    caller, answerer = trained(CALLER, rollouts, "per_role"), trained(ANSWERER, rollouts, "per_role")
    assert set(caller) == {100, 110, 101, 111} and set(answerer) == {200, 210, 201, 211}  # only its own tokens
    assert caller[100] == caller[110] > 0 > caller[101] == caller[111]
    # the answerer's reward came by its role label (rewards.reporter): its advantages are the reverse
    assert answerer[200] == answerer[210] < 0 < answerer[201] == answerer[211]
    # Change only the answerer's rewards: the caller's advantages do not move, the answerer's follow.
    flipped = [rollout(0, {"caller": 1.0, "reporter": 1.0}, 0.5), rollout(1, {"caller": 0.0, "reporter": 0.0}, 0.5)]
    assert trained(CALLER, flipped, "per_role") == caller
    assert trained(ANSWERER, flipped, "per_role")[200] > 0 > trained(ANSWERER, flipped, "per_role")[201]


def test_team_credit_trains_every_policy_on_the_episode_reward() -> None:
    rollouts = [rollout(0, {"caller": 1.0, "reporter": 0.0}, 1.0), rollout(1, {"caller": 0.0, "reporter": 1.0}, 0.0)]
    caller, answerer = trained(CALLER, rollouts, "team"), trained(ANSWERER, rollouts, "team")
    assert caller[100] > 0 and answerer[200] > 0  # rollout 0 won as a team: both roles' tokens pushed up
    assert caller[101] < 0 and answerer[201] < 0


def test_a_policy_without_its_own_reward_takes_the_episode_reward() -> None:
    row = rollout(0, {"somebody_else": 0.0}, 0.75)
    assert policy_summary([row], [CALLER, ANSWERER], "per_role") == {
        "caller": {"mean_reward": 0.75, "rollouts": 1}, "answerer": {"mean_reward": 0.75, "rollouts": 1}}
    failed = {**rollout(1, {"caller": 1.0}, 0.5), "reward": None, "status": "model_error"}
    views, _ = policy_rollouts([failed], CALLER, "per_role")
    assert views[0]["reward"] is None  # a failure is never a reward, whatever rewards it carries


def test_a_rollout_the_policy_made_no_call_in_is_not_its_data() -> None:
    row = rollout(0, {"caller": 1.0}, 1.0)
    only_caller = {**row, "response": {"output": row["response"]["output"][:1]}, "sequences": row["sequences"][:1]}
    views, left = policy_rollouts([only_caller], ANSWERER, "per_role")
    assert views == [] and left["not_this_policy"] == 1
