"""Every `rollgym` command stops on SIGINT (Ctrl-C) however it was started: a background job of a script
starts with SIGINT ignored, which Python would keep. Shown on a collection waiting on an agent that
never answers: it stops at once, exits 130 ("interrupted"), and writes no rollout and no reward."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from pathlib import Path

import orjson

from rollgym.testing import REPO_ROOT
from tests.conftest import start_rollgym, stop_rollgym


def test_a_collection_started_with_sigint_ignored_stops_on_sigint(tmp_path: Path) -> None:
    silent = socket.socket()  # an agent that takes the connection and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    registry = tmp_path / "stack.json"
    registry.write_bytes(orjson.dumps({"agent": {"url": f"http://127.0.0.1:{silent.getsockname()[1]}",
                                                 "role": "agents"}}))
    output, log = tmp_path / "rollouts.jsonl", tmp_path / "out.log"
    with log.open("w") as sink:
        process = start_rollgym("collect-rollouts", "--registry-file", str(registry), "--agent", "agent",
                                "--input", str(REPO_ROOT / "resources_servers/weather/data/example.jsonl"),
                                "--output", str(output), "--timeout", "600", "--no-progress",
                                stdout=sink, stderr=subprocess.STDOUT,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        silent.settimeout(60)
        connection, _ = silent.accept()  # the collection is under way, waiting on the agent
        time.sleep(0.2)
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=15) == 130, log.read_text()
        assert "interrupted" in log.read_text()
        assert not output.exists() or output.read_bytes() == b""  # no rollout, so no reward 0, was written
        connection.close()
    finally:
        stop_rollgym(process, grace_s=5)
        silent.close()
