"""Is a task's solution readable from inside the sandbox? The sandbox shows the system directories and the
toolchain read-only, and those can hold a copy of the task's library (setuptools vendors more-itertools,
pip vendors others, a distribution may package the library itself). A task whose fix sits in such a copy
is refused by `generate.py` (and reported by `validate.py`).

A copy is a file with the same name in a folder of the same name (`parse/__init__.py`, `more_itertools/more.py`)
anywhere under those roots, holding every line the task's fix adds; for a module at the repository's root
(`xmltodict.py`), a file of that name in any folder, or a package of that name (`xmltodict/__init__.py`).
The roots are what the sandbox shows: the system directories, the toolchain, and the prefix of the
toolchain's interpreter (a venv's base Python, whose own site-packages the sandbox shows too).
"""

from __future__ import annotations

import functools
import os
import threading
from pathlib import Path, PurePosixPath

from rollgym.sandbox import DEFAULT_EXPOSE
from rollgym.sandbox.isolation import interpreter_paths

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


@functools.lru_cache(maxsize=8)
def sandbox_roots(toolchain: str) -> tuple[str, ...]:
    """What a sandbox shows read-only: the system directories, the toolchain, and its interpreter's prefixes
    (the sandbox exposes a venv's base Python whole: `/root/.pyenv/versions/3.11.7`, site-packages included)."""
    python = os.path.realpath(os.path.join(toolchain, "bin", "python3"))
    try:
        interpreter = interpreter_paths(python) if os.path.exists(python) else ()
    except Exception:  # noqa: BLE001 - a toolchain that does not run is reported by the sandbox itself
        interpreter = ()
    return tuple(dict.fromkeys((*DEFAULT_EXPOSE, os.path.abspath(toolchain), *interpreter)))


def toolchain_roots(toolchain: str) -> tuple[str, ...]:
    """The roots of `sandbox_roots` that belong to the toolchain (not the system's directories): where
    `generate.py` refuses a copy, since it travels with the toolchain to wherever the tasks are served."""
    return tuple(root for root in sandbox_roots(toolchain) if root not in DEFAULT_EXPOSE)


def _candidates(index: dict[tuple[str, str], tuple[str, ...]], path: PurePosixPath) -> tuple[str, ...]:
    """The files under the roots that could be a copy of the repository's file `path`."""
    if path.parent.name:
        return index.get((path.parent.name, path.name), ())
    # A module at the repository's root is installed (or vendored) as a file of that name in any folder,
    # or as a package of that name.
    found = [p for (folder, name), paths in index.items() if name == path.name for p in paths]
    return (*found, *index.get((path.stem, "__init__.py"), ()))


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
        for candidate in _candidates(index, path):
            try:
                text = Path(candidate).read_text(errors="replace")
            except OSError:
                continue
            lines = {line.strip() for line in text.splitlines()}
            if all(line in lines for line in added):
                copies.append(candidate)
    return copies


def hidden_paths(patch: str, roots: tuple[str, ...]) -> tuple[str, ...]:
    """What a task's sandboxes must see empty: the folder of each copy of its fix (the copied package), or
    the file itself for a copy of a module that stands alone in its folder (a site-packages of other things)."""
    alone = {PurePosixPath(change.path).name for change in split_patch(patch) if not PurePosixPath(change.path).parent.name}
    return tuple(sorted({path if os.path.basename(path) in alone else os.path.dirname(path)
                         for path in solution_copies(patch, roots)}))
