"""What the command groups share: the start time, the usage error, and where a stack's servers are."""

from __future__ import annotations

import time

STARTED = time.perf_counter()  # before the heavy imports, so reported start-up times are honest

import os  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING, Any  # noqa: E402

if TYPE_CHECKING:
    from ..client import ServerAddress
    from ..config import StackConfig


class UsageError(Exception):
    """A command-line mistake, reported as `rollgym: error: ...` with exit code 2."""


def print_registry(registry: dict[str, ServerAddress], config: StackConfig) -> None:
    width = max(len(name) for name in registry)
    for name, address in registry.items():
        spec = config.servers[name]
        print(f"  {name:<{width}}  {' '.join(address.urls)}  ({spec.role}/{spec.folder})")


def write_private(path: Path, data: bytes) -> None:
    """Write a file only its owner can read (a registry holds the servers' bearer tokens)."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(descriptor, 0o600)  # also when the file already existed with looser permissions
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(data)


def stack_for(config: StackConfig, ray_address: str | None) -> Any:
    """The local launcher's Stack, or with `--ray [ADDRESS]` the stack as Ray actors."""
    if ray_address is None:
        from ..stack.launcher import Stack

        return Stack(config)
    if ray_address.endswith((".yaml", ".yml")) or "=" in ray_address or Path(ray_address).is_file():
        raise UsageError(f"--ray took {ray_address!r} as the cluster address: put --ray after the configs, "
                         "or write --ray=ADDRESS")
    from ..stack.ray import RayStack

    return RayStack(config, ray_address or None)


def env_registry() -> dict[str, ServerAddress] | None:
    """The registry a compose stack's container gets in ROLLGYM_REGISTRY, if any."""
    from ..client import registry_from_env

    try:
        return registry_from_env(os.environ)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def parse_params(items: list[str]) -> dict[str, Any]:
    """`--param KEY=JSON` options as responses_create_params keys (a bare word such as auto stays a string)."""
    import orjson

    params: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--param {item!r} must look like KEY=JSON, e.g. temperature=0")
        try:
            params[key] = orjson.loads(value)
        except orjson.JSONDecodeError:
            params[key] = value
    return params
