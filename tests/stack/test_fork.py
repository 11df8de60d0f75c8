"""How the launcher starts its servers: forked from itself where that is safe, else as fresh interpreters."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CONFIG = "weather:\n  resources_servers:\n    weather: {}\n"

# Starts a stack in a fresh, single-threaded interpreter and prints how its server was started.
PROGRAM = """
import sys
if sys.argv[2] == "torch":
    import torch
    torch.cuda.is_available()  # what a trainer asks first; on a GPU machine a forked child cannot use CUDA after it
from rollgym import Stack, load_stack
from rollgym.stack.launcher import ForkedServer
stack = Stack(load_stack([sys.argv[1]]))
try:
    stack.start(timeout_s=60)
    print("forked" if all(isinstance(p, ForkedServer) for p in stack.processes.values()) else "spawned")
finally:
    stack.stop()
"""


def start_mode(config: Path, first: str) -> str:
    done = subprocess.run([sys.executable, "-c", PROGRAM, str(config), first], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()[-1]


def test_servers_fork_from_a_plain_process_and_spawn_from_one_that_imported_torch(tmp_path: Path) -> None:
    config = tmp_path / "weather.yaml"
    config.write_text(CONFIG)
    assert start_mode(config, "plain") == "forked"
    assert start_mode(config, "torch") == "spawned"
