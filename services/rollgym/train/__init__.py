"""Closing the loop: from collected rollouts to a better model, through three doors.

    rollgym train PLAN.yaml          (rollgym.cli.train)
    rollgym orchestrate CONFIG.yaml  (rollgym.cli.orchestrate)

- `loop/`: what `rollgym train` drives: the plan, the epoch phases (collect → curate → optimize → apply →
  validate), the async driver, the run folder, the guard, history with its tracker and plots.
- `orchestrator/`: the generation side: task sources, groups and the difficulty filter, bounded staleness,
  policy versions, step metrics, resume, and the batch transports (step folders, the step server).
- `trainers/`: the optimize side: the trainer contract, the child-process job, the TRL trainers, rollgym's
  GRPO trainer (its loss, its long-lived process), the policy loader and the GGUF export.

`loop` may import the other two; `orchestrator` and `trainers` import neither each other nor `loop`.
All three import the kernel and `data/` (advantages, records, JSONL). Names load on first use: the CLI
starts without pydantic, torch or TRL.
"""

import importlib
from typing import Any

_EXPORTS = {
    "Artefact": ".trainers.base", "RemoteTrainer": ".trainers.base", "TrainConfig": ".trainers.base",
    "Trainer": ".trainers.base", "TrainingFailed": ".trainers.base", "TrainingJob": ".trainers.base",
    "SubprocessJob": ".trainers.jobs", "CurateConfig": ".loop.curation", "curate": ".loop.curation",
    "Plan": ".loop.plan", "PlanError": ".loop.plan", "load_plan": ".loop.plan", "TrainLoop": ".loop.epochs",
    "TrainError": ".loop.epochs", "AsyncTrainLoop": ".loop.async_driver", "Orchestrator": ".orchestrator.orchestrator",
    "OrchestratorError": ".orchestrator.orchestrator", "OrchestratorConfig": ".orchestrator.config",
    "Batch": ".orchestrator.transports.folders", "StepFolders": ".orchestrator.transports.folders",
    "StepServer": ".orchestrator.transports.http",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rollgym.train' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


__all__ = sorted(_EXPORTS)
