"""The optimize phase: a run's trainers, and one step through them.

A run keeps one instance per trainer name: a long-lived one (`grpo`) keeps its process, model and
optimizer from step to step. A `fit()` trainer runs each step in a child process (`trainers.jobs`), so a
crash or an out-of-memory kill fails that step with its cause instead of taking the loop down; a
`RemoteTrainer` submits the step elsewhere. Either way the step's artefact is recorded in its folder
(`train/artefact.json`), so that a resumed run never trains or submits it again.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Callable

from ...data.jsonl import write_json_atomic
from ..trainers.base import Artefact, RemoteTrainer, TrainConfig, load_trainer
from ..trainers.grpo_config import GRPOConfig
from ..trainers.jobs import ARTEFACT_FILE, SubprocessJob, finished_artefact
from ..trainers.progress import clear_progress, read_progress
from .plan import RL_TRAINERS, OptimizeConfig, Plan


class Trainers:
    """The trainer instances of one run, by name."""

    def __init__(self) -> None:
        self.instances: dict[str, Any] = {}

    def get(self, name: str, key: str | None = None) -> Any:
        """The run's instance of a trainer: a long-lived one (grpo) keeps its process across steps. `key` names
        an instance of its own (each policy of a plan with several has one: its own model and optimizer)."""
        key = key or name
        if key not in self.instances:
            self.instances[key] = load_trainer(name)
        return self.instances[key]

    def close(self) -> None:
        """Stop the run's trainer processes."""
        for instance in self.instances.values():
            close = getattr(instance, "close", None)
            if callable(close):
                close()
        self.instances.clear()

    def train(self, name: str, dataset: Path, config: TrainConfig,
              tick: Callable[[dict[str, Any] | None], None] | None = None, key: str | None = None) -> Artefact:
        """Run one optimize step through the trainer `name` and record its artefact in the step's folder;
        `tick` hears the step's progress (progress.py: step k of n, loss, tokens; None before the first) while
        it runs."""
        instance = self.get(name, key)
        clear_progress(config.output_dir)  # an earlier attempt's steps are not this one's
        if isinstance(instance, RemoteTrainer):
            job = instance.submit(dataset, config)
        else:  # a fit() trainer runs in a child process: its crash fails this step, not the loop
            job = SubprocessJob.start(name, dataset, config)
        while tick is not None and job.status() == "running":
            tick(read_progress(config.output_dir))
            time.sleep(0.2)
        if tick is not None:  # the last steps, however quickly they came
            tick(read_progress(config.output_dir))
        artefact = job.wait()
        folder = Path(config.output_dir)
        if finished_artefact(folder) is None:  # a remote job leaves nothing here
            folder.mkdir(parents=True, exist_ok=True)
            write_json_atomic(folder / ARTEFACT_FILE, artefact.model_dump())
        return artefact


def step_config(plan: Plan, optimize: OptimizeConfig, folder: Path, version: str, number: int,
                previous: Artefact | None, export_gguf: str = "none") -> TrainConfig:
    """What the trainer gets for the step of epoch (async: step) `number` whose folder is `folder`."""
    # A long-lived trainer keeps one seed (its RNG state carries on); a trainer per step gets its own.
    seed = plan.seed if optimize.trainer in RL_TRAINERS else plan.seed + number
    return TrainConfig(base_model=plan.base_model, output_dir=str(folder / "train"), version=version,
                       init_adapter=previous.uri if previous else None, seed=seed, export_gguf=export_gguf,
                       args=trainer_args(plan, optimize), run_dir=str(Path(plan.output)))


def trainer_args(plan: Plan, optimize: OptimizeConfig) -> dict[str, Any] | GRPOConfig:
    """The trainer's arguments as it gets them: for an RL trainer, its typed config (parsed once, with the
    plan) with `total_steps` (the LR schedule's length) filled in from the plan when it does not give one;
    any other trainer's own dict."""
    args = optimize.grpo
    if args is None:
        return dict(optimize.args)
    if args.total_steps:
        return args

    def steps(groups: int) -> int:
        return max(1, math.ceil(args.epochs * math.ceil(groups / (args.groups_per_step or groups)))) * args.mini_batches

    if plan.orchestrator is not None:
        total = steps(plan.orchestrator.batch_size // plan.orchestrator.rollouts_per_example) * (
            plan.orchestrator.max_steps or 0)
    else:
        total = sum(stage.epochs * steps(stage.collect.limit or _task_count(stage.collect.files[0]))
                    for stage in plan.stages if stage.optimize is optimize and stage.collect is not None)
    return args.model_copy(update={"total_steps": total}) if total else args


def _task_count(path: str) -> int:
    try:
        with open(path, "rb") as handle:
            return max(1, sum(1 for line in handle if line.strip()))
    except OSError:
        return 1


__all__ = ["Trainers", "step_config", "trainer_args"]
