"""The trainer contract: what the training loop hands a trainer and what it gets back.

Two shapes, as trainers come:

- `Trainer.fit(dataset, config) -> Artefact` for a trainer that runs here, in this Python process or
  (through `SubprocessJob`) in a child process of it;
- `RemoteTrainer.submit(dataset, config) -> TrainingJob` for one that runs elsewhere (a cluster, a
  service behind HTTP): the job says `status()`, `wait()`s for its artefact, and can be `cancel()`ed.

`dataset` is a JSONL file of curated records (see `curation.py` for the three kinds); `config` says
which base model and which previous artefact to start from, where to write, and the trainer's own
arguments from the plan (`optimize.args`). A failed run raises `TrainingFailed` with its cause; the loop records it and
stops that step instead of dying with it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny

from ...config import import_target

JobStatus = Literal["running", "succeeded", "failed", "cancelled"]


class Artefact(BaseModel):
    """What a training step produced: a LoRA folder (PEFT) or full weights, at `uri`."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["lora", "full_weights"]
    uri: str = Field(description="a local path or a URL the model server can load")
    base_model: str = Field(description="the model the artefact applies to")
    version: str = Field(description="the model_version the served model reports once it is applied")
    metrics: dict[str, float] = Field(default_factory=dict, description="train loss, steps, seconds, ...")
    serving_uri: str | None = Field(default=None, description="a GGUF of the merged weights, when asked for")


class TrainConfig(BaseModel):
    """What one optimize step is asked to do."""

    model_config = ConfigDict(extra="forbid")

    base_model: str = Field(description="'bundled' (the embedded SmolLM2 GGUF), a GGUF file, or a Hugging Face model")
    output_dir: str = Field(description="the step's folder; the artefact goes in it")
    version: str = Field(description="the version name the artefact gets")
    init_adapter: str | None = Field(default=None, description="a PEFT folder to continue training from")
    seed: int = 0
    export_gguf: Literal["none", "f16", "f32", "q8_0"] = Field(
        default="none", description="also write the merged weights as a GGUF the embedded model server can serve")
    # A trainer's own arguments from the plan: a dict, or the typed config the plan parsed them into once (the
    # grpo trainer's GRPOConfig), handed on as that object and written out whole.
    args: dict[str, Any] | SerializeAsAny[BaseModel] = Field(default_factory=dict,
                                                             description="the trainer's own arguments, from the plan")
    run_dir: str | None = Field(default=None, description="the run's folder: a long-lived trainer keeps its process "
                                                          "state there (grpo: RUN/trainer/)")


class TrainingFailed(RuntimeError):
    """A training step did not produce an artefact; the message is its cause."""


@runtime_checkable
class Trainer(Protocol):
    """A trainer that runs in this process (or in a child process through `SubprocessJob`)."""

    def fit(self, dataset: Path, config: TrainConfig) -> Artefact: ...


@runtime_checkable
class TrainingJob(Protocol):
    def status(self) -> JobStatus: ...

    def wait(self, timeout: float | None = None) -> Artefact: ...

    def cancel(self) -> None: ...


@runtime_checkable
class RemoteTrainer(Protocol):
    """A trainer that runs elsewhere: submit returns at once with a job to wait on."""

    def submit(self, dataset: Path, config: TrainConfig) -> TrainingJob: ...


# The built-in trainers, by the name a plan gives `optimize.trainer`; any other name is an import path
# "module:Class". `grpo` is rollgym's own policy-gradient step (grpo_loss.py, grpo_trainer.py) in one
# long-lived process per run; `trl_grpo` is an older name of it, still read: TRL's GRPOTrainer cannot take
# the sampling policy's logprobs (docs/train-objective.md).
BUILTIN = {
    "trl_sft": "rollgym.train.trainers.trl_trainers:SFTTrainer",
    "trl_dpo": "rollgym.train.trainers.trl_trainers:DPOTrainer",
    "grpo": "rollgym.train.trainers.grpo_process:LongLivedTrainer",
    "trl_grpo": "rollgym.train.trainers.grpo_process:LongLivedTrainer",
}

# What each built-in trainer trains on; the loop curates to that kind (curation.py).
DATA_KIND = {"trl_sft": "sft", "trl_dpo": "preferences", "grpo": "groups", "trl_grpo": "groups"}


def import_path(name: str) -> str:
    """The "module:attribute" of a trainer named in a plan."""
    path = BUILTIN.get(name, name)
    if ":" not in path:
        raise ValueError(f"unknown trainer {name!r}: use one of {', '.join(BUILTIN)} or an import path 'module:Class'")
    return path


def load_trainer(name: str, **kwargs: Any) -> Any:
    """An instance of the trainer class named `name` (a built-in name or "module:Class")."""
    path = import_path(name)
    try:
        factory = import_target(path)
    except ValueError as exc:
        raise ValueError(f"trainer {name!r}: {exc}") from None
    trainer = factory(**kwargs)
    if not isinstance(trainer, (Trainer, RemoteTrainer)):
        raise ValueError(f"trainer {name!r} has neither fit(dataset, config) nor submit(dataset, config)")
    return trainer


__all__ = [
    "Artefact", "BUILTIN", "DATA_KIND", "JobStatus", "RemoteTrainer", "TrainConfig", "Trainer", "TrainingFailed",
    "TrainingJob", "import_path", "load_trainer",
]
