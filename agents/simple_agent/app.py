"""simple_agent: seed the environment, loop model → tools → model until a final answer, verify
(unless the task asks `skip_verification`: then the answer has `reward: null`, `verification: "skipped"`).

Tool calls run in order on the resources server with the rollout's session cookie. A model mistake
(unknown tool, arguments that are not JSON or fail validation) becomes a tool output that says so,
for the model to read; an infrastructure failure (server down, 5xx, timeout) ends the rollout with
a failure status and no reward.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

import orjson
from pydantic import Field

from rollgym import (
    AgentServer,
    BadRequest,
    Reply,
    ResponsesCreateParams,
    RunRequest,
    ServerCallError,
    ServerConfig,
    ServerRef,
)
from rollgym.agent import unverified
from rollgym.resources import RESERVED_ROUTES, TOOL_REWARD_HEADER
from rollgym.sequences import merge_sequences

TOOL_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,127}$")


class SimpleAgentConfig(ServerConfig):
    model_server: ServerRef
    resources_server: ServerRef
    max_steps: int | None = Field(default=8, ge=1, description="model calls per rollout; null = unbounded")
    max_total_output_tokens: int | None = Field(default=None, ge=1, description="token budget per rollout")
    model_timeout_s: float = Field(default=600.0, gt=0)
    tool_timeout_s: float = Field(default=120.0, gt=0)
    # After a forced tool call, later turns use tool_choice "auto" so the model can answer
    # (the OpenAI Agents SDK does the same; otherwise a forced choice loops until max_steps).
    reset_tool_choice: bool = True
    return_sequences: bool = True


class RolloutAborted(Exception):
    """An infrastructure failure that ends the rollout without a reward."""

    def __init__(self, status: str, error: str) -> None:
        super().__init__(error)
        self.status = status
        self.error = error


@dataclass
class Loop:
    """The state of one agent loop."""

    outputs: list[dict[str, Any]] = field(default_factory=list)
    last_response: dict[str, Any] | None = None
    status: str = "ok"
    turns: int = 0
    tool_calls: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    model_latency_s: float = 0.0
    env_latency_s: float = 0.0

    def final_response(self) -> dict[str, Any] | None:
        if self.last_response is None:
            return None
        usage = dict(self.last_response.get("usage") or {})
        usage.update(input_tokens=self.input_tokens, output_tokens=self.output_tokens,
                     total_tokens=self.input_tokens + self.output_tokens)
        return {**self.last_response, "output": self.outputs, "usage": usage}

    def metrics(self, started: float) -> dict[str, Any]:
        return {
            "turns": self.turns, "tool_calls": self.tool_calls,
            "input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
            "latency_s": round(time.perf_counter() - started, 6),
            "model_latency_s": round(self.model_latency_s, 6), "env_latency_s": round(self.env_latency_s, 6),
        }


class SimpleAgent(AgentServer):
    config_class = SimpleAgentConfig
    config: SimpleAgentConfig

    async def run(self, task: RunRequest, payload: dict[str, Any]) -> dict[str, Any]:
        started = time.perf_counter()
        cookies: dict[str, str] = {}
        loop = Loop()
        try:
            await self._env_call("/seed_session", payload, cookies, loop)
            await self._loop(payload["responses_create_params"], cookies, loop)
            if task.skip_verification:
                result = unverified(payload, loop.final_response())
            else:
                verified = await self._env_call(
                    "/verify", {**payload, "response": loop.final_response()}, cookies, loop
                )
                result = verified.json()
        except RolloutAborted as failure:
            return {
                **payload, "response": loop.final_response(), "reward": None,
                "status": failure.status, "error": failure.error, "metrics": loop.metrics(started),
                "rollout_id": task.rollout_id, "group_id": task.group_id,
            }
        result.update(status=loop.status, error=None, rollout_id=task.rollout_id, group_id=task.group_id,
                      metrics=loop.metrics(started))
        if self.config.return_sequences:
            sequences, prefix_ok = merge_sequences(loop.outputs)
            if prefix_ok is not None:
                result.update(sequences=sequences, prefix_ok=prefix_ok)
        return result

    async def respond(self, params: ResponsesCreateParams, payload: dict[str, Any]) -> dict[str, Any]:
        loop = Loop()
        try:
            await self._loop(payload, {}, loop)
        except RolloutAborted as failure:
            from fastapi import HTTPException

            code = {"timeout": 504, "context_overflow": 400}.get(failure.status, 502)
            raise HTTPException(code, detail=failure.error) from None
        return loop.final_response() or {}

    async def _loop(self, params: dict[str, Any], cookies: dict[str, str], loop: Loop) -> None:
        config = self.config
        given = params["input"]
        prompt = [{"role": "user", "content": given}] if isinstance(given, str) else list(given)
        tool_choice = params.get("tool_choice")
        while True:
            if config.max_steps is not None and loop.turns >= config.max_steps:
                loop.status = "max_steps"
                return
            body = {**params, "input": prompt + loop.outputs}
            if tool_choice is not None:
                body["tool_choice"] = tool_choice
            response = await self._model_call(body, loop)
            new_items = response.get("output") or []
            loop.outputs.extend(new_items)
            calls = [item for item in new_items if item.get("type") == "function_call"]
            if response.get("status") == "incomplete":
                if not new_items:  # the prompt did not fit: nothing was generated, so there is nothing to reward
                    raise RolloutAborted("context_overflow", f"the prompt of turn {loop.turns} does not fit the "
                                         "model's context: nothing was generated")
                loop.status = "truncated"
                return
            if config.max_total_output_tokens is not None and loop.output_tokens >= config.max_total_output_tokens:
                loop.status = "truncated" if calls else "ok"
                return
            if not calls:
                return
            for call in calls:
                output, reward = await self._tool_call(call, cookies, loop)
                item = {"type": "function_call_output", "call_id": call.get("call_id"), "output": output}
                loop.outputs.append(item if reward is None else {**item, "reward": reward})
            if config.reset_tool_choice and tool_choice not in (None, "auto", "none"):
                tool_choice = "auto"

    async def _model_call(self, body: dict[str, Any], loop: Loop) -> dict[str, Any]:
        started = time.perf_counter()
        try:
            # Re-sent only when undelivered: the model server has already retried its backend on 429
            # and 5xx, so retrying its answer here would multiply the backend's requests.
            reply = await self.client.post(
                self.config.model_server.name, "/v1/responses", json=body, timeout_s=self.config.model_timeout_s,
                retry_statuses=(),
            )
        except ServerCallError as exc:
            raise RolloutAborted("timeout" if exc.kind == "timeout" else "model_error", str(exc)) from None
        finally:
            loop.model_latency_s += time.perf_counter() - started
        if 400 <= reply.status < 500 and reply.status != 429:
            # The model server refused the request itself (e.g. a malformed input item): the task row
            # is at fault, and retrying cannot help.
            raise BadRequest(f"the model server rejected the request: {reply.error_message()}",
                             field=_error_field(reply), status=reply.status)
        if not reply.ok:
            raise RolloutAborted("model_error", f"model server answered HTTP {reply.status}: {reply.error_message()}")
        response = reply.json()
        loop.turns += 1
        loop.last_response = response
        usage = response.get("usage") or {}
        loop.input_tokens += int(usage.get("input_tokens") or 0)
        loop.output_tokens += int(usage.get("output_tokens") or 0)
        return response

    async def _tool_call(self, call: dict[str, Any], cookies: dict[str, str], loop: Loop) -> tuple[str, float | None]:
        """The tool's output text and the step reward it gave, if any; model mistakes become an
        explanatory output, not a failure."""
        name = str(call.get("name") or "")
        loop.tool_calls += 1
        if not TOOL_NAME.match(name) or name in RESERVED_ROUTES:
            return f"Error: unknown tool '{name}'.", None
        try:
            arguments = orjson.loads(call.get("arguments") or "{}")
        except orjson.JSONDecodeError as exc:
            return f"Error: the arguments of {name} are not valid JSON ({exc}). Send a JSON object.", None
        if not isinstance(arguments, dict):
            return f"Error: the arguments of {name} must be a JSON object, not {type(arguments).__name__}.", None
        reply = await self._env_call(f"/{name}", arguments, cookies, loop, tool=True)
        if reply.status in (404, 405):  # no such route, or a route that is not a tool (GET /docs)
            return f"Error: unknown tool '{name}'.", None
        if 400 <= reply.status < 500:
            return f"Error: invalid arguments for {name}: {reply.error_message()}", None
        try:  # a step reward the environment gave (rollgym.resources.Rewarded); a malformed one is none
            reward = float(reply.headers[TOOL_REWARD_HEADER]) if TOOL_REWARD_HEADER in reply.headers else None
        except ValueError:
            reward = None
        return reply.text, reward

    async def _env_call(self, path: str, body: Any, cookies: dict[str, str], loop: Loop, tool: bool = False) -> Any:
        """A resources-server call; 5xx/unreachable/timeout (and 4xx outside tools) fail the rollout."""
        started = time.perf_counter()
        try:
            reply = await self.client.post(
                self.config.resources_server.name, path, json=body, cookies=cookies,
                timeout_s=self.config.tool_timeout_s,
            )
        except ServerCallError as exc:
            raise RolloutAborted("timeout" if exc.kind == "timeout" else "env_error", str(exc)) from None
        finally:
            loop.env_latency_s += time.perf_counter() - started
        if not tool and 400 <= reply.status < 500:
            # The environment rejected the task row itself: the caller's input is at fault, not the rollout.
            field = _error_field(reply)
            raise BadRequest(f"the environment's {path} rejected the task: {reply.error_message()}", field=field,
                             status=reply.status)
        if reply.status >= 500:
            raise RolloutAborted("env_error", f"resources server {path} answered HTTP {reply.status}: {reply.error_message()}")
        return reply


def _error_field(reply: Reply) -> str:
    try:
        return str(reply.json()["error"]["field"])
    except (ValueError, KeyError, TypeError):
        return "body"
