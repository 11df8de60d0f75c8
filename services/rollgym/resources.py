"""The resources-server role: a stateful environment with tools and a reward.

An environment subclasses `ResourcesServer`, declares its task row (`task_model`), marks its tool
methods with `@tool`, and implements `verify`. The base serves `POST /seed_session`, one
`POST /{tool}` per tool, `POST /verify` and `GET /tools`, keeping per-session state in a store keyed
by the signed session cookie the agent carries through one rollout.

Session state lives in a store chosen by config (`session_store`): "memory" (the default, one
process, any Python object) or "sqlite" (JSON per session in a file shared by the server's worker
processes; see rollgym.sessions). Every route loads the state before the environment's method runs
and saves it after (`async with self.sessions.session(id) as state`); calls of one session run one
at a time. Environments still just receive and mutate `state: dict`.
"""

from __future__ import annotations

import inspect
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, ClassVar, Literal, get_type_hints

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from .schema import RunRequest, VerifyRequest
from .server import BaseServer, JSONBytesResponse, ServerConfig, ServerStartError, SessionId, parse_body, read_json
from .sessions import AnySessionStore, default_session_db, make_session_store


# The routes every resources server has; no tool may take their names (an agent checks the same).
RESERVED_ROUTES = frozenset({"seed_session", "verify", "tools", "health"})

class ResourcesServerConfig(ServerConfig):
    session_ttl_s: float = Field(default=3600.0, gt=0, description="idle sessions are dropped after this")
    session_store: Literal["memory", "sqlite"] = Field(
        default="memory",
        description="memory: one process, any Python object in the state; "
        "sqlite: JSON state in a file shared by the server's worker processes",
    )
    session_db: str | None = Field(
        default=None,
        description="the sqlite session file; default: one per stack and server in the temp directory",
    )


@dataclass
class Verdict:
    """A reward with optional per-component scores and extra fields recorded in the rollout."""

    reward: float
    components: dict[str, float] | None = None
    details: dict[str, Any] = field(default_factory=dict)


# A tool's reward for the call it answered (turn-level credit) travels in this header beside its output,
# so the output the model reads is the same with or without one; the agent records it on the
# function_call_output item as `reward`.
TOOL_REWARD_HEADER = "x-rollgym-reward"


@dataclass
class Rewarded:
    """What a tool returns to give the call a reward: its output (text or JSON, as a plain return) and
    the reward of this step (`curate.advantage: {type: return_to_go}` credits it to the model turn
    that made the call)."""

    output: Any
    reward: float


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    args_model: type[BaseModel]
    method_name: str

    def schema(self) -> dict[str, Any]:
        """The tool as a Responses API function tool."""
        parameters = _strip_titles(self.args_model.model_json_schema())
        parameters.setdefault("additionalProperties", False)
        return {"type": "function", "name": self.name, "description": self.description,
                "parameters": parameters, "strict": False}


def tool(func: Callable | None = None, *, name: str | None = None, description: str | None = None) -> Any:
    """Mark `async def method(self, args: ArgsModel, state: dict)` as a tool served at `POST /{name}`.

    The args model validates the call's JSON arguments (a 422 names the bad field); the method's
    docstring is the tool's description unless one is given. What it returns is the tool output:
    a string is sent as text, anything else as JSON; `Rewarded(output, reward)` adds a step reward.
    """

    def mark(method: Callable) -> Callable:
        method.__rollgym_tool__ = {"name": name or method.__name__, "description": description}
        return method

    return mark(func) if func is not None else mark


class EmptyArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ResourcesServer(BaseServer):
    """Base of every environment."""

    role: ClassVar[str] = "resources_servers"
    config_class: ClassVar[type[ServerConfig]] = ResourcesServerConfig
    # The task row this environment expects: RunRequest plus its own fields.
    task_model: ClassVar[type[RunRequest]] = RunRequest

    def __init__(self, config: ServerConfig | None = None, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.sessions: AnySessionStore = self._make_session_store()
        self.tools = self._discover_tools()
        task_model = self.task_model
        # The verify body is the environment's task row plus the final response.
        self.verify_model: type[VerifyRequest] = VerifyRequest if task_model is RunRequest else type(
            f"{task_model.__name__}Verify", (task_model, VerifyRequest), {"__module__": type(self).__module__}
        )

    # --- what an environment implements -------------------------------------------------------
    async def seed(self, task: RunRequest, state: dict[str, Any]) -> None:
        """Set up a session's state from its task row (called by `POST /seed_session`)."""

    async def verify(self, request: VerifyRequest, state: dict[str, Any]) -> float | Verdict:
        """The reward of a finished rollout: `request` is the task row plus the final `response`."""
        raise NotImplementedError

    # --- session state -------------------------------------------------------------------------
    def _make_session_store(self) -> AnySessionStore:
        kind = getattr(self.config, "session_store", "memory")
        ttl_s = getattr(self.config, "session_ttl_s", 3600.0)
        path = getattr(self.config, "session_db", None)
        if kind == "sqlite" and not path:
            # The same file for every worker of this server (same stack secret and name), none other's.
            path = str(default_session_db(self.name, self.session_signer.fingerprint("sessions", self.name)))
        try:
            return make_session_store(kind, ttl_s, path)
        except Exception as exc:  # ValueError, OSError, sqlite3.Error: a bad path or an unusable file
            raise ServerStartError(f"server {self.name!r}: cannot open its session store: {type(exc).__name__}: {exc}") from None

    @asynccontextmanager
    async def session_state(self, session_id: str) -> AsyncIterator[dict[str, Any]]:
        """A session's state for one call: loaded (and the session locked) before, saved after."""
        async with self.sessions.session(session_id) as state:
            yield state

    @asynccontextmanager
    async def _lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        try:
            async with super()._lifespan(app):
                yield
        finally:
            self.sessions.close()

    # --- routes --------------------------------------------------------------------------------
    def add_routes(self, app: FastAPI) -> None:
        @app.post("/seed_session")
        async def seed_session(request: Request, session_id: SessionId) -> JSONBytesResponse:
            task = parse_body(self.task_model, await read_json(request))
            async with self.session_state(session_id) as state:
                state.clear()
                await self.seed(task, state)
            return JSONBytesResponse({})

        @app.post("/verify")
        async def verify(request: Request, session_id: SessionId) -> JSONBytesResponse:
            payload = await read_json(request)
            body = parse_body(self.verify_model, payload)
            async with self.session_state(session_id) as state:
                outcome = await self.verify(body, state)
            verdict = outcome if isinstance(outcome, Verdict) else Verdict(float(outcome))
            # Echo the request as received (no re-serialisation drift), then the verdict.
            answer = {**payload, **verdict.details, "reward": float(verdict.reward)}
            if verdict.components is not None:
                answer["reward_components"] = {k: float(v) for k, v in verdict.components.items()}
            return JSONBytesResponse(answer)

        @app.get("/tools")
        async def list_tools() -> JSONBytesResponse:
            return JSONBytesResponse([spec.schema() for spec in self.tools.values()])

        for spec in self.tools.values():
            app.post(f"/{spec.name}", name=spec.name)(self._tool_route(spec))

    def _tool_route(self, spec: ToolSpec) -> Callable[..., Awaitable[Any]]:
        method = getattr(self, spec.method_name)

        async def call_tool(request: Request, session_id: SessionId) -> JSONBytesResponse:
            args = parse_body(spec.args_model, await read_json(request))
            async with self.session_state(session_id) as state:
                result = await method(args, state)
            headers = None
            if isinstance(result, Rewarded):
                result, headers = result.output, {TOOL_REWARD_HEADER: repr(float(result.reward))}
            if isinstance(result, str):
                return JSONBytesResponse(result.encode(), media_type="text/plain; charset=utf-8", headers=headers)
            return JSONBytesResponse(result, headers=headers)

        return call_tool

    def _discover_tools(self) -> dict[str, ToolSpec]:
        tools: dict[str, ToolSpec] = {}
        for attr in dir(type(self)):
            method = getattr(type(self), attr, None)
            marker = getattr(method, "__rollgym_tool__", None)
            if marker is None:
                continue
            hints = get_type_hints(method)
            params = [p for p in inspect.signature(method).parameters if p != "self"]
            args_model = hints.get(params[0]) if params else None
            if not (isinstance(args_model, type) and issubclass(args_model, BaseModel)):
                args_model = EmptyArgs
            if marker["name"] in RESERVED_ROUTES:
                raise TypeError(f"tool name {marker['name']!r} collides with a built-in route")
            description = marker["description"] or inspect.getdoc(method) or ""
            tools[marker["name"]] = ToolSpec(marker["name"], description, args_model, attr)
        return tools


def _strip_titles(schema: Any) -> Any:
    """pydantic adds `title` everywhere; models read tool schemas better without the noise."""
    if isinstance(schema, list):
        return [_strip_titles(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    stripped = {}
    for key, value in schema.items():
        if key == "properties" and isinstance(value, dict):
            # Property names are data, even one called "title".
            stripped[key] = {name: _strip_titles(sub) for name, sub in value.items()}
        elif not (key == "title" and isinstance(value, str)):
            stripped[key] = _strip_titles(value)
    return stripped
