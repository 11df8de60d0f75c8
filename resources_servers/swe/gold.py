"""A scripted solver: a unified diff (a task's gold patch) as the `str_replace_editor` calls that make it.

Used by the tests and by `scripts/swe_gold_check.py` to show that every task is solvable through the
tools a model has, and that a wrong edit scores 0.
"""

from __future__ import annotations

import re
from typing import Any

_HUNK = re.compile(r"^@@ -\d+(?:,\d+)? \+\d+(?:,\d+)? @@")


def editor_calls(patch: str, root: str = "/workspace") -> list[dict[str, Any]]:
    """One str_replace per hunk (old: context and removed lines; new: context and added lines)."""
    calls: list[dict[str, Any]] = []
    path = None
    old: list[str] = []
    new: list[str] = []

    def flush() -> None:
        if path is not None and (old or new):
            calls.append({"command": "str_replace", "path": f"{root}/{path}",
                          "old_str": "\n".join(old), "new_str": "\n".join(new)})
        old.clear()
        new.clear()

    for line in patch.splitlines():
        if line.startswith("diff --git"):
            flush()
            path = None
        elif line.startswith("+++ "):
            path = line[4:].split("/", 1)[1] if line[4:].startswith(("a/", "b/")) else line[4:]
        elif line.startswith("--- ") or line.startswith("index "):
            continue
        elif _HUNK.match(line):
            flush()
        elif path is not None and line[:1] in (" ", "-", "+"):
            if line[0] in " -":
                old.append(line[1:])
            if line[0] in " +":
                new.append(line[1:])
        elif line.startswith("\\"):
            continue
    flush()
    return calls


def wrong_calls(patch: str, root: str = "/workspace") -> list[dict[str, Any]]:
    """A plausible but wrong edit: the first hunk's context lines changed by a comment only (the bug stays)."""
    first = editor_calls(patch, root)[0]
    lines = first["old_str"].split("\n")
    return [{**first, "new_str": "\n".join([*lines[:-1], lines[-1] + "  # looked at this"])}]
