"""The one JSONL reader: task files, rollout files, example and check files all go through here.

A line is one JSON object. Blank lines are ignored. A bad line is named by its file and line
number, with the column inside that line (`tasks.jsonl:7: not valid JSON: unexpected character (column 12)`).
A write cut short by a kill leaves a last line without its newline: `repair_torn_tail` cuts it, and
`read_whole_lines` reads a file that may end in one (it leaves such a line out).

Files that must never be seen half-written (state, manifests, artefacts, rewritten histories) go through
`write_atomic`: written beside the target, flushed to disk, renamed over it, and the rename made durable.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, NamedTuple

import orjson

Report = Callable[[int, str], None]  # (line number, message) of a skipped line


class JsonlError(ValueError):
    """A line of a JSONL file that a strict reader cannot use; the message names file and line."""


class JsonLine(NamedTuple):
    """One good line: its 1-based number, where it starts and how long it is in bytes, and the object."""

    number: int
    offset: int
    length: int
    row: dict[str, Any]


def iter_raw(path: Path) -> Iterator[tuple[int, int, bytes]]:
    """(line number, byte offset, raw bytes with the newline) of every line, blank ones included."""
    offset = 0
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            yield number, offset, raw
            offset += len(raw)


def parse_object(raw: bytes) -> tuple[dict[str, Any] | None, str | None]:
    """A line's JSON object, or None and why not (the column is the line's, not the file's)."""
    try:
        row = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return None, f"not valid JSON: {exc.msg} (column {exc.colno})"
    if not isinstance(row, dict):
        return None, f"expected a JSON object, got {type(row).__name__}"
    return row, None


def iter_jsonl(path: Path, report: Report | None = None) -> Iterator[JsonLine]:
    """Stream the good lines of `path`. A bad line goes to `report(line, message)` and is skipped;
    without `report` it raises JsonlError naming `path:line`."""
    for number, offset, raw in iter_raw(path):
        if not raw.strip():
            continue
        row, problem = parse_object(raw)
        if row is None:
            if report is None:
                raise JsonlError(f"{path}:{number}: {problem}")
            report(number, problem or "unreadable")
            continue
        yield JsonLine(number, offset, len(raw), row)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every object of a small file (examples, checks), strictly: the first bad line raises JsonlError."""
    if not path.is_file():
        raise JsonlError(f"{path}: no such file")
    return [line.row for line in iter_jsonl(path)]


def read_whole_lines(path: Path) -> list[Any]:
    """Every line of `path` that is whole JSON, in order; a line torn by a kill (or any other line that is
    not JSON) is left out, and a missing file reads as no lines. For files this process appends to
    itself (rollouts, histories), where a torn last line is expected after a kill, not an error."""
    rows = []
    if path.is_file():
        for raw in path.read_bytes().splitlines():
            if raw.strip():
                try:
                    rows.append(orjson.loads(raw))
                except orjson.JSONDecodeError:
                    continue
    return rows


def write_jsonl_atomic(path: Path, rows: Iterable[Any]) -> None:
    """Replace `path` with one JSON line per row, atomically (`write_atomic`)."""
    write_atomic(path, b"".join(orjson.dumps(row, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n" for row in rows))


def write_json_atomic(path: Path, data: Any) -> None:
    """Replace `path` with `data` as indented JSON, atomically (`write_atomic`)."""
    write_atomic(path, orjson.dumps(data, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))


def write_atomic(path: Path, data: bytes | str) -> None:
    """Replace `path` with `data` so that a reader (or a kill) sees the old content or the new, never a part
    (`replaced_atomically`)."""
    with replaced_atomically(path) as partial, partial.open("wb") as handle:
        handle.write(data.encode() if isinstance(data, str) else data)


@contextmanager
def replaced_atomically(path: Path) -> Iterator[Path]:
    """A temporary path beside `path` to write the new file at (for writers that want a path, such as a GGUF
    writer); when the block ends it is flushed to disk, renamed over `path`, and the rename flushed too
    (best effort where a folder cannot be opened). A block that raises leaves `path` as it was."""
    partial = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        yield partial
        with partial.open("rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    fsync_folder(path.parent)


def fsync_folder(path: Path) -> None:
    """Make the renames inside a folder durable (best effort where folders cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def repair_torn_tail(path: Path) -> str | None:
    """Cut a last line that lacks its newline (a write cut short by a kill); returns a note if it did."""
    if not path.exists():
        return None
    with path.open("r+b") as handle:
        size = handle.seek(0, os.SEEK_END)
        keep, end = 0, size
        while end > 0:  # the last newline, reading backwards in blocks
            start = max(0, end - 65536)
            handle.seek(start)
            newline = handle.read(end - start).rfind(b"\n")
            if newline >= 0:
                keep = start + newline + 1
                break
            end = start
        if keep == size:
            return None
        handle.truncate(keep)
    return f"repaired a torn last line ({size - keep} bytes) in {path}"


def truncate(path: Path, size: int) -> None:
    """Cut `path` to its first `size` bytes (an unreadable last line left by a crash)."""
    with path.open("r+b") as handle:
        handle.truncate(size)


__all__ = ["JsonLine", "JsonlError", "Report", "fsync_folder", "iter_jsonl", "iter_raw", "parse_object",
           "read_jsonl", "read_whole_lines", "repair_torn_tail", "replaced_atomically", "truncate", "write_atomic",
           "write_json_atomic", "write_jsonl_atomic"]
