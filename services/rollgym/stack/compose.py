"""A stack as containers: the docker-compose project for a stack config, and serving one of its servers.

Every server of a stack runs in its own container of one image (the Dockerfile), started as
`rollgym serve-one CONFIG... --name NAME --host 0.0.0.0 --port 8000`: the same config files and
overrides as `rollgym run`, of which the container serves the one named server (all its replicas,
on ports 8000.. inside the container). Servers find each other by compose service name through the
registry in `ROLLGYM_REGISTRY`; the bearer token every server requires comes from
`ROLLGYM_AUTH_TOKEN`. `rollgym compose CONFIG...` prints the compose file for a stack, so the
committed docker-compose.yml is generated, never edited by hand, and tests check that the two agree.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import yaml

from ..client import AUTH_TOKEN_ENV, REGISTRY_ENV, ServerAddress
from ..config import ConfigError, ServerSpec, StackConfig

# The files of the committed compose project and the stack they are generated from.
DEFAULT_COMPOSE_FILE = "docker-compose.yml"
EXTERNAL_MODEL_FILE = "docker-compose.external-model.yml"
DEFAULT_STACK = ["resources_servers/reverse_text/configs/reverse_text.yaml", "resources_servers/weather/configs/weather.yaml"]
CHAT_COMPLETIONS_CONFIG = "models/chat_completions/configs/chat_completions.yaml"
ROLLOUTS_MOUNT = "/rollouts"
HEALTH_PATH = "/health"


@dataclass
class ComposeOptions:
    """How `rollgym compose` lays a stack out as compose services."""

    port: int = 8000  # every server listens here inside its container (replicas: port, port+1, ...)
    image: str = "rollgym:latest"
    model_name: str = "policy_model"  # the server the external-model variant swaps
    collect_agent: str | None = None  # default: the stack's first agent
    collect_input: str | None = None  # default: that agent's environment's data/example.jsonl


def service_name(server: str) -> str:
    """A compose service (and DNS host) name for a server: `weather_agent` -> `weather-agent`."""
    return server.replace("_", "-").lower()


def compose_escape(text: str) -> str:
    """A literal for a compose file: `$` is compose's interpolation, `$$` a plain dollar."""
    return text.replace("$", "$$")


def references(spec: ServerSpec) -> list[str]:
    """The servers a server calls: its `*_server: {name: ...}` options."""
    return sorted({
        str(value["name"]) for key, value in spec.options.items()
        if key.endswith("_server") and isinstance(value, dict) and "name" in value
    })


def deployment_registry(stack: StackConfig, port: int) -> dict[str, Any]:
    """The registry JSON of the stack as compose services: every server by its service name, in the
    shortest form that says it: a URL, a list of URLs (replicas), or an entry with `shared_sessions`.
    The token is not in it: every container has ROLLGYM_AUTH_TOKEN."""
    registry: dict[str, Any] = {}
    for name, spec in stack.servers.items():
        urls = [f"http://{service_name(name)}:{port + index}" for index in range(spec.replicas)]
        if spec.replicas > 1 and spec.options.get("session_store") == "sqlite":
            registry[name] = {"urls": urls, "shared_sessions": True}
        else:
            registry[name] = urls[0] if len(urls) == 1 else urls
    return registry


class _Block(str):
    """A string written as a YAML literal block (`|`), one line per line."""


def compose_project(stack: StackConfig, configs: list[str], overrides: list[str],
                    options: ComposeOptions | None = None) -> dict[str, Any]:
    """The compose project (as a dict) that runs `stack`, made from `configs` and `overrides`."""
    options = options or ComposeOptions()
    _check_paths(configs)
    names: dict[str, str] = {}
    for name in stack.servers:
        other = names.setdefault(service_name(name), name)
        if other != name:
            raise ConfigError(f"servers '{other}' and '{name}' would both be the compose service '{service_name(name)}'")
    registry = deployment_registry(stack, options.port)
    registry_json = _Block("{\n" + ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in registry.items()) + "\n}\n")
    environment = {
        AUTH_TOKEN_ENV: f"${{{AUTH_TOKEN_ENV}:?set {AUTH_TOKEN_ENV} (any long random string) in the environment or .env}}",
        REGISTRY_ENV: registry_json,
    }
    stack_args = [compose_escape(item) for item in [*configs, *overrides]]
    services: dict[str, Any] = {}
    for name, spec in stack.servers.items():
        service: dict[str, Any] = {
            "image": options.image,
            "build": {"context": ".", "dockerfile": "Dockerfile"},
            "command": ["serve-one", *stack_args, "--name", name, "--host", "0.0.0.0", "--port", str(options.port)],
            "environment": dict(environment),
            "healthcheck": healthcheck([options.port + index for index in range(spec.replicas)]),
            "restart": "unless-stopped",
            "init": True,  # a real PID 1: signals reach rollgym, exited children are reaped
        }
        depends = references(spec)
        if depends:
            service["depends_on"] = {service_name(other): {"condition": "service_healthy"} for other in depends}
        if spec.role == "agents":
            # Reachable from the host on a free loopback port: `docker compose port SERVICE PORT`.
            service["ports"] = [f"127.0.0.1::{options.port}"]
        services[service_name(name)] = service
    services["collect"] = _collect_service(stack, options, environment)
    return {"name": "rollgym", "services": services}


def external_model_override(stack: StackConfig, configs: list[str], overrides: list[str],
                            options: ComposeOptions | None = None) -> dict[str, Any]:
    """A compose override file swapping the stack's model server for `models/chat_completions`
    pointed at an OpenAI-compatible endpoint (vLLM, SGLang, OpenAI) given by environment variables."""
    options = options or ComposeOptions()
    if options.model_name not in stack.servers:
        raise ConfigError(f"the stack has no server named '{options.model_name}' to swap for an external model")
    stack_args = [compose_escape(item) for item in [*configs, CHAT_COMPLETIONS_CONFIG, *overrides]]
    command = [
        "serve-one", *stack_args,
        f"{options.model_name}.base_url=${{ROLLGYM_MODEL_BASE_URL:?set ROLLGYM_MODEL_BASE_URL, e.g. http://host.docker.internal:8000/v1}}",
        f"{options.model_name}.model=${{ROLLGYM_MODEL_NAME:?set ROLLGYM_MODEL_NAME, the model name the endpoint serves}}",
        "--name", options.model_name, "--host", "0.0.0.0", "--port", str(options.port),
    ]
    return {"services": {service_name(options.model_name): {
        "command": command,
        # No value: passed through from the host when set; chat_completions.yaml reads it as the API key.
        "environment": {"ROLLGYM_BACKEND_API_KEY": None},
        # An endpoint on the Docker host: http://host.docker.internal:PORT/v1 (also on Linux).
        "extra_hosts": ["host.docker.internal:host-gateway"],
    }}}


def healthcheck(ports: list[int]) -> dict[str, Any]:
    """A compose healthcheck: GET /health of every replica in the container (the image has no curl)."""
    urls = ", ".join(f"'http://127.0.0.1:{port}{HEALTH_PATH}'" for port in ports)
    probe = f"import urllib.request as r; [r.urlopen(url, timeout=4) for url in ({urls},)]"
    return {"test": ["CMD", "python", "-c", probe], "interval": "5s", "timeout": "10s", "retries": 5,
            "start_period": "120s"}


def _collect_service(stack: StackConfig, options: ComposeOptions, environment: dict[str, str]) -> dict[str, Any]:
    agents = [name for name, spec in stack.servers.items() if spec.role == "agents"]
    if not agents:
        raise ConfigError("the stack has no agent server: nothing for the collect service to run")
    agent = options.collect_agent or agents[0]
    if agent not in agents:
        raise ConfigError(f"--collect-agent: no agent named '{agent}' (agents: {', '.join(agents)})")
    tasks = options.collect_input or _example_tasks(stack, agent)
    stem = agent.removesuffix("_agent")
    return {
        "image": options.image,
        "profiles": ["collect"],
        "command": [
            "collect-rollouts", "--agent", f"${{ROLLGYM_AGENT:-{agent}}}", "--input", f"${{ROLLGYM_INPUT:-{tasks}}}",
            "--output", f"{ROLLOUTS_MOUNT}/${{ROLLGYM_OUTPUT:-{stem}.jsonl}}", "--repeats", "${ROLLGYM_REPEATS:-4}",
            "--concurrency", "8", "--no-progress",
        ],
        "environment": dict(environment),
        # The host's ./rollouts, written as the host user (create it first: mkdir -p rollouts).
        "volumes": [f"./rollouts:{ROLLOUTS_MOUNT}"],
        "user": "${ROLLGYM_UID:-1000}:${ROLLGYM_GID:-1000}",
        "depends_on": {service_name(name): {"condition": "service_healthy"} for name in agents},
        "restart": "no",
        "init": True,
    }


def _example_tasks(stack: StackConfig, agent: str) -> str:
    env = stack.servers[agent].options.get("resources_server", {}).get("name")
    spec = stack.servers.get(env) if env else None
    if spec is None:
        raise ConfigError(f"agent '{agent}' names no resources server; give the tasks with --collect-input")
    return f"{spec.role}/{spec.folder}/data/example.jsonl"


def _check_paths(configs: list[str]) -> None:
    """Config paths go into the containers' commands: they must be relative paths under the project."""
    for path in configs:
        if Path(path).is_absolute() or ".." in Path(path).parts:
            raise ConfigError(f"{path}: give config files relative to the project folder (the image's /app), "
                              "e.g. resources_servers/weather/configs/weather.yaml")


def header(command: str, *, external_model: bool = False) -> str:
    """The comment at the top of a generated compose file: how it was made and how to use it."""
    if external_model:
        usage = [
            "The embedded model swapped for an OpenAI-compatible endpoint (vLLM, SGLang, OpenAI):",
            "  export ROLLGYM_MODEL_BASE_URL=http://gpu-box:8000/v1 ROLLGYM_MODEL_NAME=Qwen/Qwen3-4B",
            f"  docker compose -f {DEFAULT_COMPOSE_FILE} -f {EXTERNAL_MODEL_FILE} up -d --wait",
        ]
    else:
        usage = [
            "  mkdir -p rollouts && export ROLLGYM_AUTH_TOKEN=$(python3 -c 'import secrets; print(secrets.token_hex(32))')",
            "  docker compose up -d --wait          # the stack, healthy",
            "  docker compose run --rm collect      # a collection into ./rollouts",
        ]
    return "\n".join([
        f"Generated by `{command}`.",
        "Edit the server configs and regenerate; tests/test_compose.py checks that this file matches them.",
        "",
        *usage,
        "",
        "See docs/deploy.md.",
    ])


def to_yaml(project: Mapping[str, Any], header: str) -> str:
    """YAML text of a compose project, with a comment header (no anchors: every service reads alone)."""

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True

    def block(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
        return dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|")

    Dumper.add_representer(_Block, block)

    body = yaml.dump(copy.deepcopy(dict(project)), Dumper=Dumper, sort_keys=False, width=120, allow_unicode=True)
    return "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines()) + body


def single_server_stack(stack: StackConfig, name: str, *, host: str | None, port: int | None,
                        environ: Mapping[str, str] = os.environ) -> StackConfig:
    """The stack of `rollgym serve-one`: only server `name`, bound where asked, with the deployment's token.

    The token in `ROLLGYM_AUTH_TOKEN` becomes the server's `auth_token` unless its config sets one.
    """
    if name not in stack.servers:
        raise ConfigError(f"--name: no server named '{name}' in the stack (servers: {', '.join(stack.servers)})")
    spec = copy.deepcopy(stack.servers[name])
    if host is not None:
        spec.options["host"] = host
    if port is not None:
        spec.options["port"] = port
    token = environ.get(AUTH_TOKEN_ENV)
    if token and not spec.options.get("auth_token"):
        spec.options["auth_token"] = token
    return StackConfig({name: spec})


def missing_references(stack: StackConfig, name: str, registry: Mapping[str, ServerAddress]) -> list[str]:
    """The servers `name` calls that the registry does not locate."""
    return [other for other in references(stack.servers[name]) if other not in registry and other != name]
