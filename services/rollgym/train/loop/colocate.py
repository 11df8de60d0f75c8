"""Co-locate mode (`colocate: true` in a plan): the policy model server and the GRPO trainer in one process
on one device. The stack's `policy_model` is the transformers server of models/transformers/colocate.py,
whose served parameters are the trainer's; agents and environments stay their own processes.

- optimize: `ColocatedTrainer` hands each step to that server (POST /colocate/train_step), which trains
  the served weights on its worker thread and publishes them in memory as `name@VERSION`;
- apply (`memory`, the default under colocate): nothing to load when the server already serves the step's
  version; otherwise (a resumed run, the guard going back to its best model) the step's checkpoint is
  copied into the served weights (POST /update_weights_from_disk; for LoRA, POST /colocate/load_adapter).
- mode: async: the orchestrator's `loader` (`memory_loader`) reads the version each step published, so
  the rollouts' model_versions map to the step that sampled them, as hot-loaded adapters' do.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any, Callable

from ..orchestrator.policy_versions import AdapterLoadError, Loader
from ..trainers.base import Artefact, JobStatus, TrainConfig, TrainingFailed

POLICY = "policy_model"
# The server's config (the stack's policy_model), beside the repository's other model servers.
CONFIG = Path(__file__).resolve().parents[4] / "models" / "transformers" / "configs" / "colocate.yaml"
STEP_TIMEOUT_S = 6 * 3600.0


def colocate_config() -> str:
    if not CONFIG.is_file():
        raise FileNotFoundError(f"colocate: the co-located server's config {CONFIG} is missing "
                                "(models/transformers/configs/colocate.yaml of the rollgym repository)")
    return str(CONFIG)


def colocate_overrides(plan: Any) -> list[str]:
    """What the co-located server is told of the trainer and the model: the model, what it trains, one
    pass's tokens (its memory estimate)."""
    optimize = next((stage.optimize for stage in plan.stages), None) or plan.optimize
    args = optimize.grpo if optimize is not None else None
    overrides = [f"{POLICY}.model_path={plan.base_model}"]
    if args is not None:
        overrides.append(f"{POLICY}.finetune={args.finetune}")
        if args.micro_batch_tokens is not None:  # unset: the server's estimate takes 4096, the trainer picks within
            overrides.append(f"{POLICY}.train_tokens={args.micro_batch_tokens}")  # what the KV cache left free
    return overrides


def policy_url(registry: Any) -> str:
    address = registry.get(POLICY)
    if address is None:
        raise TrainingFailed(f"colocate: the stack has no {POLICY} server")
    if len(address.urls) > 1:
        raise TrainingFailed(f"colocate: {POLICY} has {len(address.urls)} replicas; the co-located trainer is one")
    return str(address.url).rstrip("/")


def colocate_problems(plan: Any) -> list[str]:
    """What co-locate mode needs: its own stack (it starts the co-located server), the grpo trainer, one
    process, apply: memory (or none); and apply: memory only under it."""
    problems = [f"stages[{i}].apply: memory publishes the co-located trainer's weights: it needs colocate: true"
                for i, stage in enumerate(plan.stages) if stage.apply == "memory" and not plan.colocate]
    if not plan.colocate:
        return problems
    if not plan.stack.configs:
        problems.append("colocate: true starts the co-located policy server, so it needs stack.configs "
                        "(not stack.registry_file)")
    optimizers = [(f"stages[{i}].optimize", stage.optimize) for i, stage in enumerate(plan.stages)]
    if plan.mode == "async" and plan.optimize is not None:  # each step published in memory, as in epochs
        optimizers.append(("optimize", plan.optimize))
    for key, optimize in optimizers:
        if optimize.trainer not in ("grpo", "trl_grpo"):
            problems.append(f"{key}.trainer: colocate: true trains with grpo (the trainer that "
                            f"runs inside the policy server), not {optimize.trainer}")
        elif optimize.grpo is not None:
            grpo = optimize.grpo
            problems += [f"{key}.args.{name}: colocate: true runs one trainer process, in the policy server"
                         for name, spread in (("processes", grpo.processes > 1), ("nnodes", grpo.nnodes > 1),
                                              ("devices", grpo.devices is not None)) if spread]
            if grpo.checkpoint_every > 1:  # the co-located server checkpoints each step: what a resume loads
                problems.append(f"{key}.args.checkpoint_every: colocate: true checkpoints every step (a resumed "
                                "run loads the last step's checkpoint into the served weights)")
    for i, stage in enumerate(plan.stages):
        if stage.apply not in ("memory", "none"):
            problems.append(f"stages[{i}].apply: {stage.apply}: under colocate: true the steps are published "
                            "in memory (apply: memory, the default; leave apply out)")
    return problems


class ColocatedJob:
    """One step running in the co-located server, waited on in a thread (the loop's bar keeps ticking)."""

    def __init__(self, url: str, dataset: Path, config: TrainConfig) -> None:
        self.result: dict[str, Any] | None = None
        self.error: str | None = None
        self._thread = threading.Thread(target=self._post, args=(url, dataset, config), daemon=True)
        self._thread.start()

    def _post(self, url: str, dataset: Path, config: TrainConfig) -> None:
        import httpx

        body = {"dataset": str(Path(dataset).resolve()), "config": config.model_dump(mode="json")}
        try:
            reply = httpx.post(f"{url}/colocate/train_step", json=body, timeout=STEP_TIMEOUT_S)
        except httpx.HTTPError as exc:
            self.error = f"the co-located server did not answer the step: {type(exc).__name__}: {exc}"
            return
        if reply.status_code != 200:
            try:
                message = reply.json().get("error", {}).get("message") or reply.text
            except ValueError:
                message = reply.text
            self.error = f"the co-located server refused the step ({reply.status_code}): {message}"
            return
        self.result = reply.json()

    def status(self) -> JobStatus:
        if self._thread.is_alive():
            return "running"
        return "succeeded" if self.result is not None else "failed"

    def wait(self, timeout: float | None = None) -> Artefact:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TrainingFailed(f"colocate: still running after {timeout} s")
        if self.result is None:
            raise TrainingFailed(f"colocate: {self.error}")
        return Artefact.model_validate(self.result["artefact"])

    def cancel(self) -> None:  # the step runs to its end in the server; nothing here to stop
        return None


class ColocatedTrainer:
    """The `grpo` trainer of a co-located run (a RemoteTrainer): the step runs in the policy server."""

    def __init__(self, serving: Any) -> None:
        self.serving = serving

    def submit(self, dataset: Path, config: TrainConfig) -> ColocatedJob:
        return ColocatedJob(policy_url(self.serving.registry), dataset, config)

    def close(self) -> None:  # the server stops with the stack
        return None


def publish(registry: Any, artefact: Artefact, listed: str | None) -> str:
    """Make the co-located server serve `artefact` (listed: what it serves now); the version it serves."""
    return publish_checkpoint(registry, artefact.kind == "full_weights", artefact.uri, artefact.version, listed)


def publish_checkpoint(registry: Any, full: bool, uri: str, version: str, listed: str | None) -> str:
    """Make the co-located server serve the step `version` whose checkpoint is `uri`; the version it serves."""
    if listed is not None and listed.rsplit("@", 1)[-1] == version:
        return listed  # the step published it in memory
    import httpx

    url = policy_url(registry)
    if full:
        reply = httpx.post(f"{url}/update_weights_from_disk", timeout=600.0,
                           json={"model_path": uri, "weight_version": f"{(listed or POLICY).rsplit('@', 1)[0]}@{version}"})
        if reply.status_code != 200:
            raise TrainingFailed(f"apply: memory: {POLICY} did not load {uri}: {reply.text}")
        # The weights are those of the step; its name makes the rollouts' versions comparable.
        return str(reply.json()["model_version"])
    reply = httpx.post(f"{url}/colocate/load_adapter", timeout=600.0, json={"adapter_path": uri, "version": version})
    if reply.status_code != 200:
        raise TrainingFailed(f"apply: memory: {POLICY} did not load the adapter {uri}: {reply.text}")
    return str(reply.json()["model_version"])


def memory_loader(registry: Any, full: bool, version_of: Callable[[int], str]) -> Loader:
    """mode: async's stand-in for the LoRA hot-load (the orchestrator's `loader`): a finished step is already
    served (published in memory) and only its version is read back; a resumed run's last step is copied in
    from its checkpoint first."""
    from ...adapters import listed_version

    async def load(uri: str, step: int) -> list[str]:
        listed = await listed_version(registry, POLICY, None)
        try:
            return [await asyncio.to_thread(publish_checkpoint, registry, full, uri, version_of(step), listed)]
        except TrainingFailed as exc:
            raise AdapterLoadError(f"step {step}: {exc}") from None

    return load


__all__ = ["CONFIG", "ColocatedJob", "ColocatedTrainer", "colocate_config", "colocate_problems", "colocate_overrides",
           "memory_loader", "policy_url", "publish", "publish_checkpoint"]
