"""Stopping a stack: `rollgym run` and `rollgym serve-one` stop on SIGINT (Ctrl-C) however they were
started, also with SIGINT ignored as a background job of a script starts, and leave no server behind."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import start_rollgym, stop_rollgym

CONFIG = "weather:\n  resources_servers:\n    weather:\n      replicas: 2\n"


def ignores_sigint(pid: int) -> bool:
    """Whether a process has SIGINT ignored (its SigIgn mask in /proc, Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGINT - 1)))
    raise LookupError(f"no SigIgn line for pid {pid}")


@pytest.mark.parametrize("command", ["run", "serve-one"])
def test_sigint_stops_a_stack_started_with_sigint_ignored(tmp_path: Path, command: str) -> None:
    config, log = tmp_path / "weather.yaml", tmp_path / "out.log"
    config.write_text(CONFIG)
    args = [command, str(config), *(["--name", "weather"] if command == "serve-one" else [])]
    with log.open("w") as output:
        process = start_rollgym(*args, stdout=output, stderr=subprocess.STDOUT,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        deadline = time.monotonic() + 60
        while " ready in " not in log.read_text():
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the stack did not start:\n" + log.read_text()
            time.sleep(0.05)
        servers = psutil.Process(process.pid).children(recursive=True)
        assert len(servers) == 2, servers  # the two replicas
        assert not any(ignores_sigint(server.pid) for server in servers)  # a terminal's Ctrl-C reaches them too

        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=15) == 0, log.read_text()
        _, alive = psutil.wait_procs(servers, timeout=5)
        assert not alive, f"servers left running: {alive}"
    finally:
        stop_rollgym(process, grace_s=5)  # a failed test leaves nothing running either
