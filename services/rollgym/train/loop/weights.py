"""`apply: weights`: a full-weight step served by engines that reload it (vLLM, SGLang, the transformers server).

    the trainer's step ends   STEP/train/checkpoint/model/*.safetensors (the checkpoint a resume loads)
    stage (the transport)     the step's safetensors where every replica reads them: WEIGHTS_DIR/VERSION/
    check                     their tensor names and shapes against the served model's (`reference`), so
                              that a checkpoint an engine would reject, or load half of, reaches none of them
    reload                    POST /update_weights_from_disk {model_path, weight_version} on every replica of
                              the policy model server, all at once (models/chat_completions/weights.py: vLLM
                              pauses, reloads, names the version, resumes; SGLang reloads)
    version                   `NAME@VERSION` counts once every replica serves it; a replica that failed keeps
                              its old weights, is named in the step's log and history, and is tried again
                              with the next step's weights

**Transports.** How the weights travel is a plug-in (`WeightTransport`): `stage(checkpoint, version)` makes
a step's weights readable by every replica and returns what the replicas load (a folder for `disk`), and
`close()` removes what it staged. `disk` copies the checkpoint's safetensors into `weights.dir` (default
`/dev/shm/rollgym-weights/RUN`, memory on one machine; a shared filesystem across machines) and keeps the
last `weights.keep` steps, or with `dir: checkpoint` hands the replicas the trainer's checkpoint folder
itself. A collective broadcast (vLLM's weight-transfer protocol: `/init_weight_transfer_engine`,
`/start_weight_update`, `/update_weights`, `/finish_weight_update` over NCCL; SGLang's
`update_weights_from_distributed`) is the next transport: its `stage` sends the tensors from the trainer's
rank 0 while the replicas receive them, and the model server's reload route takes the transfer's handle
instead of a folder; the loop does not change.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping, Protocol

from pydantic import Field

from ...adapters import publish
from ...config import StrictModel
from ..trainers.base import BUILTIN

SHM = Path("/dev/shm")
# Tensors a checkpoint may leave out: an output layer tied to the embeddings is saved once.
TIED = ("lm_head.weight",)


class WeightsConfig(StrictModel):
    """How full weights reach the serving engines (`apply: weights`; mode: async with finetune: full)."""

    transport: Literal["disk"] = Field(default="disk", description="disk: a folder every replica reads (the "
                                       "only one today; a collective broadcast is the next)")
    dir: str | None = Field(default=None, description="where the replicas read each step's weights: a folder "
                            "(default /dev/shm/rollgym-weights/RUN, else OUTPUT/serving/weights), or 'checkpoint': "
                            "the trainer's checkpoint folder itself (no copy)")
    keep: int = Field(default=2, ge=1, description="staged steps kept (older ones are removed)")
    reference: str | None = Field(default=None, description="the served model's folder, whose safetensors name every "
                                  "tensor and shape a checkpoint must have (default: base_model when it is a folder)")
    timeout_s: float = Field(default=600.0, gt=0, description="one replica's reload")


class WeightsRefused(ValueError):
    """A checkpoint no replica was given: its tensors do not match the served model's (the message says which)."""


class WeightTransport(Protocol):
    """Makes a step's weights readable by every replica of the policy model."""

    def stage(self, checkpoint: Path, version: str) -> str:
        """Put the weights of `checkpoint` (a folder of safetensors) where every replica reads them; what the
        replicas load (`model_path` of their reload route)."""
        ...

    def close(self) -> None:
        """Remove everything staged."""
        ...


def default_dir(output: Path) -> Path:
    """`/dev/shm/rollgym-weights/RUN` (RUN: the run folder's name and a hash of its path), else the run's own."""
    resolved = Path(output).resolve()
    if SHM.is_dir():
        tag = hashlib.sha1(str(resolved).encode()).hexdigest()[:8]
        return SHM / "rollgym-weights" / f"{resolved.name}-{tag}"
    return resolved / "serving" / "weights"


class DiskTransport:
    """Each step's safetensors copied into a folder of their own (written beside, then renamed: a replica never
    reads a half-written step); the last `keep` are kept. With no folder, the checkpoint itself is read."""

    def __init__(self, folder: Path | None, keep: int = 2) -> None:
        self.folder = folder
        self.keep = keep
        self.staged: list[Path] = []
        if folder is not None:  # a killed run's leftovers
            shutil.rmtree(folder, ignore_errors=True)

    def stage(self, checkpoint: Path, version: str) -> str:
        if self.folder is None:
            return str(Path(checkpoint).resolve())
        target = self.folder / version
        partial = self.folder / f"{version}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        for file in weight_files(Path(checkpoint)):
            shutil.copyfile(file, partial / file.name)
        index = Path(checkpoint) / "model.safetensors.index.json"
        if index.is_file():
            shutil.copyfile(index, partial / index.name)
        shutil.rmtree(target, ignore_errors=True)
        partial.replace(target)
        self.staged = [path for path in self.staged if path != target] + [target]
        for old in self.staged[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        self.staged = self.staged[-self.keep:]
        return str(target)

    def close(self) -> None:
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
        self.staged = []


def transport_for(config: WeightsConfig, output: Path) -> WeightTransport:
    if config.dir == "checkpoint":
        return DiskTransport(None)
    return DiskTransport(Path(config.dir) if config.dir else default_dir(output), config.keep)


# ---------------------------------------------------------------------------- the check


def weight_files(folder: Path) -> list[Path]:
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise WeightsRefused(f"{folder}: no *.safetensors files (the trainer writes model/*.safetensors)")
    return files


def tensor_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape in a folder of safetensors files, read from their headers only."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in weight_files(folder):
        with file.open("rb") as handle:
            try:
                (length,) = struct.unpack("<Q", handle.read(8))
                header = json.loads(handle.read(length))
            except (struct.error, ValueError) as exc:
                raise WeightsRefused(f"{file}: not a safetensors file ({exc})") from None
        shapes.update({name: tuple(entry["shape"]) for name, entry in header.items() if name != "__metadata__"})
    return shapes


def check_tensors(checkpoint: dict[str, tuple[int, ...]], served: dict[str, tuple[int, ...]], where: str) -> None:
    """WeightsRefused naming what differs: a tensor the served model has and the checkpoint lacks (a tied
    output layer aside), one it does not know, a shape that differs."""
    missing = sorted(name for name in served if name not in checkpoint and name not in TIED)
    unknown = sorted(name for name in checkpoint if name not in served and name not in TIED)
    reshaped = sorted(f"{name} {list(checkpoint[name])} (served: {list(served[name])})"
                      for name in checkpoint.keys() & served.keys() if checkpoint[name] != served[name])
    problems = ([f"missing tensors: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}"] if missing else []) \
        + ([f"tensors the served model does not have: {', '.join(unknown[:8])}"] if unknown else []) \
        + ([f"wrong shapes: {'; '.join(reshaped[:8])}"] if reshaped else [])
    if problems:
        raise WeightsRefused(f"{where}: refused before any replica loaded it: {'; '.join(problems)}")


def reference_of(config: WeightsConfig, base_model: str) -> Path | None:
    """The served model's folder to check checkpoints against: `weights.reference`, or base_model if a folder."""
    if config.reference:
        return Path(config.reference)
    path = Path(base_model)
    return path if path.is_dir() and any(path.glob("*.safetensors")) else None


# ---------------------------------------------------------------------------- the publish


@dataclass
class WeightsSync:
    """One step's weights on the replicas: the version, how long each part took, who failed and why."""

    version: str
    path: str
    seconds: dict[str, float] = field(default_factory=dict)
    replicas: list[dict[str, Any]] = field(default_factory=list)

    @property
    def failed(self) -> list[dict[str, Any]]:
        return [replica for replica in self.replicas if not replica["ok"]]

    @property
    def counted(self) -> bool:
        """Every replica serves the version."""
        return bool(self.replicas) and not self.failed

    def summary(self) -> dict[str, Any]:
        """What a step's history line keeps."""
        return {"version": self.version, "counted": self.counted, "replicas": len(self.replicas),
                "seconds": self.seconds, **({"failed": self.failed} if self.failed else {})}


async def reload_everywhere(registry: Mapping[str, Any], server: str, path: str, version: str, *,
                            pause_mode: str = "wait", timeout_s: float = 600.0) -> list[dict[str, Any]]:
    """POST /update_weights_from_disk on every replica of `server`, at once; each replica's `{url, ok, message,
    backends?}`. The one full-weight reload of rollgym: both loop modes and `pause_mode` (in-flight updates
    abort) go through here."""
    body = {"model_path": path, "weight_version": version, "pause_mode": pause_mode}
    replies = await publish(registry, "weights", body, servers=[server], timeout_s=timeout_s)
    results = []
    for reply in replies:
        ok = reply["status"] == 200
        answer = reply["answer"]
        message = "reloaded" if ok else ("did not answer: " if reply["status"] == 0 else f"HTTP {reply['status']}: ") \
            + str(answer)
        results.append({"url": reply["url"], "ok": ok, "message": message,
                        **({"backends": answer.get("backends")} if ok and isinstance(answer, dict) else {})})
    return results


class FullWeights:
    """Stages, checks and reloads each full-weight step on the policy model's replicas (both loop modes)."""

    def __init__(self, config: WeightsConfig, output: Path, base_model: str, log: Any = print) -> None:
        self.config = config
        self.transport = transport_for(config, output)
        self.reference = reference_of(config, base_model)
        self.served: dict[str, tuple[int, ...]] | None = None  # the served tensors, once read
        self.log = log
        self.last: WeightsSync | None = None

    def _served_shapes(self) -> dict[str, tuple[int, ...]] | None:
        if self.served is None and self.reference is not None:
            self.served = tensor_shapes(self.reference)
        return self.served

    def publish(self, registry: Mapping[str, Any], server: str, checkpoint: str | Path, version: str,
                pause_mode: str = "wait") -> WeightsSync:
        """Make every replica of `server` serve the weights of `checkpoint` as `version`; WeightsRefused (before
        any replica changed) when the checkpoint's tensors are not the served model's."""
        return asyncio.run(self.publish_async(registry, server, checkpoint, version, pause_mode))

    async def publish_async(self, registry: Mapping[str, Any], server: str, checkpoint: str | Path, version: str,
                            pause_mode: str = "wait") -> WeightsSync:
        """`publish` from a coroutine (mode: async): the check and the copy run in a thread."""
        checkpoint = Path(checkpoint)
        started = time.perf_counter()
        shapes = await asyncio.to_thread(tensor_shapes, checkpoint)
        served = await asyncio.to_thread(self._served_shapes)
        if served is not None:
            check_tensors(shapes, served, str(checkpoint))
        else:
            self.served = shapes
        checked = time.perf_counter()
        path = await asyncio.to_thread(self.transport.stage, checkpoint, version.rsplit("@", 1)[-1])
        staged = time.perf_counter()
        replicas = await reload_everywhere(registry, server, path, version, pause_mode=pause_mode,
                                           timeout_s=self.config.timeout_s)
        return self._record(version, path, replicas, started, checked, staged)

    def _record(self, version: str, path: str, replicas: list[dict[str, Any]], started: float, checked: float,
                staged: float) -> WeightsSync:
        now = time.perf_counter()
        sync = WeightsSync(version, path, {"check": round(checked - started, 3), "stage": round(staged - checked, 3),
                                           "reload": round(now - staged, 3), "total": round(now - started, 3)},
                           replicas)
        for replica in sync.failed:
            self.log(f"weights {version}: replica {replica['url']} did not reload them and keeps its old weights "
                     f"(tried again with the next step's): {replica['message']}")
        self.last = sync
        return sync

    def close(self) -> None:
        self.transport.close()


# ---------------------------------------------------------------------------- the plan's checks


def full_weight_problems(plan: Any) -> list[str]:
    """The plan's problems with full weights, by key: they are served as weights (apply: weights or merged),
    never as the LoRA adapter that apply: lora hot-loads, and apply: weights serves nothing else (a custom
    trainer that does not say is taken at its artefact's word when it is applied); refused when the plan
    loads rather than after the first step. (mode: async serves a finetune: full step as weights.)"""
    problems = [f"stages[{i}].optimize.args.finetune: full trains every weight, which stages[{i}].apply: lora "
                "cannot serve (it hot-loads a LoRA adapter); use apply: weights (vLLM, SGLang), merged or none, "
                "or finetune: lora" for i, stage in enumerate(plan.stages)
                if stage.optimize.finetune == "full" and stage.apply == "lora"]
    problems += [f"stages[{i}].apply: weights reloads full weights on the serving engines; "
                 f"stages[{i}].optimize trains {stage.optimize.finetune or 'a LoRA adapter'} (use "
                 "optimize.trainer: grpo with args.finetune: full, or apply: lora)"
                 for i, stage in enumerate(plan.stages)
                 if stage.apply == "weights" and stage.optimize.finetune != "full"
                 and (stage.optimize.finetune is not None or stage.optimize.trainer in BUILTIN)]
    reloaded = [(f"stages[{i}].optimize", stage.optimize) for i, stage in enumerate(plan.stages)
                if stage.apply == "weights"]
    if plan.mode == "async" and plan.optimize is not None and plan.optimize.finetune == "full" and not plan.colocate:
        reloaded.append(("optimize", plan.optimize))
    problems += [f"{key}.args.checkpoint_every: full weights reloaded by the engines need every step's "
                 "weights on disk (a step between checkpoints writes none); leave it at 1"
                 for key, optimize in reloaded if optimize.grpo is not None and optimize.grpo.checkpoint_every > 1]
    return problems


# The model servers that reload full weights from a folder (POST /update_weights_from_disk), and for
# chat_completions the backends that can.
RELOADING_SERVERS = ("chat_completions", "transformers")
RELOADING_BACKENDS = ("vllm", "sglang")


def reload_problems(plan: Any, policy: Any) -> list[tuple[str, str]]:
    """(key, why) when the plan serves full weights by reload (apply: weights; mode: async with finetune: full)
    and the stack's policy_model cannot reload them."""
    if policy is None or not hasattr(plan, "weights") or plan.colocate:
        return []
    keys = [f"stages[{i}].apply" for i, stage in enumerate(plan.stages) if stage.apply == "weights"]
    if plan.mode == "async" and plan.optimize is not None and plan.optimize.finetune == "full":
        keys.append("optimize.args.finetune")
    backend = policy.options.get("backend", "vllm")
    if policy.folder not in RELOADING_SERVERS:
        why = f"the stack's policy_model is models/{policy.folder}, which cannot reload full weights"
    elif policy.folder == "chat_completions" and backend not in RELOADING_BACKENDS:
        why = f"the stack's policy_model has backend {backend!r}, which cannot reload full weights"
    else:
        return []
    return [(key, f"{why}: full weights are served by models/chat_completions in front of vLLM or SGLang "
                  "(or the transformers server), or with colocate: true") for key in keys]


__all__ = ["DiskTransport", "FullWeights", "WeightTransport", "WeightsConfig", "WeightsRefused", "WeightsSync",
           "check_tensors", "default_dir", "full_weight_problems", "reload_everywhere", "reload_problems",
           "tensor_shapes", "transport_for"]
