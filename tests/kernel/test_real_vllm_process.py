"""rollgym.testing.real_vllm's process handling, on a stand-in venv whose `python` serves /health (no vLLM
needed): it waits for health, stops the server and the engine process it started, and says why when the
server does not come up."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import psutil
import pytest

from rollgym.testing.real_vllm import missing_reason, real_vllm

# What the stand-in `python` runs, whatever its arguments: a child (vLLM's engine process), then /health.
SERVER = """
import http.server, os, subprocess, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(os.environ["ENGINE_PID_FILE"], "w").write(str(engine.pid))
print("serving", sys.argv[1:], flush=True)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def stand_in_venv(root: Path, body: str) -> Path:
    """A folder shaped like a venv with vLLM, whose bin/python runs `body` with this interpreter."""
    (root / "lib" / "python3.11" / "site-packages" / "vllm").mkdir(parents=True)
    (root / "lib" / "python3.11" / "site-packages" / "vllm" / "__init__.py").write_text("")
    (root / "bin").mkdir()
    (root / "server.py").write_text(body)
    python = root / "bin" / "python"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} {root / "server.py"} "$@"\n')
    python.chmod(0o755)
    return root


def test_it_waits_for_health_and_stops_the_server_with_its_engine(tmp_path: Path, monkeypatch) -> None:
    venv = stand_in_venv(tmp_path / "venv", SERVER)
    monkeypatch.setenv("ENGINE_PID_FILE", str(tmp_path / "engine.pid"))
    with real_vllm(tmp_path, "--chat-template", "t.jinja", venv=venv, log_path=tmp_path / "server.log",
                   startup_timeout_s=60) as server:
        engine = psutil.Process(int((tmp_path / "engine.pid").read_text()))
        assert server.url == f"{server.root}/v1" and server.model == tmp_path.name
        assert psutil.Process(server.pid).is_running() and engine.is_running()
        log = server.log_tail()
        assert "--chat-template" in log and "--dtype" in log and "--enable-lora" in log
    _, alive = psutil.wait_procs([engine], timeout=10)  # orphaned by the server, reaped by init
    assert not alive and not psutil.pid_exists(server.pid)


def test_a_server_that_exits_is_an_error_with_its_log(tmp_path: Path) -> None:
    venv = stand_in_venv(tmp_path / "venv", "import sys; print('no such model'); sys.exit(3)")
    with pytest.raises(RuntimeError, match=r"(?s)exited with code 3 before it was ready.*no such model"):
        with real_vllm(tmp_path, venv=venv, startup_timeout_s=60):
            pass


def test_a_missing_venv_is_named() -> None:
    assert "make vllm" in missing_reason("/nonexistent/venv")
    with pytest.raises(RuntimeError, match="no vLLM venv at /nonexistent/venv"):
        with real_vllm(os.devnull, venv="/nonexistent/venv"):
            pass
