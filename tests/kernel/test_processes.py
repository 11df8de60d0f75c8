"""die_with_parent: a child that asked for it gets the signal when its parent dies (Linux), and
elsewhere, or without libc, the call does nothing."""

from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from rollgym.processes import die_with_parent

# The child writes the name of the signal it got to a file, then exits; it never outlives 30 s.
CHILD = """
import signal, sys, time
from rollgym.processes import die_with_parent

marker, signum = sys.argv[1], int(sys.argv[2])

def got(number, frame):
    open(marker, "w").write(signal.Signals(number).name)
    sys.exit(0)

signal.signal(signum, got)
die_with_parent() if signum == signal.SIGTERM else die_with_parent(signum)
print("armed", flush=True)
time.sleep(30)
"""

# The parent starts the child, prints its pid once the child is armed, and exits without waiting for it.
PARENT = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], *sys.argv[2:]], stdout=subprocess.PIPE, text=True)
assert child.stdout.readline() == "armed\\n"
print(child.pid, flush=True)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1], ids=["default", "SIGUSR1"])
def test_the_child_gets_the_signal_when_its_parent_exits(tmp_path: Path, signum: signal.Signals) -> None:
    marker = tmp_path / "signal.txt"
    parent = subprocess.run([sys.executable, "-c", PARENT, CHILD, str(marker), str(int(signum))],
                            capture_output=True, text=True, timeout=30)
    assert parent.returncode == 0, parent.stderr
    child_pid = int(parent.stdout)
    try:
        child = psutil.Process(child_pid)
    except psutil.NoSuchProcess:
        child = None  # already gone: the marker says why
    try:
        deadline = time.monotonic() + 10
        while not marker.exists() or not marker.read_text():
            assert time.monotonic() < deadline, "the child outlived its parent"
            time.sleep(0.02)
        assert marker.read_text() == signum.name
        if child is not None:
            child.wait(timeout=10)
    finally:
        if child is not None and child.is_running():
            child.kill()


def test_it_does_nothing_off_linux_or_without_libc(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_libc(*args: object, **kwargs: object) -> None:
        raise OSError("libc.so.6: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", no_libc)
    die_with_parent()  # no libc: no error
    monkeypatch.setattr(sys, "platform", "darwin")

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("libc loaded off Linux")

    monkeypatch.setattr(ctypes, "CDLL", never)
    die_with_parent(signal.SIGKILL)
