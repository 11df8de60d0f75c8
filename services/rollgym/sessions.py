"""Sessions: signed, unguessable session ids carried by cookie, and per-session state stores.

A session id is 128 random bits; the cookie holds `id.signature` with an HMAC under the stack's
random secret, so a client cannot forge another session's id: a tampered cookie is a new session.

Two stores keep the state of a session (a dict), both with a time-to-live and the same interface:

- `SessionStore` (memory, the default): live dicts in this process; any Python object may be kept
  in the state (an environment object, a subprocess handle). One process only.
- `SQLiteSessionStore`: the state as JSON in a SQLite file (WAL mode, busy timeout, one connection
  per process and thread), so several worker processes of one server share sessions and a restart
  keeps them. The state must be JSON-serialisable.

Servers use `async with store.session(session_id) as state:` around each call: it serialises the
calls of one session (other sessions run concurrently), loads the state before and saves it after
(for the memory store both are no-ops: the dict is live).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import secrets
import sqlite3
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable, TypeVar

import orjson

logger = logging.getLogger("rollgym.sessions")
T = TypeVar("T")

SESSION_COOKIE = "rollgym_session"


class SessionSigner:
    """Makes and checks `id.signature` cookie values under one secret."""

    def __init__(self, secret: str) -> None:
        if len(secret) < 16:
            raise ValueError("session secret must be at least 16 characters")
        self._key = secret.encode()

    def _signature(self, session_id: str) -> str:
        return hmac.new(self._key, session_id.encode(), hashlib.sha256).hexdigest()[:32]

    def new(self) -> tuple[str, str]:
        """A fresh (session_id, cookie_value) pair."""
        session_id = secrets.token_urlsafe(16)
        return session_id, f"{session_id}.{self._signature(session_id)}"

    def verify(self, cookie_value: str | None) -> str | None:
        """The session id a cookie value carries, or None if it is missing or not signed by us."""
        if not cookie_value:
            return None
        session_id, _, signature = cookie_value.rpartition(".")
        if not session_id or not hmac.compare_digest(signature, self._signature(session_id)):
            return None
        return session_id

    def fingerprint(self, *parts: str) -> str:
        """A stable, non-secret digest of the secret and `parts`: equal in every process of one stack."""
        digest = hmac.new(self._key, "\x00".join(("rollgym-fingerprint", *parts)).encode(), hashlib.sha256)
        return digest.hexdigest()[:20]


class _SessionLocks:
    """Per-session asyncio locks of one process; a lock is dropped when nobody holds or awaits it."""

    def __init__(self) -> None:
        self._locks: dict[str, list[Any]] = {}  # session id -> [lock, holders + waiters]

    @asynccontextmanager
    async def hold(self, session_id: str) -> AsyncIterator[None]:
        entry = self._locks.get(session_id)
        if entry is None:
            entry = self._locks[session_id] = [asyncio.Lock(), 0]
        entry[1] += 1
        try:
            async with entry[0]:
                yield
        finally:
            entry[1] -= 1
            if entry[1] == 0 and self._locks.get(session_id) is entry:
                del self._locks[session_id]

    def __len__(self) -> int:
        return len(self._locks)


@dataclass
class _Entry:
    state: dict[str, Any]
    touched: float = field(default_factory=time.monotonic)


class SessionStore:
    """In-memory per-session state with a time-to-live; one store per server process.

    State is a plain dict the server owns (any Python object may live in it); entries idle longer
    than `ttl_s` are dropped, checked lazily on access so there is no background task to manage.
    """

    kind = "memory"
    holds_objects = True  # the state may hold objects that are not JSON (environment handles)

    def __init__(self, ttl_s: float = 3600.0, sweep_every: int = 1024) -> None:
        self.ttl_s = ttl_s
        self._entries: dict[str, _Entry] = {}
        self._sweep_every = sweep_every
        self._accesses = 0
        self._locks = _SessionLocks()

    @asynccontextmanager
    async def session(self, session_id: str) -> AsyncIterator[dict[str, Any]]:
        """The live state of a session, with the session's lock held (its other calls wait)."""
        async with self._locks.hold(session_id):
            state = self.get(session_id)
            try:
                yield state
            finally:
                entry = self._entries.get(session_id)
                if entry is not None and entry.state is state:
                    entry.touched = time.monotonic()  # a long call does not count as idle time

    def get(self, session_id: str) -> dict[str, Any]:
        """The state of a session, created empty on first use."""
        self._maybe_sweep()
        entry = self._entries.get(session_id)
        now = time.monotonic()
        if entry is None or now - entry.touched > self.ttl_s:
            entry = self._entries[session_id] = _Entry({}, now)
        entry.touched = now
        return entry.state

    def save(self, session_id: str, state: dict[str, Any]) -> None:
        """Replace a session's state (a live dict needs no saving; this is for callers holding a copy)."""
        self._entries[session_id] = _Entry(state)

    def exists(self, session_id: str) -> bool:
        entry = self._entries.get(session_id)
        return entry is not None and time.monotonic() - entry.touched <= self.ttl_s

    def delete(self, session_id: str) -> None:
        self._entries.pop(session_id, None)

    def close(self) -> None:
        """Nothing to release."""

    def __len__(self) -> int:
        return len(self._entries)

    def _maybe_sweep(self) -> None:
        self._accesses += 1
        if self._accesses % self._sweep_every:
            return
        deadline = time.monotonic() - self.ttl_s
        for session_id in [sid for sid, entry in self._entries.items() if entry.touched < deadline]:
            del self._entries[session_id]


MemorySessionStore = SessionStore


class SessionLeaseLost(RuntimeError):
    """A call outlived its lease on a session and another call took the session over; nothing was saved."""


_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY,
    state BLOB NOT NULL,
    touched REAL NOT NULL,
    lease_owner TEXT,
    lease_until REAL NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS sessions_touched ON sessions (touched);
"""


class SQLiteSessionStore:
    """Per-session state as JSON in a SQLite file, shared by the processes that open the same path.

    Each call takes a *lease* on its session's row (`BEGIN IMMEDIATE`: read the row, claim it, commit;
    milliseconds), runs with the loaded state, then saves the state and frees the lease in one
    `UPDATE`. A second call of the same session waits: on a per-session asyncio lock inside this
    process, and by polling the lease across processes. The database's write lock is never held
    while a tool runs, so slow calls of one session never stall other sessions. A call that raises
    saves nothing (the state stays as it was before the call). A lease left by a crashed process
    lapses after `lease_s`.

    The blocking sqlite3 calls run on a small thread pool of this store (one connection per thread
    and process), never on the event loop. Timestamps are wall-clock (`time.time()`), comparable
    across processes. Rows idle longer than `ttl_s` read as empty and are deleted now and then.
    """

    kind = "sqlite"
    holds_objects = False

    def __init__(
        self,
        path: str | os.PathLike[str],
        ttl_s: float = 3600.0,
        *,
        busy_timeout_s: float = 30.0,
        lease_s: float = 900.0,
        sweep_every: int = 1024,
        threads: int = 4,
    ) -> None:
        self.path = str(path)
        self.ttl_s = ttl_s
        self.busy_timeout_s = busy_timeout_s
        self.lease_s = lease_s
        self._sweep_every = sweep_every
        self._threads = threads
        self._accesses = 0
        self._local = threading.local()
        self._connections: list[tuple[int, sqlite3.Connection]] = []  # (opening pid, connection)
        self._connections_lock = threading.Lock()
        self._generation = 0
        self._executor: ThreadPoolExecutor | None = None
        self._executor_pid = 0
        self._locks = _SessionLocks()
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        conn = self._conn()
        mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            logger.warning("session database %s is not in WAL mode (%s)", self.path, mode)
        conn.executescript(_SCHEMA)

    # --- connections and the thread pool (both per process: a forked worker makes its own) ------
    def _conn(self) -> sqlite3.Connection:
        local = self._local
        key = (os.getpid(), self._generation)
        if getattr(local, "key", None) != key:
            # A new thread, a forked process (never reuse a connection across fork), or a reopen.
            conn = sqlite3.connect(
                self.path, timeout=self.busy_timeout_s, isolation_level=None, check_same_thread=False
            )
            conn.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: durable across process crashes
            local.conn, local.key = conn, key
            with self._connections_lock:
                self._connections.append((key[0], conn))
        return local.conn

    def _pool(self) -> ThreadPoolExecutor:
        pid = os.getpid()
        if self._executor is None or self._executor_pid != pid:
            self._executor = ThreadPoolExecutor(self._threads, thread_name_prefix="rollgym-sessions")
            self._executor_pid = pid
        return self._executor

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        # Shielded: a cancelled request still lets its database write finish (a lease is never leaked
        # by a half-done release).
        return await asyncio.shield(loop.run_in_executor(self._pool(), fn, *args))

    # --- blocking primitives (run on the pool, or directly by the synchronous API) ---------------
    def _claim(self, session_id: str, owner: str) -> dict[str, Any] | None:
        """Claim the session's lease and return its state; None while another call holds it."""
        conn = self._conn()
        now = time.time()
        conn.execute("BEGIN IMMEDIATE")
        try:
            row = conn.execute(
                "SELECT state, touched, lease_owner, lease_until FROM sessions WHERE id = ?", (session_id,)
            ).fetchone()
            if row is not None and row[2] is not None and row[3] > now:
                conn.execute("ROLLBACK")
                return None
            if row is None or now - row[1] > self.ttl_s:
                data = b"{}"
                conn.execute(
                    "INSERT OR REPLACE INTO sessions (id, state, touched, lease_owner, lease_until) "
                    "VALUES (?, ?, ?, ?, ?)", (session_id, data, now, owner, now + self.lease_s),
                )
            else:
                data = row[0]
                conn.execute(
                    "UPDATE sessions SET lease_owner = ?, lease_until = ?, touched = ? WHERE id = ?",
                    (owner, now + self.lease_s, now, session_id),
                )
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        return orjson.loads(data)

    def _release(self, session_id: str, owner: str, data: bytes | None) -> bool:
        """Free the lease, saving `data` unless it is None; False if the lease was no longer ours."""
        conn = self._conn()
        now = time.time()
        if data is None:
            cursor = conn.execute(
                "UPDATE sessions SET lease_owner = NULL, lease_until = 0, touched = ? WHERE id = ? AND lease_owner = ?",
                (now, session_id, owner),
            )
        else:
            cursor = conn.execute(
                "UPDATE sessions SET state = ?, lease_owner = NULL, lease_until = 0, touched = ? "
                "WHERE id = ? AND lease_owner = ?", (data, now, session_id, owner),
            )
        return cursor.rowcount == 1

    def _sweep(self) -> int:
        now = time.time()
        cursor = self._conn().execute(
            "DELETE FROM sessions WHERE touched < ? AND (lease_owner IS NULL OR lease_until < ?)",
            (now - self.ttl_s, now),
        )
        return cursor.rowcount

    # --- the async API the server uses --------------------------------------------------------
    @asynccontextmanager
    async def session(self, session_id: str) -> AsyncIterator[dict[str, Any]]:
        """The session's state, loaded under its lease; saved when the block exits without error."""
        async with self._locks.hold(session_id):
            owner = uuid.uuid4().hex
            state = await self._acquire(session_id, owner)
            try:
                yield state
            except BaseException:
                await self._run(self._release, session_id, owner, None)
                raise
            try:
                data = orjson.dumps(state)
            except TypeError as exc:
                await self._run(self._release, session_id, owner, None)
                raise TypeError(f"session state is not JSON-serialisable ({exc}); the sqlite session store "
                                "keeps JSON only: use session_store: memory for object state") from None
            if not await self._run(self._release, session_id, owner, data):
                raise SessionLeaseLost(
                    f"session lease lapsed after {self.lease_s:g} s and the session was taken over; "
                    "this call's changes were not saved"
                )

    async def _acquire(self, session_id: str, owner: str) -> dict[str, Any]:
        self._accesses += 1
        if self._accesses % self._sweep_every == 0:
            await self._run(self._sweep)
        loop = asyncio.get_running_loop()
        delay = 0.002
        while True:
            claim = loop.run_in_executor(self._pool(), self._claim, session_id, owner)
            try:
                state = await asyncio.shield(claim)
            except asyncio.CancelledError:
                # The claim may still succeed after this call stopped waiting: free the lease then.
                pool = self._pool()
                claim.add_done_callback(lambda _: pool.submit(self._release, session_id, owner, None))
                raise
            if state is not None:
                return state
            # Another process holds this session: wait for its call to finish.
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)

    # --- synchronous helpers (tests, tools, inspection); each is one short statement ------------
    def get(self, session_id: str) -> dict[str, Any]:
        """A copy of the session's saved state ({} if none or expired); changes need `save`."""
        row = self._conn().execute("SELECT state, touched FROM sessions WHERE id = ?", (session_id,)).fetchone()
        if row is None or time.time() - row[1] > self.ttl_s:
            return {}
        return orjson.loads(row[0])

    def save(self, session_id: str, state: dict[str, Any]) -> None:
        """Write a session's state outside any lease (keeps a lease another call holds)."""
        data = orjson.dumps(state)
        self._conn().execute(
            "INSERT INTO sessions (id, state, touched) VALUES (?, ?, ?) "
            "ON CONFLICT (id) DO UPDATE SET state = excluded.state, touched = excluded.touched",
            (session_id, data, time.time()),
        )

    def exists(self, session_id: str) -> bool:
        row = self._conn().execute("SELECT touched FROM sessions WHERE id = ?", (session_id,)).fetchone()
        return row is not None and time.time() - row[0] <= self.ttl_s

    def delete(self, session_id: str) -> None:
        self._conn().execute("DELETE FROM sessions WHERE id = ?", (session_id,))

    def sweep(self) -> int:
        """Delete expired sessions now; returns how many."""
        return self._sweep()

    def __len__(self) -> int:
        row = self._conn().execute(
            "SELECT COUNT(*) FROM sessions WHERE touched >= ?", (time.time() - self.ttl_s,)
        ).fetchone()
        return int(row[0])

    def close(self) -> None:
        """Close this process's connections and thread pool (the file stays for other processes).

        The store stays usable: a later call opens fresh connections."""
        pid = os.getpid()
        if self._executor is not None and self._executor_pid == pid:
            self._executor.shutdown(wait=True)
        self._executor = None
        with self._connections_lock:
            self._generation += 1  # every thread's cached connection is now stale
            mine = [conn for owner, conn in self._connections if owner == pid]
            # Connections inherited through fork belong to the parent: never close them here.
            self._connections = []
        for conn in mine:
            try:
                conn.close()
            except sqlite3.Error:
                pass


AnySessionStore = SessionStore | SQLiteSessionStore


def default_session_db(name: str, fingerprint: str) -> Path:
    """Where a server's SQLite sessions live by default: one file per (stack secret, server name),
    so every worker process of that server finds the same file and other stacks never do."""
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in name)[:64] or "server"
    return Path(tempfile.gettempdir()) / "rollgym-sessions" / f"{safe}-{fingerprint}.sqlite3"


def make_session_store(kind: str, ttl_s: float, path: str | os.PathLike[str] | None = None) -> AnySessionStore:
    """A store by config name: "memory" or "sqlite" (which needs `path`)."""
    if kind == "memory":
        return SessionStore(ttl_s=ttl_s)
    if kind == "sqlite":
        if path is None:
            raise ValueError("the sqlite session store needs a database path")
        return SQLiteSessionStore(path, ttl_s=ttl_s)
    raise ValueError(f"unknown session store {kind!r} (expected 'memory' or 'sqlite')")
