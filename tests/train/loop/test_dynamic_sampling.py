"""Dynamic sampling in epochs mode (`collect.difficulty`): real epochs over the scripted backend and a
reverse-text environment whose "mixed" tasks score 1, 0, 1, ... by call (a group with a reward spread)
while the others score the same every time (no spread). Refills reach the planned groups; the bound
stops them, counted; an epoch with no spread at all is skipped, as an all-dropped epoch is."""

from __future__ import annotations

from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Iterator

import orjson
import pytest
import yaml

from resources_servers.reverse_text.app import ReverseTextServer, ReverseTextTask
from rollgym import Verdict
from rollgym.client import ServerAddress
from rollgym.testing import scripted_backend, serve_in_thread
from rollgym.train.loop.epochs import TrainLoop
from rollgym.train.loop.plan import PlanError, load_plan
from tests.conftest import simple_agent
from tests.train.orchestrator.support import reverse_row, write_rows
from models.chat_completions.app import ChatCompletionsConfig, ChatCompletionsModel

TOY = "tests.train.toy_trainers"


@pytest.fixture(autouse=True)
def toys(importable_toys: None) -> None:
    """The trainer is a toy adapter in a child process."""


class AlternatingServer(ReverseTextServer):
    """Reverse text, except that a text starting "mixed" scores 1.0, 0.0, 1.0, ... on its own calls."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.calls: Counter = Counter()

    async def verify(self, request: ReverseTextTask, state: dict[str, Any]) -> Verdict:
        if not request.text.startswith("mixed"):
            return await super().verify(request, state)
        self.calls[request.text] += 1
        return Verdict(reward=float(self.calls[request.text] % 2))


@pytest.fixture(scope="module")
def registry_file(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with ExitStack() as stack:
        backend = stack.enter_context(scripted_backend("--token-info"))
        model = ChatCompletionsModel(ChatCompletionsConfig(base_url=backend, model="scripted", return_token_ids=True),
                                     name="policy_model")
        model_url = stack.enter_context(serve_in_thread(model))
        env_url = stack.enter_context(serve_in_thread(AlternatingServer(name="reverse_text")))
        agent_url = stack.enter_context(serve_in_thread(simple_agent("agent", "reverse_text", model_url, env_url)))
        path = tmp_path_factory.mktemp("stack") / "stack.json"
        path.write_bytes(orjson.dumps({"policy_model": {"url": model_url, "role": "models"},
                                       "agent": {"url": agent_url, "role": "agents"}}))
        yield path


def plan_file(tmp_path: Path, registry_file: Path, words: list[str], difficulty: dict[str, Any],
              trainer: str = "groups") -> Path:
    tasks = write_rows(tmp_path / "tasks.jsonl", [reverse_row(word) for word in words])
    plan = {"output": str(tmp_path / "run"), "stack": {"registry_file": str(registry_file), "concurrency": 2},
            "stages": [{"name": "rl", "epochs": 1,
                        "collect": {"input": tasks, "repeats": 2, "limit": 3, "difficulty": difficulty},
                        "optimize": {"trainer": f"{TOY}:CountingTrainer", "data": trainer}, "apply": "none"}]}
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    return path


def trained_groups(tmp_path: Path) -> list[str]:
    rows = [orjson.loads(line) for line in (tmp_path / "run" / "epoch-001" / "curated.jsonl").read_bytes().splitlines()]
    return [row["rollouts"][0]["rollout_id"].split("-r")[0] for row in rows]


# Three planned tasks, one with a spread; then two, one with a spread; then one with a spread.
WORDS = ["flat0", "flat1", "mixed2", "mixed3", "flat4", "mixed5", "flat6"]


def test_refills_reach_the_planned_groups(tmp_path: Path, registry_file: Path) -> None:
    loop = TrainLoop(load_plan(plan_file(tmp_path, registry_file, WORDS, {"enabled": True, "max_refill_rounds": 3})),
                     progress=False)
    loop.run()
    line = loop.history()[-1]
    assert line["train"]["dynamic_sampling"] == {
        "planned": 3, "groups_collected": 6, "groups_kept": 3, "groups_dropped_zero_spread": 3,
        "refill_rounds": 2, "stopped": None}
    assert line["train"]["rollouts"] == 6, "train.mean_reward and rollouts stay those of the planned tasks"
    assert line["curated"]["records"] == 3 and line["curated"]["dropped"] == {"zero_reward_spread": 6}
    assert len(trained_groups(tmp_path)) == 3
    assert all(group.startswith(("L000003-", "L000004-", "L000006-")) for group in trained_groups(tmp_path)), \
        "a refilled group keeps the id of its line in the task file"
    assert (tmp_path / "run" / "epoch-001" / "refill-2.tasks.jsonl").is_file()


def test_the_bound_stops_refills_and_is_counted(tmp_path: Path, registry_file: Path) -> None:
    loop = TrainLoop(load_plan(plan_file(tmp_path, registry_file, WORDS, {"enabled": True, "max_refill_rounds": 1})),
                     progress=False)
    loop.run()
    line = loop.history()[-1]
    assert line["train"]["dynamic_sampling"] == {
        "planned": 3, "groups_collected": 5, "groups_kept": 2, "groups_dropped_zero_spread": 3,
        "refill_rounds": 1, "stopped": "max_refill_rounds"}
    assert line["curated"]["records"] == 2 and line["artefact"] is not None, "it trains on the groups it has"


def test_an_epoch_with_no_spread_after_its_refills_is_skipped(tmp_path: Path, registry_file: Path) -> None:
    words = ["flat0", "flat1", "flat2", "flat3", "flat4"]
    loop = TrainLoop(load_plan(plan_file(tmp_path, registry_file, words, {"enabled": True, "oversampling_factor": 2})),
                     progress=False)
    loop.run()
    line = loop.history()[-1]
    assert line["train"]["dynamic_sampling"] == {
        "planned": 3, "groups_collected": 5, "groups_kept": 0, "groups_dropped_zero_spread": 5,
        "refill_rounds": 1, "stopped": "no tasks left"}
    assert line["skipped"] and line["artefact"] is None and not loop.state.get("stopped")


def test_off_by_default_and_only_for_groups(tmp_path: Path, registry_file: Path) -> None:
    loop = TrainLoop(load_plan(plan_file(tmp_path, registry_file, WORDS, {})), progress=False)
    loop.run()
    line = loop.history()[-1]
    assert "dynamic_sampling" not in line["train"] and line["curated"]["records"] == 1
    assert not list((tmp_path / "run" / "epoch-001").glob("refill-*"))
    with pytest.raises(PlanError, match=r"collect\.difficulty\.enabled: refills groups for a trainer of groups"):
        load_plan(plan_file(tmp_path, registry_file, WORDS, {"enabled": True}, trainer="sft"))
    with pytest.raises(PlanError, match=r"max_refill_rounds"):
        load_plan(plan_file(tmp_path, registry_file, WORDS, {"enabled": True, "max_refill_rounds": -1}))
