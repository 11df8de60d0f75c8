"""rollgym: rollouts and rewards for reinforcement learning of LLM agents.

The public API: the three server roles and their building blocks, the client, config loading, the
launcher and the collector. Environments import from here; nothing here imports a server folder.
"""

import importlib
from typing import TYPE_CHECKING, Any

# Names are imported on first use, so `rollgym.cli` and small helpers start without loading every
# server dependency.
_EXPORTS = {
    "AgentServer": ".agent",
    "BadRequest": ".server",
    "BaseServer": ".server",
    "CollectOptions": ".rollouts.collector",
    "Collector": ".rollouts.collector",
    "ConfigError": ".config",
    "FAILURE_STATUSES": ".schema",
    "ModelResponse": ".schema",
    "ModelServer": ".model",
    "POLICY_STATUSES": ".schema",
    "Reply": ".client",
    "ResourcesServer": ".resources",
    "ResourcesServerConfig": ".resources",
    "RolloutClient": ".rollouts.rollout_client",
    "RolloutFailure": ".rollouts.rollout_client",
    "RolloutResult": ".rollouts.rollout_client",
    "RolloutsFailed": ".rollouts.rollout_client",
    "ResponsesCreateParams": ".schema",
    "RunRequest": ".schema",
    "RunResponse": ".schema",
    "RolloutLine": ".schema",
    "ServerAddress": ".client",
    "ServerCallError": ".client",
    "ServerClient": ".client",
    "ServerConfig": ".server",
    "ServerRef": ".server",
    "SessionId": ".server",
    "Stack": ".stack.launcher",
    "StackConfig": ".config",
    "Verdict": ".resources",
    "VerifyRequest": ".schema",
    "VerifyResponse": ".schema",
    "build_response": ".model",
    "load_stack": ".config",
    "merge_sequences": ".sequences",
    "tool": ".resources",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rollgym' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from .agent import AgentServer
    from .client import Reply, ServerAddress, ServerCallError, ServerClient
    from .rollouts.collector import CollectOptions, Collector
    from .config import ConfigError, StackConfig, load_stack
    from .stack.launcher import Stack
    from .model import ModelServer, build_response
    from .resources import ResourcesServer, ResourcesServerConfig, Verdict, tool
    from .rollouts.rollout_client import RolloutClient, RolloutFailure, RolloutResult, RolloutsFailed
    from .schema import (
        FAILURE_STATUSES,
        POLICY_STATUSES,
        ModelResponse,
        ResponsesCreateParams,
        RunRequest,
        RolloutLine,
        RunResponse,
        VerifyRequest,
        VerifyResponse,
    )
    from .sequences import merge_sequences
    from .server import BadRequest, BaseServer, ServerConfig, ServerRef, SessionId

__all__ = [
    "FAILURE_STATUSES",
    "POLICY_STATUSES",
    "AgentServer",
    "BadRequest",
    "BaseServer",
    "CollectOptions",
    "Collector",
    "ConfigError",
    "ModelResponse",
    "ModelServer",
    "Reply",
    "ResourcesServer",
    "ResourcesServerConfig",
    "ResponsesCreateParams",
    "RolloutClient",
    "RolloutFailure",
    "RolloutLine",
    "RolloutResult",
    "RolloutsFailed",
    "RunRequest",
    "RunResponse",
    "ServerAddress",
    "ServerCallError",
    "ServerClient",
    "ServerConfig",
    "ServerRef",
    "SessionId",
    "Stack",
    "StackConfig",
    "Verdict",
    "VerifyRequest",
    "VerifyResponse",
    "build_response",
    "load_stack",
    "merge_sequences",
    "tool",
]
