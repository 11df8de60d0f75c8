"""Sessions: signed, unguessable session ids carried by cookie, and a per-session state store.

A session id is 128 random bits; the cookie holds `id.signature` with an HMAC under the stack's
random secret, so a client cannot forge another session's id: a tampered cookie is a new session.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

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


@dataclass
class _Entry:
    state: dict[str, Any]
    touched: float = field(default_factory=time.monotonic)


class SessionStore:
    """In-memory per-session state with a time-to-live; one store per server process.

    State is a plain dict the server owns; entries idle longer than `ttl_s` are dropped, checked
    lazily on access so there is no background task to manage.
    """

    def __init__(self, ttl_s: float = 3600.0, sweep_every: int = 1024) -> None:
        self.ttl_s = ttl_s
        self._entries: dict[str, _Entry] = {}
        self._sweep_every = sweep_every
        self._accesses = 0

    def get(self, session_id: str) -> dict[str, Any]:
        """The state of a session, created empty on first use."""
        self._maybe_sweep()
        entry = self._entries.get(session_id)
        now = time.monotonic()
        if entry is None or now - entry.touched > self.ttl_s:
            entry = self._entries[session_id] = _Entry({}, now)
        entry.touched = now
        return entry.state

    def exists(self, session_id: str) -> bool:
        entry = self._entries.get(session_id)
        return entry is not None and time.monotonic() - entry.touched <= self.ttl_s

    def delete(self, session_id: str) -> None:
        self._entries.pop(session_id, None)

    def __len__(self) -> int:
        return len(self._entries)

    def _maybe_sweep(self) -> None:
        self._accesses += 1
        if self._accesses % self._sweep_every:
            return
        deadline = time.monotonic() - self.ttl_s
        for session_id in [sid for sid, entry in self._entries.items() if entry.touched < deadline]:
            del self._entries[session_id]
