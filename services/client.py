"""The HTTP client every server and the collector use to call other servers by name.

One pooled aiohttp session per client (one client per process); every call has a timeout and
bounded retries with jittered exponential backoff on connection errors, 429 and 5xx. Cookies are
kept per caller-supplied dict, never in a shared jar, so concurrent rollouts never mix sessions.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from http.cookies import SimpleCookie
from typing import Any, Mapping

import aiohttp
import orjson
from pydantic import BaseModel

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})


@dataclass(frozen=True)
class ServerAddress:
    """Where a named server listens, its role, and the bearer token it requires (if any)."""

    url: str
    role: str = ""
    auth_token: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"url": self.url, "role": self.role, "auth_token": self.auth_token}


Registry = Mapping[str, ServerAddress]


def registry_from_json(data: Mapping[str, Any]) -> dict[str, ServerAddress]:
    """A registry from its JSON form: {name: {url, role, auth_token}} or {name: url}."""
    registry = {}
    for name, entry in data.items():
        if isinstance(entry, str):
            registry[name] = ServerAddress(url=entry)
        else:
            registry[name] = ServerAddress(
                url=entry["url"], role=entry.get("role", ""), auth_token=entry.get("auth_token")
            )
    return registry


class ServerCallError(Exception):
    """A call that got no HTTP answer: the server could not be reached or did not answer in time."""

    def __init__(self, server: str, path: str, kind: str, message: str) -> None:
        super().__init__(f"{kind} calling {server} {path}: {message}")
        self.server = server
        self.path = path
        self.kind = kind  # "connect" | "timeout" | "unknown_server"


@dataclass
class Reply:
    """An HTTP answer: status, raw body and the JSON-decoded body on demand."""

    status: int
    body: bytes
    headers: Mapping[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    def json(self) -> Any:
        return orjson.loads(self.body)

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")

    def error_message(self) -> str:
        """The message of a rollgym/OpenAI-style JSON error body, or the body's text."""
        try:
            payload = self.json()
        except orjson.JSONDecodeError:
            return self.text[:500]
        if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
            return str(payload["error"].get("message", payload["error"]))
        if isinstance(payload, dict) and "detail" in payload:
            return str(payload["detail"])
        return self.text[:500]


def encode_json(payload: Any) -> bytes:
    """JSON bytes for a dict/list, a pydantic model, or bytes passed through."""
    if isinstance(payload, bytes):
        return payload
    if isinstance(payload, BaseModel):
        return payload.model_dump_json(exclude_unset=True).encode()
    return orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY)


class ServerClient:
    """Calls servers of a stack by name (or by absolute URL) with timeouts and bounded retries."""

    def __init__(
        self,
        registry: Registry | None = None,
        *,
        timeout_s: float = 300.0,
        max_retries: int = 3,
        backoff_base_s: float = 0.1,
        backoff_max_s: float = 5.0,
        connection_limit: int = 0,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive: no call goes without a timeout")
        self.registry: dict[str, ServerAddress] = dict(registry or {})
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self.connection_limit = connection_limit
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self.connection_limit, ttl_dns_cache=None, keepalive_timeout=60)
            self._session = aiohttp.ClientSession(
                connector=connector, cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False
            )
        return self._session

    def url_for(self, server: str, path: str) -> tuple[str, str | None]:
        """The absolute URL and bearer token of `path` on `server` (a registry name or a base URL)."""
        if server.startswith(("http://", "https://")):
            return server.rstrip("/") + path, None
        address = self.registry.get(server)
        if address is None:
            known = ", ".join(sorted(self.registry)) or "none"
            raise ServerCallError(server, path, "unknown_server", f"no server named {server!r} (known: {known})")
        return address.url.rstrip("/") + path, address.auth_token

    async def post(self, server: str, path: str, json: Any = None, **kwargs: Any) -> Reply:
        return await self.request("POST", server, path, json=json, **kwargs)

    async def get(self, server: str, path: str, **kwargs: Any) -> Reply:
        return await self.request("GET", server, path, **kwargs)

    async def request(
        self,
        method: str,
        server: str,
        path: str,
        *,
        json: Any = None,
        cookies: dict[str, str] | None = None,
        timeout_s: float | None = None,
        max_retries: int | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Reply:
        """Send one request, retrying connection errors, 429 and 5xx up to `max_retries` times.

        Returns the last Reply (whatever its status) or raises ServerCallError when no answer came.
        `cookies` is read for the Cookie header and updated in place from Set-Cookie.
        Timeouts are not retried: the server may still be working on the request.
        """
        url, token = self.url_for(server, path)
        send_headers = {"Content-Type": "application/json"} if json is not None else {}
        if token:
            send_headers["Authorization"] = f"Bearer {token}"
        if headers:
            send_headers.update(headers)
        data = encode_json(json) if json is not None else None
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.timeout_s)
        retries = self.max_retries if max_retries is None else max_retries
        attempt = 0
        while True:
            if cookies:
                send_headers["Cookie"] = "; ".join(f"{k}={v}" for k, v in cookies.items())
            try:
                async with self._http().request(
                    method, url, data=data, headers=send_headers, timeout=timeout
                ) as response:
                    body = await response.read()
                    if cookies is not None:
                        _update_cookies(cookies, response.headers.getall("Set-Cookie", []))
                    reply = Reply(response.status, body, response.headers)
            except asyncio.TimeoutError:
                raise ServerCallError(server, path, "timeout", f"no answer within {timeout.total:g} s") from None
            except (aiohttp.ClientConnectionError, OSError) as exc:
                if attempt >= retries:
                    raise ServerCallError(server, path, "connect", f"{type(exc).__name__}: {exc}") from None
            else:
                if reply.status not in RETRY_STATUSES or attempt >= retries:
                    return reply
            attempt += 1
            await asyncio.sleep(self._backoff(attempt))

    def _backoff(self, attempt: int) -> float:
        # Full jitter: spreads retries of many concurrent rollouts instead of synchronising them.
        return random.uniform(0, min(self.backoff_max_s, self.backoff_base_s * 2 ** (attempt - 1)))

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None


def _update_cookies(cookies: dict[str, str], set_cookie_headers: list[str]) -> None:
    for header in set_cookie_headers:
        parsed = SimpleCookie()
        parsed.load(header)
        for key, morsel in parsed.items():
            cookies[key] = morsel.value
