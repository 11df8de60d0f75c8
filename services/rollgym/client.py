"""The HTTP client every server and the collector use to call other servers by name.

One pooled aiohttp session per client (one client per process); every call has a timeout and
bounded retries with jittered exponential backoff on connection errors, 429 and 5xx. Cookies are
kept per caller-supplied dict, never in a shared jar, so concurrent rollouts never mix sessions.

A server may run as several replicas (one URL each). A call without a cookies dict goes to the
replica with the fewest calls in flight from this client (round-robin among equals); a call with
one sticks to the replica its session started on, remembered in that dict under a private key that
is never sent. A replica that refuses connections is avoided for a few seconds. A session moves to
another replica only when the server's replicas share their session state (`shared_sessions`, the
SQLite session store); otherwise losing its replica fails the call, and the rollout with it.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from dataclasses import dataclass, field
from http.cookies import SimpleCookie
from pathlib import Path
from typing import Any, Collection, Mapping

import aiohttp
import orjson

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
# Where a cookies dict remembers the replica of its session: `~replica:<server name>`. Never sent.
REPLICA_KEY_PREFIX = "~replica:"
# How long a replica that refused a connection is passed over.
DOWN_COOLDOWN_S = 5.0


@dataclass(frozen=True)
class ServerAddress:
    """Where a named server listens (one URL per replica), its role, and the bearer token it requires.

    `url` is the first replica's URL; `urls` lists them all (just `url` for one replica).
    `shared_sessions`: the replicas share session state, so a session may move between them.
    """

    url: str
    role: str = ""
    auth_token: str | None = None
    urls: tuple[str, ...] = ()
    shared_sessions: bool = False

    def __post_init__(self) -> None:
        urls = tuple(url.rstrip("/") for url in self.urls or (self.url,))
        object.__setattr__(self, "urls", urls)
        object.__setattr__(self, "url", urls[0])

    @classmethod
    def replicated(cls, urls: list[str] | tuple[str, ...], role: str = "", auth_token: str | None = None,
                   shared_sessions: bool = False) -> "ServerAddress":
        """The address of a server with one URL per replica."""
        if not urls:
            raise ValueError("a server needs at least one URL")
        return cls(url=urls[0], role=role, auth_token=auth_token, urls=tuple(urls), shared_sessions=shared_sessions)

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"url": self.url, "role": self.role, "auth_token": self.auth_token}
        if len(self.urls) > 1:
            data["urls"] = list(self.urls)
        if self.shared_sessions:
            data["shared_sessions"] = True
        return data


Registry = Mapping[str, ServerAddress]


def registry_from_json(data: Mapping[str, Any], *, auth_token: str | None = None) -> dict[str, ServerAddress]:
    """A registry from its JSON form: {name: {url, urls, role, auth_token, shared_sessions}},
    {name: url} or {name: [url, ...]} (one URL per replica).

    `auth_token` is used for entries that name none (a stack-wide token, e.g. from the environment).
    """
    registry = {}
    for name, entry in data.items():
        if isinstance(entry, str):
            registry[name] = ServerAddress(url=entry, auth_token=auth_token)
        elif isinstance(entry, list) and entry and all(isinstance(url, str) for url in entry):
            registry[name] = ServerAddress.replicated(entry, auth_token=auth_token)
        elif isinstance(entry, dict) and (isinstance(entry.get("url"), str) or entry.get("urls")):
            urls = [str(url) for url in entry.get("urls") or [entry["url"]]]
            registry[name] = ServerAddress.replicated(
                urls, role=str(entry.get("role") or ""), auth_token=entry.get("auth_token") or auth_token,
                shared_sessions=bool(entry.get("shared_sessions", False)),
            )
        else:
            raise ValueError(f"registry entry {name!r}: expected a URL, a list of URLs or {{\"url\": ...}}, got {entry!r}")
    return registry


def load_registry_file(path: str | Path, *, auth_token: str | None = None) -> dict[str, ServerAddress]:
    """The registry in a JSON file (as `rollgym run --registry-file` writes it); ValueError naming the
    file when it is missing, unreadable, not JSON or not a registry."""
    path = Path(path)
    try:
        data = orjson.loads(path.read_bytes())
    except FileNotFoundError:
        raise ValueError(f"registry file {path}: no such file (`rollgym run ... --registry-file {path}` "
                         "writes it)") from None
    except IsADirectoryError:
        raise ValueError(f"registry file {path}: is a folder") from None
    except OSError as exc:
        raise ValueError(f"registry file {path}: cannot read it: {exc.strerror or exc}") from None
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"registry file {path}: not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})") from None
    if not isinstance(data, dict) or not data:
        raise ValueError(f"registry file {path}: expected a JSON object {{name: address}} with at least one server")
    try:
        return registry_from_json(data, auth_token=auth_token)
    except ValueError as exc:
        raise ValueError(f"registry file {path}: {exc}") from None


# A deployment's registry and bearer token, for `rollgym serve-one` and `collect-rollouts` in a
# container: ROLLGYM_REGISTRY='{"policy_model": "http://policy-model:8000", ...}' (registry JSON).
REGISTRY_ENV = "ROLLGYM_REGISTRY"
AUTH_TOKEN_ENV = "ROLLGYM_AUTH_TOKEN"


def registry_from_env(environ: Mapping[str, str]) -> dict[str, ServerAddress] | None:
    """The registry in `environ[ROLLGYM_REGISTRY]` (None if unset), every entry without a token
    given `environ[ROLLGYM_AUTH_TOKEN]`; a ValueError names the variable when it is not registry JSON."""
    text = environ.get(REGISTRY_ENV)
    if not text:
        return None
    try:
        data = orjson.loads(str(text))
        if not isinstance(data, dict):
            raise ValueError(f"expected a JSON object, got {type(data).__name__}")
        return registry_from_json(data, auth_token=environ.get(AUTH_TOKEN_ENV) or None)
    except (orjson.JSONDecodeError, ValueError) as exc:
        raise ValueError(f"{REGISTRY_ENV} is not a registry ({{name: url, ...}}): {exc}") from None


def parse_registry_items(items: list[str], *, auth_token: str | None = None) -> dict[str, ServerAddress]:
    """`NAME=URL[,URL...]` items (one URL per replica) as registry entries."""
    registry = {}
    for item in items:
        name, sep, urls = item.partition("=")
        if not sep or not name or not urls or not all(url.startswith(("http://", "https://")) for url in urls.split(",")):
            raise ValueError(f"registry item {item!r} must look like NAME=http://HOST:PORT[,http://HOST:PORT...]")
        registry[name] = ServerAddress.replicated(urls.split(","), auth_token=auth_token)
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
    model_dump_json = getattr(payload, "model_dump_json", None)  # a pydantic model, without importing pydantic
    if model_dump_json is not None:
        return model_dump_json(exclude_unset=True).encode()
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
        connections_per_server: int = 1024,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive: no call goes without a timeout")
        self.registry: dict[str, ServerAddress] = dict(registry or {})
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self.connections_per_server = connections_per_server
        self._session: aiohttp.ClientSession | None = None
        self._in_flight: dict[str, int] = {}  # per replica URL, calls of this client
        self._down_until: dict[str, float] = {}  # replica URL -> monotonic time it is avoided until
        self._turn = itertools.count()

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # Bounded per server: past the bound, requests wait for a free connection instead of each
            # opening a socket (16k rollouts in flight would otherwise need ~50k file descriptors).
            connector = aiohttp.TCPConnector(limit=0, limit_per_host=self.connections_per_server,
                                             ttl_dns_cache=None, keepalive_timeout=60)
            self._session = aiohttp.ClientSession(
                connector=connector, cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False
            )
        return self._session

    def url_for(self, server: str, path: str, cookies: dict[str, str] | None = None) -> tuple[str, str | None]:
        """The absolute URL and bearer token of `path` on `server` (a registry name or a base URL).

        For a replicated server this picks the replica (see the module docstring); with `cookies`,
        the session's replica, recorded in `cookies` on its first call.
        """
        base, token = self._target(server, path, cookies)
        return base + path, token

    def _target(self, server: str, path: str, cookies: dict[str, str] | None) -> tuple[str, str | None]:
        """(base URL of the replica to call, bearer token)."""
        if server.startswith(("http://", "https://")):
            return server.rstrip("/"), None
        address = self.registry.get(server)
        if address is None:
            known = ", ".join(sorted(self.registry)) or "none"
            raise ServerCallError(server, path, "unknown_server", f"no server named {server!r} (known: {known})")
        return self._replica(server, address, cookies).rstrip("/"), address.auth_token

    def _replica(self, server: str, address: ServerAddress, cookies: dict[str, str] | None) -> str:
        urls = address.urls
        if len(urls) == 1:
            return urls[0]
        key = REPLICA_KEY_PREFIX + server
        if cookies is not None:
            chosen = cookies.get(key)
            if chosen in urls and not (address.shared_sessions and self._is_down(chosen)):
                return chosen
        up = [url for url in urls if not self._is_down(url)] or list(urls)
        # Fewest calls in flight from this client; the rotating start spreads ties round-robin.
        start = next(self._turn) % len(up)
        rotated = up[start:] + up[:start]
        chosen = min(rotated, key=lambda url: self._in_flight.get(url, 0))
        if cookies is not None:
            cookies[key] = chosen
        return chosen

    def _is_down(self, url: str) -> bool:
        until = self._down_until.get(url)
        return until is not None and time.monotonic() < until

    def _mark_down(self, url: str) -> None:
        self._down_until[url] = time.monotonic() + DOWN_COOLDOWN_S

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
        retry_statuses: Collection[int] = RETRY_STATUSES,
    ) -> Reply:
        """Send one request, retrying connection errors, 429 and 5xx up to `max_retries` times.

        `retry_statuses=()` retries only a request that could not be delivered (a caller that retries
        failed answers itself, as the rollout attempts do, so retries do not multiply).

        Returns the last Reply (whatever its status) or raises ServerCallError when no answer came.
        `cookies` is read for the Cookie header and updated in place from Set-Cookie.
        Timeouts are not retried: the server may still be working on the request.
        """
        send_headers = {"Content-Type": "application/json"} if json is not None else {}
        if headers:
            send_headers.update(headers)
        data = encode_json(json) if json is not None else None
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.timeout_s)
        retries = self.max_retries if max_retries is None else max_retries
        attempt = 0
        while True:
            # Picked again on every attempt: a retry may go to another replica.
            base, token = self._target(server, path, cookies)
            url = base + path
            if token:
                send_headers["Authorization"] = f"Bearer {token}"
            if cookies:
                sent = "; ".join(f"{k}={v}" for k, v in cookies.items() if not k.startswith(REPLICA_KEY_PREFIX))
                if sent:
                    send_headers["Cookie"] = sent
            self._in_flight[base] = self._in_flight.get(base, 0) + 1
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
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError) as exc:
                # A payload error is an answer cut off mid-body: the server died while sending it.
                self._mark_down(base)
                if attempt >= retries:
                    raise ServerCallError(server, path, "connect", f"{type(exc).__name__}: {exc}") from None
            else:
                if reply.status not in retry_statuses or attempt >= retries:
                    return reply
            finally:
                self._in_flight[base] -= 1
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
