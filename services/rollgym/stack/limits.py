"""Process limits a stack needs, set before any socket opens (the CLI calls this for every command)."""

from __future__ import annotations


def raise_open_file_limit() -> int:
    """Lift this process's soft limit on open files to the hard limit; returns the new soft limit.

    Thousands of rollouts in flight hold thousands of sockets, far past the usual soft limit of 1024.
    Children inherit the limit, so the launcher and the collector call this once at start.
    """
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = max(soft, 1 << 20)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft
