"""A plan stage reads `trace://` sources beside rollouts files (`replay`): the traces' records reach the
trainer with their token sources, and a GRPO stage refuses re-tokenized episodes unless the source allows them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from rollgym.client import ServerAddress
from rollgym.train.loop.epochs import TrainError, TrainLoop
from rollgym.train.loop.plan import load_plan

traces = pytest.importorskip("rollgym.traces")
pytest.importorskip("opentelemetry.sdk", reason="the traces extra: pip install 'rollgym[traces]'")
TOY = "tests.train.toy_trainers"


@pytest.fixture(autouse=True)
def toys(importable_toys: None) -> None:
    """The toy trainer runs in a child process."""


def plan_file(tmp_path: Path, agents: dict[str, ServerAddress], stage: dict[str, Any]) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    registry = tmp_path / "stack.json"
    registry.write_bytes(orjson.dumps({name: {"url": a.url, "role": a.role} for name, a in agents.items()}))
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump({"output": str(tmp_path / "run"), "stages": [stage],
                                    "stack": {"registry_file": str(registry), "agent": "weather_agent"}}))
    return path


def test_a_stage_trains_on_trace_sources(tmp_path: Path, scripted_agents: dict[str, ServerAddress],
                                         capsys: pytest.CaptureFixture[str]) -> None:
    tracing = traces.Tracing(tmp_path / "store")
    ids = []
    for answer, served in [("Sunny.", True), ("Rain.", True), ("Hot.", False)]:
        with tracing.episode(task="weather", input="Weather?") as ep:
            tokens = traces.TokenRecord(prompt_ids=[1, 2], completion_ids=[3, len(answer)],
                                        completion_logprobs=[-0.1, -0.2]) if served else None
            ep.llm_call(traces.Step(kind="llm", input={"messages": [{"role": "user", "content": "Weather?"}]},
                                    output={"messages": [{"role": "assistant", "content": answer}]}, tokens=tokens))
        ids.append(ep.id)
    for episode, score in zip(ids, [1.0, 0.0, 1.0]):
        tracing.emit(traces.Event(episode_id=episode, kind="reward", reward=traces.Reward(value=score, name="thumbs")))
    source = f"trace://local/{tmp_path}/store?score=thumbs"
    sft = {"name": "sft", "replay": [f"{source}&min_reward=1"], "apply": "none",
           "optimize": {"trainer": f"{TOY}:CountingTrainer", "data": "sft"}}
    loop = TrainLoop(load_plan(plan_file(tmp_path / "a", scripted_agents, sft)), progress=False)
    loop.run()
    curated = [orjson.loads(line) for line in (tmp_path / "a/run/epoch-001/curated.jsonl").read_bytes().splitlines()]
    assert [(r["rollout_id"], r["token_source"]) for r in curated] == [(ids[0], "served"), (ids[2], "retokenized")]
    [line] = [line for line in loop.history() if line["epoch"] > 0]
    # the source's own drops count in the history with the rest: episode 2 scored 0 < min_reward
    assert line["curated"]["records"] == 2 and line["curated"]["dropped"] == {"below_min_reward": 1}
    grpo = {"name": "rl", "replay": [source], "apply": "none",
            "optimize": {"trainer": f"{TOY}:CountingTrainer", "data": "groups"}}
    with pytest.raises(TrainError, match=r"1 of 3 episodes have no served token ids.*allow_retokenized"):
        TrainLoop(load_plan(plan_file(tmp_path / "b", scripted_agents, grpo)), progress=False).run()
    from rollgym.cli import main  # the same refusal, found by --check before anything starts

    assert main(["train", str(tmp_path / "b" / "plan.yaml"), "--check"]) == 2
    assert "key 'stages[0].replay[0]'" in capsys.readouterr().err


def test_a_source_that_names_nothing_readable_stops_the_plan_before_a_stack(tmp_path: Path,
                                                                            capsys: pytest.CaptureFixture[str]) -> None:
    from rollgym.cli import main

    (tmp_path / "stack.json").write_text('{"weather_agent": {"url": "http://127.0.0.1:9", "role": "agents"}}')
    plan = tmp_path / "plan.yaml"
    replay = ["trace://jaeger/x", f"trace://otlp/{tmp_path}/none.jsonl", "trace://local/x?top_k=a"]
    stage = {"name": "s", "apply": "none", "optimize": {"trainer": "trl_sft"}, "replay": replay}
    plan.write_text(yaml.safe_dump({"output": str(tmp_path / "run"), "stages": [stage],
                                    "stack": {"registry_file": str(tmp_path / "stack.json")}}))
    assert main(["train", str(plan), "--check"]) == 2
    err = capsys.readouterr().err
    assert "3 problems; nothing started" in err and "key 'stages[0].replay[0]': trace://jaeger/x: not a source" in err
    assert "stages[0].replay[1]" in err and "no such file" in err and "top_k='a' is not a number" in err
