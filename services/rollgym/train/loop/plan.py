"""The training plan: one YAML file, validated with errors that name the key at fault.

    base_model: bundled               # the embedded SmolLM2 GGUF; or a *.gguf file; or a HF model name
    output: runs/train-weather
    stack:
      configs: [resources_servers/weather/configs/weather.yaml]
      overrides: [policy_model.n_ctx=2048]
      # registry_file: stack.json     # or use a running stack (then apply: lora only)
    validation:
      input: resources_servers/weather/data/validation.jsonl
      every: 1                        # epochs; the base model is measured at epoch 0
      repeats: 4
      params: {temperature: 1.0, max_output_tokens: 64}
    stages:
      - name: bootstrap
        epochs: 1
        collect: {input: resources_servers/weather/data/train.jsonl, repeats: 4, params: {...}}
        curate: {min_reward: 1.0, top_k_per_group: 1}
        optimize: {trainer: trl_sft, args: {learning_rate: 2.0e-4, epochs: 2}}
        apply: merged
      - name: grpo
        epochs: 3
        ...
    guard: {max_drop: 0.1, on_violation: stop}

With `mode: async` the plan names an `orchestrator` section (batch_size, rollouts_per_example,
max_steps, max_async_level, max_off_policy_steps, envs with ratios, difficulty, advantage) and one
`optimize` section instead of stages, optionally `curate: {segments: all | last | drop}` and a `teacher`
for its batches; `validation.every` then counts steps (scripts/train/async.yaml).

Relative paths are relative to the current directory, as on the command line.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any, Literal, Mapping

from pydantic import Field, PrivateAttr, ValidationError, field_validator, model_validator

from ...config import StrictModel, import_target, key_problems, read_mapping, set_dotted
from ...data.rollout_filters import DifficultyConfig
from ...data.sampling import check_params
from ...sampling_contract import params_problems, temperature_of
from .colocate import colocate_problems
from .curation import CurateConfig, SegmentMode, unverified_problem
from .dynamic_sampling import difficulty_problem
from ..orchestrator.config import OrchestratorConfig, task_file_problem
from .teacher import TeacherConfig, teacher_file_problems, teacher_plan_problems
from .policies import Credit, PolicyConfig, plan_policy_problems, stack_problems
from .tracking import TrackingConfig
from .validation_metrics import metric_path, metric_problem, pass_k_problem
from .weights import WeightsConfig, full_weight_problems, reload_problems
from ..trainers.base import BUILTIN, DATA_KIND
from ..trainers.grpo_config import GRPOConfig

# The trainers that train on the sampling policy's logprobs with rollgym's own objective (grpo_trainer.py).
RL_TRAINERS = frozenset({"grpo", "trl_grpo"})


class PlanError(ValueError):
    """A plan that cannot be run; the message names the file and the key."""


class RunStackConfig(StrictModel):
    configs: list[str] = Field(default_factory=list, description="server config files of the stack")
    overrides: list[str] = Field(default_factory=list, description="key.path=value overrides")
    registry_file: str | None = Field(default=None, description="use a running stack (rollgym run --registry-file)")
    agent: str | None = Field(default=None, description="which agent of the stack (default: the only one)")
    concurrency: int = Field(default=8, ge=1, description="rollouts in flight while collecting")
    timeout_s: float = Field(default=3600.0, gt=0, description="one rollout attempt, collecting and validating")
    max_attempts: int = Field(default=3, ge=1, description="tries per rollout for infrastructure failures")
    budget_s: float | None = Field(default=None, gt=0, description="all the attempts of one rollout, waits included")

    @model_validator(mode="after")
    def _one_source(self) -> "RunStackConfig":
        if bool(self.configs) == bool(self.registry_file):
            raise ValueError("give either configs (start a stack) or registry_file (use a running one)")
        return self

    def resolved_overrides(self, seed: int) -> list[str]:
        """The overrides with "{seed}" replaced by the plan's seed (policy_model.seed={seed}: each seed samples anew)."""
        return [item.replace("{seed}", str(seed)) for item in self.overrides]


class CollectConfig(StrictModel):
    input: str | None = Field(default=None, description="task rows JSONL")
    levels: list[str] = Field(default_factory=list, description="a difficulty curriculum instead of input: task "
                              "files from easiest to hardest; the stage moves to the next one after an epoch that "
                              "reaches advance_at")
    advance_at: float = Field(default=0.7, description="with levels: the mean reward (advance_on) that moves the "
                              "stage to the next level")
    advance_on: Literal["train", "validation"] = Field(default="train", description="with levels: the epoch's reward "
                                                       "on its level's tasks, or the plan's validation")
    repeats: int = Field(default=4, ge=1, description="rollouts per task (a group)")
    limit: int | None = Field(default=None, ge=1, description="use the first N tasks")
    params: dict[str, Any] = Field(default_factory=dict, description="merged into every responses_create_params; "
                                   "temperature may be a schedule over the stage's epochs (rollgym.data.sampling)")
    skip_verification: bool = Field(default=False, description="agents skip /verify: rollouts with reward null "
                                    "(verification: skipped), for data: sft only")
    difficulty: DifficultyConfig = Field(default_factory=DifficultyConfig, description="dynamic sampling: refill "
                                         "groups without reward spread (dynamic_sampling.py)")

    @model_validator(mode="after")
    def _one_source(self) -> "CollectConfig":
        if (self.input is None) == (not self.levels):
            raise ValueError("collect takes input (one task file) or levels (a difficulty curriculum), not both")
        return self

    _params = field_validator("params")(check_params)  # each mistake named: params.temperature

    @property
    def files(self) -> list[str]:
        return self.levels or [self.input or ""]


class OptimizeConfig(StrictModel):
    trainer: str = Field(description=f"one of {', '.join(BUILTIN)}, or an import path 'module:Class'")
    data: Literal["sft", "preferences", "groups"] | None = Field(
        default=None, description="what to curate to; default: what the built-in trainer trains on")
    args: dict[str, Any] = Field(default_factory=dict, description="the trainer's own arguments")
    # An RL trainer's args, parsed once here and handed on (to the teacher check, the trainer process, the loss).
    _grpo: GRPOConfig | None = PrivateAttr(default=None)

    @property
    def grpo(self) -> GRPOConfig | None:
        """The RL trainer's typed arguments (None for any other trainer, whose args are its own)."""
        return self._grpo

    @property
    def finetune(self) -> str | None:
        return self._grpo.finetune if self._grpo is not None else self.args.get("finetune")

    @model_validator(mode="after")
    def _known(self) -> "OptimizeConfig":
        if self.trainer not in BUILTIN and ":" not in self.trainer:
            raise ValueError(f"unknown trainer {self.trainer!r}: use one of {', '.join(BUILTIN)} or 'module:Class'")
        if self.data is None:
            if self.trainer not in DATA_KIND:
                raise ValueError("say what a custom trainer trains on: data: sft | preferences | groups")
            self.data = DATA_KIND[self.trainer]  # type: ignore[assignment]
        elif self.trainer in DATA_KIND and self.data != DATA_KIND[self.trainer]:  # found here, not after a collection
            raise ValueError(f"data: {self.data}: {self.trainer} trains on {DATA_KIND[self.trainer]} records; leave "
                             f"data out, or pick the trainer of {self.data} records "
                             f"({', '.join(name for name, kind in DATA_KIND.items() if kind == self.data)})")
        if self.trainer in RL_TRAINERS:
            try:  # a misspelt argument fails here, not in the trainer after the first collection
                self._grpo = GRPOConfig.model_validate(self.args)
            except ValidationError as exc:
                raise ValueError("\n".join(f"args.{'.'.join(str(part) for part in error['loc'])}: {error['msg']}"
                                           for error in exc.errors())) from None
        if self.trainer not in BUILTIN:
            try:  # a typo fails here, not after the first collection
                import_target(self.trainer)
            except ValueError as exc:
                raise ValueError(f"trainer: {exc}") from None
        return self


class StageConfig(StrictModel):
    name: str
    epochs: int = Field(default=1, ge=1)
    collect: CollectConfig | None = Field(default=None, description="live rollouts through the stack")
    replay: list[str] = Field(default_factory=list, description="rollouts files (collect-rollouts' or an earlier "
                                                                "run's) curated with every epoch's live rollouts")
    curate: CurateConfig = Field(default_factory=CurateConfig)
    optimize: OptimizeConfig
    teacher: TeacherConfig | None = Field(default=None, description="on-policy distillation (loop/teacher.py)")
    apply: Literal["lora", "merged", "weights", "memory", "none"] = Field(
        default="merged", description="lora: hot-load the adapter (POST /v1/load_lora_adapter); merged: serve the "
                                      "merged weights as a GGUF of serve_dtype (embedded model); weights (finetune: "
                                      "full): every replica of the policy model (vLLM, SGLang) reloads the step's "
                                      "safetensors (the plan's weights section); memory (the default under "
                                      "colocate: true): the co-located server serves the trainer's weights, "
                                      "published in memory; none")

    @model_validator(mode="after")
    def _has_data(self) -> "StageConfig":
        if self.collect is None and not self.replay:
            raise ValueError("a stage trains on collect (live rollouts), replay (rollouts files), or both")
        if self.collect is not None and self.collect.skip_verification and (
                problem := unverified_problem(self.optimize.data or "sft", self.curate)
                or (self.collect.levels and self.collect.advance_on == "train"
                    and "levels advance on the train reward: use advance_on: validation")):
            raise ValueError(f"collect.skip_verification: {problem}")
        if self.collect is not None and (problem := difficulty_problem(self.collect.difficulty, self.optimize.data,
                                                                       self.optimize.trainer)):
            raise ValueError(problem)
        return self


class BatchCurateConfig(StrictModel):
    """mode: async: what each batch trains on (its groups and advantages are the orchestrator's)."""

    segments: SegmentMode = Field(default="all", description="a rollout with several token sequences (segments): "
                                  "train all, the last, or drop the rollout (prefix_broken)")


class ValidationConfig(StrictModel):
    input: str | None = Field(default=None, description="held-out task rows JSONL")
    suite: str | None = Field(default=None, description="instead of input: an eval suite (`rollgym eval`, a file or "
                              "a bundled name); each of its environments validates, with the suite's repeats, "
                              "limit and params, in this run's stack")
    every: int = Field(default=1, ge=1, description="validate every N epochs (and at epoch 0, the base model)")
    repeats: int = Field(default=4, ge=1)
    limit: int | None = Field(default=None, ge=1)
    params: dict[str, Any] = Field(default_factory=dict)
    pass_threshold: float = 1.0

    _params = field_validator("params")(check_params)

    @model_validator(mode="after")
    def _one_source(self) -> "ValidationConfig":
        if (self.input is None) == (self.suite is None):
            raise ValueError("validation takes input (one task file) or suite (an eval suite), not both")
        return self


class GuardConfig(StrictModel):
    max_drop: float | None = Field(default=0.1, ge=0.0,
                                   description="validation reward may fall this far below the best (None: any)")
    accept: dict[str, float] = Field(
        default_factory=dict, description="validation metric -> the least value an epoch's model must reach to be "
                                          "kept, e.g. {mean_reward: 0.5, pass@4: 0.8, reward_components.used_tool: 1, "
                                          "environments.weather.mean_reward: 0.6}")
    on_violation: Literal["stop", "continue"] = "stop"

    @model_validator(mode="after")
    def _known_metrics(self) -> "GuardConfig":
        problems = [problem for name in self.accept if (problem := metric_problem(name))]
        if problems:
            raise ValueError("\n".join(problems))
        return self


class CheckpointConfig(StrictModel):
    keep_last: int | None = Field(default=None, ge=1, description="keep the weights and trainer state of the last N "
                                  "steps (and the applied and best ones); None: all")
    every: int | None = Field(default=None, ge=1, description="also keep every Nth step's weights (merged GGUF "
                              "included), to rewind to (`rollgym train --rewind N`)")


class Plan(StrictModel):
    base_model: str = "bundled"
    output: str
    seed: int = 0
    serve_dtype: Literal["f16", "f32", "q8_0"] = Field(default="f16", description="GGUF precision of apply: merged")
    stack: RunStackConfig
    validation: ValidationConfig | None = None
    mode: Literal["epochs", "async"] = Field(
        default="epochs", description="epochs: collect then train, stage by stage; async: the orchestrator streams "
                                      "step batches while the trainer steps (docs/train-async.md)")
    stages: list[StageConfig] = Field(default_factory=list, description="mode: epochs")
    orchestrator: OrchestratorConfig | None = Field(default=None, description="mode: async")
    optimize: OptimizeConfig | None = Field(default=None, description="mode: async: the trainer of every step")
    curate: BatchCurateConfig | None = Field(default=None, description="mode: async: how every batch is curated")
    teacher: TeacherConfig | None = Field(default=None, description="mode: async: on-policy distillation (teacher.py)")
    guard: GuardConfig | None = None
    checkpoints: CheckpointConfig = Field(default_factory=CheckpointConfig)
    weights: WeightsConfig = Field(default_factory=WeightsConfig, description="how full weights reach the serving "
                                   "engines (apply: weights, and mode: async with finetune: full)")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig,
                                      description="where history's numbers also go: tensorboard (default), wandb, none")
    policies: list[PolicyConfig] = Field(default_factory=list, description="several policies, adapters on one base, "
                                         "each claiming calls (docs/train-policies.md); none: one, every call's")
    credit: Credit = Field(default="per_role", description="with policies: per_role (rewards[ROLE]) or team")
    colocate: bool = Field(default=False, description="the policy model server (transformers) and the grpo trainer "
                           "in one process on one device, sharing the weights; each step is published in memory "
                           "(apply: memory, the default then). docs/train-loop.md")

    @model_validator(mode="after")
    def _colocate_apply(self) -> "Plan":
        """Under colocate a stage that names no apply publishes in memory; memory needs colocate."""
        for stage in self.stages:
            if self.colocate and "apply" not in stage.model_fields_set:
                stage.apply = "memory"
        return self

    @model_validator(mode="after")
    def _consistent(self) -> "Plan":
        problems = []
        if self.mode == "epochs" and (not self.stages or self.orchestrator or self.optimize):
            problems.append("mode: epochs runs stages (at least one), without orchestrator or optimize")
        if self.mode == "async" and (self.stages or not self.orchestrator or not self.optimize):
            problems.append("mode: async needs orchestrator and optimize, and takes no stages")
        problems += [f"{key}: mode: epochs sets it stage by stage (stages[i].{key})" for key, value in
                     (("curate", self.curate), ("teacher", self.teacher)) if self.mode == "epochs" and value is not None]
        if self.mode == "async" and self.guard is not None and self.guard.on_violation != "stop":
            problems.append("guard.on_violation: an async run's guard can only stop it (generation runs ahead on "
                            "the newest weights: there is no rolling back and going on)")
        names = [stage.name for stage in self.stages]
        if len(set(names)) != len(names):
            problems.append(f"stage names must be distinct: {names}")
        if self.guard is not None and self.validation is None:
            problems.append("a guard needs a validation section (it compares validation rewards)")
        modes = {stage.apply for stage in self.stages} - {"none"}
        if len(modes) > 1:
            problems.append(f"stages mix apply modes {sorted(modes)}: a run serves one kind of weights (merged GGUFs, "
                            "LoRAs, or full weights)")
        if "merged" in modes and self.stack.registry_file:
            problems.append("apply: merged restarts the stack's servers on the merged GGUF, so it needs "
                            "stack.configs; with stack.registry_file use apply: lora or none")
        if "merged" in modes and self.base_model != "bundled" and not self.base_model.endswith(".gguf"):
            problems.append("apply: merged serves GGUF files with the embedded model; base_model must be "
                            "'bundled' or a *.gguf file (use apply: lora with another model server)")
        problems += colocate_problems(self)
        problems += plan_policy_problems(self, OptimizeConfig)
        if self.orchestrator is not None and self.orchestrator.inflight_updates:
            if self.colocate:
                problems.append("orchestrator.inflight_updates: the co-located server publishes each step between "
                                "batches and stamps every answer with its weights; in-flight updates are for a "
                                "chat_completions stack in front of vLLM")
            elif self.optimize is not None and self.optimize.finetune != "full":
                problems.append("orchestrator.inflight_updates: a LoRA hot-load does not pause the engine, so nothing "
                                "is aborted and continued; in-flight updates reload full weights (optimize.args."
                                "finetune: full)")
        problems += self._sampling_problems() + self._full_weight_problems() + teacher_plan_problems(self._teachers())
        if problems:  # every one, one per line (load_plan gives each line the file and key)
            raise ValueError("\n".join(problems))
        return self

    def _teachers(self) -> list[tuple[str, TeacherConfig | None, OptimizeConfig]]:
        places = [(f"stages[{i}].teacher", stage.teacher, stage.optimize) for i, stage in enumerate(self.stages)]
        return places + ([("teacher", self.teacher, self.optimize)] if self.optimize is not None else [])

    def _full_weight_problems(self) -> list[str]:
        return full_weight_problems(self)

    def _sampling_problems(self) -> list[str]:
        """An RL trainer computes the logprobs of the distribution that was sampled: its temperature must be
        the collection's, and top-p/top-k truncation (which it cannot rebuild) is refused, by key."""
        pairs: list[tuple[str, dict[str, Any], str, OptimizeConfig]] = [
            (f"stages[{i}].collect.params", stage.collect.params, f"stages[{i}].optimize", stage.optimize)
            for i, stage in enumerate(self.stages) if stage.collect is not None]
        if self.orchestrator is not None and self.optimize is not None:
            pairs += [(f"orchestrator.envs[{i}].params", env.params, "optimize", self.optimize)
                      for i, env in enumerate(self.orchestrator.envs)]
        problems = []
        for where, params, optimize_key, optimize in pairs:
            if optimize.grpo is None:
                continue
            trained = optimize.grpo.temperature
            if isinstance(params.get("temperature"), dict):  # a schedule: each rollout's recorded one trains
                if trained is not None:
                    problems.append(f"{optimize_key}.args.temperature: {where}.temperature is a schedule; leave it "
                                    "out (the trainer takes the temperature each rollout was sampled at)")
                sampled = trained = None
            else:
                sampled = temperature_of(params)
            if trained is not None and float(trained) != sampled:
                problems.append(f"{optimize_key}.args.temperature {trained} disagrees with {where}.temperature "
                                f"{sampled}: the trainer must compute the logprobs of the distribution that was sampled")
            problems += [f"{where}: {problem}" for problem in params_problems(params, optimize.trainer)]
        return problems

    def epochs(self) -> list[tuple[int, StageConfig]]:
        """(epoch number from 1, its stage) for every training epoch of the plan."""
        out: list[tuple[int, StageConfig]] = []
        for stage in self.stages:
            out.extend((len(out) + 1, stage) for _ in range(stage.epochs))
        return out


def load_plan(path: str | Path, overrides: Mapping[str, Any] | None = None) -> Plan:
    """Read and validate a plan file, with `overrides` ({"seed": 1, "stack.concurrency": 2}: dotted keys
    reach into sections) applied; then check the files it names. PlanError names the file and the key."""
    path = Path(path)
    try:
        data = read_mapping(path, "plan", "base_model, output, stack, stages")
    except ValueError as exc:
        raise PlanError(str(exc)) from None
    for note in renamed_keys(data):
        print(f"rollgym: {path}: {note}", file=sys.stderr)
    try:
        for key, value in (overrides or {}).items():
            set_dotted(data, key, value, list(Plan.model_fields), "plan")
    except ValueError as exc:
        raise PlanError(str(exc)) from None
    try:
        plan = Plan.model_validate(data)
    except ValidationError as exc:
        def origin(key: str) -> str:
            return next((f" (set by the override of {name!r})" for name in overrides or {}
                         if key == name or key.startswith((f"{name}.", f"{name}[")) or name.startswith(f"{key}.")), "")

        lines = _one_per_line(key_problems(path, exc, origin), str(path))
        lines += [f"{path}: key '{key}': {message}" for key, message in section_file_problems(data)]
        raise PlanError("\n".join(lines)) from None
    try:
        environments = validation_environments(plan)  # the suite read and checked once here, where its errors get a key
        add_suite_environments(plan)
    except ValueError as exc:
        raise PlanError(f"{path}: key 'validation.suite': {exc}") from None
    problems = [f"{path}: key 'guard.accept': {message}" for message in accept_problems(plan, environments)]
    problems += [f"{path}: key '{key}': {message}" for key, message in file_problems(plan)]
    if problems:
        raise PlanError("\n".join(problems))
    return plan


def _one_per_line(text: str, source: str) -> list[str]:
    """key_problems' lines, a message of several problems split so that each line names the file and key."""
    lines: list[str] = []
    prefix = f"{source}: "
    for line in text.splitlines():
        if not line.startswith(f"{source}: ") and lines:
            line = prefix + line
        else:
            match = re.match(rf"^{re.escape(source)}: key '[^']*': ", line)
            prefix = match.group(0) if match else f"{source}: "
        lines.append(line)
    return lines


def section_file_problems(data: Mapping[str, Any]) -> list[tuple[str, str]]:
    """`file_problems` of a plan that did not validate as a whole, over the sections that validate on their own,
    so that a missing file is reported beside the key errors rather than after they are fixed."""
    from types import SimpleNamespace

    def valid(model: Any, value: Any) -> Any:
        try:
            return None if value is None else model.model_validate(value)
        except (ValidationError, ValueError, TypeError):
            return None

    stages = []
    for raw in data["stages"] if isinstance(data.get("stages"), list) else []:
        raw = raw if isinstance(raw, dict) else {}
        replay = raw["replay"] if isinstance(raw.get("replay"), list) else []
        stages.append(SimpleNamespace(collect=valid(CollectConfig, raw.get("collect")),
                                      replay=[str(item) for item in replay]))
    seed = data.get("seed", 0)
    partial = SimpleNamespace(
        output=str(data.get("output") or "."), base_model=str(data.get("base_model") or "bundled"), stages=stages,
        validation=valid(ValidationConfig, data.get("validation")),
        orchestrator=valid(OrchestratorConfig, data.get("orchestrator")),
        stack=valid(RunStackConfig, data.get("stack")), seed=seed if isinstance(seed, int) else 0)
    return file_problems(partial)  # type: ignore[arg-type]


def renamed_keys(data: dict[str, Any]) -> list[str]:
    """Rename the keys a plan (or a run's saved plan.json) may still use by an older name, in place; a note
    for each: `optimize.adapter` is `optimize.trainer` now ("adapter" names LoRAs only)."""
    notes = []
    sections = [("optimize", data.get("optimize"))] + [
        (f"stages[{i}].optimize", stage.get("optimize")) for i, stage in enumerate(data.get("stages") or [])
        if isinstance(stage, dict)]
    for where, section in sections:
        if isinstance(section, dict) and "adapter" in section and "trainer" not in section:
            section["trainer"] = section.pop("adapter")
            notes.append(f"key '{where}.adapter' is now '{where}.trainer'; the old name is still read, rename it")
    return notes


def file_problems(plan: Plan) -> list[tuple[str, str]]:
    """(key, what is wrong) for each file or folder the plan names that is missing or of the wrong kind,
    so that a mistake is reported before a stack starts or the output folder is claimed."""
    from ...client import load_registry_file
    from ...config import ConfigError, load_stack

    problems: list[tuple[str, str]] = []
    output = Path(plan.output)
    if output.exists() and not output.is_dir():
        problems.append(("output", f"{output} is a file; a run's output is a folder"))
    if plan.base_model.endswith(".gguf") and not Path(plan.base_model).is_file():
        problems.append(("base_model", f"no such GGUF file: {plan.base_model}"))
    inputs = [(f"stages[{i}].collect.{'levels[' + str(j) + ']' if stage.collect.levels else 'input'}", file)
              for i, stage in enumerate(plan.stages) if stage.collect is not None
              for j, file in enumerate(stage.collect.files)]
    problems += [(f"stages[{i}].replay[{j}]", f"no such rollouts file: {file}") for i, stage in enumerate(plan.stages)
                 for j, file in enumerate(stage.replay) if "://" not in file and not Path(file).is_file()]
    if plan.validation is not None and plan.validation.input is not None:
        inputs.append(("validation.input", plan.validation.input))
    if plan.orchestrator is not None:
        inputs += [(f"orchestrator.envs[{i}].input", env.input) for i, env in enumerate(plan.orchestrator.envs)]
    problems += [(key, problem) for key, file in inputs if (problem := task_file_problem(file))]
    problems += teacher_file_problems(plan._teachers()) if isinstance(plan, Plan) else []
    stack = plan.stack
    if stack is None:  # section_file_problems: the stack's own errors are reported already
        return problems
    try:
        if stack.registry_file:
            servers = list(load_registry_file(stack.registry_file))
        else:
            loaded = load_stack(stack.configs, stack.resolved_overrides(plan.seed))
            servers = list(loaded.servers)
            problems += reload_problems(plan, loaded.servers.get("policy_model"))
            problems += stack_problems(plan, loaded) if isinstance(plan, Plan) else []
    except (ValueError, ConfigError) as exc:
        problems.append(("stack.registry_file" if stack.registry_file else "stack", str(exc)))
    else:
        if stack.agent is not None and stack.agent not in servers:
            problems.append(("stack.agent", f"the stack has no server named {stack.agent!r} ({', '.join(servers)})"))
        try:
            environments = validation_environments(plan)
        except ValueError:  # a suite that does not load is reported under validation.suite by load_plan
            environments = []
        problems += [("validation.suite", f"environment {env.name!r}: the stack has no agent {env.agent!r}")
                     for env in environments if env.agent not in servers]
    return problems


def accept_problems(plan: Plan, environments: list[Any]) -> list[str]:
    """The guard's metrics that the plan's validation can never report: a per-environment one without a suite,
    an environment the suite does not have, a pass@K that the validation (each of the suite's environments,
    or the one named) does not measure."""
    if plan.guard is None or plan.validation is None:
        return []
    by_name = {env.name: env for env in environments}
    problems = []
    for name in plan.guard.accept:
        env, metric = metric_path(name)
        if env is not None and plan.validation.suite is None:
            problems.append(f"{name!r}: per-environment metrics need validation.suite")
        elif env is not None and env not in by_name:
            problems.append(f"{name!r}: the suite has no environment {env!r} ({', '.join(by_name)})")
        elif plan.validation.suite is None:
            if problem := pass_k_problem(name, metric, plan.validation.repeats):
                problems.append(problem)
        else:  # a suite's own pass@K is the mean over its environments, so each of them must measure it
            for each in ([by_name[env]] if env is not None else environments):
                if problem := pass_k_problem(name, metric, each.repeats):
                    problems.append(f"{problem} (environment {each.name!r})")
                    break
    return problems


def validation_environments(plan: Plan) -> list[Any]:
    """The environments of the plan's validation suite (none without one), every path resolved."""
    if plan.validation is None or plan.validation.suite is None:
        return []
    from ...eval.suite import find_suite, load_suite, suite_environments

    source = find_suite(plan.validation.suite)
    return suite_environments(load_suite(source), source)


def add_suite_environments(plan: Plan) -> None:
    """A stack the loop starts also serves the validation suite's environments (their configs after the
    plan's; the suite's overrides before the plan's, so the plan's win). SuiteError (a ValueError) names
    what is wrong with the suite."""
    if plan.validation is None or plan.validation.suite is None or not plan.stack.configs:
        return
    from ...eval.suite import find_suite, load_suite

    suite = load_suite(find_suite(plan.validation.suite))
    have = {str(Path(item).resolve()) for item in plan.stack.configs}
    for env in validation_environments(plan):
        for config in env.configs:
            if str(config.resolve()) not in have:
                plan.stack.configs.append(str(config))
                have.add(str(config.resolve()))
    plan.stack.overrides[:0] = [item for item in suite.stack.overrides if item not in plan.stack.overrides]


__all__ = ["CollectConfig", "GuardConfig", "OptimizeConfig", "Plan", "PlanError", "RL_TRAINERS", "RunStackConfig",
           "StageConfig", "ValidationConfig", "accept_problems", "file_problems", "load_plan",
           "renamed_keys", "validation_environments"]
