"""`rollgym prepare-data` on the real environment configs and data files (no server is started)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from resources_servers.reverse_text.app import ReverseTextTask
from resources_servers.weather.app import WeatherTask
from rollgym.cli import main
from rollgym.config import load_stack
from rollgym.data.prepare import prepare, split_of
from rollgym.testing import REPO_ROOT

WEATHER_DATA = REPO_ROOT / "resources_servers" / "weather" / "data" / "example.jsonl"
REVERSE_DATA = REPO_ROOT / "resources_servers" / "reverse_text" / "data" / "train.jsonl"
CONFIGS = [
    str(REPO_ROOT / "resources_servers" / "weather" / "configs" / "weather.yaml"),
    str(REPO_ROOT / "resources_servers" / "reverse_text" / "configs" / "reverse_text.yaml"),
    str(REPO_ROOT / "models" / "chat_completions" / "configs" / "chat_completions.yaml"),
]
WEATHER_REF = {"type": "agents", "name": "weather_agent"}
REVERSE_REF = {"type": "agents", "name": "reverse_text_agent"}


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def jsonl_rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_main(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture()
def mixed_input(tmp_path: Path) -> Path:
    """Weather and reverse_text rows in one file, with an invalid row of each, bad JSON, and a routed row."""
    weather = jsonl_rows(WEATHER_DATA)
    reverse = jsonl_rows(REVERSE_DATA)[:6]
    bad_weather = {**weather[0], "expected": []}  # expected needs at least one fact
    no_text = {k: v for k, v in reverse[0].items() if k != "text"}
    lines = [json.dumps(r) for r in weather[:3]]  # lines 1-3
    lines += [json.dumps(bad_weather), "{not json"]  # lines 4, 5
    lines += [json.dumps(r) for r in reverse]  # lines 6-11
    lines += [json.dumps(no_text)]  # line 12
    lines += [json.dumps({**weather[3], "agent_ref": {"type": "agents", "name": "nobody"}})]  # line 13
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_cli_routes_validates_and_splits(mixed_input: Path, tmp_path: Path) -> None:
    out = tmp_path / "prepared"
    result = subprocess.run(
        [sys.executable, "-m", "rollgym.cli", "prepare-data", "--input", str(mixed_input), "--config", *CONFIGS,
         "--output-dir", str(out), "--validation-fraction", "0.3", "--seed", "0"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    problems = result.stderr.splitlines()
    assert problems[1].startswith(f"{mixed_input}:5: not valid JSON: unexpected character")
    assert problems[:1] + problems[2:] == [
        f"{mixed_input}:4: field 'expected': List should have at least 1 item after validation, not 0",
        # Most rows of this input so far were reverse_text rows: its error is the one reported.
        f"{mixed_input}:12: field 'text': Field required",
        f"{mixed_input}:13: field 'agent_ref': no agent 'nobody' in the stack (agents: weather_agent, reverse_text_agent)",
    ]
    train, validation = read_jsonl(out / "train.jsonl"), read_jsonl(out / "validation.jsonl")
    rows = train + validation
    assert len(rows) == 9
    weather = [r for r in rows if "city" in r]
    reverse = [r for r in rows if "text" in r]
    assert len(weather) == 3 and all(r["agent_ref"] == WEATHER_REF for r in weather)
    assert len(reverse) == 6 and all(r["agent_ref"] == REVERSE_REF for r in reverse)
    for row in weather:
        WeatherTask.model_validate(row)
    for row in reverse:
        ReverseTextTask.model_validate(row)
    # Every row sits on the side its hash picks.
    for side, stamped in (("train", train), ("validation", validation)):
        for row in stamped:
            assert split_of(row, 0.3, 0) == side
    counts = {tuple(line.split()[:2]): line.split()[2:] for line in result.stdout.splitlines()[1:3]}
    assert counts == {
        ("reverse_text", "reverse_text_agent"): [str(sum(1 for r in train if "text" in r)), str(sum(1 for r in validation if "text" in r))],
        ("weather", "weather_agent"): [str(sum(1 for r in train if "city" in r)), str(sum(1 for r in validation if "city" in r))],
    }
    assert "skipped 4 invalid rows" in result.stdout


def test_per_input_agent_and_reported_fields(tmp_path: Path, capsys) -> None:
    weather_file = tmp_path / "weather.jsonl"
    rows = jsonl_rows(WEATHER_DATA)
    weather_file.write_text("".join(json.dumps(r) + "\n" for r in [*rows, {**rows[0], "city": 7}]))
    out = tmp_path / "out"
    code, stdout, stderr = run_main(capsys, "prepare-data", "--input", str(weather_file), "--agent", "weather_agent",
                                    "--input", str(REVERSE_DATA), "--agent", "reverse_text_agent",
                                    "--config", *CONFIGS, "--output-dir", str(out))
    assert code == 0, stderr
    assert stderr.splitlines() == [f"{weather_file}:6: field 'city': Input should be a valid string"]
    rows_out = read_jsonl(out / "train.jsonl") + read_jsonl(out / "validation.jsonl")
    assert len(rows_out) == 205
    # The reverse_text file under the weather agent: every row is invalid for weather.
    code, _, stderr = run_main(capsys, "prepare-data", "--agent", "weather_agent", "--input", str(REVERSE_DATA),
                               "--config", *CONFIGS, "--output-dir", str(out))
    assert code == 0
    assert len(stderr.splitlines()) == 200 and stderr.splitlines()[0] == f"{REVERSE_DATA}:1: field 'city': Field required"
    assert (out / "train.jsonl").read_text() == "" and (out / "validation.jsonl").read_text() == ""


def test_split_is_deterministic_and_order_free(tmp_path: Path) -> None:
    config = load_stack(CONFIGS)
    rows = REVERSE_DATA.read_text().splitlines()
    reversed_input = tmp_path / "reversed.jsonl"
    reversed_input.write_text("\n".join(reversed(rows)) + "\n")

    def sides(path: Path, seed: int, fraction: float = 0.1) -> tuple[list[str], list[str]]:
        out = tmp_path / f"out-{path.stem}-{seed}-{fraction}"
        stats = prepare([(path, None)], config, out, validation_fraction=fraction, seed=seed)
        assert stats.invalid == 0
        return tuple(sorted(r["text"] for r in read_jsonl(out / f"{side}.jsonl")) for side in ("train", "validation"))

    train, validation = sides(REVERSE_DATA, 0)
    assert len(train) + len(validation) == 200
    assert not set(train) & set(validation)  # the file repeats some rows: a repeat lands beside its twin
    assert 5 <= len(validation) <= 40  # about 10%: the hash decides each row on its own
    assert sides(REVERSE_DATA, 0) == (train, validation)
    assert sides(reversed_input, 0) == (train, validation)
    assert sides(REVERSE_DATA, 1) != (train, validation)
    assert sides(REVERSE_DATA, 0, 0.0)[1] == []
    # The stamp does not change a row's side.
    row = jsonl_rows(REVERSE_DATA)[0]
    assert split_of(row, 0.5, 3) == split_of({**row, "agent_ref": REVERSE_REF}, 0.5, 3)


def test_ambiguous_agents_need_agent(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(REPO_ROOT)  # the config below names folders of this repository
    config = tmp_path / "two_agents.yaml"
    config.write_text(
        "weather:\n  resources_servers:\n    weather: {}\n"
        "agent_a:\n  agents:\n    simple_agent:\n      model_server: {name: policy_model}\n      resources_server: {name: weather}\n"
        "agent_b:\n  agents:\n    simple_agent:\n      model_server: {name: policy_model}\n      resources_server: {name: weather}\n")
    configs = [str(config), CONFIGS[2]]
    out = tmp_path / "out"
    code, stdout, stderr = run_main(capsys, "prepare-data", "--input", str(WEATHER_DATA), "--config", *configs, "--output-dir", str(out))
    assert code == 0
    assert stderr.splitlines()[0] == f"{WEATHER_DATA}:1: environment 'weather' has several agents (agent_a, agent_b); pick one with --agent"
    assert "skipped 5 invalid rows" in stdout
    code, stdout, stderr = run_main(capsys, "prepare-data", "--input", str(WEATHER_DATA), "--agent", "agent_b",
                                    "--config", *configs, "--output-dir", str(out))
    assert code == 0 and stderr == ""
    rows = read_jsonl(out / "train.jsonl") + read_jsonl(out / "validation.jsonl")
    assert len(rows) == 5 and all(r["agent_ref"] == {"type": "agents", "name": "agent_b"} for r in rows)


def test_usage_errors(tmp_path: Path, capsys) -> None:
    code, _, stderr = run_main(capsys, "prepare-data", "--input", str(tmp_path / "none.jsonl"), "--config", *CONFIGS,
                               "--output-dir", str(tmp_path / "o"))
    assert code == 2 and stderr.strip() == f"rollgym: error: --input: no such file or dataset folder: {tmp_path / 'none.jsonl'}"
    code, _, stderr = run_main(capsys, "prepare-data", "--input", str(WEATHER_DATA), "--agent", "ghost", "--config", *CONFIGS,
                               "--output-dir", str(tmp_path / "o"))
    assert code == 2 and "rollgym: error: --agent: no agent named 'ghost' in the stack" in stderr
    code, _, stderr = run_main(capsys, "prepare-data", "--input", str(WEATHER_DATA), "--config", "missing.yaml",
                               "--output-dir", str(tmp_path / "o"))
    assert code == 2 and "config file not found: missing.yaml" in stderr
    code, _, stderr = run_main(capsys, "prepare-data", "--input", str(WEATHER_DATA), "--config", *CONFIGS,
                               "--output-dir", str(tmp_path / "o"), "--validation-fraction", "1")
    assert code == 2 and "--validation-fraction must be in [0, 1)" in stderr


def test_hugging_face_dataset_input_matches_jsonl(tmp_path: Path, capsys) -> None:
    datasets = pytest.importorskip("datasets", reason="dataset folders need `pip install datasets`")
    folder = tmp_path / "weather_ds"
    datasets.Dataset.from_list(jsonl_rows(WEATHER_DATA)).save_to_disk(str(folder))
    from_jsonl, from_dataset = tmp_path / "a", tmp_path / "b"
    for source, out in ((WEATHER_DATA, from_jsonl), (folder, from_dataset)):
        code, stdout, stderr = run_main(capsys, "prepare-data", "--input", str(source), "--config", *CONFIGS,
                                        "--output-dir", str(out), "--validation-fraction", "0.5")
        assert code == 0 and stderr == "", stderr
    for side in ("train.jsonl", "validation.jsonl"):
        assert read_jsonl(from_dataset / side) == read_jsonl(from_jsonl / side)
    assert len(read_jsonl(from_dataset / "train.jsonl") + read_jsonl(from_dataset / "validation.jsonl")) == 5
