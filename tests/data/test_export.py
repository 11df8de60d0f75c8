"""`rollgym export`: SFT, DPO, GRPO and Hugging Face data from a real rollouts file.

The rollouts come from the real stack, once for the module: scripted backend (with token ids) →
chat_completions model → simple_agent → weather and reverse_text, collected by the real Collector.
The scripted backend is deterministic, so every real group has one reward; the reverse_text rows of
two tasks that share a prompt (but grade against different texts) are then put in one group to give
DPO and GRPO a reward spread. A few hand-written lines add shapes the stack does not make.
"""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from agents.simple_agent.app import SimpleAgent, SimpleAgentConfig
from models.chat_completions.app import ChatCompletionsConfig, ChatCompletionsModel
from resources_servers.reverse_text.app import ReverseTextServer
from resources_servers.weather.app import WeatherServer
from rollgym.cli import main
from rollgym.client import ServerAddress, ServerClient
from rollgym.rollouts.collector import CollectOptions, Collector
from rollgym.data.advantages import grpo_advantages
from rollgym.data.export import DataError, dpo_candidate, dpo_pairs, export_file, grpo_keeps, sft_record
from rollgym.schema import RolloutLine, RunResponse
from rollgym.testing import REPO_ROOT, scripted_backend, serve_in_thread

WEATHER_SYSTEM = "You are a weather assistant. Use the get_weather tool, then answer with the condition and the temperature."
REVERSE_SYSTEM = "You reverse text. Reply with the reversed text only, nothing else."
WEATHER_TOOL = {
    "type": "function", "name": "get_weather", "description": "Get the current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False},
    "strict": False,
}


def weather_task(city: str, expected: list[str], **params: Any) -> dict[str, Any]:
    return {"responses_create_params": {"input": [{"role": "system", "content": WEATHER_SYSTEM},
                                                  {"role": "user", "content": f"What is the weather in {city}?"}],
                                        "tools": [WEATHER_TOOL], **params},
            "city": city, "expected": expected, "task_type": "weather"}


def reverse_task(shown: str, graded: str) -> dict[str, Any]:
    return {"responses_create_params": {"input": [{"role": "system", "content": REVERSE_SYSTEM},
                                                  {"role": "user", "content": f"Reverse this text: {shown}"}],
                                        "max_output_tokens": 48},
            "text": graded, "agent_ref": {"type": "agents", "name": "reverse_agent"}}


def agent(name: str, env: str, model_url: str, env_url: str) -> SimpleAgent:
    return SimpleAgent(
        SimpleAgentConfig(model_server={"name": "policy_model"}, resources_server={"name": env}), name=name,
        registry={"policy_model": ServerAddress(url=model_url, role="models"),
                  env: ServerAddress(url=env_url, role="resources_servers")},
    )


async def collect(registry: dict[str, ServerAddress], tasks: Path, output: Path) -> dict[str, Any]:
    client = ServerClient(registry, timeout_s=30.0, max_retries=0)
    try:
        options = CollectOptions(input=tasks, output=output, repeats=2, concurrency=8, progress=False)
        return await Collector(client, "weather_agent", options, log=lambda message: None).run()
    finally:
        await client.close()


@pytest.fixture(scope="module")
def real(tmp_path_factory) -> dict[str, Any]:
    """Real rollouts: 4 tasks × 2 repeats; returns the raw file and a regrouped copy."""
    tmp = tmp_path_factory.mktemp("export")
    tasks = tmp / "tasks.jsonl"
    rows = [
        weather_task("Paris", ["sunny", "22"], instructions="Be brief."),  # reward 1.0
        weather_task("Oslo", ["sunny"]),  # the tool says snowy: a real 0.0
        reverse_task("bridge", "bridge"),  # exact: 1.0
        reverse_task("bridge", "bridges"),  # answer "egdirb" graded against "segdirb": 6/7
    ]
    tasks.write_text("".join(json.dumps(row) + "\n" for row in rows))
    raw = tmp / "rollouts.jsonl"
    with ExitStack() as stack:
        backend = stack.enter_context(scripted_backend("--token-info"))
        model = ChatCompletionsModel(ChatCompletionsConfig(base_url=backend, model="scripted", return_token_ids=True),
                                     name="policy_model")
        model_url = stack.enter_context(serve_in_thread(model))
        weather_url = stack.enter_context(serve_in_thread(WeatherServer(name="weather")))
        reverse_url = stack.enter_context(serve_in_thread(ReverseTextServer(name="reverse_text")))
        registry = {
            "weather_agent": ServerAddress(stack.enter_context(serve_in_thread(agent("weather_agent", "weather", model_url, weather_url))), "agents"),
            "reverse_agent": ServerAddress(stack.enter_context(serve_in_thread(agent("reverse_agent", "reverse_text", model_url, reverse_url))), "agents"),
        }
        summary = asyncio.run(collect(registry, tasks, raw))
    assert summary["rollouts"] == 8 and summary["failed"] == 0
    rollouts = [json.loads(line) for line in raw.read_text().splitlines()]
    for rollout in rollouts:
        line = RolloutLine.model_validate(rollout)  # the format specification's shape
        assert "output" not in rollout["response"] and line.output and rollout["metadata"]
    # The two reverse_text tasks share a prompt: one group of 4 with rewards 1, 1, 6/7, 6/7.
    regrouped = []
    for rollout in sorted(rollouts, key=lambda r: r["rollout_id"]):
        if "text" in rollout:
            tag = "a" if rollout["text"] == "bridge" else "b"
            rollout = {**rollout, "group_id": "rev", "rollout_id": f"rev-{tag}{rollout['rollout_id'][-1]}"}
        regrouped.append(rollout)
    grouped = tmp / "grouped.jsonl"
    grouped.write_text("".join(json.dumps(r) + "\n" for r in regrouped))
    by_id = {r["rollout_id"]: r for r in regrouped}
    return {"raw": raw, "grouped": grouped, "rows": regrouped, "by_id": by_id, "tmp": tmp}


def cli(*args: str) -> subprocess.CompletedProcess:
    """The command as a user runs it, in a new process (start-up costs about a second)."""
    return subprocess.run([sys.executable, "-m", "rollgym.cli", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120)


def main_cli(capsys: pytest.CaptureFixture, *args: str) -> subprocess.CompletedProcess:
    """The same command through `rollgym.cli.main` in this process (same parser, handler and output)."""
    capsys.readouterr()
    code = main(list(args))
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, captured.out, captured.err)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def weather_rows(real: dict[str, Any], city: str) -> list[dict[str, Any]]:
    return [r for r in real["rows"] if r.get("city") == city]


# --- SFT -----------------------------------------------------------------------------------------------


def test_sft_messages_of_a_real_tool_call_rollout(real: dict[str, Any]) -> None:
    rollout = weather_rows(real, "Paris")[0]
    call = rollout["output"][0]
    assert rollout["reward"] == 1.0 and call["type"] == "function_call"
    record = sft_record(rollout)
    assert record["messages"] == [
        {"role": "system", "content": "Be brief."},  # instructions come first
        {"role": "system", "content": WEATHER_SYSTEM},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call["call_id"], "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
        {"role": "tool", "tool_call_id": call["call_id"], "content": "Paris: sunny, 22 C"},
        {"role": "assistant", "content": "The weather in Paris: Paris: sunny, 22 C"},
    ]
    assert record["reward"] == 1.0 and record["task_type"] == "weather"
    assert record["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather for a city.", "parameters": WEATHER_TOOL["parameters"]}}]


def test_sft_cli_min_reward_and_task_type(real: dict[str, Any]) -> None:
    out = real["tmp"] / "sft.jsonl"
    result = cli("export", "--input", str(real["raw"]), "--output", str(out), "--format", "sft", "--min-reward", "0.9")
    assert result.returncode == 0, result.stderr
    records = read_jsonl(out)
    # Paris ×2 (1.0) and the exact reverse ×2 (1.0); Oslo (0.0) and the 6/7 rows are filtered.
    assert len(records) == 4
    assert sorted(r.get("task_type") for r in records) == ["reverse_agent", "reverse_agent", "weather", "weather"]
    reverse = next(r for r in records if r["task_type"] == "reverse_agent")
    assert reverse["messages"] == [
        {"role": "system", "content": REVERSE_SYSTEM},
        {"role": "user", "content": "Reverse this text: bridge"},
        {"role": "assistant", "content": "egdirb"},
    ]
    assert "tools" not in reverse
    assert "read 8 rollouts; wrote 4 examples" in result.stdout
    assert "4 below --min-reward" in result.stdout


def test_sft_reasoning_parallel_calls_and_string_input() -> None:
    rollout = {
        "responses_create_params": {"input": "Weather in Paris and Oslo?", "instructions": "Use tools."},
        "response": {"output": [
            {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Two cities."}]},
            {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}', "status": "completed"},
            {"type": "function_call", "id": "fc_2", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Oslo"}', "status": "completed"},
            {"type": "function_call_output", "call_id": "c1", "output": "Paris: sunny, 22 C"},
            {"type": "function_call_output", "call_id": "c2", "output": "Oslo: snowy, -3 C"},
            {"type": "message", "id": "m1", "role": "assistant", "status": "completed",
             "content": [{"type": "output_text", "text": "Sunny in Paris, snowy in Oslo.", "annotations": []}]},
        ]},
        "reward": 1.0, "agent_ref": {"type": "agents", "name": "weather_agent"},
    }
    assert sft_record(rollout) == {
        "messages": [
            {"role": "system", "content": "Use tools."},
            {"role": "user", "content": "Weather in Paris and Oslo?"},
            {"role": "assistant", "content": None, "reasoning_content": "Two cities.", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "Paris: sunny, 22 C"},
            {"role": "tool", "tool_call_id": "c2", "content": "Oslo: snowy, -3 C"},
            {"role": "assistant", "content": "Sunny in Paris, snowy in Oslo."},
        ],
        "reward": 1.0,
        "task_type": "weather_agent",
    }


def test_malformed_lines_are_reported_and_skipped(real: dict[str, Any], tmp_path: Path, capsys) -> None:
    lines = real["raw"].read_text().splitlines()
    broken = lines[:2] + ["{oops", "[1, 2]", json.dumps({"reward": 1.0}), "",
                          json.dumps({**json.loads(lines[2]), "response": {"output": [
                              {"type": "function_call_output", "call_id": "nobody", "output": "x"}]}})] + lines[2:]
    source = tmp_path / "broken.jsonl"
    source.write_text("\n".join(broken) + "\n")
    out = tmp_path / "sft.jsonl"
    result = main_cli(capsys, "export", "--input", str(source), "--output", str(out), "--format", "sft")
    assert result.returncode == 0, result.stderr
    assert f"{source}:3: skipped: not valid JSON" in result.stderr
    assert f"{source}:4: skipped: expected a JSON object, got list" in result.stderr
    assert f"{source}:5: skipped: not a rollout: no 'responses_create_params' object" in result.stderr
    assert f"{source}:7: skipped: cannot convert to chat messages: input[" in result.stderr
    assert "no earlier function_call has call_id 'nobody'" in result.stderr
    assert len(read_jsonl(out)) == 8
    assert "read 9 rollouts; wrote 8 examples" in result.stdout
    assert "4 malformed or unconvertible lines skipped" in result.stdout


def test_missing_input_and_misused_options_are_usage_errors(tmp_path: Path, capsys) -> None:
    result = main_cli(capsys, "export", "--input", str(tmp_path / "nope.jsonl"), "--output", str(tmp_path / "o.jsonl"), "--format", "sft")
    assert result.returncode == 2
    assert result.stderr.strip() == f"rollgym: error: --input: no such file: {tmp_path / 'nope.jsonl'}"
    source = tmp_path / "empty.jsonl"
    source.write_text("")
    result = main_cli(capsys, "export", "--input", str(source), "--output", str(tmp_path / "o.jsonl"), "--format", "dpo", "--min-reward", "1")
    assert result.returncode == 2 and "--min-reward applies to the sft format only" in result.stderr
    assert "Traceback" not in result.stderr


# --- DPO -----------------------------------------------------------------------------------------------


def test_dpo_pairs_real_group(real: dict[str, Any], capsys) -> None:
    out = real["tmp"] / "dpo.jsonl"
    result = main_cli(capsys, "export", "--input", str(real["grouped"]), "--output", str(out), "--format", "dpo")
    assert result.returncode == 0, result.stderr
    pairs = read_jsonl(out)
    # rev: [a0, a1] = 1.0, [b0, b1] = 6/7 → best with worst (a0, b1), then (a1, b0). Paris/Oslo: no spread.
    assert [(p["chosen_rollout_id"], p["rejected_rollout_id"]) for p in pairs] == [("rev-a0", "rev-b1"), ("rev-a1", "rev-b0")]
    for pair in pairs:
        assert pair["group_id"] == "rev"
        assert pair["quality_difference"] == pytest.approx(1 / 7)
        assert pair["prompt"] == [{"role": "system", "content": REVERSE_SYSTEM},
                                  {"role": "user", "content": "Reverse this text: bridge"}]
        assert pair["chosen"] == pair["rejected"] == [{"role": "assistant", "content": "egdirb"}]
    assert "read 8 rollouts; wrote 2 pairs" in result.stdout
    assert "groups: 3, 2 produced no pair" in result.stdout
    # With a larger minimum the group gives nothing.
    result = main_cli(capsys, "export", "--input", str(real["grouped"]), "--output", str(out), "--format", "dpo", "--min-diff", "0.2")
    assert result.returncode == 0 and read_jsonl(out) == []
    assert "groups: 3, 3 produced no pair" in result.stdout


def hand_rollout(group: str, rollout_id: str, reward: float, answer: str, question: str = "Reverse this text: abc") -> dict[str, Any]:
    row = {
        "responses_create_params": {"input": [{"role": "user", "content": question}]},
        "text": "abc", "group_id": group, "rollout_id": rollout_id, "reward": reward, "status": "ok",
        "response": {"id": "resp_1", "object": "response", "created_at": 0.0, "model": "m", "status": "completed",
                     "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
                     "output": [{"type": "message", "id": f"msg_{rollout_id}", "role": "assistant", "status": "completed",
                                 "content": [{"type": "output_text", "text": answer, "annotations": []}]}]},
        "metrics": {"turns": 1},
    }
    RunResponse.model_validate(row)
    return row


def test_dpo_pairs_best_with_worst_once_each() -> None:
    rewards = {"r0": 0.9, "r1": 0.1, "r2": 0.5, "r3": 0.45, "r4": 0.7}
    candidates = [dpo_candidate(hand_rollout("g", rid, r, f"answer {rid}"), i) for i, (rid, r) in enumerate(rewards.items())]
    pairs = dpo_pairs("g", candidates, min_diff=0.1)
    assert [(p["chosen_rollout_id"], p["rejected_rollout_id"]) for p in pairs] == [("r0", "r1"), ("r4", "r3")]
    assert [p["quality_difference"] for p in pairs] == pytest.approx([0.8, 0.25])
    assert pairs[0]["chosen"] == [{"role": "assistant", "content": "answer r0"}]
    assert pairs[0]["rejected"] == [{"role": "assistant", "content": "answer r1"}]
    # 0.7 - 0.45 < 0.3: the inner pair stops the pairing.
    assert [(p["chosen_rollout_id"], p["rejected_rollout_id"]) for p in dpo_pairs("g", candidates, min_diff=0.3)] == [("r0", "r1")]
    # A difference equal to the minimum counts, despite float noise (0.3 - 0.2 = 0.0999...).
    close = [dpo_candidate(hand_rollout("g", "x", 0.3, "x")), dpo_candidate(hand_rollout("g", "y", 0.2, "y"))]
    assert len(dpo_pairs("g", close, min_diff=0.1)) == 1


def test_dpo_pairs_only_identical_prompts(tmp_path: Path) -> None:
    rows = [
        hand_rollout("g", "g-r0", 1.0, "cba"),
        hand_rollout("g", "g-r1", 0.0, "abc", question="Reverse this text, please: abc"),  # another prompt
        hand_rollout("g", "g-r2", 0.0, "abc"),
        hand_rollout("h", "h-r0", 1.0, "cba"),
    ]
    source = tmp_path / "rollouts.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    stats = export_file(source, tmp_path / "dpo.jsonl", "dpo")
    pairs = read_jsonl(tmp_path / "dpo.jsonl")
    assert [(p["chosen_rollout_id"], p["rejected_rollout_id"]) for p in pairs] == [("g-r0", "g-r2")]
    assert pairs[0]["quality_difference"] == 1.0
    assert (stats.read, stats.written, stats.groups, stats.groups_without_pair) == (4, 1, 2, 1)


# --- GRPO ----------------------------------------------------------------------------------------------


def test_grpo_real_groups(real: dict[str, Any], capsys) -> None:
    out = real["tmp"] / "grpo.jsonl"
    result = main_cli(capsys, "export", "--input", str(real["grouped"]), "--output", str(out), "--format", "grpo")
    assert result.returncode == 0, result.stderr
    groups = read_jsonl(out)
    assert [g["group_id"] for g in groups] == ["rev"]  # Paris (all 1.0) and Oslo (all 0.0) have no spread
    group = groups[0]
    assert group["prompt"] == [{"role": "system", "content": REVERSE_SYSTEM}, {"role": "user", "content": "Reverse this text: bridge"}]
    assert group["reward_mean"] == pytest.approx(13 / 14)
    assert group["reward_std"] == pytest.approx(1 / 14)
    assert [r["rollout_id"] for r in group["rollouts"]] == ["rev-a0", "rev-a1", "rev-b0", "rev-b1"]
    for member in group["rollouts"]:
        sign = 1 if member["reward"] == 1.0 else -1
        assert member["advantage_mean_only"] == pytest.approx(sign / 14)
        assert member["advantage"] == pytest.approx(sign * (1 / 14) / (1 / 14 + 1e-6), rel=1e-12)
        original = real["by_id"][member["rollout_id"]]
        assert member["sequences"] == original["sequences"] and len(member["sequences"]) == 1
        assert member["prefix_ok"] is True
    assert "groups: 3, 2 dropped" in result.stdout
    assert "warning" not in result.stdout


def test_grpo_advantages_numbers_and_missing_sequences(tmp_path: Path) -> None:
    rows = [hand_rollout("g", f"g-r{i}", r, "x") for i, r in enumerate([1.0, 0.5, 0.0])]
    rows += [hand_rollout("flat", f"flat-r{i}", 0.5, "x") for i in range(3)]
    rows += [hand_rollout("close", "close-r0", 0.5, "x"), hand_rollout("close", "close-r1", 0.45, "x")]
    rows[0]["sequences"] = [{"prompt_ids": [1, 2], "completion_ids": [3, 4], "completion_mask": [1, 1],
                             "completion_logprobs": [-0.5, -0.25]}]
    rows[0]["prefix_ok"] = True
    source = tmp_path / "rollouts.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    stats = export_file(source, tmp_path / "grpo.jsonl", "grpo", min_reward_diff=0.1)
    (group,) = read_jsonl(tmp_path / "grpo.jsonl")
    std = math.sqrt(1 / 6)
    assert group["reward_mean"] == pytest.approx(0.5) and group["reward_std"] == pytest.approx(std)
    assert [r["advantage"] for r in group["rollouts"]] == pytest.approx([0.5 / (std + 1e-6), 0.0, -0.5 / (std + 1e-6)], rel=1e-12)
    assert [r["advantage_mean_only"] for r in group["rollouts"]] == pytest.approx([0.5, 0.0, -0.5])
    assert group["rollouts"][0]["sequences"] == rows[0]["sequences"] and group["rollouts"][0]["prefix_ok"] is True
    assert group["rollouts"][1]["sequences"] is None and group["rollouts"][1]["prefix_ok"] is None
    assert (stats.groups, stats.groups_dropped, stats.missing_sequences) == (3, 2, 2)
    # The default minimum (0.0) drops only the group with no spread.
    stats = export_file(source, tmp_path / "grpo.jsonl", "grpo")
    assert [g["group_id"] for g in read_jsonl(tmp_path / "grpo.jsonl")] == ["close", "g"]
    assert stats.groups_dropped == 1
    assert "warning: 4 rollouts have no token sequences" in "\n".join(stats.lines())


def test_advantage_helpers() -> None:
    mean, std, normalized, centered = grpo_advantages([2.0, 4.0])
    assert (mean, std) == (3.0, 1.0)
    assert normalized == pytest.approx([-1 / (1 + 1e-6), 1 / (1 + 1e-6)], rel=1e-15) and centered == [-1.0, 1.0]
    assert not grpo_keeps([1.0, 1.0]) and grpo_keeps([1.0, 0.9]) and not grpo_keeps([1.0, 0.9], 0.2)


# --- Hugging Face --------------------------------------------------------------------------------------


def drop_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [drop_nulls(v) for v in value]
    return value


@pytest.mark.parametrize("kind", ["sft", "dpo", "grpo"])
def test_hf_export_loads_with_datasets(real: dict[str, Any], kind: str, capsys) -> None:
    datasets = pytest.importorskip("datasets", reason="the hf format needs `pip install datasets`")
    folder = real["tmp"] / f"hf-{kind}"
    result = main_cli(capsys, "export", "--input", str(real["grouped"]), "--output", str(folder), "--format", "hf", "--hf-format", kind)
    assert result.returncode == 0, result.stderr
    jsonl = real["tmp"] / f"hf-{kind}.jsonl"
    export_file(real["grouped"], jsonl, kind)
    expected = read_jsonl(jsonl)
    loaded = datasets.load_from_disk(str(folder))
    assert loaded.num_rows == len(expected) > 0
    # Arrow gives absent struct keys as None; otherwise the rows are the JSONL records.
    assert [drop_nulls(row) for row in loaded] == [drop_nulls(row) for row in expected]


def test_hf_without_datasets_is_a_clear_error(real: dict[str, Any], tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` now raises ImportError
    result = main_cli(capsys, "export", "--input", str(real["grouped"]), "--output", str(tmp_path / "hf"), "--format", "hf")
    assert result.returncode == 2
    assert result.stderr.strip() == "rollgym: error: this needs the Hugging Face `datasets` library: pip install datasets"
    with pytest.raises(DataError, match="unknown format"):
        export_file(real["grouped"], tmp_path / "x", "parquet")


def test_hf_refuses_an_empty_dataset(tmp_path: Path, capsys) -> None:
    pytest.importorskip("datasets", reason="the hf format needs `pip install datasets`")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    result = main_cli(capsys, "export", "--input", str(empty), "--output", str(tmp_path / "hf"), "--format", "hf")
    # `load_from_disk` cannot read back a saved dataset without rows: nothing is written.
    assert result.returncode == 2 and "no sft records to save as a Hugging Face dataset (read 0 rollouts" in result.stderr
    assert not (tmp_path / "hf").exists()


def test_grpo_keeps_every_segment_with_its_index(tmp_path: Path) -> None:
    from rollgym.sequences import merge_sequences

    rows = [hand_rollout("g", f"g-r{i}", r, "x") for i, r in enumerate([1.0, 0.0])]
    # The second turn's prompt drops the first turn's reasoning (tokens 20-21): a second segment.
    calls = [{"prompt_token_ids": [1, 2], "generation_token_ids": [20, 21, 30], "generation_log_probs": [-0.1, -0.2, -0.3]},
             {"prompt_token_ids": [1, 2, 30, 4], "generation_token_ids": [31], "generation_log_probs": [-0.4]}]
    rows[0]["sequences"], rows[0]["prefix_ok"] = merge_sequences(calls)
    rows[1]["sequences"], rows[1]["prefix_ok"] = merge_sequences(calls[:1])
    source = tmp_path / "rollouts.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    stats = export_file(source, tmp_path / "grpo.jsonl", "grpo")
    (group,) = read_jsonl(tmp_path / "grpo.jsonl")
    first, second = group["rollouts"]
    assert [(s["segment"], s["completion_ids"]) for s in first["sequences"]] == [(0, [20, 21, 30]), (1, [31])]
    assert first["prefix_ok"] is False
    assert second["sequences"] == rows[1]["sequences"]  # one sequence: as before, no index
    assert (stats.segments, stats.multi_segment_rollouts) == (3, 1)
    assert "segments: 3 written, 1 rollouts with more than one" in "\n".join(stats.lines())
