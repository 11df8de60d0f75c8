"""LoRA adapters on a model server: vLLM's runtime routes, the registry of what is loaded, versions.

Every model server speaks vLLM's adapter API, so one trainer drives the embedded model and a GPU fleet:

* `POST /v1/load_lora_adapter` `{"lora_name", "lora_path", "load_inplace"?}` loads an adapter (a
  name already loaded is 400 unless `load_inplace: true`, which replaces its weights, as in vLLM);
* `POST /v1/unload_lora_adapter` `{"lora_name"}` unloads one (404 when it is not loaded);
* `GET /v1/models` lists the base model and every adapter.

A request's `model` picks the weights: an adapter's name → that adapter; the base model's name →
the base weights; anything else (no `model`, another name) → the *policy*, the adapter loaded most
recently (the base when none is), so a trainer that publishes a new adapter moves every following
rollout onto it without rewriting the task rows. A server configured with named policies
(`rollgym.policies`) resolves otherwise: a call's policy picks the adapter loaded under the policy's name,
and a call no policy claims is refused. The weights that answered a request are named by
`model_version`: `name@DIGEST` for an adapter, where DIGEST is the first 12 hex digits of the sha256 of
its files (relative names and bytes, in name order; a path the server cannot read, such as one on a
vLLM host, by the path itself), and the base model's name for the base. A version names the weights,
not the load: loading the same files again, after a restart or under `load_inplace`, gives the same
version, so rollouts sampled before a restart stay on-policy, while new weights under the same name
give a new one.

Swaps are atomic from the caller's side: a request resolves its adapter once, on arrival, and keeps
that object to the end; a load replaces the registry entry only after the new weights are attached,
so a request that arrives after the load's 200 gets them, one in flight finishes on the old ones, and
a failed load changes nothing. The weights themselves are the server's business
(`ModelServer.attach_adapter` / `detach_adapter`).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from pydantic import BaseModel, ConfigDict, Field


class LoadLoraAdapterRequest(BaseModel):
    """vLLM's `LoadLoRAAdapterRequest`."""

    model_config = ConfigDict(extra="ignore")

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)
    load_inplace: bool = False


class UpdateWeightsFromDiskRequest(BaseModel):
    """SGLang's `/update_weights_from_disk` body: a checkpoint folder the server reads, and the version to call it."""

    model_config = ConfigDict(extra="ignore")

    model_path: str = Field(min_length=1, max_length=4096)
    weight_version: str | None = Field(default=None, min_length=1, max_length=256)


class UnloadLoraAdapterRequest(BaseModel):
    """vLLM's `UnloadLoRAAdapterRequest` (`lora_int_id` is accepted and ignored, as vLLM does)."""

    model_config = ConfigDict(extra="ignore")

    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None


@dataclass(frozen=True)
class Adapter:
    """One loaded adapter: what it is called, where it came from, its load number (which orders loads:
    the latest is the policy), the digest of its files and the server's handle."""

    name: str
    path: str
    load_id: int
    digest: str = ""
    handle: Any = field(default=None, compare=False, repr=False)
    loaded_at: float = field(default_factory=time.time)
    load_s: float = 0.0

    @property
    def version(self) -> str:
        return f"{self.name}@{self.digest or self.load_id}"


def content_digest(path: str) -> str:
    """12 hex digits of the sha256 of an adapter's files (a folder's files in relative-name order, or
    one file); for a path this process cannot read, of the path string. Files a server derives from
    the adapter and caches beside it (`*.rollgym-*`, the embedded model's GGUF conversion) are left out."""
    root = Path(path)
    sha = hashlib.sha256()
    if root.is_dir():
        files = sorted(p for p in root.rglob("*") if p.is_file() and ".rollgym-" not in p.name)
    else:
        files = [root] if root.is_file() else []
    if not files:
        sha.update(b"path\0" + path.encode())
    for file in files:
        sha.update(str(file.relative_to(root) if file != root else file.name).encode() + b"\0")
        with file.open("rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                sha.update(chunk)
        sha.update(b"\0")
    return sha.hexdigest()[:12]


class AdapterRegistry:
    """The adapters a model server holds, by name; mutated only on the event loop, so swaps are atomic."""

    def __init__(self) -> None:
        self._adapters: dict[str, Adapter] = {}
        self._counter = 0

    def __contains__(self, name: object) -> bool:
        return name in self._adapters

    def __len__(self) -> int:
        return len(self._adapters)

    def get(self, name: str) -> Adapter | None:
        return self._adapters.get(name)

    def all(self) -> list[Adapter]:
        """Loaded adapters, oldest load first."""
        return sorted(self._adapters.values(), key=lambda adapter: adapter.load_id)

    def next_id(self) -> int:
        self._counter += 1
        return self._counter

    def put(self, adapter: Adapter) -> Adapter | None:
        """Serve `adapter` under its name from now on; returns the adapter it replaced, if any."""
        previous = self._adapters.get(adapter.name)
        self._adapters[adapter.name] = adapter
        return previous

    def pop(self, name: str) -> Adapter | None:
        return self._adapters.pop(name, None)

    def policy(self) -> Adapter | None:
        """The adapter loaded most recently (None: the base weights)."""
        return max(self._adapters.values(), key=lambda adapter: adapter.load_id, default=None)

    def resolve(self, model: Any, base_names: list[str]) -> Adapter | None:
        """The adapter that serves a request for `model` (None: the base weights)."""
        if isinstance(model, str):
            if model in self._adapters:
                return self._adapters[model]
            if model in base_names:
                return None
        return self.policy()


def model_card(adapter: Adapter, parent: str) -> dict[str, Any]:
    """An adapter's entry in `GET /v1/models` (vLLM's ModelCard fields, plus its version)."""
    return {"id": adapter.name, "object": "model", "created": int(adapter.loaded_at), "owned_by": "rollgym",
            "root": adapter.path, "parent": parent, "model_version": adapter.version}


def stamp_version(items: list[dict[str, Any]], version: str | None) -> list[dict[str, Any]]:
    """Put `model_version` on every generated item that does not carry one yet."""
    if version is not None:
        for item in items:
            if isinstance(item, dict):
                item.setdefault("model_version", version)
    return items


async def publish(registry: Mapping[str, Any], action: str, body: dict[str, Any] | None = None,
                  servers: list[str] | None = None, *, timeout_s: float = 600.0) -> list[dict[str, Any]]:
    """Call an adapter route on every replica of the stack's model servers (or of `servers`).

    `action` is "load" or "unload" (POST `/v1/{action}_lora_adapter` with `body`), "weights" (POST
    `/update_weights_from_disk` with `body`: full weights, train/loop/weights.py) or "list" (GET `/v1/models`). Returns one `{server, url, status, answer}` per replica, in registry order; a
    replica that does not answer has status 0 and the reason as its answer.
    """
    from .client import ServerCallError, ServerClient

    names = servers if servers is not None else [name for name, address in registry.items()
                                                 if address.role in ("models", "")]
    unknown = [name for name in names if name not in registry]
    if unknown:
        raise KeyError(f"no server named {', '.join(map(repr, unknown))} in the registry; "
                       f"its servers: {', '.join(registry)}")
    client = ServerClient(timeout_s=timeout_s, max_retries=1)

    async def one(name: str, url: str) -> dict[str, Any]:
        token = registry[name].auth_token
        headers = {"Authorization": f"Bearer {token}"} if token else None
        try:
            if action == "list":
                reply = await client.get(url, "/v1/models", headers=headers)
            elif action == "weights":  # a failed reload is the replica's answer, reported, not retried here
                reply = await client.post(url, "/update_weights_from_disk", json=body, headers=headers,
                                          retry_statuses=())
            else:
                reply = await client.post(url, f"/v1/{action}_lora_adapter", json=body, headers=headers)
        except ServerCallError as exc:
            return {"server": name, "url": url, "status": 0, "answer": str(exc)}
        try:
            answer: Any = reply.json()
        except ValueError:
            answer = reply.text
        return {"server": name, "url": url, "status": reply.status,
                "answer": answer if reply.ok else reply.error_message()}

    try:
        return list(await asyncio.gather(*(one(name, url) for name in names for url in registry[name].urls)))
    finally:
        await client.close()


class AdapterRefused(RuntimeError):
    """A replica did not take an adapter (`status` 0: it did not answer); `loaded` holds the replicas
    (server, url) that did take it, so a caller can unload it again."""

    def __init__(self, message: str, *, server: str, url: str, status: int,
                 loaded: list[tuple[str, str]]) -> None:
        super().__init__(message)
        self.server, self.url, self.status, self.loaded = server, url, status, loaded


async def load_everywhere(registry: Mapping[str, Any], servers: list[str], lora_name: str, lora_path: str, *,
                          timeout_s: float = 600.0) -> list[str | None]:
    """Load an adapter under `lora_name` on every replica of `servers` (in place: a name already loaded gets
    the new weights, as vLLM's `load_inplace`) and return the `model_version` each replica answers with
    (None where it says none, as vLLM does). Raises AdapterRefused for the first replica that refused it or
    did not answer. The one hot-load of rollgym: the train loop's apply phase, the orchestrator and
    `rollgym eval` all load adapters through here."""
    body = {"lora_name": lora_name, "lora_path": lora_path, "load_inplace": True}
    replies = await publish(registry, "load", body, servers=servers, timeout_s=timeout_s)
    loaded = [(reply["server"], reply["url"]) for reply in replies if reply["status"] == 200]
    for reply in replies:
        if reply["status"] != 200:
            how = ("did not answer" if reply["status"] == 0 else f"refused adapter {lora_name!r} ({lora_path}): "
                   f"HTTP {reply['status']}")
            raise AdapterRefused(f"{reply['server']} at {reply['url']} {how}: {reply['answer']}",
                                 server=reply["server"], url=reply["url"], status=reply["status"], loaded=loaded)
    return [reply["answer"].get("model_version") if isinstance(reply["answer"], dict) else None for reply in replies]


def base_card(cards: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The base model's entry of a `GET /v1/models` listing: the card without a parent."""
    return next((card for card in cards if isinstance(card, dict) and not card.get("parent")), None)


async def listed_version(registry: Mapping[str, Any], server: str, name: str | None) -> str | None:
    """The `model_version` every replica of `server` lists for the adapter `name` (None: the base model's
    card); None when the replicas disagree, do not answer, or do not say."""
    versions = set()
    for reply in await publish(registry, "list", servers=[server], timeout_s=30.0):
        cards = reply["answer"].get("data", []) if reply["status"] == 200 and isinstance(reply["answer"], dict) else []
        card = base_card(cards) if name is None else next(
            (c for c in cards if isinstance(c, dict) and c.get("id") == name), None)
        versions.add(card.get("model_version") if card else None)
    return versions.pop() if len(versions) == 1 and None not in versions else None


__all__ = ["Adapter", "AdapterRefused", "AdapterRegistry", "LoadLoraAdapterRequest", "UnloadLoraAdapterRequest",
           "UpdateWeightsFromDiskRequest",
           "base_card", "content_digest", "listed_version", "load_everywhere", "model_card", "publish",
           "stamp_version"]
