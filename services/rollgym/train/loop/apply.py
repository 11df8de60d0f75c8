"""The apply phase: the stack the loop collects through, and getting an artefact into its policy model.

- `lora`: vLLM's runtime route, which every rollgym model server offers too (`adapters.load_everywhere`):
  `POST /v1/load_lora_adapter {"lora_name": version, "lora_path": artefact.uri}` on every replica of
  the policy model; requests then select it with `model: version`. The exact `model_version` the
  replicas report for it (`name@DIGEST`, from `GET /v1/models`, a digest of the adapter's files) is
  what every rollout must carry: a rollout sampled from other weights loaded under the same name is
  stale, and one sampled before a restart that loads the same files again is not.
- `merged`: the embedded llama.cpp model serves the merged weights as a GGUF of the plan's
  `serve_dtype` (written by the trainer, `gguf_export.py`); applying restarts the stack's servers on
  that file. Its model name, the file's stem, is the version the rollouts report. The base model is
  served the same way (a copy of the bundled GGUF in that precision), so that what is sampled is what
  the trainer computes, up to that precision (docs/train-loop.md).
- `weights` (finetune: full): every replica of the policy model (chat_completions in front of vLLM or SGLang,
  or the transformers server) reloads the step's safetensors from a folder they all read, under the version
  `NAME@STEP`; the checkpoint is checked against the served model's tensors first (weights.py).
- `memory` (co-locate mode, `colocate: true`): the policy server is the trainer's own process and the step
  published its weights in memory (colocate.py); applying checks the version it serves.
- `none`: the served model stays as it is.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from ...adapters import AdapterRefused, listed_version, load_everywhere, publish
from ...client import load_registry_file
from ...config import load_stack
from ...stack.launcher import Stack
from .plan import Plan
from .weights import FullWeights, WeightsRefused
from ..trainers.base import Artefact

POLICY = "policy_model"  # the model server the agents of a stack name


class ApplyError(RuntimeError):
    """The policy could not be served or an artefact applied; the message says which and why."""


class Serving:
    """Starts (or attaches to) the plan's stack and applies artefacts to its policy model."""

    def __init__(self, plan: Plan, serving_dir: Path) -> None:
        self.plan = plan
        self.serving_dir = serving_dir
        self.stack: Stack | None = None
        self.registry: dict[str, Any] = {}
        self.model_path: str | None = None  # merged: the GGUF being served
        self.version: str | None = None  # what the rollouts must report; None = not known/checked
        self.lora_loaded: set[str] = set()
        self.full: FullWeights | None = None  # apply: weights (and mode: async with finetune: full)
        self.base_name: str | None = None  # the served model's own name, which full-weight versions extend
        # With several policies (plan.policies): the version each policy is served as (its adapter's, or the base's).
        self.policy_versions: dict[str, str | None] = {}

    @property
    def owns_stack(self) -> bool:
        return bool(self.plan.stack.configs)

    def start(self, model_path: str | None = None, timeout_s: float = 300.0) -> None:
        stack = self.plan.stack
        if not self.owns_stack:
            try:
                self.registry = load_registry_file(stack.registry_file or "")
            except ValueError as exc:
                raise ApplyError(f"stack.registry_file: {exc}") from None
            return
        configs, overrides = list(stack.configs), stack.resolved_overrides(self.plan.seed)
        if self.plan.colocate:  # the policy server is the transformers server that hosts the trainer
            from .colocate import colocate_config, colocate_overrides

            try:
                configs.append(colocate_config())
            except FileNotFoundError as exc:
                raise ApplyError(str(exc)) from None
            overrides = colocate_overrides(self.plan) + overrides
        if self.plan.orchestrator is not None and self.plan.orchestrator.inflight_updates:
            # The policy server continues the generations each update aborts (models/chat_completions).
            overrides = [f"{POLICY}.continue_aborted=true"] + overrides
        if self.plan.policies:  # the model server answers each policy's calls with its adapter (rollgym.policies)
            from .policies import server_overrides

            overrides = server_overrides(self.plan.policies, POLICY) + overrides
        if model_path is not None:
            overrides.append(f"{POLICY}.model_path={model_path}")
        self.stack = Stack(load_stack(configs, overrides))
        self.registry = self.stack.start(timeout_s=timeout_s)
        self.model_path = model_path

    def stop(self) -> None:
        if self.stack is not None:
            self.stack.stop()
            self.stack = None
        if self.full is not None:  # what it staged (in /dev/shm by default) goes with the run
            self.full.close()

    def request_params(self) -> dict[str, Any]:
        """What every collection request adds: the served model's name, which selects a hot-loaded
        adapter, or the base weights once adapters are loaded (a server answers a request for no
        known model with its latest adapter)."""
        if self.plan.policies:  # each call's own model name picks its policy
            return {}
        name = (self.version or "").rsplit("@", 1)[0]
        return {"model": name} if name else {}

    def serve_base(self, mode: str, base_model: str) -> None:
        """Start serving the base model; for `merged`, as a `serve_dtype` copy named policy-base."""
        if mode != "merged":
            self.start()
            if mode in ("lora", "memory", "weights"):
                self.version = asyncio.run(listed_version(self.registry, POLICY, None))
            if self.plan.policies:  # every policy on the base weights until its first step is applied
                self.policy_versions = {policy.name: self.version for policy in self.plan.policies}
            if mode == "weights":
                self.full = FullWeights(self.plan.weights, self.serving_dir.parent, base_model, self._log)
                self.base_name = (self.version or POLICY).rsplit("@", 1)[0]
            return
        from ..trainers.gguf_export import write_merged_gguf
        from ..trainers.policy import gguf_of

        try:
            template = gguf_of(base_model)
        except FileNotFoundError as exc:
            raise ApplyError(str(exc)) from None
        if template is None:
            raise ApplyError("apply: merged serves GGUF files with the embedded model; base_model must be "
                             "'bundled' or a *.gguf file (use apply: lora with another model server)")
        path = self.serving_dir / "policy-base.gguf"
        if not path.is_file():
            write_merged_gguf(template, {}, path, self.plan.serve_dtype)
        self.start(str(path))
        self.version = path.stem

    def apply(self, artefact: Artefact | None, mode: str) -> float:
        """Make `artefact` (None: the base model) the served policy; returns the seconds it took."""
        started = time.perf_counter()
        if mode == "none":
            return 0.0
        if mode == "merged":
            path = self.serving_dir / "policy-base.gguf" if artefact is None else artefact.serving_uri
            if not path or not Path(path).is_file():
                raise ApplyError(f"apply: merged: no GGUF of {artefact.version if artefact else 'the base'} "
                                 f"at {path} (the trainer writes it with export_gguf)")
            if str(path) != self.model_path:
                self.stop()
                self.start(str(path))
            self.version = Path(path).stem
        elif mode == "weights":
            self._reload(artefact)
        elif artefact is None:
            self.version = asyncio.run(listed_version(self.registry, POLICY, None))  # the base model, by its own name
        elif mode == "memory":
            from ..trainers.base import TrainingFailed
            from .colocate import publish

            try:
                self.version = publish(self.registry, artefact, asyncio.run(listed_version(self.registry, POLICY, None)))
            except TrainingFailed as exc:
                raise ApplyError(str(exc)) from None
        else:
            self.version = asyncio.run(self._load_lora(artefact))
            self.lora_loaded.add(artefact.version)
        return time.perf_counter() - started

    def apply_policy(self, policy: str, artefact: Artefact | None) -> float:
        """Serve `artefact` (None: the base weights) as policy `policy`: its adapter is loaded under the policy's
        name, replacing the one before (the model server answers the policy's calls with it); returns seconds."""
        started = time.perf_counter()
        if artefact is None:
            if policy in self.lora_loaded:
                asyncio.run(publish(self.registry, "unload", {"lora_name": policy}, servers=[POLICY]))
                self.lora_loaded.discard(policy)
            self.policy_versions[policy] = asyncio.run(listed_version(self.registry, POLICY, None))
        else:
            try:
                asyncio.run(load_everywhere(self.registry, [POLICY], policy, artefact.uri, timeout_s=120.0))
            except AdapterRefused as exc:
                raise ApplyError(f"apply: lora: policy {policy}: {exc}") from None
            self.lora_loaded.add(policy)
            self.policy_versions[policy] = asyncio.run(listed_version(self.registry, POLICY, policy)) or policy
        return time.perf_counter() - started

    def full_version(self, step_version: str) -> str:
        """The version a full-weight step is served as: the served model's name @ the step's."""
        return f"{self.base_name or POLICY}@{step_version}"

    def _reload(self, artefact: Artefact | None) -> None:
        """apply: weights: every replica reloads the artefact's safetensors (None: the base model's, from the
        reference folder); the version counts once every replica serves it, a replica that failed is named."""
        assert self.full is not None
        if artefact is None:
            if self.full.reference is None:
                raise ApplyError("apply: weights: serving the base model again needs its safetensors folder "
                                 "(weights.reference, or base_model as a folder)")
            path, version = str(self.full.reference), self.base_name or POLICY
        elif artefact.kind != "full_weights":
            raise ApplyError(f"apply: weights serves full weights; {artefact.version} is a {artefact.kind} "
                             "(use apply: lora)")
        else:
            path, version = artefact.uri, self.full_version(artefact.version)
        try:
            sync = self.full.publish(self.registry, POLICY, path, version)
        except WeightsRefused as exc:
            raise ApplyError(f"apply: weights: {exc}") from None
        if any(replica["ok"] for replica in sync.replicas):
            # Rollouts of a replica that failed carry its old version: stale, not trained on as this one's.
            self.version = version

    def _log(self, message: str) -> None:
        import sys

        print(f"rollgym: {message}", file=sys.stderr)

    async def _load_lora(self, artefact: Artefact) -> str:
        """Load the adapter on every replica of the policy model; returns the `model_version` they list
        for it, or its name when replicas disagree."""
        try:
            await load_everywhere(self.registry, [POLICY], artefact.version, artefact.uri, timeout_s=120.0)
        except AdapterRefused as exc:
            raise ApplyError(f"apply: lora: {exc}") from None
        return await listed_version(self.registry, POLICY, artefact.version) or artefact.version


__all__ = ["ApplyError", "POLICY", "Serving"]
