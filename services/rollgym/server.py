"""The server base: one FastAPI app per server, shared by the model, resources and agent roles.

Every server gets `GET /health`, a request-body size limit, structured JSON errors (4xx naming the
field at fault, 500 without a stack trace), signed cookie sessions, optional bearer-token auth
(required when bound beyond loopback) and a pooled client for calling the other servers by name.
The app is a `rollgym.server_app.ServerApp`: routes that take just the request skip FastAPI's
per-request layers, with the same guard, auth and error handlers.
"""

from __future__ import annotations

import importlib
import inspect
import ipaddress
import logging
import secrets
import sys
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, AsyncIterator, ClassVar

import orjson
from fastapi import Depends, FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .client import Registry, ServerClient
from .errors import ServerStartError, validation_errors
from .server_app import ServerApp
from .sessions import SESSION_COOKIE, SessionSigner
from .tracing import TracingConfig

if TYPE_CHECKING:  # the config layer (yaml, omegaconf) is not a server's to load
    from .config import ServerSpec

logger = logging.getLogger("rollgym.server")


class ServerConfig(BaseModel):
    """Options every server has; a server's own config class extends this."""

    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = 0
    auth_token: str | None = Field(default=None, description="bearer token required on every route but /health")
    max_body_bytes: int = Field(default=64 * 1024 * 1024, ge=1)
    client_timeout_s: float = Field(default=300.0, gt=0, description="default timeout of calls to other servers")
    client_max_retries: int = Field(default=3, ge=0)
    tracing: TracingConfig | None = Field(default=None, description="agents: each rollout as an OpenTelemetry "
                                          "trace to this OTLP endpoint (rollgym.tracing); off by default")


class ServerRef(BaseModel):
    """A reference to another server of the stack by name (`type` is the role, optional)."""

    type: str | None = None
    name: str


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class JSONBytesResponse(Response):
    """A JSON response serialised with orjson (several times faster than the stdlib encoder)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        if isinstance(content, bytes):
            return content
        if isinstance(content, BaseModel):
            return content.model_dump_json(exclude_unset=True).encode()
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)


def error_body(kind: str, message: str, **extra: Any) -> dict[str, Any]:
    return {"error": {"type": kind, "message": message, **extra}}


def invalid_request(errors: list[dict[str, str]], status: int = 422) -> JSONBytesResponse:
    first = errors[0] if errors else {"field": "body", "message": "invalid request"}
    message = f"field '{first['field']}': {first['message']}"
    return JSONBytesResponse(error_body("invalid_request", message, field=first["field"], errors=errors), status)


def parse_body(model: type[BaseModel], payload: Any, prefix: str = "") -> BaseModel:
    """Validate a decoded body; a ValidationError becomes a 422 naming the field (raised as BadRequest)."""
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        raise BadRequest(validation_errors(exc.errors(), prefix)) from None


class BadRequest(Exception):
    """Raised inside a route for input that fails validation; answered with 422 and the field."""

    def __init__(self, errors: list[dict[str, str]] | str, field: str = "body", status: int = 422) -> None:
        if isinstance(errors, str):
            errors = [{"field": field, "message": errors}]
        super().__init__(errors[0]["message"] if errors else "invalid request")
        self.errors = errors
        self.status = status


async def read_json(request: Request) -> Any:
    """The request body decoded as JSON, or BadRequest(400) naming the problem."""
    body = await request.body()
    if not body:
        raise BadRequest("request body is empty; a JSON object is required", status=400)
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"body is not valid JSON: {exc}", status=400) from None


class _BodyTooLarge(Exception):
    pass


def crash_response(exc: Exception) -> JSONBytesResponse:
    """The answer to an exception no route handled: 400 for JSON too deep to re-encode, else 500."""
    if isinstance(exc, orjson.JSONEncodeError) and "Recursion limit" in str(exc):
        # orjson reads 1024 levels but writes 254: such a body is accepted, then cannot be echoed on.
        return invalid_request([{"field": "body", "message": "JSON nested deeper than 254 levels is not supported"}], 400)
    message = f"{type(exc).__name__}: {exc}"[:1000]
    return JSONBytesResponse(error_body("internal_error", message), 500)


class RequestGuardMiddleware:
    """One ASGI layer for what every request needs (each layer costs every request a little):

    - bodies over `limit` bytes get 413, by Content-Length or while streaming;
    - a session created during the request gets its Set-Cookie, whatever response the route built;
    - an unhandled exception gets a JSON answer and the keep-alive connection stays usable.
      (Starlette's own catch-all answers and then re-raises, so the server logs the trace twice and
      drops the connection under the client's feet.) The trace goes to the server's log; the
      caller gets the cause, not the stack.
    """

    def __init__(self, app: Any, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > self.limit:
                await self._too_large()(scope, receive, send)
                return
        received = 0
        started = False

        async def limited_receive() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise _BodyTooLarge()
            return message

        async def guarded_send(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                cookie = scope.get("state", {}).get("session_cookie")
                if cookie:
                    message["headers"] = [*message.get("headers", ()), (b"set-cookie", cookie)]
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception as exc:
            if started:
                raise  # half an answer went out: nothing better to do than to drop the connection
            if isinstance(exc, _BodyTooLarge):
                response = self._too_large()
            else:
                response = crash_response(exc)
                if response.status_code == 500:
                    logger.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            await response(scope, receive, guarded_send)

    def _too_large(self) -> JSONBytesResponse:
        return JSONBytesResponse(error_body("payload_too_large", f"request body exceeds {self.limit} bytes"), 413)


class BearerAuthMiddleware:
    """Requires `Authorization: Bearer <token>` on every route but /health and the paths under
    `open_prefixes` (routes that check keys of their own)."""

    def __init__(self, app: Any, token: str, open_prefixes: tuple[str, ...] = ()) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode()
        self.open_prefixes = open_prefixes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and path != "/health" and not path.startswith(self.open_prefixes):
            supplied = dict(scope.get("headers", ())).get(b"authorization", b"")
            if not secrets.compare_digest(supplied, self.expected):
                body = orjson.dumps(error_body("unauthorized", "missing or wrong bearer token"))
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"www-authenticate", b"Bearer")]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


async def current_session(request: Request) -> str:
    """The caller's session id from its signed cookie; a new session (and cookie) when absent or forged.

    Async on purpose: FastAPI runs a plain `def` dependency in its thread pool, a thread hop per
    environment call that cost the resources server a quarter of its CPU under load."""
    signer: SessionSigner = request.app.state.session_signer
    session_id = signer.verify(request.cookies.get(SESSION_COOKIE))
    if session_id is None:
        session_id, cookie = signer.new()
        # RequestGuardMiddleware adds it to whatever response the route returns.
        request.state.session_cookie = f"{SESSION_COOKIE}={cookie}; HttpOnly; Path=/; SameSite=Strict".encode()
    return session_id


SessionId = Annotated[str, Depends(current_session)]


class BaseServer:
    """What every rollgym server has; subclasses add their role's routes in `add_routes`."""

    role: ClassVar[str] = ""
    config_class: ClassVar[type[ServerConfig]] = ServerConfig
    # Paths whose routes check credentials of their own (e.g. the proxy agent's per-rollout keys).
    own_auth_prefixes: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        config: ServerConfig | None = None,
        *,
        name: str | None = None,
        registry: Registry | None = None,
        session_secret: str | None = None,
    ) -> None:
        self.config = config if config is not None else self.config_class()
        self.name = name or type(self).__name__
        if not is_loopback(self.config.host) and not self.config.auth_token:
            raise ServerStartError(
                f"server {self.name!r} would listen on {self.config.host}, beyond loopback, without auth_token; "
                "set auth_token (for example auth_token=${oc.env:ROLLGYM_AUTH_TOKEN}) or bind 127.0.0.1"
            )
        self.client = ServerClient(
            registry, timeout_s=self.config.client_timeout_s, max_retries=self.config.client_max_retries
        )
        self.session_signer = SessionSigner(session_secret or secrets.token_hex(32))

    # Hooks for subclasses.
    @classmethod
    def live_check_skip_reason(cls, config: ServerConfig) -> str | None:
        """Why `rollgym test` cannot start this server here (e.g. it needs an API key), or None."""
        return None

    def add_routes(self, app: FastAPI) -> None:
        """Register the role's routes."""

    async def startup(self) -> None:
        """Called once before the first request (load a model, open a database...)."""

    async def shutdown(self) -> None:
        """Called once at graceful shutdown."""

    @asynccontextmanager
    async def _lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        try:
            await self.startup()
        except Exception as exc:
            # One line that names the server and the cause; the ASGI server's traceback of the same failure is
            # left out (StartupFailureFilter): a wrong path or setting is a user's mistake, not a crash.
            cause = str(exc) if isinstance(exc, ServerStartError) else f"{type(exc).__name__}: {exc}"
            print(f"rollgym: server '{self.name}' cannot start: {cause}", file=sys.stderr, flush=True)
            StartupFailureFilter.reported = True
            raise
        try:
            yield
        finally:
            await self.shutdown()
            await self.client.close()

    def build_app(self) -> FastAPI:
        """The ASGI app of this server."""
        app = ServerApp(
            title=f"rollgym {self.role or 'server'}: {self.name}",
            lifespan=self._lifespan,
            default_response_class=JSONBytesResponse,
            hot_guard=self._guard,
            default_response=JSONBytesResponse,
        )
        app.state.session_signer = self.session_signer
        app.state.server = self
        self._install_error_handlers(app)
        app.add_middleware(RequestGuardMiddleware, limit=self.config.max_body_bytes)
        if self.config.auth_token:
            app.add_middleware(BearerAuthMiddleware, token=self.config.auth_token, open_prefixes=self.own_auth_prefixes)

        @app.get("/health")
        async def health() -> dict[str, Any]:
            return {"status": "ok", "name": self.name, "role": self.role, **self.health_details()}

        self.add_routes(app)
        return app

    def _guard(self, app: Any) -> Any:
        """`app` behind what every request needs: the request guard, and the bearer check when auth is on.
        (The FastAPI stack gets the same two as middleware; the hot routes, rollgym.server_app, get them here.)"""
        guarded: Any = RequestGuardMiddleware(app, limit=self.config.max_body_bytes)
        if self.config.auth_token:
            guarded = BearerAuthMiddleware(guarded, token=self.config.auth_token, open_prefixes=self.own_auth_prefixes)
        return guarded

    def health_details(self) -> dict[str, Any]:
        """Extra fields of `GET /health` (an agent says which model server it samples from)."""
        return {}

    def _install_error_handlers(self, app: FastAPI) -> None:
        @app.exception_handler(RequestValidationError)
        async def on_validation_error(request: Request, exc: RequestValidationError) -> Response:
            errors = validation_errors(list(exc.errors()))
            status = 400 if errors and errors[0]["field"] == "body" and "JSON" in errors[0]["message"] else 422
            return invalid_request(errors, status)

        @app.exception_handler(BadRequest)
        async def on_bad_request(request: Request, exc: BadRequest) -> Response:
            return invalid_request(exc.errors, exc.status)

        @app.exception_handler(StarletteHTTPException)
        async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
            kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
            message = str(exc.detail)
            if exc.status_code == 404 and exc.detail == "Not Found":
                message = f"no route {request.method} {request.url.path}"
            return JSONBytesResponse(error_body(kind, message), exc.status_code, headers=exc.headers)


class StartupFailureFilter(logging.Filter):
    """On uvicorn's error logger: drops the traceback and the closing line of a startup failure the server
    already reported in one line (`_lifespan`); everything else passes."""

    reported = False

    def filter(self, record: logging.LogRecord) -> bool:
        return not (self.reported and str(record.msg).startswith(("Traceback (most recent call last)",
                                                                  "Application startup failed")))


def _reach_role_folder(spec: ServerSpec) -> None:
    """Let `role.folder` import from the folder the stack found (ROOT/role/folder), also when `role` was
    imported from elsewhere first: an environment kept outside the checkout, whose `resources_servers/` has no
    `__init__.py` (or has one, but the checkout's package was imported before), would otherwise be looked for in
    the checkout's `resources_servers/` only (`No module named 'resources_servers.capital'`)."""
    folder = str(Path(spec.root) / spec.role)
    try:
        package = importlib.import_module(spec.role)
    except ImportError:
        return
    paths = getattr(package, "__path__", None)
    if paths is not None and folder not in list(paths):
        paths.append(folder)


def load_server_class(spec: ServerSpec) -> type[BaseServer]:
    """Import a server folder's entrypoint and return the one BaseServer subclass it defines."""
    if spec.root not in sys.path:
        sys.path.insert(0, spec.root)
    if not spec.package:
        _reach_role_folder(spec)
    module = importlib.import_module(spec.module)
    classes = [
        obj for obj in vars(module).values()
        if inspect.isclass(obj) and issubclass(obj, BaseServer) and obj.__module__ == module.__name__
        and not inspect.isabstract(obj)
    ]
    if len(classes) != 1:
        names = ", ".join(c.__name__ for c in classes) or "none"
        raise ServerStartError(f"{spec.role}/{spec.folder}/{spec.entrypoint} must define exactly one server class (found: {names})")
    return classes[0]
