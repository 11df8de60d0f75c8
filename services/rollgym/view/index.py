"""A byte-offset index over a rollouts JSONL file that may still be growing.

A million-line file is never held in memory: the index keeps, per line, its byte offset and the
few fields the table filters and sorts on, in numpy columns (about 40 bytes a line); a row is read
from disk by its offset when it is shown. `refresh()` picks up lines appended since the last call
(a torn last line waits until it is complete), so a view of a running collection stays current.
"""

from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import orjson

CHUNK_BYTES = 8 * 1024 * 1024
BATCH_LINES = 20_000  # lines parsed before they are published to readers

# name -> (dtype, value for a line that lacks it)
COLUMNS: dict[str, tuple[Any, Any]] = {
    "offset": (np.int64, 0),
    "length": (np.int32, 0),  # a line over 2 GB is not a rollout
    "reward": (np.float64, math.nan),
    "status": (np.int32, 0),
    "group": (np.int32, 0),
    "env": (np.int32, 0),
    "version": (np.int32, 0),
    "prefix_ok": (np.int8, -1),  # -1: no tokens, 0: a prefix broke, 1: exact
    "latency": (np.float32, math.nan),
    "input_tokens": (np.int32, 0),
    "output_tokens": (np.int32, 0),
    "turns": (np.int32, 0),
}
SORT_KEYS = ("line", "reward", "latency", "output_tokens", "turns", "group", "status")


class FileChangedError(Exception):
    """An indexed line is no longer where the index says (the file was rewritten in place)."""


class Strings:
    """Interned strings: a column stores codes, this table their text (code 0 is "no value")."""

    def __init__(self) -> None:
        self.values: list[str | None] = [None]
        self.codes: dict[str, int] = {}
        self.ranks: np.ndarray | None = None  # alphabetical rank per code, for sorting

    def code(self, value: Any) -> int:
        found = self.codes.get(value) if type(value) is str else None
        if found is not None:
            return found
        if value is None:
            return 0
        text = str(value)
        found = self.codes.get(text)
        if found is None:
            found = self.codes[text] = len(self.values)
            self.values.append(text)
        return found

    def lookup(self, value: str) -> int | None:
        return self.codes.get(value)


def environment_of(row: dict[str, Any]) -> str | None:
    """The environment/agent a rollout ran in: its agent_ref's name, else its task_type."""
    ref = row.get("agent_ref")
    if isinstance(ref, dict) and ref.get("name"):
        return str(ref["name"])
    if isinstance(ref, str) and ref:
        return ref
    task_type = row.get("task_type")
    return str(task_type) if task_type else None


def model_version_of(row: dict[str, Any]) -> str | None:
    """The weights that sampled the rollout: the last generated item's `model_version`, else the
    rollout's or its response's (absent before adapters existed)."""
    response = row.get("response")
    if type(response) is not dict:
        response = _EMPTY
    output = response.get("output")
    if type(output) is not list:  # a rollout line of the format specification's shape: top-level `output`
        output = row.get("output")
    for item in reversed(output) if type(output) is list else ():
        version = item.get("model_version") if type(item) is dict else None
        if version is not None:
            return str(version)
    for holder in (row, response):
        if holder.get("model_version") is not None:
            return str(holder["model_version"])
    return None


_NUMBERS = (int, float)  # compared by exact type, so booleans are not numbers here
_EMPTY: dict[str, Any] = {}


@dataclass
class Filters:
    """What the rollouts table may be narrowed to; None means any."""

    status: list[str] | None = None
    reward_min: float | None = None
    reward_max: float | None = None
    group: str | None = None
    env: str | None = None
    prefix_ok: bool | None = None
    no_tokens: bool = False  # only rollouts without token sequences (prefix_ok absent)
    version: str | None = None


@dataclass
class Page:
    rows: list[int]  # line numbers (0-based) in the file
    total: int  # matching lines among those indexed
    indexed: int
    complete: bool  # the index has reached the end of the file


@dataclass
class BadLine:
    line: int  # 1-based, as an editor shows it
    message: str


@dataclass
class _Columns:
    capacity: int = 0
    count: int = 0
    arrays: dict[str, np.ndarray] = field(
        default_factory=lambda: {name: np.empty(0, dtype) for name, (dtype, _) in COLUMNS.items()})

    def grow(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        capacity = max(1024, self.capacity * 2, needed)
        for name, (dtype, missing) in COLUMNS.items():
            fresh = np.full(capacity, missing, dtype=dtype)
            if self.count:
                fresh[: self.count] = self.arrays[name][: self.count]
            self.arrays[name] = fresh
        self.capacity = capacity


def _name_ranks(table: Strings) -> np.ndarray:
    """Each code's rank in the alphabetical order of the table's strings (no value first); kept
    until the table grows, since sorting a quarter of a million group ids takes a moment."""
    cached = table.ranks
    if cached is not None and len(cached) == len(table.values):
        return cached
    names = [value or "" for value in table.values]
    ranks = np.empty(len(names), dtype=np.int64)
    ranks[sorted(range(len(names)), key=names.__getitem__)] = np.arange(len(names))
    table.ranks = ranks
    return ranks


class RolloutIndex:
    """The index of one rollouts file. Thread-safe: one thread refreshes, any number query."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.lock = threading.Lock()
        self.refresh_lock = threading.Lock()
        self.statuses, self.groups, self.envs, self.versions = Strings(), Strings(), Strings(), Strings()
        self.bad_lines: list[BadLine] = []
        self.bad_count = 0
        self.blank_count = 0
        self._columns = _Columns()
        self._read_to = 0  # byte offset after the last complete line indexed
        self._tail = 0  # bytes of a last line without its newline yet, seen at the end of the file
        self._lines_seen = 0  # every complete line, bad and blank ones included
        self._identity: tuple[int, int] | None = None
        self.file_size = 0
        self._worker: threading.Thread | None = None

    # --- building -------------------------------------------------------------------------------

    @property
    def count(self) -> int:
        return self._columns.count

    @property
    def complete(self) -> bool:
        """Every complete line is indexed (a last line still being written does not count)."""
        return self._read_to + self._tail >= self.file_size

    def refresh(self, budget_s: float | None = None) -> bool:
        """Index complete lines appended since the last call; True when every complete line is
        indexed. With `budget_s`, stops after about that long (the rest comes with the next call).
        """
        with self.refresh_lock:
            try:
                stat = os.stat(self.path)
            except FileNotFoundError:
                self.file_size = self._read_to = self._tail = 0
                return True
            identity = (stat.st_dev, stat.st_ino)
            if identity != self._identity or stat.st_size < self._read_to:
                self._reset(identity)  # replaced or truncated: start over
            self.file_size = stat.st_size
            deadline = None if budget_s is None else time.monotonic() + budget_s
            with open(self.path, "rb") as handle:
                handle.seek(self._read_to)
                pending = b""
                self._tail = 0
                while True:
                    chunk = handle.read(CHUNK_BYTES)
                    if not chunk:
                        self._tail = len(pending)
                        break
                    data = pending + chunk
                    end = data.rfind(b"\n")
                    if end < 0:
                        pending = data
                        continue
                    self._index_lines(data[: end + 1], self._read_to)
                    pending = data[end + 1:]
                    if deadline is not None and time.monotonic() > deadline:
                        break
            return self.complete

    def _reset(self, identity: tuple[int, int]) -> None:
        with self.lock:
            self.statuses, self.groups, self.envs, self.versions = Strings(), Strings(), Strings(), Strings()
            self.bad_lines, self.bad_count, self.blank_count = [], 0, 0
            self._columns = _Columns()
            self._read_to = self._lines_seen = self._tail = 0
            self._identity = identity

    def _index_lines(self, data: bytes, base: int) -> None:
        """Parse complete lines (data ends with a newline) starting at byte `base` of the file."""
        lines = data.split(b"\n")
        lines.pop()  # the empty piece after the last newline
        offset = base
        batch: list[tuple] = []
        # small batches first, so the first page is readable within milliseconds of opening
        publish_at = min(BATCH_LINES, max(500, self._columns.count))
        loads, fields = orjson.loads, self._fields
        for line in lines:
            self._lines_seen += 1
            length = len(line)
            if length and not line.isspace():
                try:
                    row = loads(line)
                    if type(row) is not dict:
                        raise ValueError("not a JSON object")
                    batch.append(fields(row, offset, length))
                except (orjson.JSONDecodeError, ValueError, TypeError) as exc:
                    self._bad(self._lines_seen, str(exc))
            else:
                self.blank_count += 1
            offset += length + 1
            if len(batch) >= publish_at:
                self._publish(batch, offset)
                batch = []
                publish_at = min(BATCH_LINES, max(500, self._columns.count))
        self._publish(batch, offset)

    def _fields(self, row: dict[str, Any], offset: int, length: int) -> tuple:
        # The hot loop of indexing: plain lookups, no helper calls for the common shapes.
        get = row.get
        metrics = get("metrics")
        if type(metrics) is not dict:
            metrics = _EMPTY
        reward, latency = get("reward"), metrics.get("latency_s")
        tokens_in, tokens, turns = metrics.get("input_tokens"), metrics.get("output_tokens"), metrics.get("turns")
        prefix = get("prefix_ok")
        return (
            offset, length, reward if type(reward) in _NUMBERS else math.nan,
            self.statuses.code(get("status") or "ok"), self.groups.code(get("group_id")),
            self.envs.code(environment_of(row)), self.versions.code(model_version_of(row)),
            -1 if prefix is None else int(bool(prefix)),
            latency if type(latency) in _NUMBERS else math.nan, tokens_in if type(tokens_in) is int else 0,
            tokens if type(tokens) is int else 0, turns if type(turns) is int else 0,
        )

    def _bad(self, line: int, message: str) -> None:
        self.bad_count += 1
        if len(self.bad_lines) < 100:
            self.bad_lines.append(BadLine(line, message[:200]))

    def _publish(self, batch: list[tuple], read_to: int) -> None:
        with self.lock:
            columns = self._columns
            if batch:
                columns.grow(columns.count + len(batch))
                values = list(zip(*batch))
                for position, name in enumerate(COLUMNS):
                    columns.arrays[name][columns.count: columns.count + len(batch)] = values[position]
                columns.count += len(batch)
            self._read_to = read_to

    def start_background(self, on_error: Callable[[Exception], None] | None = None) -> None:
        """Keep indexing in a daemon thread until the end of the file (no-op while one runs)."""
        if (self._worker is not None and self._worker.is_alive()) or not self._changed():
            return

        def work() -> None:
            try:
                while not self.refresh(budget_s=0.2):
                    pass
            except OSError as exc:
                if on_error:
                    on_error(exc)

        self._worker = threading.Thread(target=work, name=f"index {self.path.name}", daemon=True)
        self._worker.start()

    def _changed(self) -> bool:
        """Whether the file is not the one indexed or has another size (a stat, no read)."""
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            return self.file_size != 0
        return (stat.st_dev, stat.st_ino) != self._identity or stat.st_size != self.file_size

    def wait(self, rows: int, timeout_s: float) -> None:
        """Return once `rows` lines are indexed, the file is indexed to its end, or the time is up."""
        deadline = time.monotonic() + timeout_s
        while self.count < rows and not self.complete and time.monotonic() < deadline:
            time.sleep(0.005)

    # --- reading --------------------------------------------------------------------------------

    def snapshot(self) -> tuple[int, dict[str, np.ndarray]]:
        with self.lock:
            count = self._columns.count
            return count, {name: array[:count] for name, array in self._columns.arrays.items()}

    def mask(self, filters: Filters) -> tuple[int, np.ndarray]:
        """(indexed lines, boolean mask of those matching `filters`)."""
        count, cols = self.snapshot()
        keep = np.ones(count, dtype=bool)
        if filters.status:
            codes = [c for c in (self.statuses.lookup(s) for s in filters.status) if c is not None]
            keep &= np.isin(cols["status"], codes) if count else keep
        if filters.reward_min is not None:
            keep &= cols["reward"] >= filters.reward_min
        if filters.reward_max is not None:
            keep &= cols["reward"] <= filters.reward_max
        for name, table, value in (("group", self.groups, filters.group), ("env", self.envs, filters.env),
                                   ("version", self.versions, filters.version)):
            if value is not None:
                code = table.lookup(value)
                keep &= cols[name] == (code if code is not None else -1)
        if filters.no_tokens:
            keep &= cols["prefix_ok"] == -1
        elif filters.prefix_ok is not None:
            keep &= cols["prefix_ok"] == int(filters.prefix_ok)
        return count, keep

    def page(self, filters: Filters, sort: str = "line", descending: bool = False,
             offset: int = 0, limit: int = 50) -> Page:
        """The line numbers of one page of matching rollouts, in the order asked for."""
        if sort not in SORT_KEYS:
            raise ValueError(f"sort must be one of {', '.join(SORT_KEYS)}")
        count, keep = self.mask(filters)
        matching = np.flatnonzero(keep)
        if sort in ("group", "status"):
            table = self.groups if sort == "group" else self.statuses
            _, cols = self.snapshot()
            rank = _name_ranks(table)[cols[sort][:count][matching]]
            matching = matching[np.argsort(-rank if descending else rank, kind="stable")]
        elif sort != "line":
            _, cols = self.snapshot()
            key = cols[sort][:count][matching].astype(np.float64)
            key = -key if descending else key
            key[np.isnan(key)] = np.inf  # rollouts without the value go last either way
            matching = matching[np.argsort(key, kind="stable")]
        elif descending:
            matching = matching[::-1]
        rows = matching[offset: offset + limit].tolist()
        return Page(rows=rows, total=int(matching.size), indexed=count, complete=self.complete)

    def read(self, line: int) -> dict[str, Any]:
        """The rollout on line `line` (0-based among the indexed rollouts), read from disk."""
        with self.lock:
            if not 0 <= line < self._columns.count:
                raise IndexError(line)
            offset = int(self._columns.arrays["offset"][line])
            length = int(self._columns.arrays["length"][line])
        with open(self.path, "rb") as handle:
            handle.seek(offset)
            data = handle.read(length)
        try:
            row = orjson.loads(data)
        except orjson.JSONDecodeError:
            row = None
        if type(row) is not dict:  # rewritten under us since it was indexed: index it afresh
            self._identity = None
            raise FileChangedError(f"{self.path.name} changed while it was read; reload the page")
        return row

    def group_rows(self, group_id: str) -> list[int]:
        code = self.groups.lookup(group_id)
        if code is None:
            return []
        count, cols = self.snapshot()
        return np.flatnonzero(cols["group"] == code).tolist()

    def rewards(self) -> np.ndarray:
        count, cols = self.snapshot()
        return cols["reward"]
