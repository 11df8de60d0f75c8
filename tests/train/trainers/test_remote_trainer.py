"""The remote trainer example of docs/train-extending.md (scripts/train/http_trainer.py) against a small
training service on loopback, directly and as a plan's adapter in the loop."""

from __future__ import annotations

import json
import os
import sys
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import orjson
import pytest
import yaml

from rollgym.client import ServerAddress
from rollgym.testing import REPO_ROOT
from rollgym.train.loop.epochs import TrainLoop
from rollgym.train.loop.plan import load_plan
from rollgym.train.trainers.base import Artefact, TrainConfig, TrainingFailed

sys.path.insert(0, str(REPO_ROOT / "scripts" / "train"))
from http_trainer import HttpTrainer  # noqa: E402


class Service:
    """Jobs train in a thread: records with "crash" in them fail, the others succeed."""

    def __init__(self) -> None:
        self.jobs: dict[str, dict[str, Any]] = {}

    def run(self, job_id: str, config: dict[str, Any], records: list[dict[str, Any]]) -> None:
        job = self.jobs[job_id]
        if any("crash" in json.dumps(r) for r in records):
            job.update(status="failed", error="RuntimeError: NaN loss at step 3")
            return
        artefact = Artefact(kind="lora", uri=f"s3://bucket/{job_id}", base_model=config["base_model"],
                            version=config["version"], metrics={"examples": float(len(records))})
        job.update(status="succeeded", artefact=artefact.model_dump())


@pytest.fixture()
def service() -> Iterator[tuple[str, Service]]:
    state = Service()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def answer(self, code: int, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            job_id = uuid.uuid4().hex[:8]
            state.jobs[job_id] = {"status": "running", "artefact": None, "error": None}
            threading.Thread(target=state.run, args=(job_id, body["config"], body["records"])).start()
            self.answer(200, {"id": job_id})

        def do_GET(self) -> None:
            job = state.jobs.get(self.path.rsplit("/", 1)[-1])
            self.answer(200, job) if job else self.answer(404, {"error": "no such job"})

        def do_DELETE(self) -> None:
            state.jobs[self.path.rsplit("/", 1)[-1]]["status"] = "cancelled"
            self.answer(200, {})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", state
    server.shutdown()


def config(tmp_path: Path, url: str) -> TrainConfig:
    return TrainConfig(base_model="Qwen/Qwen3-4B", output_dir=str(tmp_path), version="policy-e001",
                       args={"url": url, "poll_s": 0.05})


def test_submit_and_wait(service: tuple[str, Service], tmp_path: Path) -> None:
    url, _ = service
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt_ids": [1]}\n{"prompt_ids": [2]}\n')
    artefact = HttpTrainer().submit(good, config(tmp_path, url)).wait(10)
    assert artefact.uri.startswith("s3://bucket/") and artefact.metrics == {"examples": 2.0}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"note": "crash"}\n')
    with pytest.raises(TrainingFailed, match="failed: RuntimeError: NaN loss at step 3"):
        HttpTrainer().submit(bad, config(tmp_path, url)).wait(10)
    with pytest.raises(TrainingFailed, match="cannot be reached"):
        HttpTrainer().submit(good, config(tmp_path, "http://127.0.0.1:9"))


def test_the_loop_drives_a_remote_trainer(service: tuple[str, Service], scripted_agents: dict[str, ServerAddress],
                                          tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url, state = service
    registry = tmp_path / "stack.json"
    registry.write_bytes(orjson.dumps({n: {"url": a.url, "role": a.role} for n, a in scripted_agents.items()}))
    tasks = str(REPO_ROOT / "resources_servers/weather/data/example.jsonl")
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump({
        "base_model": "Qwen/Qwen3-4B", "output": str(tmp_path / "run"),
        "stack": {"registry_file": str(registry), "agent": "weather_agent"},
        "stages": [{"name": "sft", "collect": {"input": tasks, "limit": 2, "repeats": 2},
                    "optimize": {"trainer": "http_trainer:HttpTrainer", "data": "sft",
                                 "args": {"url": url, "poll_s": 0.05}},
                    "apply": "none"}],
    }))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO_ROOT / "scripts" / "train"), str(REPO_ROOT)]))
    loop = TrainLoop(load_plan(plan), progress=False)
    loop.run()
    [line] = loop.history()
    assert line["artefact"].startswith("s3://bucket/") and line["train"]["examples"] == 4.0
    assert len(state.jobs) == 1
    # Killed after the job finished but before the epoch was recorded: the rerun does not submit it again.
    run = tmp_path / "run"
    (run / "history.jsonl").unlink()
    phases = orjson.loads((run / "epoch-001" / "phases.json").read_bytes())
    (run / "epoch-001" / "phases.json").write_bytes(orjson.dumps({k: v for k, v in phases.items()
                                                                   if k in ("collect", "curate")}))
    TrainLoop(load_plan(plan), progress=False).run()
    assert len(state.jobs) == 1 and (run / "epoch-001" / "train" / "artefact.json").is_file()
    assert [line["epoch"] for line in loop.history()] == [1]
