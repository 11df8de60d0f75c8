"""Which weights the model servers serve, and which trainer step they came from.

Version `n` is the policy after the trainer's step `n` (0: the base model). A step's adapter is
hot-loaded on every replica of every model server (vLLM's `POST /v1/load_lora_adapter`); each load
makes the servers answer with a new `model_version`, which is mapped back to the step, so the items
of a rollout tell which step's weights sampled them.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, Mapping

from ...adapters import AdapterRefused, base_card, load_everywhere
from ...client import ServerAddress, ServerClient
from ...data.records import model_versions, output_items
from ...sequences import token_record


class AdapterLoadError(RuntimeError):
    """A model server refused an adapter; the message says which server, which adapter and why."""


# Makes the servers serve a step's weights by other means than a LoRA hot-load (co-locate mode: the step was
# published in memory): (path, step) -> the model_versions the servers now report.
Loader = Callable[[str, int], Awaitable[list[str]]]


class PolicyVersions:
    """The stack's model servers, the adapters loaded on them, and model_version → step."""

    def __init__(self, registry: Mapping[str, ServerAddress], model_servers: list[str] | None, adapter_name: str,
                 log: Callable[[str], None] = print, loader: Loader | None = None) -> None:
        self.registry = registry
        self.loader = loader
        self.adapter_name = adapter_name
        self.log = log
        self.named = model_servers is not None
        self.servers = self._resolve(model_servers)
        self.agents: list[str] = []  # the agents whose model servers are the policy's (find_policy_servers)
        self.steps: dict[str, int] = {}  # model_version -> the step whose adapter it is (0: the base)
        self.adapter: str | None = None  # the adapter loaded last (None: the base)
        self._lock = asyncio.Lock()

    def _resolve(self, names: list[str] | None) -> list[str]:
        """The model servers to load adapters on: those named (all must be in the stack), else every one."""
        if names is None:
            return [name for name, address in self.registry.items() if address.role == "models"]
        unknown = [name for name in names if name not in self.registry]
        if unknown:
            known = ", ".join(sorted(self.registry))
            raise ValueError(f"model_servers {unknown} are not in the stack (servers: {known})")
        return list(names)

    async def find_policy_servers(self, client: ServerClient) -> None:
        """Unless the config names them, the servers to load adapters on are the model servers the
        agents sample from (each says so in `GET /health`): a judge or any other model server of the
        stack keeps its weights. Agents that do not say leave every model server in."""
        if self.named:
            return
        found: set[str] = set()
        for agent in self.agents:
            try:
                reply = await client.get(agent, "/health", timeout_s=30)
                name = reply.json().get("model_server") if reply.ok else None
            except Exception:  # noqa: BLE001 - an agent that cannot say leaves the default
                name = None
            if name is None or name not in self.registry:
                return
            found.add(name)
        if found:
            self.servers = [name for name in self.registry if name in found]
            self.log(f"adapters go to {', '.join(self.servers)}: the model server(s) the agents sample from")
        self.named = True

    async def load(self, client: ServerClient, adapter_path: str, step: int) -> None:
        """Load the adapter on every replica of every model server; AdapterLoadError if one refuses."""
        await self.find_policy_servers(client)
        if not self.servers:
            return
        async with self._lock:
            try:
                versions = await (self.loader(adapter_path, step) if self.loader is not None else
                                  load_everywhere(self.registry, self.servers, self.adapter_name, adapter_path))
            except AdapterRefused as exc:
                raise AdapterLoadError(f"step {step}: {exc}") from None
            for version in versions:
                if version:  # vLLM answers a plain sentence: its rollouts fall back to the dispatch-time step
                    self.steps[str(version)] = step
        self.adapter = adapter_path
        if self.loader is None:
            self.log(f"step {step}: adapter {adapter_path} loaded on {', '.join(self.servers)}")

    async def learn_base(self, client: ServerClient) -> None:
        """The model_version each model server reports for its base weights is version 0."""
        await self.find_policy_servers(client)
        for name in self.servers:
            try:
                reply = await client.get(name, "/v1/models", timeout_s=30)
                models = reply.json().get("data", []) if reply.ok else []
            except Exception:  # noqa: BLE001 - a server without the route just reports no base version
                continue
            base = base_card(models)
            if base is not None:
                self.steps.setdefault(str(base.get("model_version") or base.get("id")), 0)

    def sampled_step(self, rollout: Mapping[str, Any], fallback: int) -> int:
        """The oldest step among the model_versions of a rollout's generated items (`fallback` if none is known)."""
        steps = [self.steps[v] for v in model_versions(rollout, served_model=False) if v in self.steps]
        return min(steps) if steps else fallback

    def sampled_tokens(self, rollout: Mapping[str, Any], fallback: int) -> dict[int, int]:
        """How many of a rollout's generated tokens each step sampled: per model call its `model_version_spans`
        (a generation continued across weight updates), else its `model_version`; `fallback` for a version
        not known."""
        counts: dict[int, int] = {}
        for item in output_items(rollout):
            record = token_record(item)
            for version, tokens in record.spans() if record is not None else []:
                step = self.steps.get(version, fallback) if version is not None else fallback
                counts[step] = counts.get(step, 0) + tokens
        return counts

    def carry(self, step: int) -> None:
        """Step `step` made no new weights: the ones served are its policy too. Their model_versions map to it,
        so what they sample is not counted stale (and dropped again and again) while steps train nothing."""
        newest, versions = self.newest()
        if step > newest:
            for version in versions:
                self.steps[version] = step

    def newest(self) -> tuple[int, list[str]]:
        """The newest step whose weights were loaded, and the model_versions the servers report for them."""
        newest = max(self.steps.values(), default=0)
        return newest, sorted(version for version, step in self.steps.items() if step == newest)


__all__ = ["AdapterLoadError", "Loader", "PolicyVersions"]
