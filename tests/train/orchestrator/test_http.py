"""The trainer's HTTP signal: `rollgym orchestrate --listen` serves POST /steps/{N}/done and GET /status,
which do what the ADAPTER file does. Real HTTP to a real orchestrator process in front of a loopback stack."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx
import orjson
import pytest

from rollgym.client import ServerAddress
from rollgym.server import ServerConfig
from rollgym.testing import serve_in_thread
from rollgym.train.orchestrator.orchestrator import Orchestrator
from rollgym.train.orchestrator.config import OrchestratorConfig
from rollgym.train.orchestrator.transports.http import StepServer
from rollgym.train.orchestrator.transports.folders import StepFolders
from tests.train.orchestrator.support import medium_rows, scripted_stack, write_rows


@pytest.fixture(scope="module")
def stack() -> Iterator[dict[str, ServerAddress]]:
    with scripted_stack() as registry:
        yield registry


def orchestrator_config(tmp_path: Path) -> dict:
    return {"batch_size": 4, "rollouts_per_example": 2, "max_steps": 3, "max_async_level": 1,
            "max_off_policy_steps": 2, "concurrency": 4,
            "envs": [{"name": "reverse", "input": write_rows(tmp_path / "tasks.jsonl", medium_rows(20)),
                      "agent": "reverse_text_agent"}]}


def orchestrate(tmp_path: Path, stack: dict[str, ServerAddress], *options: str, **popen: object) -> list[str]:
    (tmp_path / "config.json").write_bytes(orjson.dumps(orchestrator_config(tmp_path)))
    (tmp_path / "registry.json").write_bytes(orjson.dumps({n: a.to_json() for n, a in stack.items()}))
    return [sys.executable, "-m", "rollgym.cli", "orchestrate", str(tmp_path / "config.json"),
            "--registry-file", str(tmp_path / "registry.json"), "--output", str(tmp_path / "run"), *options]


def adapter(tmp_path: Path, name: str) -> str:
    folder = tmp_path / "adapters" / name
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text("{}")
    return str(folder)


def test_a_trainer_signals_finished_steps_over_http(stack, tmp_path):
    process = subprocess.Popen(orchestrate(tmp_path, stack, "--listen", "127.0.0.1:0", "--poll-s", "5"),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    folders = StepFolders(tmp_path / "run" / "steps")
    try:
        first = process.stdout.readline().decode()
        found = re.search(r"GET (http://127\.0\.0\.1:\d+)/status", first)
        assert found, first
        http = httpx.Client(base_url=found.group(1), timeout=30)
        folders.wait(2, timeout_s=60)  # steps 1 and 2 are out; step 3 waits for the trainer (max_async_level 1)
        deadline = time.monotonic() + 10
        while (status := http.get("/status").json())["step"] < 3 and time.monotonic() < deadline:
            time.sleep(0.01)  # the folder is out a moment before the step counts as published
        assert status["ready"] == [1, 2] and status["finished"] == 0 and status["step"] == 3
        assert status["applied"]["adapter_path"] is None

        def done(step: object, body: object, **kwargs: object) -> httpx.Response:
            content = body if isinstance(body, bytes) else orjson.dumps(body)
            return http.post(f"/steps/{step}/done", content=content, **kwargs)

        one = adapter(tmp_path, "one")
        refused = {
            "unknown step": (done(4, {"adapter_path": one}), 404, "step", "step 4 does not exist"),
            "not handed out": (done(3, {"adapter_path": one}), 409, "step", "step 3 has not been handed out yet"),
            "out of order": (done(2, {"adapter_path": one}), 409, "step", "step 2 cannot finish before step 1"),
            "no path": (done(1, {}), 422, "adapter_path", "field 'adapter_path': Field required"),
            "typo": (done(1, {"adapter_path": one, "adaptor": one}), 422, "adaptor", "Extra inputs"),
            "not JSON": (done(1, b"{adapter_path"), 400, "body", "not valid JSON"),
            "not a step": (done("two", {"adapter_path": one}), 422, "path.step", "valid integer"),
        }
        for case, (reply, code, field, message) in refused.items():
            error = reply.json()["error"]
            assert (reply.status_code, error["field"]) == (code, field), (case, reply.text)
            assert message in error["message"], (case, reply.text)
        assert folders.finished(1) is None  # nothing refused was recorded

        reply = done(1, {"adapter_path": one})  # answered once the adapter is loaded on the model server
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["applied"] and body["recorded"] and body["status"]["finished"] == 1
        assert body["status"]["applied"]["adapter_path"] == one
        (version,) = body["status"]["applied"]["model_versions"]
        assert folders.finished(1) == one  # the same record as the ADAPTER file a trainer writes
        assert done(1, {"adapter_path": one}).json()["recorded"] is False  # a retry changes nothing
        clash = done(1, {"adapter_path": adapter(tmp_path, "other")})
        assert clash.status_code == 409 and clash.json()["error"]["field"] == "adapter_path"

        folders.finish(2, None)  # the file signal still works next to the route
        folders.wait(3, timeout_s=60)
        queued = done(3, {"adapter_path": ""}, params={"wait": "false"})
        assert queued.status_code == 202 and queued.json()["recorded"] is True
        out, _ = process.communicate(timeout=60)
        assert process.returncode == 0, out.decode()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    # Step 3 was generated after step 1's adapter was loaded, by that adapter.
    assert {r["response"]["model_version"] for r in folders.read(3).rollouts} == {version}
    history = [orjson.loads(line) for line in (tmp_path / "run" / "history.jsonl").read_bytes().splitlines()]
    assert [line["step"] for line in history] == [1, 2, 3]


def test_routes_need_the_token_beyond_loopback(stack, tmp_path):
    config = OrchestratorConfig.model_validate(orchestrator_config(tmp_path))
    orchestrator = Orchestrator(config, stack, tmp_path / "run", log=lambda _: None)
    server = StepServer(orchestrator, ServerConfig(host="0.0.0.0", auth_token="s3cret"))
    with serve_in_thread(server) as url:
        assert httpx.get(f"{url}/status").status_code == 401
        assert httpx.post(f"{url}/steps/1/done", json={"adapter_path": None}).status_code == 401
        assert httpx.get(f"{url}/health").status_code == 200
        status = httpx.get(f"{url}/status", headers={"Authorization": "Bearer s3cret"})
        assert status.status_code == 200 and status.json()["step"] == 1
    env = {k: v for k, v in os.environ.items() if k != "ROLLGYM_AUTH_TOKEN"}
    open_to_all = subprocess.run(orchestrate(tmp_path, stack, "--listen", "0.0.0.0:0"), capture_output=True,
                                 text=True, timeout=60, env=env)
    assert open_to_all.returncode == 2 and "beyond loopback: set ROLLGYM_AUTH_TOKEN" in open_to_all.stderr
    malformed = subprocess.run(orchestrate(tmp_path, stack, "--listen", "8089"), capture_output=True, text=True,
                               timeout=60)
    assert malformed.returncode == 2 and "must look like HOST:PORT" in malformed.stderr
    assert "Traceback" not in open_to_all.stderr + malformed.stderr
