"""The verl agent loop: a rollgym /run rollout mapped onto verl's AgentLoopOutput.

Against verl's real `AgentLoopBase` / `AgentLoopOutput` when verl is installed (then the loop is also
instantiated the way verl's AgentLoopWorker does it: hydra, from an agent-loop config entry), else
against the module's stand-ins with verl 0.9.1's field set. The rollouts come from a real stack:
scripted backend with token ids → chat_completions → simple_agent → reverse_text / weather.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

from rollgym import RolloutsFailed
from rollgym.testing import REPO_ROOT

# Imported as verl's workers import it (PYTHONPATH=scripts/integrations): verl ships a top-level
# `scripts` package, so `scripts.integrations.verl_agent_loop` does not import where verl is installed.
sys.path.insert(0, str(REPO_ROOT / "scripts" / "integrations"))
import verl_agent_loop as V  # noqa: E402

REVERSE_SYSTEM = "You reverse text. Reply with the reversed text only, nothing else."
TOOL = {"type": "function", "name": "get_weather", "strict": False,
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def reverse_row(word: str) -> dict[str, Any]:
    return {"responses_create_params": {"input": [{"role": "system", "content": REVERSE_SYSTEM},
                                                  {"role": "user", "content": f"Reverse this text: {word}"}]},
            "text": word, "agent_ref": {"type": "agents", "name": "reverse_text_agent"}}


def weather_row(city: str, expected: list[str]) -> dict[str, Any]:
    return {"responses_create_params": {"input": [{"role": "user", "content": f"What is the weather in {city}?"}],
                                        "tools": [TOOL]},
            "city": city, "expected": expected, "task_type": "weather",
            "agent_ref": {"type": "agents", "name": "weather_agent"}}


@pytest.fixture(scope="module")
def registry_file(tmp_path_factory, scripted_agents) -> Iterator[Path]:
    """The shared two-agent stack's registry file (as `rollgym run --registry-file` writes it)."""
    path = tmp_path_factory.mktemp("verl") / "registry.json"
    path.write_text(json.dumps({name: address.to_json() for name, address in scripted_agents.items()}))
    try:
        yield path
    finally:
        V.close_clients()


def trainer_config(response_length: int = 512) -> Any:
    rollout = {"response_length": response_length, "prompt_length": 1024, "temperature": 1.0, "top_p": 1.0,
               "agent": {"default_agent_loop": V.AGENT_NAME}}
    config = {"actor_rollout_ref": {"rollout": rollout}, "data": {}}
    try:
        from omegaconf import OmegaConf

        return OmegaConf.create(config)
    except ImportError:  # pragma: no cover - omegaconf is a rollgym dependency
        return config


class Wrap:
    """verl's DictConfigWrap: the config under `.config`."""

    def __init__(self, config: Any) -> None:
        self.config = config


def make_loop(target: str, response_length: int = 512, **entry: Any) -> Any:
    """The agent loop, made the way verl's AgentLoopWorker makes it."""
    config = trainer_config(response_length)
    constructor = dict(trainer_config=Wrap(config), server_manager=None, tokenizer=None, processor=None,
                       dataset_cls=None, data_config=Wrap(config["data"]))
    if V.VERL_AVAILABLE:
        import hydra
        from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap

        constructor.update(trainer_config=DictConfigWrap(config), data_config=DictConfigWrap(config.data),
                           hf_model_type=None, tools=ToolListWrap([]))
        entry_config = {"name": V.AGENT_NAME, "_target_": "verl_agent_loop.RollgymAgentLoop",
                        "target": target, **entry}
        return hydra.utils.instantiate(config=entry_config, **constructor)
    return V.RollgymAgentLoop(target=target, **entry, **constructor)


def sample(row: dict[str, Any], index: int = 0) -> dict[str, Any]:
    """One verl sample's dataset fields (what AgentLoopWorker passes as **kwargs)."""
    fields = V.to_verl_rows([row])[0]
    return {**fields, "raw_prompt": fields["prompt"], "index": index, "tools_kwargs": {}, "interaction_kwargs": {}}


SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}


def test_uses_verls_real_classes_when_installed() -> None:
    if not V.VERL_AVAILABLE:
        pytest.skip("verl is not installed here: the stand-ins with verl 0.9.1's fields are tested instead")
    from verl.experimental.agent_loop import agent_loop

    assert V.AgentLoopOutput is agent_loop.AgentLoopOutput and issubclass(V.RollgymAgentLoop, agent_loop.AgentLoopBase)
    assert agent_loop._agent_loop_registry[V.AGENT_NAME]["_target_"] == "verl_agent_loop.RollgymAgentLoop"


def test_single_turn_rollout_maps_to_agent_loop_output(registry_file: Path) -> None:
    loop = make_loop(str(registry_file))
    output = asyncio.run(loop.run(dict(SAMPLING), **sample(reverse_row("bridge"))))
    assert isinstance(output, V.AgentLoopOutput)
    assert output.reward_score == 1.0 and output.num_turns == 2  # prompt + one model turn, as verl counts
    assert len(output.response_ids) == len(output.response_mask) == len(output.response_logprobs) > 0
    assert set(output.response_mask) == {1}
    assert bytes(i - 3 for i in output.response_ids) == b"egdirb"  # the scripted backend's byte tokens
    info = output.extra_fields["rollgym"]
    assert info["status"] == "ok" and info["rollout_id"].endswith("-r0")
    assert output.metrics.generate_sequences > 0
    if V.VERL_AVAILABLE:  # verl's own tensor conversion accepts it and puts the reward on the last token
        tensors = output.as_dict()
        assert tensors["responses"].tolist() == output.response_ids
        assert tensors["rm_scores"].tolist()[-1] == 1.0 and sum(tensors["rm_scores"].tolist()) == 1.0
        assert tensors["rollout_log_probs"].shape == tensors["responses"].shape


def test_multi_turn_rollout_masks_the_tool_output(registry_file: Path) -> None:
    loop = make_loop(str(registry_file))
    output = asyncio.run(loop.run(dict(SAMPLING), **sample(weather_row("Paris", ["sunny", "22"]))))
    assert output.reward_score == 1.0
    assert output.num_turns == 4  # prompt, tool call, tool output, answer
    mask = output.response_mask
    first_zero = mask.index(0)
    assert 0 < first_zero and mask[-1] == 1 and 0 in mask[first_zero:]
    assert all(lp == 0.0 for lp, m in zip(output.response_logprobs, mask) if m == 0)
    assert all(lp < 0.0 for lp, m in zip(output.response_logprobs, mask) if m == 1)
    assert b"Paris: sunny, 22 C" in bytes(i - 3 for i, m in zip(output.response_ids, mask) if m == 0)
    assert output.metrics.tool_calls > 0


def test_sampling_params_and_response_length_reach_the_rollout(registry_file: Path) -> None:
    loop = make_loop(str(registry_file), response_length=4)
    assert loop.rollout_params({"temperature": 0.7, "top_p": 0.9}) == {"temperature": 0.7, "top_p": 0.9,
                                                                        "max_output_tokens": 4}
    output = asyncio.run(loop.run({"temperature": 0.0, "top_p": 1.0}, **sample(reverse_row("puzzle"))))
    assert len(output.response_ids) <= 4


def test_a_row_with_a_real_zero_reward_keeps_it(registry_file: Path) -> None:
    loop = make_loop(str(registry_file))
    output = asyncio.run(loop.run(dict(SAMPLING), **sample(weather_row("Oslo", ["sunny"]))))
    assert output.reward_score == 0.0 and output.extra_fields["rollgym"]["status"] == "ok"


def test_a_failed_rollout_raises_instead_of_scoring_zero(registry_file: Path, tmp_path: Path) -> None:
    registry = json.loads(registry_file.read_text())
    registry["reverse_text_agent"]["url"] = "http://127.0.0.1:9"  # nothing listens there
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(registry))
    loop = make_loop(str(broken), max_attempts=2)
    with pytest.raises(RolloutsFailed, match="agent_error"):
        asyncio.run(loop.run(dict(SAMPLING), **sample(reverse_row("x"))))
    with pytest.raises(V.UnusableRollout, match="no token ids"):
        V.rollout_to_output({"rollout_id": "a-r0", "reward": 1.0, "status": "ok", "sequences": None})
    with pytest.raises(V.UnusableRollout, match="2 token sequences"):
        seq = {"prompt_ids": [1], "completion_ids": [2], "completion_mask": [1], "completion_logprobs": [-0.1]}
        V.rollout_to_output({"rollout_id": "a-r0", "reward": 1.0, "sequences": [seq, seq], "prefix_ok": False})


def test_prepare_writes_a_verl_dataset(tmp_path: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [reverse_row("bridge"), weather_row("Paris", ["sunny"])]
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "train.parquet"
    command = [sys.executable, "scripts/integrations/verl_agent_loop.py", "prepare", "--input", str(tasks),
               "--output", str(out)]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    table = pq.read_table(out).to_pylist()
    assert [record["agent_name"] for record in table] == [V.AGENT_NAME] * 2
    assert [record["data_source"] for record in table] == ["rollgym/reverse_text_agent", "rollgym/weather"]
    assert [V.task_row(record) for record in table] == rows
    assert table[0]["prompt"] == [{"role": "system", "content": REVERSE_SYSTEM},
                                  {"role": "user", "content": "Reverse this text: bridge"}]
    assert table[1]["extra_info"] == {"index": 1}
    # The row may also ride in extra_info.
    assert V.task_row({"extra_info": {"rollgym_task": rows[0]}}) == rows[0]
    with pytest.raises(KeyError, match="rollgym_task"):
        V.task_row({"prompt": []})
