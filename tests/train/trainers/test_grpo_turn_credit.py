"""Turn-level credit end to end: the inventory environment with `step_rewards: true` answers each tool call
with the progress it made, the real simple_agent records it on the call's output item, curation gives each
model turn its return-to-go advantage (`advantage: {type: return_to_go}`), and one step of the RL trainer
on a tiny random model trains every token with its own turn's advantage.

Every server runs in-process over real HTTP; the policy is a scripted ModelServer that plays one of two
tool sequences (chosen by the request's `metadata.script`) and returns prefix-consistent token ids with
sampling logprobs, as the embedded model does."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agents.simple_agent.app import SimpleAgent, SimpleAgentConfig
from resources_servers.inventory.app import InventoryConfig, InventoryServer
from rollgym import ModelServer, ResponsesCreateParams, ServerAddress, build_response
from rollgym.data.jsonl import read_jsonl
from rollgym.testing import serve_in_thread
from rollgym.train.loop.curation import CurateConfig, curate

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from rollgym.train.trainers.grpo_config import GRPOConfig  # noqa: E402
from rollgym.train.trainers.grpo_loss import LossConfig  # noqa: E402
from rollgym.train.trainers.grpo_trainer import PolicyTrainer, sequences_of  # noqa: E402

SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "logprobs": "processed"}
# Example row 0: target warehouse apple 7 / pear 2, store apple 4 / pear 5, from warehouse apple 10 / pear 2 and
# store apple 1, so one entry (warehouse/pear) matches at the start: progress 0.25.
TRANSFER = ("transfer", '{"item": "apple", "quantity": 3, "from_location": "warehouse", "to_location": "store"}')
ORDER = ("place_order", '{"item": "pear", "quantity": 5, "location": "store"}')
LIST = ("list_inventory", "{}")
SCRIPTS = {"good": [TRANSFER, ORDER], "slow": [LIST, TRANSFER]}


class ScriptedPolicy(ModelServer):
    """Turn k of script s: its k-th tool call, then a final message; each call's tokens extend the
    previous call's prompt + generation by two environment tokens per tool output."""

    async def responses(self, params: ResponsesCreateParams, payload: dict[str, Any]) -> dict[str, Any]:
        items = payload["input"]
        script = SCRIPTS[payload["metadata"]["script"]]
        context, turn = [1, 2, 3], 0
        for item in items:
            if item.get("generation_token_ids") is not None:
                context = item["prompt_token_ids"] + item["generation_token_ids"]
                turn += 1
            elif item.get("type") == "function_call_output":
                context = context + [5, 6]
        generation = [10 + 3 * turn, 11 + 3 * turn, 39]
        tokens = {"prompt_token_ids": context, "generation_token_ids": generation,
                  "generation_log_probs": [-0.5, -0.7, -0.2], "sampling": SAMPLING}
        if turn < len(script):
            name, arguments = script[turn]
            output = [{"type": "function_call", "id": f"fc_{turn}", "call_id": f"call_{turn}", "name": name,
                       "arguments": arguments, "status": "completed", **tokens}]
        else:
            output = [{"type": "message", "id": "msg", "role": "assistant", "status": "completed",
                       "content": [{"type": "output_text", "text": "Done.", "annotations": []}], **tokens}]
        return build_response(payload, output, model="scripted", usage={"input_tokens": len(context),
                                                                         "output_tokens": 3})


@pytest.fixture(scope="module")
def agent() -> Iterator[httpx.Client]:
    env = InventoryServer(InventoryConfig(step_rewards=True), name="inventory")
    with serve_in_thread(env) as env_url, serve_in_thread(ScriptedPolicy(name="policy_model")) as model_url:
        agent = SimpleAgent(SimpleAgentConfig(model_server={"name": "policy_model"},
                                              resources_server={"name": "inventory"}, max_steps=6), name="agent",
                            registry={"policy_model": ServerAddress(url=model_url, role="models"),
                                      "inventory": ServerAddress(url=env_url, role="resources_servers")})
        with serve_in_thread(agent) as url, httpx.Client(base_url=url, timeout=15.0) as http:
            yield http


def rollouts(agent: httpx.Client) -> list[dict[str, Any]]:
    import resources_servers.inventory.app as inventory

    row = read_jsonl(Path(inventory.__file__).parent / "data" / "example.jsonl")[0]
    out = []
    for i, script in enumerate(["good", "slow"]):
        params = {**row["responses_create_params"], "metadata": {"script": script}}
        reply = agent.post("/run", json={**row, "responses_create_params": params, "rollout_id": f"r{i}",
                                         "group_id": "g"})
        assert reply.status_code == 200, reply.text
        out.append(reply.json())
    return out


def test_step_rewards_reach_each_turn_and_each_token(agent, tiny_model) -> None:
    good, slow = rollouts(agent)
    assert (good["reward"], slow["reward"]) == (1.0, 0.75)
    # The environment's step rewards, as the agent recorded them on the tool outputs: the progress each
    # call made (0.25 → 0.75 → 1.0 for good; listing changes nothing).
    assert [i.get("reward") for i in good["response"]["output"] if i["type"] == "function_call_output"] == [0.5, 0.25]
    assert [i.get("reward") for i in slow["response"]["output"] if i["type"] == "function_call_output"] == [0.0, 0.5]

    curated = curate([good, slow], "groups", CurateConfig(advantage={"type": "return_to_go", "gamma": 0.5}),
                     group_size=2)
    [group] = curated.records
    # By hand: turn rewards good [0.5, 0.25, 0 + 1.0], slow [0, 0.5, 0 + 0.75]; γ = 0.5:
    # G good = [0.5 + 0.125 + 0.25, 0.25 + 0.5, 1.0] = [0.875, 0.75, 1.0], slow = [0 + 0.25 + 0.1875, 0.875, 0.75].
    returns = {"r0": [0.875, 0.75, 1.0], "r1": [0.4375, 0.875, 0.75]}
    pooled = returns["r0"] + returns["r1"]
    mean = sum(pooled) / 6
    std = (sum((g - mean) ** 2 for g in pooled) / 6) ** 0.5
    expected = {rid: [(g - mean) / (std + 1e-6) for g in gs] for rid, gs in returns.items()}
    for member in group["rollouts"]:
        assert member["sequence"]["turn_advantages"] == pytest.approx(expected[member["rollout_id"]])
        assert member["advantage"] == pytest.approx(expected[member["rollout_id"]][0])

    # The trainer: every model token carries its turn's advantage (three tokens per turn, the environment's
    # out of the loss), and with r = 1 and no behaviour weight the loss is −Σ_t A_t / Σ n (token_mean).
    [sequences] = sequences_of(curated.records)
    for seq, member in zip(sequences, group["rollouts"]):
        turns = expected[member["rollout_id"]]
        assert [a for a, m in zip(seq.token_advantages, seq.loss_mask) if m] == pytest.approx(
            [a for a in turns for _ in range(3)])
    loss = LossConfig(correction="none", mask_low=None, mask_high=None)
    trainer = PolicyTrainer(GRPOConfig(finetune="full", learning_rate=1e-3, loss=loss), tiny_model)
    trainer.load(None)
    tensors = trainer._tensors(sequences)
    order = [member["rollout_id"] for member in group["rollouts"]]
    assert tensors["advantages"].tolist() == pytest.approx(
        [a for rid in order for a in expected[rid] for _ in range(3)], rel=1e-6)
    metrics = trainer.train_records(curated.records)
    assert metrics["loss"] == pytest.approx(-sum(3 * a for a in expected["r0"] + expected["r1"]) / 18, abs=1e-6)
    assert trainer.step == 1
