"""proxy_agent: train an existing agent unchanged. `/run` seeds the environment, gives the agent
its own OpenAI-compatible base URL for this rollout, runs it, and records every model call it makes
with the token ids the model server sampled; then verifies and answers the usual /run result (a task
with `skip_verification` is not scored at all: `reward: null`, `verification: "skipped"`).

The per-rollout endpoint `/rollouts/{id}/v1` serves `POST /chat/completions` and `POST /responses`
(streaming or not), `GET /models`, and the environment's tools under `/rollouts/{id}/tools`. It
needs the rollout's key (`Authorization: Bearer <key>`, the agent's OPENAI_API_KEY), and refuses
calls once the rollout has ended. Token fields are hidden from the agent unless a request sets
`return_token_ids: true`.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request, Response
from pydantic import Field, model_validator
from starlette.routing import Route

from rollgym import AgentServer, BadRequest, ResponsesCreateParams, RunRequest, ServerCallError, ServerConfig, ServerRef
from rollgym.agent import unverified
from rollgym.client import Reply
from rollgym.resources import RESERVED_ROUTES
from rollgym.server import JSONBytesResponse, ServerStartError, parse_body, read_json
from rollgym.streaming import stream_chat_completion, stream_response, wants_usage

from .capture import Call, Capture, strip_tokens
from .chat import chat_to_responses, response_to_chat
from .runners import AgentFailure, CallableRunner, CommandRunner, Endpoint, HttpRunner, Outcome
from .verifiers_runner import VerifiersRunner

ENDED_REMEMBERED = 100_000  # ended rollout ids kept to answer "ended" rather than "unknown"


class ProxyAgentConfig(ServerConfig):
    model_server: ServerRef
    resources_server: ServerRef | None = Field(
        default=None, description="the environment; none for an agent that brings its own (verifiers) and scores itself")
    agent: Annotated[CommandRunner | HttpRunner | CallableRunner | VerifiersRunner, Field(discriminator="kind")]
    timeout_s: float = Field(default=300.0, gt=0, description="the agent's whole run")
    max_model_calls: int | None = Field(default=64, ge=1, description="per rollout; later calls are refused")
    model: str | None = Field(default=None, description="the `model` sent to the model server; null: the agent's is dropped")
    models: list[str] = Field(default_factory=list, description="the model names the program's agents ask for, each "
                              "passed on as it is (with named policies, each a policy's: docs/train-policies.md); a "
                              "call under another name is refused (404 naming it). Not with model")
    reward: Literal["verify", "agent"] = Field(
        default="verify", description="verify: /verify on the captured conversation; agent: the workflow's own score")
    public_url: str | None = Field(default=None, description="this server's URL as the agent reaches it; default: the URL /run was called on")
    model_timeout_s: float = Field(default=600.0, gt=0)
    tool_timeout_s: float = Field(default=120.0, gt=0)
    return_sequences: bool = True
    serve_mcp: bool = Field(default=False, description="also serve the environment's tools over MCP at "
                                                       "/rollouts/{id}/mcp (needs the mcp package)")

    @model_validator(mode="after")
    def _scored_somewhere(self) -> "ProxyAgentConfig":
        if self.model is not None and self.models:
            raise ValueError("model replaces every call's model name, models passes the agent's on: give one")
        if self.resources_server is None and self.reward == "verify":
            raise ValueError("reward: verify needs a resources_server; without one use reward: agent")
        if self.agent.kind == "verifiers" and self.reward != "agent":
            raise ValueError("a verifiers Env scores itself: set reward: agent")
        return self


@dataclass
class Rollout:
    """One running rollout: its key, the environment session and every model call it made."""

    id: str
    key: str
    capture: Capture = field(default_factory=Capture)
    cookies: dict[str, str] = field(default_factory=dict)
    responses: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # for previous_response_id
    failure: AgentFailure | None = None  # the model server failed under the agent
    calls_started: int = 0
    call_limit_hit: bool = False
    env_latency_s: float = 0.0
    last_response: dict[str, Any] = field(default_factory=dict)


class ProxyAgent(AgentServer):
    config_class = ProxyAgentConfig
    config: ProxyAgentConfig
    # The agent holds its rollout's key, not the stack's token.
    own_auth_prefixes = ("/rollouts/",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rollouts: dict[str, Rollout] = {}
        self.ended: OrderedDict[str, None] = OrderedDict()
        self.mcp_gateway = None
        if self.config.serve_mcp:
            try:
                from .mcp_tools import McpGateway
            except ImportError as exc:
                raise ServerStartError(f"serve_mcp needs the mcp package (pip install 'rollgym[agents]'): {exc}") from None
            self.mcp_gateway = McpGateway(self.find_rollout, self.env_tools, self.env_tool_call)
        if isinstance(self.config.agent, VerifiersRunner):
            try:
                self.config.agent.load()
            except ValueError as exc:
                raise ServerStartError(str(exc)) from None

    async def startup(self) -> None:
        if self.mcp_gateway is not None:
            await self.mcp_gateway.start()
        if isinstance(self.config.agent, VerifiersRunner):
            await self.config.agent.start()

    async def shutdown(self) -> None:
        if self.mcp_gateway is not None:
            await self.mcp_gateway.stop()
        if isinstance(self.config.agent, (VerifiersRunner, HttpRunner)):
            await self.config.agent.close()

    # /run --------------------------------------------------------------------------------------
    async def run_rollout(self, task: RunRequest, payload: dict[str, Any], base_url: str) -> dict[str, Any]:
        started = time.perf_counter()
        rollout = Rollout(id=secrets.token_urlsafe(12), key="rk-" + secrets.token_urlsafe(24))
        root = f"{(self.config.public_url or base_url).rstrip('/')}/rollouts/{rollout.id}"
        endpoint = Endpoint(base_url=f"{root}/v1", api_key=rollout.key, tools_url=f"{root}/tools",
                            model=self.config.model or next(iter(self.config.models), "policy"), rollout_id=rollout.id,
                            mcp_url=f"{root}/mcp" if self.config.serve_mcp else None)
        outcome = Outcome()
        failure: AgentFailure | None = None
        self.rollouts[rollout.id] = rollout
        try:
            try:
                await self._env_call(rollout, "/seed_session", payload)
                outcome = await self.config.agent.run(payload, endpoint, self.config.timeout_s)
            except AgentFailure as exc:  # the agent's, or the environment's at seeding
                failure = exc
        finally:
            self._end(rollout)
        # A model server that failed under the agent explains the agent's failure (and voids its answer).
        failure = rollout.failure or (None if rollout.call_limit_hit else failure)
        if failure is None and not rollout.capture.calls:
            # Nothing to train on: usually an agent that ignores OPENAI_BASE_URL and calls elsewhere.
            failure = AgentFailure("agent_error", "the agent made no model call through its rollout's endpoint "
                                                  "(does it read OPENAI_BASE_URL / OPENAI_API_KEY?)")
        response = self._final_response(rollout)
        base = {**payload, "response": response, "rollout_id": task.rollout_id, "group_id": task.group_id,
                "agent_answer": outcome.answer, "agent_score": outcome.score}
        metrics = self._metrics(rollout, started)
        if failure is not None:
            return {**base, "reward": None, "status": failure.status, "error": failure.error, "metrics": metrics}
        if task.skip_verification:  # neither /verify nor the agent's own score: no reward at all
            result = unverified(base, response)
        elif self.config.reward == "agent":
            if outcome.score is None:
                return {**base, "reward": None, "status": "agent_error", "metrics": metrics,
                        "error": "reward: agent is configured, but the agent returned no score"}
            result = {**base, "reward": outcome.score}
            if outcome.components is not None:
                result["reward_components"] = outcome.components
        else:
            try:
                verified = await self._env_call(rollout, "/verify", {**payload, "response": response})
            except AgentFailure as exc:
                return {**base, "reward": None, "status": exc.status, "error": exc.error, "metrics": metrics}
            result = {**verified.json(), "rollout_id": task.rollout_id, "group_id": task.group_id,
                      "agent_answer": outcome.answer, "agent_score": outcome.score}
        result.update(status=self._status(rollout), error=None, metrics=self._metrics(rollout, started))
        if self.config.return_sequences:
            sequences, prefix_ok = rollout.capture.sequences()
            if prefix_ok is not None:
                result.update(sequences=sequences, prefix_ok=prefix_ok)
        return result

    def _end(self, rollout: Rollout) -> None:
        self.rollouts.pop(rollout.id, None)
        self.ended[rollout.id] = None
        while len(self.ended) > ENDED_REMEMBERED:
            self.ended.popitem(last=False)

    def _status(self, rollout: Rollout) -> str:
        calls = rollout.capture.calls
        if rollout.call_limit_hit:
            return "max_steps"
        if calls and calls[-1].status == "incomplete":
            return "truncated"
        return "ok"

    def _final_response(self, rollout: Rollout) -> dict[str, Any] | None:
        calls = rollout.capture.calls
        if not calls:
            return None
        usage = dict(rollout.last_response.get("usage") or {})  # keeps the detail fields /verify requires
        usage.update(input_tokens=sum(int(c.usage.get("input_tokens") or 0) for c in calls),
                     output_tokens=sum(int(c.usage.get("output_tokens") or 0) for c in calls))
        usage["total_tokens"] = usage["input_tokens"] + usage["output_tokens"]
        return {**rollout.last_response, "output": rollout.capture.transcript(), "usage": usage}

    def _metrics(self, rollout: Rollout, started: float) -> dict[str, Any]:
        calls = rollout.capture.calls
        return {
            "turns": len(calls),
            "tool_calls": sum(1 for c in calls for item in c.output if item.get("type") == "function_call"),
            "input_tokens": sum(int(c.usage.get("input_tokens") or 0) for c in calls),
            "output_tokens": sum(int(c.usage.get("output_tokens") or 0) for c in calls),
            "latency_s": round(time.perf_counter() - started, 6),
            "model_latency_s": round(sum(c.latency_s for c in calls), 6),
            "env_latency_s": round(rollout.env_latency_s, 6),
        }

    async def _env_call(self, rollout: Rollout, path: str, body: Any) -> Reply | None:
        if self.config.resources_server is None:
            return None  # the agent brings its own environment
        started = time.perf_counter()
        try:
            reply = await self.client.post(self.config.resources_server.name, path, json=body,
                                           cookies=rollout.cookies, timeout_s=self.config.tool_timeout_s)
        except ServerCallError as exc:
            raise AgentFailure("timeout" if exc.kind == "timeout" else "env_error", str(exc)) from None
        finally:
            rollout.env_latency_s += time.perf_counter() - started
        if 400 <= reply.status < 500:
            # The environment refused the task row itself: the caller's input is at fault.
            raise BadRequest(f"the environment's {path} rejected the task: {reply.error_message()}",
                             field=_error_field(reply), status=reply.status)
        if reply.status >= 500:
            raise AgentFailure("env_error", f"resources server {path} answered HTTP {reply.status}: {reply.error_message()}")
        return reply

    # The per-rollout OpenAI-compatible endpoint ---------------------------------------------------
    def find_rollout(self, rollout_id: str, authorization: str) -> Rollout:
        """The running rollout at this id whose key is in `authorization` (BadRequest 404/409/401 otherwise)."""
        rollout = self.rollouts.get(rollout_id)
        if rollout is None:
            if rollout_id in self.ended:
                raise BadRequest(f"rollout {rollout_id} has ended; its URL takes no more calls", field="rollout", status=409)
            raise BadRequest(f"no rollout {rollout_id} is running here", field="rollout", status=404)
        supplied = authorization.removeprefix("Bearer ").strip()
        if not secrets.compare_digest(supplied.encode(), rollout.key.encode()):
            raise BadRequest("the API key is not this rollout's key (OPENAI_API_KEY as given to the agent)",
                             field="authorization", status=401)
        return rollout

    def _rollout(self, request: Request, rollout_id: str) -> Rollout:
        return self.find_rollout(rollout_id, request.headers.get("authorization", ""))

    async def _generate(self, rollout: Rollout, params: dict[str, Any]) -> dict[str, Any]:
        """Forward one model call with the rollout's token records restored; record what came back."""
        limit = self.config.max_model_calls
        if limit is not None and rollout.calls_started >= limit:
            rollout.call_limit_hit = True
            raise BadRequest(f"this rollout reached max_model_calls ({limit})", field="max_model_calls", status=400)
        rollout.calls_started += 1
        params.pop("stream", None)
        params.pop("stream_options", None)
        if self.config.model is not None:
            params["model"] = self.config.model
        elif self.config.models:  # the agent's own name picks its policy: it must be one the program declares
            if params.get("model") not in self.config.models:
                rollout.calls_started -= 1
                raise BadRequest(f"no model {params.get('model')!r} here: this program's agents ask for "
                                 f"{', '.join(self.config.models)}", field="model", status=404)
        else:
            params.pop("model", None)
        params["input"] = rollout.capture.restore_tokens(params["input"])
        started = time.perf_counter()
        try:
            reply = await self.client.post(self.config.model_server.name, "/v1/responses", json=params,
                                           timeout_s=self.config.model_timeout_s)
        except ServerCallError as exc:
            rollout.failure = AgentFailure("timeout" if exc.kind == "timeout" else "model_error", str(exc))
            raise BadRequest(f"the model server failed: {exc}", field="model", status=504 if exc.kind == "timeout" else 502) from None
        latency = time.perf_counter() - started
        if 400 <= reply.status < 500 and reply.status != 429:
            # The agent's request was refused: it is the agent's to handle, as with any API.
            raise _Relayed(reply)
        if not reply.ok:
            rollout.failure = AgentFailure("model_error", f"model server answered HTTP {reply.status}: {reply.error_message()}")
            raise _Relayed(reply)
        response = reply.json()
        if rollout.id not in self.rollouts:
            raise BadRequest(f"rollout {rollout.id} ended while this call ran", field="rollout", status=409)
        output = response.get("output") or []
        if response.get("status") == "incomplete" and not output and rollout.failure is None:
            # The prompt did not fit: nothing was generated, so the rollout has nothing to reward.
            rollout.failure = AgentFailure("context_overflow", f"the prompt of model call {rollout.calls_started} "
                                           "does not fit the model's context: nothing was generated")
        rollout.capture.calls.append(Call(input=params["input"], output=output, status=response.get("status") or "completed",
                                          usage=response.get("usage") or {}, latency_s=latency))
        rollout.last_response = response
        rollout.responses[str(response.get("id"))] = [*params["input"], *output]
        return response

    def add_routes(self, app: FastAPI) -> None:
        @app.post("/run")
        async def run(request: Request) -> JSONBytesResponse:
            payload = await read_json(request)
            task = parse_body(RunRequest, payload)
            return JSONBytesResponse(await self.run_rollout(task, payload, str(request.base_url)))

        @app.exception_handler(_Relayed)
        async def relayed(request: Request, exc: _Relayed) -> Response:
            return Response(exc.reply.body, exc.reply.status, media_type="application/json")

        @app.post("/rollouts/{rollout_id}/v1/responses")
        async def responses(rollout_id: str, request: Request) -> Response:
            rollout = self._rollout(request, rollout_id)
            payload = await read_json(request)
            parse_body(ResponsesCreateParams, payload)
            stream, tokens = payload.get("stream") is True, payload.pop("return_token_ids", False) is True
            if isinstance(payload.get("input"), str):
                payload["input"] = [{"type": "message", "role": "user", "content": payload["input"]}]
            previous = payload.pop("previous_response_id", None)
            if previous is not None:
                if previous not in rollout.responses:
                    raise BadRequest(f"no response {previous} in this rollout", field="previous_response_id", status=404)
                payload["input"] = [*rollout.responses[previous], *payload["input"]]
            response = await self._generate(rollout, payload)
            if not tokens:
                response = {**response, "output": [strip_tokens(item) for item in response.get("output") or []]}
            return stream_response(response) if stream else JSONBytesResponse(response)

        @app.post("/rollouts/{rollout_id}/v1/chat/completions")
        async def chat_completions(rollout_id: str, request: Request) -> Response:
            rollout = self._rollout(request, rollout_id)
            payload = await read_json(request)
            if not isinstance(payload, dict) or not isinstance(payload.get("messages"), list):
                raise BadRequest("required: a list of chat messages", field="messages")
            tokens = payload.get("return_token_ids") is True
            response = await self._generate(rollout, chat_to_responses(payload))
            completion = response_to_chat(response, token_ids=tokens, logprobs=payload.get("logprobs") is True)
            if payload.get("stream") is True:
                return stream_chat_completion(completion, include_usage=wants_usage(payload))
            return JSONBytesResponse(completion)

        @app.get("/rollouts/{rollout_id}/v1/models")
        async def models(rollout_id: str, request: Request) -> JSONBytesResponse:
            self._rollout(request, rollout_id)
            names = [self.config.model] if self.config.model else self.config.models or ["policy"]
            return JSONBytesResponse({"object": "list", "data": [{"id": name, "object": "model", "created": 0,
                                                                  "owned_by": "rollgym"} for name in names]})

        if self.mcp_gateway is not None:
            app.router.routes.append(Route("/rollouts/{rollout_id}/mcp", self.mcp_gateway))

        @app.get("/rollouts/{rollout_id}/tools")
        async def tools(rollout_id: str, request: Request) -> Response:
            rollout = self._rollout(request, rollout_id)
            if self.config.resources_server is None:
                raise BadRequest("this agent has no resources server, so no tools here", field="tools", status=404)
            reply = await self.env_tools(rollout)
            return Response(reply.body, reply.status, media_type="application/json")

        @app.post("/rollouts/{rollout_id}/tools/{name}")
        async def tool(rollout_id: str, name: str, request: Request) -> Response:
            rollout = self._rollout(request, rollout_id)
            reply = await self.env_tool_call(rollout, name, await read_json(request))
            return Response(reply.body, reply.status, media_type=reply.headers.get("content-type", "application/json"))

    async def env_tools(self, rollout: Rollout) -> Reply:
        """The environment's tool list for the agent, as the resources server answers it."""
        return await self.client.get(self.config.resources_server.name, "/tools", cookies=rollout.cookies,
                                     timeout_s=self.config.tool_timeout_s)

    async def env_tool_call(self, rollout: Rollout, name: str, arguments: Any) -> Reply:
        """A tool call for the agent: its answer relayed as it is (a 4xx is the agent's to read)."""
        if name in RESERVED_ROUTES or self.config.resources_server is None:
            raise BadRequest(f"'{name}' is not a tool", field="name", status=404)
        path = f"/{name}"
        started = time.perf_counter()
        try:
            reply = await self.client.post(self.config.resources_server.name, path, json=arguments,
                                           cookies=rollout.cookies, timeout_s=self.config.tool_timeout_s)
        except ServerCallError as exc:
            rollout.failure = AgentFailure("timeout" if exc.kind == "timeout" else "env_error", str(exc))
            raise BadRequest(f"the environment failed: {exc}", field="tool", status=502) from None
        finally:
            rollout.env_latency_s += time.perf_counter() - started
        if reply.status >= 500:
            rollout.failure = AgentFailure("env_error", f"resources server {path} answered HTTP {reply.status}: {reply.error_message()}")
        return reply


class _Relayed(Exception):
    """A model-server answer passed on to the agent as it is."""

    def __init__(self, reply: Reply) -> None:
        super().__init__(reply.status)
        self.reply = reply


def _error_field(reply: Reply) -> str:
    try:
        return str(reply.json()["error"]["field"])
    except (ValueError, KeyError, TypeError):
        return "body"

