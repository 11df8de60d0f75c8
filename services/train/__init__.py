"""Closing the loop: trainer adapters, curation, the training plan and the epoch loop.

    rollgym train PLAN.yaml

`trainers` (the adapter protocol and `Artefact`), `jobs` (a training step in a child process),
`trl_trainers` (SFT, DPO and GRPO on TRL + PEFT), `policy` and `gguf_export` (the model a trainer
trains and the GGUF it serves), `curation` (rollouts → training records), `plan` (the YAML),
`serving` (the stack and the apply phase), `loop` (the epochs), `plot`; the command is rollgym.cli.train.
Async RL: `orchestrator` (bounded-staleness step batches), with `orchestrator_config`, `advantages`,
`mixing` (task sources, dedupe, env ratios), `policy_versions` (hot-loads, model_version → step),
`steps` (the step-folder transport), `resume`, `step_metrics` and `step_server` (the trainer's HTTP signal).
Names load on first use: the CLI starts without pydantic, torch or TRL.
"""

import importlib
from typing import Any

_EXPORTS = {
    "Artefact": ".trainers", "RemoteTrainer": ".trainers", "TrainConfig": ".trainers", "Trainer": ".trainers",
    "TrainingFailed": ".trainers", "TrainingJob": ".trainers", "SubprocessJob": ".jobs", "CurateConfig": ".curation",
    "curate": ".curation", "Plan": ".plan", "PlanError": ".plan", "load_plan": ".plan", "TrainLoop": ".loop",
    "TrainError": ".loop", "Orchestrator": ".orchestrator", "OrchestratorError": ".orchestrator",
    "OrchestratorConfig": ".orchestrator_config", "Batch": ".steps", "StepFolders": ".steps",
    "StepServer": ".step_server",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rollgym.train' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


__all__ = sorted(_EXPORTS)
