"""Is a task's solution readable from inside the sandbox? The sandbox shows the system directories and the
toolchain read-only, and those can hold a copy of the task's library (setuptools vendors more-itertools,
pip vendors others, a distribution may package the library itself). A task whose fix sits in such a copy
is refused by `generate.py` (and reported by `validate.py`).

A copy is a file with the same name in a folder of the same name (`parse/__init__.py`, `more_itertools/more.py`)
anywhere under those roots, holding every line the task's fix adds.
"""

from __future__ import annotations

import functools
import os
import threading
from pathlib import Path, PurePosixPath

from rollgym.sandbox import DEFAULT_EXPOSE

from .patch import split_patch


_INDEX_LOCK = threading.Lock()


def _index(roots: tuple[str, ...]) -> dict[tuple[str, str], tuple[str, ...]]:
    """{(folder name, file name): paths} of the Python files under the roots (links not followed); made once
    per process and set of roots (a walk of /usr takes seconds)."""
    with _INDEX_LOCK:
        return _walk(roots)


@functools.lru_cache(maxsize=8)
def _walk(roots: tuple[str, ...]) -> dict[tuple[str, str], tuple[str, ...]]:
    found: dict[tuple[str, str], list[str]] = {}
    seen: list[str] = []
    for root in roots:
        real = os.path.realpath(root)
        if any(real == done or real.startswith(done + os.sep) for done in seen) or not os.path.isdir(real):
            continue  # /lib is /usr/lib on a merged-/usr system: walked once
        seen.append(real)
        for directory, _, files in os.walk(root):  # under the path the sandbox shows (a venv may be a link)
            folder = os.path.basename(directory)
            for name in files:
                if name.endswith(".py"):
                    found.setdefault((folder, name), []).append(os.path.join(directory, name))
    return {key: tuple(paths) for key, paths in found.items()}


def sandbox_roots(toolchain: str) -> tuple[str, ...]:
    """What a sandbox shows read-only: the system directories and the toolchain."""
    return (*DEFAULT_EXPOSE, os.path.abspath(toolchain))


def solution_copies(patch: str, roots: tuple[str, ...]) -> list[str]:
    """The files under `roots` that hold the fix of `patch` (every line it adds, in a file of the same name)."""
    index = _index(tuple(roots))
    copies = []
    for change in split_patch(patch):
        added = [line[1:].strip() for line in change.text.splitlines()
                 if line.startswith("+") and not line.startswith("+++") and line[1:].strip()]
        if not added:
            continue
        path = PurePosixPath(change.path)
        for candidate in index.get((path.parent.name, path.name), ()):
            try:
                text = Path(candidate).read_text(errors="replace")
            except OSError:
                continue
            lines = {line.strip() for line in text.splitlines()}
            if all(line in lines for line in added):
                copies.append(candidate)
    return copies
