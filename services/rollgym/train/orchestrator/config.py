"""The orchestrator's settings (the `orchestrator:` section of an async plan), validated with the field at fault.

Field names follow the GRPO orchestrators users know: `batch_size`, `rollouts_per_example`,
`max_async_level`, `max_off_policy_steps`, `oversampling_factor`, per-environment ratios, `hash_keys`,
an `advantage` and a `difficulty` section.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, field_validator, model_validator

from ...config import StrictModel, key_problems, read_mapping
from ...data.advantages import AdvantageConfig
from ...data.rollout_filters import DifficultyConfig, RolloutFilter
from ...data.sampling import check_params, temperature_schedule


class EnvConfig(StrictModel):
    name: str = Field(min_length=1)
    input: str = Field(description="task rows JSONL")
    agent: str | None = Field(default=None, description="the agent that runs these tasks (default: the row's "
                                                        "agent_ref, else the stack's only agent)")
    ratio: float = Field(default=1.0, ge=0, description="share of each batch's groups, relative to the others")
    limit: int | None = Field(default=None, ge=1)
    params: dict[str, Any] = Field(default_factory=dict, description="merged into responses_create_params; "
                                   "temperature may be a schedule over the steps (rollgym.data.sampling)")

    _params = field_validator("params")(check_params)  # each mistake named: params.temperature


class OrchestratorConfig(StrictModel):
    batch_size: int = Field(default=128, ge=1, description="rollouts per training step")
    rollouts_per_example: int = Field(default=8, ge=1, description="rollouts per task: one group")
    max_steps: int | None = Field(default=None, ge=1, description="stop after this many batches (None: no end)")
    max_async_level: int = Field(default=1, ge=0, description="steps inference may run ahead of the trainer")
    max_off_policy_steps: int = Field(default=8, ge=0, description="oldest policy lag a used rollout may have")
    oversampling_factor: float = Field(default=1.0, ge=1.0, description="groups in flight per group still missing")
    envs: list[EnvConfig] = Field(min_length=1)
    hash_keys: list[str] = Field(default_factory=lambda: ["responses_create_params.input"],
                                 description="task fields that identify a task, for dedupe")
    shuffle: bool = True
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    difficulty: DifficultyConfig = Field(default_factory=DifficultyConfig)
    filters: list[RolloutFilter] = Field(
        default_factory=list, description="degenerate-generation filters, Surogate's filters[] (rollgym.data."
        "rollout_filters): every flag counted in the step's metrics; an enforced one keeps the rollout out of "
        "training (its group's advantages still count it)")
    concurrency: int = Field(default=32, ge=1, description="rollouts in flight at most")
    max_attempts: int = Field(default=3, ge=1, description="tries per rollout for infrastructure failures")
    timeout_s: float = Field(default=3600.0, gt=0, description="one rollout attempt")
    budget_s: float | None = Field(default=None, gt=0, description="all attempts of one rollout together")
    max_drops_per_step: int | None = Field(
        default=None, ge=1, description="after this many dropped groups a step is published with the groups "
                                        "it has; this many failed groups stop the run (default: 20 times the "
                                        "groups in a batch)")
    adapter_name: str = Field(default="policy", min_length=1, description="lora_name of hot-loaded adapters")
    model_servers: list[str] | None = Field(default=None, description="servers to hot-load (default: the model "
                                                                      "servers the agents sample from, as their "
                                                                      "/health says; else every one)")
    inflight_updates: bool = Field(
        default=False, description="a new version does not wait for running generations: each replica is paused "
        "with its requests aborted, and the policy model server continues every aborted generation on the new "
        "weights (models/chat_completions continue_aborted); items record which version sampled which tokens "
        "(model_version_spans), and staleness counts a rollout's oldest token (docs/train-async.md)")
    seed: int = 42
    skip_verification: bool = Field(default=False, description="Surogate's buffer.skip_verification; refused: "
                                    "a batch is GRPO groups weighed by their rewards")

    @field_validator("advantage")
    @classmethod
    def _one_per_rollout(cls, advantage: AdvantageConfig) -> AdvantageConfig:
        if advantage.type == "return_to_go":
            raise ValueError("type return_to_go gives every model turn its own advantage, and the orchestrator's "
                             "batches carry one advantage per rollout; use return_to_go in mode: epochs "
                             "(stages[i].curate.advantage), or another type here (normalized, mean, rloo, ...)")
        return advantage

    @field_validator("skip_verification")
    @classmethod
    def _verified(cls, skip: bool) -> bool:
        if skip:
            raise ValueError("a batch is GRPO groups weighed by their rewards, so every rollout is verified; collect "
                             "unverified rollouts with `rollgym collect-rollouts --skip-verification` or a stage's "
                             "collect.skip_verification (data: sft)")
        return skip

    @field_validator("difficulty")
    @classmethod
    def _async_keys(cls, difficulty: DifficultyConfig) -> DifficultyConfig:
        if keys := difficulty.other_mode_keys("async"):
            raise ValueError(f"{', '.join(keys)}: a key of mode: epochs (stages[i].collect.difficulty); the "
                             "orchestrator's own oversampling_factor is a key of its section")
        return difficulty

    @model_validator(mode="after")
    def _consistent(self) -> "OrchestratorConfig":
        if self.batch_size % self.rollouts_per_example:
            raise ValueError(f"batch_size ({self.batch_size}) must be a multiple of rollouts_per_example "
                             f"({self.rollouts_per_example}): batches hold whole groups")
        if self.max_off_policy_steps < self.max_async_level:
            raise ValueError(f"max_off_policy_steps ({self.max_off_policy_steps}) must be at least max_async_level "
                             f"({self.max_async_level}), or rollouts generated ahead would all be discarded")
        names = [env.name for env in self.envs]
        if len(set(names)) != len(names):
            raise ValueError(f"environment names must be distinct: {names}")
        if not any(env.ratio > 0 for env in self.envs):
            raise ValueError("at least one environment needs a ratio above 0")
        if self.max_steps is None and any(temperature_schedule(env.params) for env in self.envs):
            raise ValueError("a temperature schedule runs from the first step to the last: set max_steps")
        return self

    @property
    def groups_per_step(self) -> int:
        return self.batch_size // self.rollouts_per_example


def task_file_problem(path: str) -> str | None:
    """What is wrong with a tasks JSONL file a config names, or None when it is a file."""
    if Path(path).is_file():
        return None
    return f"{path} is a folder, not a tasks JSONL file" if Path(path).is_dir() else f"no such tasks file: {path}"


def load_orchestrator_config(path: str | Path) -> OrchestratorConfig:
    """An orchestrator config from YAML (or JSON), with its tasks files checked; ValueError naming the file
    and the key at fault."""
    path = Path(path)
    data = read_mapping(path, "orchestrator config", "batch_size, rollouts_per_example, envs")
    try:
        config = OrchestratorConfig.model_validate(data)
    except ValidationError as exc:
        raise ValueError(key_problems(path, exc)) from None
    problems = [f"{path}: key 'envs[{i}].input': {problem}"
                for i, env in enumerate(config.envs) if (problem := task_file_problem(env.input))]
    if problems:
        raise ValueError("\n".join(problems))
    return config


__all__ = ["EnvConfig", "OrchestratorConfig", "load_orchestrator_config", "task_file_problem"]
