"""Several backends behind one model server: sticky sessions, least-loaded placement, cool-downs.

A rollout (session) sticks to the backend that served its previous turn, so its prefix stays in
that backend's KV cache. The session is recognised without any help from the agent: every item the
model server generates has an `id` whose last 4 hex digits are the serving backend's tag (a hash of
its URL), and the agent echoes those items back in the next turn's input. A request whose input
holds no tagged item is a new session and goes to the backend with the fewest requests in flight.

A backend that fails (no connection, 5xx) is taken out for `cooldown_s` and the request is retried
on another one; after the cool-down it gets traffic again (a failure takes it out again). A session
whose backend is out is re-routed; with token-id prompts its tokens stay exact on the new backend.
A backend that failed is asked which weights it serves before it gets traffic again (weights.py): one
restarted on its base weights is brought to the pool's current ones first.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

TAG_LENGTH = 4


class BackendUnavailable(Exception):
    """A backend did not answer, or answered 5xx: try another one."""


@dataclass
class Backend:
    url: str  # the OpenAI-compatible base URL, e.g. http://host:8000/v1
    tag: str
    in_flight: int = 0
    down_until: float = 0.0
    failures: int = 0
    served: int = 0
    # Learned capabilities: None = not tried yet, False = the backend lacks the route.
    capabilities: dict[str, bool] = field(default_factory=dict)
    # The full weights it serves (weights.py; None: those it started with), and whether to ask it again before
    # its next request (it failed one: a restarted backend serves its base weights again).
    weight_version: str | None = None
    needs_weights_check: bool = False
    weights_checked_at: float = 0.0

    @property
    def root(self) -> str:
        """The server root (vLLM and SGLang serve /tokenize there, outside /v1)."""
        url = self.url.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url

    def is_up(self, now: float) -> bool:
        return now >= self.down_until


def url_tag(url: str) -> str:
    return hashlib.sha1(url.rstrip("/").encode()).hexdigest()[:TAG_LENGTH]


class BackendPool:
    """The backends of one model server and the routing state."""

    def __init__(self, urls: Iterable[str], cooldown_s: float = 10.0) -> None:
        self.backends: list[Backend] = []
        seen: set[str] = set()
        for url in urls:
            tag = url_tag(url)
            if tag in seen:
                raise ValueError(f"base_url {url!r} is listed twice")
            seen.add(tag)
            self.backends.append(Backend(url=url.rstrip("/"), tag=tag))
        if not self.backends:
            raise ValueError("at least one base_url is required")
        self.cooldown_s = cooldown_s
        self._by_tag = {backend.tag: backend for backend in self.backends}

    @property
    def multi(self) -> bool:
        return len(self.backends) > 1

    def sticky_backend(self, items: Any) -> Backend | None:
        """The backend that served the latest tagged item of the input, if any."""
        if not self.multi or not isinstance(items, list):
            return None
        for item in reversed(items):
            item_id = item.get("id") if isinstance(item, dict) else None
            if isinstance(item_id, str) and len(item_id) > TAG_LENGTH:
                backend = self._by_tag.get(item_id[-TAG_LENGTH:])
                if backend is not None:
                    return backend
        return None

    def pick(self, sticky: Backend | None, exclude: set[str]) -> Backend:
        """Sticky backend when up; else the least-loaded up backend; else the one back soonest."""
        now = time.monotonic()
        if sticky is not None and sticky.url not in exclude and sticky.is_up(now):
            return sticky
        candidates = [b for b in self.backends if b.url not in exclude] or list(self.backends)
        up = [b for b in candidates if b.is_up(now)]
        if up:
            return min(up, key=lambda b: (b.in_flight, b.served))
        return min(candidates, key=lambda b: b.down_until)

    def mark_down(self, backend: Backend) -> None:
        backend.failures += 1
        backend.needs_weights_check = True
        backend.down_until = time.monotonic() + self.cooldown_s

    def mark_ok(self, backend: Backend) -> None:
        backend.down_until = 0.0

    def tag_item_id(self, item_id: str, backend: Backend) -> str:
        """`item_id` with its last hex digits replaced by the backend's tag (only with several backends)."""
        if not self.multi or len(item_id) <= TAG_LENGTH + 4:
            return item_id
        return item_id[:-TAG_LENGTH] + backend.tag

    def status(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        return [{"url": b.url, "tag": b.tag, "up": b.is_up(now), "in_flight": b.in_flight, "served": b.served,
                 "failures": b.failures} for b in self.backends]
