"""rollgym: rollouts and rewards for reinforcement learning of LLM agents.

The public API: the three server roles and their building blocks, the client, config loading, the
launcher and the collector. Environments import from here; nothing here imports a server folder.
"""

from .agent import AgentServer
from .client import Reply, ServerAddress, ServerCallError, ServerClient
from .collector import CollectOptions, Collector
from .config import ConfigError, StackConfig, load_stack
from .launcher import Stack
from .model import ModelServer, build_response
from .resources import ResourcesServer, ResourcesServerConfig, Verdict, tool
from .schema import (
    FAILURE_STATUSES,
    POLICY_STATUSES,
    ModelResponse,
    ResponsesCreateParams,
    RunRequest,
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
