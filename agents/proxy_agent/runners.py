"""The three ways to run an external agent for one rollout, and what its run gave back.

- `command`: a subprocess with OPENAI_BASE_URL / OPENAI_API_KEY set, the task row as JSON on stdin,
  the answer on stdout (plain text, or a JSON object with `answer` and optional `score`);
- `http`: `POST` to a workflow URL with the task and the endpoint; it answers `{answer, score?}`;
- `callable`: an (async or plain) Python function named `package.module:function`, called in-process
  as `function(task, endpoint)`; it returns the answer, or `{answer, score?}`.

Every runner is bounded in time (and a command in output); a crash, a non-zero exit or a timeout
raises `AgentFailure` with its cause (a command's stderr tail), never an answer.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import signal
import sys
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Literal

import aiohttp
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from rollgym.config import import_target

STDERR_TAIL_BYTES = 2000


class AgentFailure(Exception):
    """The agent did not finish: `status` is `agent_error` or `timeout`, `error` says why."""

    def __init__(self, status: str, error: str) -> None:
        super().__init__(error)
        self.status = status
        self.error = error


@dataclass(frozen=True)
class Endpoint:
    """What the agent is given: its OpenAI-compatible base URL and key, and the rollout's tools."""

    base_url: str
    api_key: str
    tools_url: str
    model: str
    rollout_id: str
    mcp_url: str | None = None  # the environment's tools over MCP, when the proxy serves them

    def environ(self) -> dict[str, str]:
        environ = {"OPENAI_BASE_URL": self.base_url, "OPENAI_API_KEY": self.api_key, "OPENAI_MODEL": self.model,
                   "ROLLGYM_TOOLS_URL": self.tools_url, "ROLLGYM_ROLLOUT_ID": self.rollout_id}
        if self.mcp_url:
            environ["ROLLGYM_MCP_URL"] = self.mcp_url
        return environ

    def to_json(self) -> dict[str, Any]:
        return {"base_url": self.base_url, "api_key": self.api_key, "model": self.model,
                "tools_url": self.tools_url, "rollout_id": self.rollout_id, "mcp_url": self.mcp_url}


@dataclass
class Outcome:
    """What a finished agent said: its answer and, for workflows that score themselves, a score
    (and, where the score is a weighted sum, its named components)."""

    answer: str | None = None
    score: float | None = None
    components: dict[str, float] | None = None


def outcome_from(value: Any, source: str) -> Outcome:
    """An agent's return value (text, or an object with `answer` and `score`) as an Outcome."""
    if value is None:
        return Outcome()
    if isinstance(value, str):
        return Outcome(answer=value)
    if isinstance(value, dict):
        score = value.get("score")
        if score is not None and (isinstance(score, bool) or not isinstance(score, (int, float))):
            raise AgentFailure("agent_error", f"{source}: 'score' must be a number, got {score!r}")
        answer = value.get("answer")
        return Outcome(answer=None if answer is None else str(answer), score=None if score is None else float(score))
    raise AgentFailure("agent_error", f"{source}: expected text or an object with 'answer', got {type(value).__name__}")


class CommandRunner(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["command"]
    argv: list[str] = Field(min_length=1, description="the command and its arguments (no shell); "
                                                      "`python` is the server's own interpreter")
    cwd: str | None = Field(default=None, description="working directory; default: the server's")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment variables")
    max_output_bytes: int = Field(default=1_000_000, ge=1, description="stdout beyond this fails the rollout")

    async def run(self, task: dict[str, Any], endpoint: Endpoint, timeout_s: float) -> Outcome:
        environ = {**os.environ, **self.env, **endpoint.environ()}
        argv = [sys.executable, *self.argv[1:]] if self.argv[0] == "python" else self.argv
        try:
            process = await asyncio.create_subprocess_exec(
                *argv, cwd=self.cwd, env=environ, stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True)
        except OSError as exc:
            raise AgentFailure("agent_error", f"cannot start {self.argv[0]!r}: {exc}") from None
        stderr = bytearray()
        stdout = bytearray()

        async def read_stderr() -> None:
            while chunk := await process.stderr.read(65536):
                stderr.extend(chunk)
                del stderr[:-STDERR_TAIL_BYTES]

        async def read_stdout() -> None:
            while chunk := await process.stdout.read(65536):
                stdout.extend(chunk)
                if len(stdout) > self.max_output_bytes:
                    raise AgentFailure("agent_error", f"the agent wrote more than {self.max_output_bytes} bytes to stdout")

        async def communicate() -> int:
            try:
                process.stdin.write(json.dumps(task).encode())
                await process.stdin.drain()
                process.stdin.close()
            except (BrokenPipeError, ConnectionResetError):
                pass  # the agent does not read its task; its exit status tells the rest
            readers = asyncio.ensure_future(asyncio.gather(read_stdout(), read_stderr()))
            exited = asyncio.ensure_future(process.wait())
            try:
                await asyncio.wait({readers, exited}, return_when=asyncio.FIRST_COMPLETED)
                if readers.done():
                    readers.result()  # too much output: raises now, not when the agent exits
                code = await exited
                # A child the agent left behind may hold its pipes open: give them a moment, then end it.
                try:
                    await asyncio.wait_for(asyncio.shield(readers), 2.0)
                except asyncio.TimeoutError:
                    await _kill(process, group_only=True)
                    await readers
                return code
            finally:
                readers.cancel()
                exited.cancel()

        try:
            code = await asyncio.wait_for(communicate(), timeout_s)
        except asyncio.TimeoutError:
            await _kill(process)
            raise AgentFailure("timeout", f"the agent ran past {timeout_s:g} s{_tail(stderr)}") from None
        except BaseException:
            await _kill(process)
            raise
        if code != 0:
            how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
            raise AgentFailure("agent_error", f"the agent {how}{_tail(stderr)}")
        text = stdout.decode(errors="replace").strip()
        try:
            parsed = json.loads(text) if text.startswith("{") else text
        except ValueError:
            parsed = text
        return outcome_from(parsed, "the agent's stdout")


class HttpRunner(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["http"]
    url: str = Field(pattern=r"^https?://", description="the workflow's URL; it gets POST {task, endpoint}")
    headers: dict[str, str] = Field(default_factory=dict)
    # One pooled session for every rollout (a session per rollout paid a connection and its set-up each time).
    _http: aiohttp.ClientSession | None = PrivateAttr(default=None)

    async def run(self, task: dict[str, Any], endpoint: Endpoint, timeout_s: float) -> Outcome:
        body = {"task": task, **endpoint.to_json()}
        if self._http is None or self._http.closed:
            # No connection limit: a workflow call lasts its whole rollout, and aiohttp's default of 100
            # would quietly cap the rollouts in flight.
            self._http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                               cookie_jar=aiohttp.DummyCookieJar())
        try:
            async with self._http.post(self.url, json=body, headers=self.headers,
                                       timeout=aiohttp.ClientTimeout(total=timeout_s)) as reply:
                text = await reply.text()
                if reply.status >= 400:
                    raise AgentFailure("agent_error", f"the workflow answered HTTP {reply.status}: {text[-STDERR_TAIL_BYTES:]}")
        except asyncio.TimeoutError:
            raise AgentFailure("timeout", f"the workflow gave no answer within {timeout_s:g} s") from None
        except aiohttp.ClientError as exc:
            raise AgentFailure("agent_error", f"the workflow at {self.url} is unreachable: {exc}") from None
        try:
            value = json.loads(text) if text.strip() else None
        except ValueError:
            value = text
        return outcome_from(value, "the workflow's answer")

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None


class CallableRunner(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["callable"]
    target: str = Field(pattern=r"^[\w.]+:[\w.]+$", description="package.module:function")

    def resolve(self) -> Callable[..., Any]:
        return import_target(self.target)

    async def run(self, task: dict[str, Any], endpoint: Endpoint, timeout_s: float) -> Outcome:
        function = self.resolve()
        try:
            if inspect.iscoroutinefunction(function):
                call: Awaitable[Any] = function(task, endpoint)
            else:
                call = asyncio.to_thread(function, task, endpoint)
            value = await asyncio.wait_for(call, timeout_s)
        except asyncio.TimeoutError:
            raise AgentFailure("timeout", f"{self.target} ran past {timeout_s:g} s") from None
        except AgentFailure:
            raise
        except Exception as exc:
            raise AgentFailure("agent_error", f"{self.target} raised {type(exc).__name__}: {exc}") from None
        return outcome_from(value, self.target)


Runner = CommandRunner | HttpRunner | CallableRunner


async def _kill(process: asyncio.subprocess.Process, group_only: bool = False) -> None:
    """Stop the agent and everything it started (its own process group, which outlives the agent
    while a child it started runs)."""
    if process.returncode is None or group_only:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if not group_only:
            await process.wait()


def _tail(stderr: bytearray) -> str:
    text = stderr.decode(errors="replace").strip()
    return f"; stderr: ...{text[-STDERR_TAIL_BYTES:]}" if text else ""
