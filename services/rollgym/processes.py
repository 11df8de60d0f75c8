"""Process-lifetime helpers shared by the stack launcher and the trainer jobs.

A child that must not outlive the process that started it asks the kernel for a signal when that
parent dies (`die_with_parent`), so a launcher or training loop killed with SIGKILL leaves no server
or trainer behind.
"""

from __future__ import annotations

import ctypes
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(signum: int = signal.SIGTERM) -> None:
    """Ask the kernel to send this process `signum` when its parent dies; call it in the child (as
    Popen's `preexec_fn`, or right after `os.fork()`). Linux only: elsewhere, or without libc, nothing.

    The kernel watches the parent *thread* that created the child: start such children from a
    thread that lives as long as they should."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signum))
    except OSError:  # no glibc (e.g. musl names it differently): the child just outlives its parent
        pass


__all__ = ["die_with_parent"]
