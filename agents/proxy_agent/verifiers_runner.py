"""A verifiers (`verifiers.v1`) Env as the proxy's agent: one task row, one episode.

The Env is loaded once per server from `env` (its `EnvConfig`, as `vf-eval` takes it) and keeps
its serving resources (verifiers' interception server, shared tool servers) up between rollouts.
Each rollout runs one episode whose model client is the rollout's own proxy URL, so every model
call of the harness program is captured token-exact. The reward is the episode's weighted total
(`trace.reward`), with one component per reward function; an episode that fails (a harness that
crashes, a reward function that raises) fails the rollout with its cause, never with a reward.

verifiers finds tasksets and harnesses by id as top-level modules; `python_path` puts folders
holding such modules on `sys.path`. The `null` and `bash` harnesses run verifiers' own chat
program; with `local_program: true` (the default) it runs on this server's interpreter, which
already has its packages, instead of a `uv` environment bootstrapped from the network.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import secrets
import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from rollgym.server import BadRequest

from .runners import AgentFailure, Endpoint, Outcome

TASK_FIELD = "verifiers"  # the task row's field holding the verifiers task data (see verifiers_export)


class VerifiersRunner(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["verifiers"]
    env: dict[str, Any] = Field(description="the verifiers EnvConfig, e.g. {taskset: {id: gsm8k}, agent: "
                                            "{harness: {id: null}, runtime: {type: subprocess}}}")
    python_path: list[str] = Field(default_factory=list, description="folders put on sys.path before loading")
    sampling: dict[str, Any] = Field(default_factory=dict, description="verifiers Sampling (temperature, max_tokens, ...)")
    local_program: bool = Field(default=True, description="run the null/bash harness program on this interpreter")

    _env: Any = PrivateAttr(default=None)
    _serving: Any = PrivateAttr(default=None)
    _lock: asyncio.Lock | None = PrivateAttr(default=None)

    async def run(self, task: dict[str, Any], endpoint: Endpoint, timeout_s: float) -> Outcome:
        env = await self._loaded()
        vf_task = self._task(env, task)
        import verifiers.v1 as vf

        # verifiers reads an endpoint's key from a named variable; one per rollout, gone after it.
        # The name holds "API_KEY", which verifiers' subprocess runtime keeps out of programs.
        key_var = f"ROLLGYM_API_KEY_{secrets.token_hex(8)}"
        os.environ[key_var] = endpoint.api_key
        ctx = vf.ModelContext(model=endpoint.model, sampling=vf.Sampling(**self.sampling),
                              client=vf.EvalClientConfig(base_url=endpoint.base_url, api_key_var=key_var))
        try:
            episode = await asyncio.wait_for(env.run_episode(vf_task, ctx), timeout_s)
        except asyncio.TimeoutError:
            raise AgentFailure("timeout", f"the verifiers episode ran past {timeout_s:g} s") from None
        finally:
            os.environ.pop(key_var, None)
            await release_client(env, ctx.client)
        return outcome_of(episode)

    def load(self) -> None:
        """Load the Env (ValueError naming what is wrong); its serving resources start with `start`."""
        if self._env is None:
            self._env = load_env(self.env, self.python_path, self.local_program)
            from verifiers.v1 import Sampling

            try:
                Sampling(**self.sampling)
            except (ValueError, TypeError) as exc:
                raise ValueError(f"agent.sampling: {exc}") from None

    async def start(self) -> None:
        """Bring up the Env's serving resources (interception server, shared tool servers)."""
        await self._loaded()

    async def close(self) -> None:
        """Stop the Env's serving resources (the proxy's shutdown calls this)."""
        if self._serving is not None:
            serving, self._serving = self._serving, None
            await serving.__aexit__(None, None, None)

    async def _loaded(self) -> Any:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._serving is None:
                self.load()
                serving = self._env.serving()
                await serving.__aenter__()
                self._serving = serving
        return self._env

    def _task(self, env: Any, row: dict[str, Any]) -> Any:
        """The verifiers task a row carries (BadRequest naming the field: the row is at fault)."""
        data = row.get(TASK_FIELD)
        if not isinstance(data, dict) or not isinstance(data.get("data"), dict):
            raise BadRequest("required: the verifiers task data (write rows with python -m "
                             "agents.proxy_agent.verifiers_export)", field=f"{TASK_FIELD}.data")
        task_cls = type(env.taskset).task_type()
        try:
            return task_cls(task_cls.data_type().model_validate(data["data"]), env.taskset.config.task)
        except ValueError as exc:
            first = str(exc).splitlines()[1:3]
            raise BadRequest(f"not a {task_cls.__name__}'s data: {' '.join(line.strip() for line in first)}",
                             field=f"{TASK_FIELD}.data") from None


def env_config(config: dict[str, Any], python_path: list[str] = ()) -> Any:
    """`config` as the concrete verifiers EnvConfig, `python_path` on sys.path first; ValueError
    naming what is wrong."""
    for folder in python_path:
        resolved = str(Path(folder).resolve())
        if resolved not in sys.path:
            sys.path.insert(0, resolved)
        # verifiers serves a Toolset by running its module in a child process, which must find it too.
        inherited = os.environ.get("PYTHONPATH", "")
        if resolved not in inherited.split(os.pathsep):
            os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (resolved, inherited) if p)
    try:
        from verifiers.v1.utils.loaders import resolve_env_config
    except ImportError as exc:
        raise ValueError(f"verifiers environments need verifiers 0.4 (pip install 'rollgym[envs]'): {exc}") from None
    try:
        return resolve_env_config(config)
    except (ValueError, ModuleNotFoundError, TypeError, AttributeError) as exc:
        raise ValueError(f"verifiers env config: {exc}") from None


def load_taskset(config: dict[str, Any], python_path: list[str] = ()) -> Any:
    """The taskset of the Env `config` describes (ValueError naming what is wrong)."""
    from verifiers.v1.utils.loaders import load_taskset as load

    resolved = env_config(config, python_path)
    if not resolved.taskset.id:
        raise ValueError("verifiers env config: taskset.id is required")
    try:
        return load(resolved.taskset)
    except (ValueError, ModuleNotFoundError, TypeError, AttributeError) as exc:
        raise ValueError(f"verifiers taskset {resolved.taskset.id!r}: {exc}") from None


def load_env(config: dict[str, Any], python_path: list[str] = (), local_program: bool = True) -> Any:
    """The verifiers Env for `config` (an EnvConfig as a dict); ValueError naming what is wrong."""
    resolved = env_config(config, python_path)
    from verifiers.v1.configs.agent import agent_config_fields
    from verifiers.v1.runtimes import runtime_is_local
    from verifiers.v1.utils.loaders import load_environment

    for role, spec in agent_config_fields(resolved).items():
        if not runtime_is_local(spec.runtime):
            raise ValueError(f"verifiers env {role}.runtime: {spec.runtime.type!r} runs the harness off this host "
                             f"(a tunnel and that provider's account); use {{type: subprocess}} (or docker/podman)")
    try:
        env = load_environment(resolved)
    except (ValueError, ModuleNotFoundError, TypeError, AttributeError) as exc:
        raise ValueError(f"verifiers env: {exc}") from None
    if local_program:
        provision_chat_program()
    return env


def provision_chat_program() -> None:
    """Register verifiers' chat program (the null and bash harnesses' loop) as prepared on this
    interpreter: verifiers' subprocess runtime keeps prepared scripts in a shared table and only
    bootstraps `uv` (from the network) for scripts it does not hold."""
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    data = CHAT_PROGRAM_SOURCE.encode()
    path = Path(SubprocessRuntime.scripts_dir) / f"{hashlib.sha256(data).hexdigest()}.py"
    if not path.exists() or path.read_bytes() != data:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    SubprocessRuntime._interpreters[str(path)] = sys.executable


async def release_client(env: Any, client_config: Any) -> None:
    """Close the rollout's model client in verifiers' interception server(s). They keep one client
    per distinct endpoint for their lifetime, and each rollout's endpoint is its own URL: without
    this, one HTTP client per rollout would pile up over a long run."""
    interception = getattr(env, "_interception", None)
    servers = getattr(interception, "servers", None) or ([interception] if interception is not None else [])
    key = client_config.model_dump_json()
    for server in servers:
        client = getattr(server, "clients", {}).pop(key, None)
        if client is not None:
            await client.close()


def outcome_of(episode: Any) -> Outcome:
    """A finished episode as the rollout's outcome: the answer, the weighted total reward and one
    component per reward; AgentFailure with the first error of a failed episode."""
    errors = [*episode.errors, *(error for trace in episode.traces for error in trace.errors)]
    if errors or not episode.ok:
        first = errors[0] if errors else None
        cause = f"{first.type}: {first.message}" if first else "the episode did not complete"
        status = "timeout" if episode.is_timeout or any(t.is_timeout for t in episode.traces) else "agent_error"
        raise AgentFailure(status, f"the verifiers episode failed: {cause}")
    components: dict[str, float] = {}
    total = 0.0
    for trace in episode.traces:
        for name, reward in trace.rewards.items():
            if reward is None:
                raise AgentFailure("agent_error", f"the verifiers reward {name!r} was not scored")
            key = name if len(episode.traces) == 1 else f"{trace.agent.name}.{name}"
            components[key] = reward.score
        total += trace.reward
    answer = episode.traces[-1].last_reply if episode.traces else None
    return Outcome(answer=answer, score=total, components=components)
