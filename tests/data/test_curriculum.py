"""Curriculum selection: the library API on chosen rewards, and `rollgym curriculum` on a real rollouts file.

The real file comes from the real stack, once for the module (scripted backend → chat_completions →
simple_agent → reverse_text, collected by the real Collector). Every task shows "bridge" (the
backend answers "egdirb") but is graded against another text, so each group has its own mean
reward: 1, 6/7, 3/4, 2/3 and 0.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from agents.simple_agent.app import SimpleAgent, SimpleAgentConfig
from models.chat_completions.app import ChatCompletionsConfig, ChatCompletionsModel
from resources_servers.reverse_text.app import ReverseTextServer
from rollgym.cli import main
from rollgym.client import ServerAddress, ServerClient
from rollgym.rollouts.collector import CollectOptions, Collector
from rollgym.data.curriculum import CurriculumConfig, allocate, filter_by_difficulty, mix, select_groups, select_groups_staged
from rollgym.testing import REPO_ROOT, scripted_backend, serve_in_thread

REVERSE_SYSTEM = "You reverse text. Reply with the reversed text only, nothing else."
# graded text → reward of the answer "egdirb"
GRADED = {"bridge": 1.0, "bridges": 6 / 7, "abridges": 6 / 8, "bridgexyz": 6 / 9, "qqq": 0.0}


@pytest.fixture(scope="module")
def real(tmp_path_factory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("curriculum")
    tasks = tmp / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({
        "responses_create_params": {"input": [{"role": "system", "content": REVERSE_SYSTEM},
                                              {"role": "user", "content": "Reverse this text: bridge"}]},
        "text": text, "group_id": f"g-{text}"}) + "\n" for text in GRADED))
    rollouts = tmp / "rollouts.jsonl"
    with ExitStack() as stack:
        backend = stack.enter_context(scripted_backend())
        model = stack.enter_context(serve_in_thread(ChatCompletionsModel(
            ChatCompletionsConfig(base_url=backend, model="scripted"), name="policy_model")))
        env = stack.enter_context(serve_in_thread(ReverseTextServer(name="reverse_text")))
        agent = stack.enter_context(serve_in_thread(SimpleAgent(
            SimpleAgentConfig(model_server={"name": "policy_model"}, resources_server={"name": "reverse_text"}),
            name="reverse_agent",
            registry={"policy_model": ServerAddress(model, "models"), "reverse_text": ServerAddress(env, "resources_servers")})))
        summary = asyncio.run(collect({"reverse_agent": ServerAddress(agent, "agents")}, tasks, rollouts))
    assert summary["failed"] == 0
    rows = [json.loads(line) for line in rollouts.read_text().splitlines()]
    assert len(rows) == 15
    for row in rows:
        assert row["reward"] == pytest.approx(GRADED[row["text"]])
    return {"tmp": tmp, "rollouts": rollouts, "rows": rows}


async def collect(registry: dict[str, ServerAddress], tasks: Path, output: Path) -> dict[str, Any]:
    client = ServerClient(registry, timeout_s=30.0, max_retries=0)
    try:
        options = CollectOptions(input=tasks, output=output, repeats=3, concurrency=8, progress=False)
        return await Collector(client, "reverse_agent", options, log=lambda message: None).run()
    finally:
        await client.close()


def run_main(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def groups_of(path: Path) -> list[str]:
    """The group ids of a rollouts file, in the order their rollouts appear (each once)."""
    seen: list[str] = []
    for line in path.read_text().splitlines():
        group = json.loads(line)["group_id"]
        if group not in seen:
            seen.append(group)
    return seen


# --- the library --------------------------------------------------------------------------------------

# Ten groups: g0 mean 0.0 (hardest) … g9 mean 0.9 (easiest); g5 has no spread.
GROUPS = {f"g{i}": [i / 10 + 0.05, i / 10 - 0.05] for i in range(10)}
GROUPS["g5"] = [0.5, 0.5]


def test_percentile_grows_per_expansion_interval() -> None:
    config = CurriculumConfig(initial_percentile=0.3, increment_percentile=0.2, expansion_interval=2, min_reward_diff=0)
    assert [config.percentile(e) for e in range(8)] == pytest.approx([0.3, 0.3, 0.5, 0.5, 0.7, 0.7, 0.9, 0.9])
    assert CurriculumConfig(initial_percentile=0.5, increment_percentile=0.3, expansion_interval=1).percentile(5) == 1.0
    # The finetuning harness's defaults: a group needs a spread of 0.1; the share grows every 5 epochs.
    defaults = CurriculumConfig()
    assert (defaults.min_reward_diff, defaults.expansion_interval) == (0.1, 5)
    assert [defaults.percentile(e) for e in (0, 4, 5, 10)] == pytest.approx([0.3, 0.3, 0.5, 0.7])
    assert select_groups(GROUPS, config, 0) == ["g9", "g8", "g7"]  # ceil(0.3 × 10) = 3, not 4
    assert select_groups(GROUPS, config, 3) == ["g9", "g8", "g7", "g6", "g5"]
    assert select_groups(GROUPS, config, 7) == ["g9", "g8", "g7", "g6", "g5", "g4", "g3", "g2", "g1"]
    assert select_groups(GROUPS, config, 8) == [f"g{i}" for i in range(9, -1, -1)]


def test_sort_and_spread_filter() -> None:
    config = CurriculumConfig(sort="hard_to_easy", min_reward_diff=0.1, initial_percentile=0.25, increment_percentile=0.25,
                              expansion_interval=1)
    # g5 (spread 0) is out; 9 groups left; ceil(0.25 × 9) = 3 hardest.
    assert select_groups(GROUPS, config, 0) == ["g0", "g1", "g2"]
    chosen, stages = select_groups_staged(GROUPS, config, 1)
    assert chosen == ["g0", "g1", "g2", "g3", "g4"]  # ceil(0.5 × 9) = 5
    assert [(s.name, s.groups, s.rollouts) for s in stages] == [
        ("input", 10, 20), ("reward spread >= 0.1", 9, 18), ("hardest 50% (epoch 1)", 5, 10)]
    assert stages[0].mean_reward == pytest.approx(0.45)
    assert stages[2].mean_reward == pytest.approx(0.2)
    # Spread 0.1 passes a 0.1 minimum despite float noise (0.15 - 0.05).
    assert select_groups({"a": [0.15, 0.05]}, CurriculumConfig(min_reward_diff=0.1, initial_percentile=1.0), 0) == ["a"]
    # Ties in mean reward go by group id, naturally ordered.
    ties = {"t10": [0.5], "t2": [0.5], "t1": [0.5]}
    assert select_groups(ties, CurriculumConfig(initial_percentile=1.0, min_reward_diff=0), 0) == ["t1", "t2", "t10"]


def test_random_subsample_is_seeded_and_keeps_curriculum_order() -> None:
    config = CurriculumConfig(initial_percentile=1.0, random_subsample=0.5, seed=7)
    first = select_groups(GROUPS, config, 0)
    assert len(first) == 5 and first == select_groups(GROUPS, config, 0)
    order = [f"g{i}" for i in range(9, -1, -1)]
    assert first == [g for g in order if g in first]
    other_seeds = {tuple(select_groups(GROUPS, CurriculumConfig(initial_percentile=1.0, random_subsample=0.5, seed=s), 0))
                   for s in range(8)}
    assert len(other_seeds) > 1


def test_config_is_validated() -> None:
    for bad in ({"initial_percentile": 0.0}, {"initial_percentile": 1.5}, {"expansion_interval": 0},
                {"random_subsample": 0.0}, {"sort": "random"}, {"min_reward_diff": -1.0}, {"unknown": 1}):
        with pytest.raises(ValidationError):
            CurriculumConfig(**bad)
    with pytest.raises(ValueError, match="epoch"):
        select_groups(GROUPS, CurriculumConfig(), -1)


def test_nat_curriculum_learning_names_are_read() -> None:
    """A NeMo Agent Toolkit `curriculum_learning` section pastes in: sort_ascending is sort, enabled: false keeps
    every group (no spread filter, all at every epoch), enabled: true changes nothing."""
    nat = {"enabled": True, "initial_percentile": 0.3, "increment_percentile": 0.2, "expansion_interval": 5,
           "min_reward_diff": 0.1, "sort_ascending": False, "random_subsample": None}
    assert CurriculumConfig(**nat) == CurriculumConfig(sort="easy_to_hard", initial_percentile=0.3)
    ascending = CurriculumConfig(**{**nat, "sort_ascending": True})
    assert ascending.sort == "hard_to_easy"
    assert select_groups(GROUPS, ascending, 0) == select_groups(GROUPS, CurriculumConfig(sort="hard_to_easy"), 0)
    off = CurriculumConfig(**{**nat, "enabled": False, "random_subsample": 0.5})
    for epoch in (0, 7):
        assert sorted(select_groups(GROUPS, off, epoch)) == sorted(GROUPS)  # g5, without spread, too
    for bad, message in [({"sort_ascending": "yes"}, "sort_ascending: true .* or false"),
                         ({"sort_ascending": True, "sort": "easy_to_hard"}, "give sort or sort_ascending"),
                         ({"enabled": "no"}, "enabled: true or false")]:
        with pytest.raises(ValidationError, match=message):
            CurriculumConfig(**bad)


def test_filter_by_difficulty() -> None:
    groups = {"solved": [1.0, 1.0], "unsolved": [0.0, 0.0], "mixed": [1.0, 0.0], "partial": [0.5, 0.5], "empty": []}
    assert filter_by_difficulty(groups) == {"mixed": [1.0, 0.0], "partial": [0.5, 0.5]}
    assert list(filter_by_difficulty(groups, drop_all_zero=False)) == ["unsolved", "mixed", "partial"]
    assert list(filter_by_difficulty(groups, drop_all_one=False)) == ["solved", "mixed", "partial"]


def test_mix_ratios_are_exact_and_deterministic() -> None:
    rows = {"weather": [f"w{i}" for i in range(10)], "reverse": [f"r{i}" for i in range(3)], "math": ["m0"]}
    assert allocate({"weather": 0.5, "reverse": 0.3, "math": 0.2}, 10) == {"math": 2, "reverse": 3, "weather": 5}
    assert allocate({"a": 1, "b": 1, "c": 1}, 10) == {"a": 4, "b": 3, "c": 3}  # the remainder goes by name
    mixed = mix(rows, {"weather": 0.5, "reverse": 0.3, "math": 0.2}, 10, seed=3)
    assert mixed == mix(rows, {"weather": 0.5, "reverse": 0.3, "math": 0.2}, 10, seed=3)
    assert len(mixed) == 10
    assert sum(r.startswith("w") for r in mixed) == 5 and len({r for r in mixed if r.startswith("w")}) == 5
    assert sorted(r for r in mixed if r.startswith("r")) == ["r0", "r1", "r2"]
    assert [r for r in mixed if r.startswith("m")] == ["m0", "m0"]  # oversampled: 2 from a 1-row environment
    # Ratios need not add up to 1; an environment left out of the ratios gives nothing.
    assert sorted(mix(rows, {"reverse": 2.0}, 6, seed=0)) == ["r0", "r0", "r1", "r1", "r2", "r2"]
    with pytest.raises(ValueError, match="no rows given: code"):
        mix(rows, {"code": 1.0}, 5, seed=0)
    with pytest.raises(ValueError, match="at least one ratio"):
        mix(rows, {"weather": 0.0}, 5, seed=0)


# --- the command, on real rollouts ------------------------------------------------------------------------


def test_cli_selects_easiest_groups_of_a_real_file(real: dict[str, Any]) -> None:
    out = real["tmp"] / "epoch0.jsonl"
    result = subprocess.run(
        [sys.executable, "-m", "rollgym.cli", "curriculum", "--input", str(real["rollouts"]), "--output", str(out),
         "--epoch", "0", "--initial-percentile", "0.4"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    # ceil(0.4 × 5) = 2 easiest: bridge (1.0), then bridges (6/7); their rollouts copied byte for byte.
    assert groups_of(out) == ["g-bridge", "g-bridges"]
    originals = set(real["rollouts"].read_text().splitlines())
    lines = out.read_text().splitlines()
    assert len(lines) == 6 and set(lines) <= originals
    assert [line.split()[:4] for line in result.stdout.splitlines()[:4]] == [
        ["stage", "groups", "rollouts", "mean"],
        ["input", "5", "15", f"{sum(GRADED.values()) / 5:.3f}"],
        ["reward", "spread", ">=", "0"],
        ["easiest", "40%", "(epoch", "0)"],
    ]
    assert result.stdout.splitlines()[3].split()[-3:] == ["2", "6", f"{(1 + 6 / 7) / 2:.3f}"]
    assert f"kept 2 of 5 groups (6 rollouts) -> {out}" in result.stdout


def test_cli_later_epoch_hard_to_easy_and_difficulty_flags(real: dict[str, Any], capsys) -> None:
    out = real["tmp"] / "epoch.jsonl"
    code, stdout, _ = run_main(capsys, "curriculum", "--input", str(real["rollouts"]), "--output", str(out), "--epoch", "3",
                               "--sort", "hard_to_easy", "--expansion-interval", "2", "--initial-percentile", "0.2",
                               "--increment-percentile", "0.2")
    assert code == 0
    assert groups_of(out) == ["g-qqq", "g-bridgexyz"]  # p = 0.2 + 0.2 × (3 // 2) = 0.4 → 2 hardest
    code, stdout, _ = run_main(capsys, "curriculum", "--input", str(real["rollouts"]), "--output", str(out), "--epoch", "9",
                               "--drop-solved", "--drop-unsolved", "--expansion-interval", "1")
    assert code == 0
    assert groups_of(out) == ["g-bridges", "g-abridges", "g-bridgexyz"]
    assert "drop solved and unsolved" in stdout and "kept 3 of 5 groups (9 rollouts)" in stdout
    # Real groups have no spread (the backend is deterministic): a minimum spread leaves none.
    code, stdout, _ = run_main(capsys, "curriculum", "--input", str(real["rollouts"]), "--output", str(out), "--epoch", "9",
                               "--min-reward-diff", "0.1")
    assert code == 0 and out.read_text() == "" and "kept 0 of 5 groups" in stdout


def test_cli_subsample_malformed_lines_and_errors(real: dict[str, Any], tmp_path: Path, capsys) -> None:
    source = tmp_path / "rollouts.jsonl"
    lines = real["rollouts"].read_text().splitlines()
    source.write_text("\n".join(lines[:3] + ["not json", json.dumps({"group_id": "x"})] + lines[3:]) + "\n")
    out = tmp_path / "out.jsonl"
    args = ("curriculum", "--input", str(source), "--output", str(out), "--epoch", "5", "--random-subsample", "0.6",
            "--seed", "1", "--expansion-interval", "1")
    code, stdout, stderr = run_main(capsys, *args)
    assert code == 0
    assert f"{source}:4: skipped: not valid JSON" in stderr
    assert f"{source}:5: skipped: not a rollout" in stderr
    assert "2 malformed lines skipped" in stdout
    chosen = groups_of(out)
    assert len(chosen) == 3 and "random 60% (seed 1)" in stdout
    run_main(capsys, *args)
    assert groups_of(out) == chosen  # seeded: a rerun agrees
    code, _, stderr = run_main(capsys, "curriculum", "--input", str(tmp_path / "none.jsonl"), "--output", str(out), "--epoch", "0")
    assert code == 2 and stderr.strip() == f"rollgym: error: --input: no such file: {tmp_path / 'none.jsonl'}"
    code, _, stderr = run_main(capsys, "curriculum", "--input", str(source), "--output", str(out), "--epoch", "0",
                               "--initial-percentile", "1.5")
    assert code == 2 and "rollgym: error: --initial-percentile: Input should be less than or equal to 1" in stderr
