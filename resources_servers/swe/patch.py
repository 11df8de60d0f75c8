"""The model's patch as the grader takes it: split per file, the files that could change how the task's
tests are collected, run or reported left out, and counted for `submit`'s answer. Pure text functions.

The rule (README, "Reward"): a change to any of these paths is **left out of the graded copy** (listed in
the verdict's `left_out`), never applied:

- test configuration and start-up hooks, at any depth: `conftest.py`, `pytest.ini`, `.pytest.ini`,
  `pytest.toml`, `.pytest.toml`, `tox.ini`, `setup.cfg`, `pyproject.toml`, `sitecustomize.py`,
  `usercustomize.py`, `.gitattributes`, any `*.pth`, anything in a `*.dist-info` or `*.egg-info` folder
  (entry points register pytest plugins);
- the task's tests: the files of its FAIL_TO_PASS and PASS_TO_PASS ids and of its `test_patch`, everything
  in their folders (helpers, `__init__.py`, data) unless that folder is the repository's root, and any
  `test_*.py` or `*_test.py` anywhere.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from pathlib import PurePosixPath

SETTINGS = frozenset({"conftest.py", "pytest.ini", ".pytest.ini", "pytest.toml", ".pytest.toml", "tox.ini",
                      "setup.cfg", "pyproject.toml", "sitecustomize.py", "usercustomize.py", ".gitattributes"})
_OCTAL = re.compile(rb"\\([0-7]{3}|.)")
_ESCAPES = {b"n": b"\n", b"t": b"\t", b'"': b'"', b"\\": b"\\", b"a": b"\a", b"b": b"\b", b"f": b"\f",
            b"r": b"\r", b"v": b"\v"}


@dataclass(frozen=True)
class FileChange:
    path: str
    kind: str  # added | deleted | modified
    binary: bool
    text: str  # this file's part of the patch, from its `diff --git` line


def unquote(name: str) -> str:
    """A path as git prints it: C-quoted ("a/\\303\\251.py") when it holds unusual bytes."""
    if not (len(name) >= 2 and name.startswith('"') and name.endswith('"')):
        return name
    raw = name[1:-1].encode("utf-8", "surrogateescape")
    decoded = _OCTAL.sub(lambda m: bytes([int(m.group(1), 8)]) if len(m.group(1)) == 3
                         else _ESCAPES.get(m.group(1), m.group(1)), raw)
    return decoded.decode("utf-8", "surrogateescape")


def _header_path(line: str) -> str:
    """The path of a `diff --git a/P b/P` line (renames are off: both sides name the same path)."""
    rest = line[len("diff --git "):]
    if rest.startswith('"'):
        end = rest.index('" ', 1) + 1 if '" ' in rest[1:] else len(rest)
        return unquote(rest[:end])[2:]
    # Unquoted, the two names are the same: "a/P b/P" has length 2 * len(P) + 5.
    return rest[2:2 + (len(rest) - 5) // 2]


def split_patch(patch: str) -> list[FileChange]:
    """Each file's part of a `git diff --no-renames` output."""
    parts: list[list[str]] = []
    for line in patch.splitlines(keepends=True):
        if line.startswith("diff --git "):
            parts.append([line])
        elif parts:
            parts[-1].append(line)
    changes = []
    for lines in parts:
        head = [line for line in lines[:6] if not line.startswith(("@@", "+", "-", " "))]
        kind = ("added" if any(line.startswith("new file mode") for line in head)
                else "deleted" if any(line.startswith("deleted file mode") for line in head) else "modified")
        binary = any(line.startswith(("GIT binary patch", "Binary files ")) for line in lines[:8])
        changes.append(FileChange(_header_path(lines[0].rstrip("\n")), kind, binary, "".join(lines)))
    return changes


def task_test_paths(tests: list[str], test_patch: str) -> tuple[set[str], set[str]]:
    """(the task's test files, their folders) from its test ids and its test_patch."""
    files = {test.split("::", 1)[0] for test in tests} | {change.path for change in split_patch(test_patch)}
    folders = {str(PurePosixPath(path).parent) for path in files} - {"."}
    return files, folders


def left_out_because(path: str, test_files: set[str], test_folders: set[str]) -> str | None:
    """Why a changed path is left out of the graded copy, or None when it is graded."""
    parts = PurePosixPath(path).parts
    name = parts[-1] if parts else path
    if name in SETTINGS:
        return "test configuration"
    if name.endswith(".pth"):
        return "a .pth file (code run at start-up)"
    if any(part.endswith((".dist-info", ".egg-info")) for part in parts):
        return "package metadata (entry points can register pytest plugins)"
    if path in test_files:
        return "one of the task's test files"
    if any(path.startswith(folder + "/") for folder in test_folders):
        return "in the task's test folder"
    if fnmatch.fnmatch(name, "test_*.py") or fnmatch.fnmatch(name, "*_test.py"):
        return "a test module"
    return None


def graded_part(patch: str, test_files: set[str], test_folders: set[str]) -> tuple[str, list[dict[str, str]]]:
    """(the patch without the files left out, [{path, why}] of those left out)."""
    kept, left_out = [], []
    for change in split_patch(patch):
        why = left_out_because(change.path, test_files, test_folders)
        if why is None:
            kept.append(change.text)
        else:
            left_out.append({"path": change.path, "why": why})
    return "".join(kept), left_out


def printable(text: str) -> str:
    """Text that JSON and HTTP can carry: bytes that were not UTF-8 shown as U+FFFD."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def describe(patch: str) -> str:
    """`submit`'s summary: how many files, by kind, and their names."""
    changes = split_patch(patch)
    if not changes:
        return "Submitted an empty patch: the workspace has no change from the task's starting point."
    kinds = [f"{sum(c.kind == kind for c in changes)} {kind}" for kind in ("modified", "added", "deleted")
             if any(c.kind == kind for c in changes)]
    binary = sum(c.binary for c in changes)
    names = ", ".join(printable(c.path) for c in changes[:20]) + (f", ... ({len(changes) - 20} more)" if len(changes) > 20 else "")
    return (f"Submitted a patch touching {len(changes)} file(s) ({', '.join(kinds)}"
            f"{f'; {binary} binary' if binary else ''}): {names}.")
