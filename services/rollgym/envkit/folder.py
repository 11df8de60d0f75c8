"""An environment folder as its own tests see it: its paths, example rows, and its servers built
from its config, so a test needs none of the stack's internals.

    ENV = env_folder(__file__)             # in resources_servers/NAME/tests/test_NAME.py
    ENV.rows()                             # data/example.jsonl, parsed
    server = ENV.build("NAME")             # the server as `rollgym run` would configure it
    agent = ENV.build("NAME_agent", "NAME_agent.max_steps=4")
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import DEFAULT_MODEL_NAME, load_stack
from ..data.jsonl import read_jsonl
from ..server import BaseServer
from ..stack.serve import build_server

# A model config that needs no weights: the agent's `policy_model` resolves without loading llama.cpp.
_STAND_IN_MODEL = Path("models") / "chat_completions" / "configs" / "chat_completions.yaml"


@dataclass(frozen=True)
class EnvFolder:
    path: Path

    @property
    def root(self) -> Path:
        """The repository root the folder lives in (resources_servers/NAME → the checkout)."""
        return self.path.parents[1]

    @property
    def examples(self) -> Path:
        return self.path / "data" / "example.jsonl"

    @property
    def config(self) -> Path:
        return self.path / "configs" / f"{self.path.name}.yaml"

    def rows(self, name: str = "example.jsonl") -> list[dict[str, Any]]:
        """The task rows of data/NAME (JsonlError naming the line when one is bad)."""
        return read_jsonl(self.path / "data" / name)

    def build(self, server: str, *overrides: str) -> BaseServer:
        """Server `server` of this folder's config (with `a.b=c` overrides), built as a stack would build it."""
        # An installed environment package's tests run from a checkout: the stand-in model is there.
        model = next((d / _STAND_IN_MODEL for d in (self.root, Path.cwd()) if (d / _STAND_IN_MODEL).is_file()),
                     self.root / _STAND_IN_MODEL)
        stack = load_stack([self.config, model], list(overrides))
        if server not in stack.servers:
            raise KeyError(f"{self.config} has no server {server!r} (servers: {', '.join(sorted(stack.servers))}; "
                           f"{DEFAULT_MODEL_NAME} is the stand-in model)")
        return build_server(stack.servers[server], {"registry": {}, "secret": "x" * 32})


def env_folder(test_file: str | Path) -> EnvFolder:
    """The environment folder of a test file in its `tests/` folder."""
    return EnvFolder(Path(test_file).resolve().parents[1])


__all__ = ["EnvFolder", "env_folder"]
