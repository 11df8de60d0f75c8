"""`str_replace_editor` as SWE-agent and OpenHands shape it: view / create / str_replace / insert /
undo_edit, with their messages. Pure text functions; the server reads and writes the files in the
session's sandbox and keeps each file's earlier contents for undo_edit."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

SNIPPET_LINES = 4
MAX_VIEW_CHARS = 16000


class EditorArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    command: Literal["view", "create", "str_replace", "insert", "undo_edit"] = Field(
        description="view a file or directory; create a file; str_replace old_str by new_str; insert new_str after "
                    "line insert_line; undo_edit the last edit of a file")
    path: str = Field(description="absolute path, e.g. /workspace/pkg/module.py")
    file_text: str | None = Field(default=None, description="create: the new file's content")
    old_str: str | None = Field(default=None, description="str_replace: the exact text to replace (must occur once)")
    new_str: str | None = Field(default=None, description="str_replace: the replacement; insert: the text to insert")
    insert_line: int | None = Field(default=None, description="insert: new_str goes after this line (0: at the top)")
    view_range: list[int] | None = Field(default=None, description="view: [first, last] line, 1-based; last -1 = to the end")

    @model_validator(mode="after")
    def _needs(self) -> "EditorArgs":
        # Bounds checked here rather than declared in the schema (see BashArgs).
        if not self.path.strip() or len(self.path) > 4096:
            raise ValueError("path must be a non-empty path of at most 4096 characters")
        if "\0" in self.path:
            raise ValueError("path cannot hold a NUL byte")
        if self.insert_line is not None and self.insert_line < 0:
            raise ValueError("insert_line must be 0 or more")
        if self.view_range is not None and len(self.view_range) != 2:
            raise ValueError("view_range must be [first, last]")
        required = {"create": ("file_text",), "str_replace": ("old_str",), "insert": ("insert_line", "new_str")}
        for name in required.get(self.command, ()):
            if getattr(self, name) is None:
                raise ValueError(f"command {self.command!r} needs {name}")
        return self


class EditError(Exception):
    """The edit cannot be made: the message is the tool's answer, as the agents' editors phrase it."""


def numbered(text: str, first_line: int = 1) -> str:
    """`cat -n` style: the line number right-aligned in 6 columns, a tab, the line."""
    return "\n".join(f"{number:6}\t{line}" for number, line in enumerate(text.split("\n"), start=first_line))


def clip(text: str, limit: int = MAX_VIEW_CHARS) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + "\n<response clipped><NOTE>To save on context only part of this file has been shown to you. " \
                          "Use `grep -n` with bash, or view_range, to find what you need.</NOTE>"


def view_file(path: str, content: str, view_range: list[int] | None) -> str:
    lines = content.split("\n")
    first = 1
    if view_range:
        first, last = view_range
        if not 1 <= first <= len(lines):
            raise EditError(f"Invalid `view_range`: {view_range}. Its first element `{first}` should be within the "
                            f"range of lines of the file: [1, {len(lines)}]")
        if last != -1 and not first <= last <= len(lines):
            raise EditError(f"Invalid `view_range`: {view_range}. Its second element `{last}` should be -1 or within "
                            f"[{first}, {len(lines)}]")
        content = "\n".join(lines[first - 1:] if last == -1 else lines[first - 1:last])
    return f"Here's the result of running `cat -n` on {path}:\n{clip(numbered(content, first))}\n"


def _snippet(path: str, text: str, around_line: int, extra_lines: int) -> str:
    lines = text.split("\n")
    start = max(0, around_line - SNIPPET_LINES)
    end = min(len(lines), around_line + SNIPPET_LINES + extra_lines + 1)
    return (f"The file {path} has been edited. Here's the result of running `cat -n` on a snippet of {path}:\n"
            f"{numbered(chr(10).join(lines[start:end]), start + 1)}\n"
            "Review the changes and make sure they are as expected. Edit the file again if necessary.")


def str_replace(path: str, content: str, old: str, new: str) -> tuple[str, str]:
    """(new content, message); EditError unless `old` occurs exactly once."""
    count = content.count(old)
    if count == 0:
        raise EditError(f"No replacement was performed, old_str `{old}` did not appear verbatim in {path}.")
    if count > 1:
        lines = [i + 1 for i, line in enumerate(content.split("\n")) if old.split("\n")[0] in line]
        raise EditError(f"No replacement was performed. Multiple occurrences of old_str `{old}` in lines {lines}. "
                        "Please ensure it is unique")
    if old == new:
        raise EditError(f"No replacement was performed, old_str `{old}` is the same as new_str `{new}`.")
    at_line = content.split(old)[0].count("\n")
    updated = content.replace(old, new)
    return updated, _snippet(path, updated, at_line, new.count("\n"))


def insert(path: str, content: str, line: int, text: str) -> tuple[str, str]:
    lines = content.split("\n")
    if not 0 <= line <= len(lines):
        raise EditError(f"Invalid `insert_line` parameter: {line}. It should be within the range of lines of the "
                        f"file: [0, {len(lines)}]")
    updated = "\n".join([*lines[:line], *text.split("\n"), *lines[line:]])
    return updated, _snippet(path, updated, line, text.count("\n"))
