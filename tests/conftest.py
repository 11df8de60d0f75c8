"""Fixtures shared by the tests of services/ and the trainer integrations."""

from __future__ import annotations

import signal
import subprocess
import sys
from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Iterator

import psutil
import pytest

from agents.simple_agent.app import SimpleAgent, SimpleAgentConfig
from models.chat_completions.app import ChatCompletionsConfig, ChatCompletionsModel
from resources_servers.reverse_text.app import ReverseTextServer
from resources_servers.weather.app import WeatherServer
from rollgym.client import ServerAddress
from rollgym.processes import die_with_parent
from rollgym.testing import REPO_ROOT, scripted_backend, serve_in_thread


def simple_agent(name: str, env: str, model_url: str, env_url: str) -> SimpleAgent:
    return SimpleAgent(
        SimpleAgentConfig(model_server={"name": "policy_model"}, resources_server={"name": env}), name=name,
        registry={"policy_model": ServerAddress(url=model_url, role="models"),
                  env: ServerAddress(url=env_url, role="resources_servers")},
    )


@contextmanager
def scripted_stack(*backend_flags: str, **model_options: Any) -> Iterator[dict[str, ServerAddress]]:
    """A real in-process stack: the scripted backend (with token ids; `backend_flags` add e.g.
    `--latency-ms`) behind chat_completions (`model_options`: more of its config, e.g. max_retries),
    and two agents, `reverse_text_agent` and `weather_agent`; yields its registry."""
    with ExitStack() as stack:
        backend = stack.enter_context(scripted_backend("--token-info", *backend_flags))
        model = ChatCompletionsModel(ChatCompletionsConfig(base_url=backend, model="scripted", return_token_ids=True,
                                                           **model_options), name="policy_model")
        model_url = stack.enter_context(serve_in_thread(model))
        reverse_url = stack.enter_context(serve_in_thread(ReverseTextServer(name="reverse_text")))
        weather_url = stack.enter_context(serve_in_thread(WeatherServer(name="weather")))
        yield {
            "policy_model": ServerAddress(model_url, "models"),
            "reverse_text_agent": ServerAddress(stack.enter_context(serve_in_thread(
                simple_agent("reverse_text_agent", "reverse_text", model_url, reverse_url))), "agents"),
            "weather_agent": ServerAddress(stack.enter_context(serve_in_thread(
                simple_agent("weather_agent", "weather", model_url, weather_url))), "agents"),
        }


@pytest.fixture(scope="module")
def scripted_agents() -> Iterator[dict[str, ServerAddress]]:
    """`scripted_stack()`, shared by a module's tests (none of which loads an adapter into it)."""
    with scripted_stack() as registry:
        yield registry


def start_rollgym(*args: str, preexec_fn: Callable[[], None] | None = None, **popen: Any) -> subprocess.Popen:
    """`rollgym ARGS...`, a command that runs until stopped (run, serve-one), as a subprocess in the
    repository's folder (`popen`: more of Popen's arguments). Stop it with `stop_rollgym`; should this
    test process die first, the kernel sends it SIGTERM, which stops it and its servers."""

    def in_child() -> None:
        die_with_parent(signal.SIGTERM)
        if preexec_fn is not None:
            preexec_fn()

    return subprocess.Popen([sys.executable, "-m", "rollgym.cli", *args], cwd=REPO_ROOT, preexec_fn=in_child, **popen)


def stop_rollgym(process: subprocess.Popen, signum: int = signal.SIGINT, grace_s: float = 30.0) -> int:
    """Stop a `start_rollgym` process as a user does (`signum`: SIGINT is Ctrl-C) and return its exit
    code. Nothing of it is left running: if it or a server it started still runs after `grace_s`, it is
    killed and the test fails saying so, so a failed or stuck test leaves no process behind."""
    try:
        children = psutil.Process(process.pid).children(recursive=True)
    except psutil.Error:  # it has exited already (the test saw it stop)
        children = []
    if process.poll() is None:
        process.send_signal(signum)
    try:
        code: int | None = process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        code = None
        process.kill()
        process.wait()
    # A launcher that exited stopped its servers first: any still alive is a leak.
    _, left = psutil.wait_procs(children, timeout=1.0 if code is not None else 0.0)
    for child in left:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(left, timeout=10.0)
    name = signal.Signals(signum).name
    if code is None:
        raise AssertionError(f"rollgym (pid {process.pid}) still ran {grace_s:g} s after {name}; "
                             f"killed it and the {len(left)} processes it had started")
    if left:
        raise AssertionError(f"rollgym (pid {process.pid}) exited with code {code} after {name} but left "
                             f"{len(left)} of its processes running (pids {[c.pid for c in left]}); killed them")
    return code
