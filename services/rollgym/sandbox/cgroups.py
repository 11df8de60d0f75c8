"""Per-session control groups, where the machine lets root make them: memory, processes and CPU time
counted for the whole session (every process of every command), not per process as rlimits are.

Each workspace gets `rollgym/<id>` under the memory, pids and cpuacct hierarchies (cgroup v1) or one
group under the unified hierarchy (v2). The launcher joins the listed `cgroup.procs` files before it
forks anything, so the whole command tree is inside. Best effort: where none can be made, `make`
returns None and the rlimits remain the only bounds (`info` says so).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

ROOT = "/sys/fs/cgroup"
GROUP = "rollgym"


@dataclass
class SessionGroup:
    kind: str  # "v1" or "v2"
    dirs: tuple[str, ...]

    @property
    def procs(self) -> list[str]:
        return [os.path.join(d, "cgroup.procs") for d in self.dirs]

    def cpu_s(self) -> float:
        """CPU seconds used by every process the session ran so far."""
        try:
            if self.kind == "v1":
                cpuacct = next(d for d in self.dirs if "/cpuacct/" in d)
                return int(_read(os.path.join(cpuacct, "cpuacct.usage"))) / 1e9
            stat = dict(line.split() for line in _read(os.path.join(self.dirs[0], "cpu.stat")).splitlines())
            return int(stat["usage_usec"]) / 1e6
        except (OSError, StopIteration, KeyError, ValueError):
            return 0.0

    def remove(self) -> None:
        for directory in self.dirs:
            for _ in range(50):  # the last command's processes may take an instant to leave
                try:
                    os.rmdir(directory)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)


def _read(path: str) -> str:
    with open(path) as handle:
        return handle.read().strip()


def _write(path: str, value: str) -> None:
    with open(path, "w") as handle:
        handle.write(value)


def make(ws_id: str, memory_mb: int, max_processes: int) -> SessionGroup | None:
    """A session's groups with its memory and process limits, or None where they cannot be made."""
    if os.geteuid() != 0:
        return None
    made: list[str] = []
    try:
        if os.path.exists(os.path.join(ROOT, "cgroup.controllers")):  # v2, unified at the root
            base = os.path.join(ROOT, GROUP)
            os.makedirs(base, exist_ok=True)
            _write(os.path.join(base, "cgroup.subtree_control"), "+memory +pids +cpu")
            directory = os.path.join(base, ws_id)
            os.mkdir(directory)
            made.append(directory)
            _write(os.path.join(directory, "memory.max"), str(memory_mb * 1024 * 1024))
            _write(os.path.join(directory, "memory.swap.max"), "0")
            _write(os.path.join(directory, "pids.max"), str(max_processes))
            return SessionGroup("v2", tuple(made))
        for controller in ("memory", "pids", "cpuacct"):
            directory = os.path.join(ROOT, controller, GROUP, ws_id)
            os.makedirs(directory)
            made.append(directory)
        memory, pids, _ = made
        _write(os.path.join(memory, "memory.limit_in_bytes"), str(memory_mb * 1024 * 1024))
        _write(os.path.join(pids, "pids.max"), str(max_processes))
        return SessionGroup("v1", tuple(made))
    except OSError:
        SessionGroup("?", tuple(made)).remove()
        return None
