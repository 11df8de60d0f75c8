"""An evaluation suite: which environments, on which tasks, how many repeats, with which sampling.

A suite is a YAML file (bundled ones in `evals/`, named by their stem: `rollgym eval smoke`):

    name: smoke
    stack: {configs: [], overrides: [policy_model.n_ctx=2048]}  # the model server; default: the embedded model
    repeats: 4                          # defaults for every environment, each may override them
    limit: 10
    pass_threshold: 1.0
    params: {temperature: 0.7, max_output_tokens: 64}           # merged into every responses_create_params
    environments:
      weather:
        config: resources_servers/weather/configs/weather.yaml  # its resources server and agent
        tasks: resources_servers/weather/data/validation.jsonl
        params: {tool_choice: {type: function, name: get_weather}}

An environment can also be named on the command line (`--env weather`): its folder's
`configs/NAME.yaml` and `data/example.jsonl`. A relative path is taken from the current folder, else
from the rollgym checkout, so the bundled suites run from anywhere.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, field_validator

from ..config import StrictModel, key_problems, read_mapping
from ..data.sampling import check_params

ROOT = Path(__file__).resolve().parents[3]  # the rollgym checkout: bundled suites and environments
SUITES_DIR = ROOT / "evals"
ENVIRONMENTS_DIR = ROOT / "resources_servers"
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")  # becomes a folder of the output


class SuiteError(ValueError):
    """A suite or environment that cannot be run; the message names the file and key, or the name."""


class SuiteStackConfig(StrictModel):
    configs: list[str] = Field(default_factory=list, description="model server configs shared by every "
                                                                  "environment (default: the embedded model)")
    overrides: list[str] = Field(default_factory=list, description="key.path=value overrides of the stack")


class SuiteEnvironmentConfig(StrictModel):
    config: list[str] = Field(min_length=1, description="the environment's server configs (resources server, agent)")
    tasks: str = Field(description="task rows JSONL")
    agent: str | None = Field(default=None, description="the agent the tasks go to (default: the configs' only one)")
    repeats: int | None = Field(default=None, ge=1)
    limit: int | None = Field(default=None, ge=1)
    pass_threshold: float | None = None
    params: dict[str, Any] = Field(default_factory=dict, description="merged over the suite's params")

    _params = field_validator("params")(check_params)  # each value in its range, by key

    @field_validator("config", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value


class Suite(StrictModel):
    name: str = ""
    description: str = ""
    stack: SuiteStackConfig = Field(default_factory=SuiteStackConfig)
    repeats: int = Field(default=4, ge=1, description="rollouts per task")
    limit: int | None = Field(default=None, ge=1, description="the first N tasks of each file")
    pass_threshold: float = Field(default=1.0, description="a reward at or above it is a pass (pass@k)")
    params: dict[str, Any] = Field(default_factory=dict, description="responses_create_params of every rollout")
    concurrency: int = Field(default=4, ge=1, description="rollouts in flight")
    timeout_s: float = Field(default=600.0, gt=0, description="one attempt of a rollout")
    max_attempts: int = Field(default=2, ge=1, description="tries per rollout on infrastructure failure")
    environments: dict[str, SuiteEnvironmentConfig] = Field(min_length=1)

    _params = field_validator("params")(check_params)  # each value in its range, by key

    @field_validator("environments")
    @classmethod
    def _names(cls, value: dict[str, SuiteEnvironmentConfig]) -> dict[str, SuiteEnvironmentConfig]:
        for name in value:
            if not NAME.match(name):
                raise ValueError(f"environment name {name!r}: letters, digits, '_', '-' and '.' only")
        return value


@dataclass
class Environment:
    """One environment of a run, every default resolved and every path checked."""

    name: str
    configs: list[Path]
    tasks: Path
    agent: str
    repeats: int
    limit: int | None
    pass_threshold: float
    params: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "configs": [str(p) for p in self.configs], "tasks": str(self.tasks),
                "agent": self.agent, "repeats": self.repeats, "limit": self.limit,
                "pass_threshold": self.pass_threshold, "params": self.params}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Environment":
        return cls(**{**data, "configs": [Path(p) for p in data["configs"]], "tasks": Path(data["tasks"])})


def resolve_path(value: str | Path) -> Path:
    """A relative path from the current folder if it is there, else from the rollgym checkout."""
    path = Path(value).expanduser()
    if path.is_absolute() or path.exists() or not (ROOT / path).exists():
        return path.absolute()
    return ROOT / path


def find_suite(name_or_path: str) -> Path:
    """A suite file, or a bundled suite by name (`smoke` → evals/smoke.yaml)."""
    path = resolve_path(name_or_path)
    if path.is_file():
        return path
    bundled = SUITES_DIR / f"{name_or_path}.yaml"
    if NAME.match(name_or_path) and bundled.is_file():
        return bundled
    known = ", ".join(sorted(p.stem for p in SUITES_DIR.glob("*.yaml"))) or "none"
    raise SuiteError(f"suite {name_or_path!r}: no such file, nor a bundled suite (bundled: {known})")


def load_suite(path: Path) -> Suite:
    """Read and validate a suite file; SuiteError names the file and the key at fault."""
    try:
        data = read_mapping(path, "suite", "environments, repeats, params")
        return Suite.model_validate(data)
    except ValueError as exc:
        if isinstance(exc, ValidationError):
            raise SuiteError(key_problems(path, exc)) from None
        raise SuiteError(str(exc)) from None


def suite_environments(suite: Suite, source: Path, only: list[str] | None = None) -> list[Environment]:
    """The suite's environments (or those of `only`, which must be in it), defaults applied, paths checked."""
    if only:
        unknown = [name for name in only if name not in suite.environments]
        if unknown:
            raise SuiteError(f"--env {unknown[0]}: not an environment of {source} "
                             f"(it has {', '.join(suite.environments)})")
    environments = []
    for name, section in suite.environments.items():
        if only and name not in only:
            continue
        where = f"{source}: key 'environments.{name}"
        configs = [resolve_path(item) for item in section.config]
        for index, config in enumerate(configs):
            if not config.is_file():
                raise SuiteError(f"{where}.config[{index}]': no such config file: {section.config[index]}")
        tasks = resolve_path(section.tasks)
        if not tasks.is_file():
            raise SuiteError(f"{where}.tasks': no such task file: {section.tasks}")
        environments.append(Environment(
            name=name, configs=configs, tasks=tasks,
            agent=section.agent or only_agent(configs, f"{where}.agent'"),
            repeats=section.repeats or suite.repeats,
            limit=section.limit if section.limit is not None else suite.limit,
            pass_threshold=section.pass_threshold if section.pass_threshold is not None else suite.pass_threshold,
            params={**suite.params, **section.params},
        ))
    return environments


def folder_environment(name: str, repeats: int, limit: int | None, pass_threshold: float,
                       params: dict[str, Any]) -> Environment:
    """An environment named on the command line: resources_servers/NAME, its configs/NAME.yaml (or its only
    config) and data/example.jsonl."""
    folder = ENVIRONMENTS_DIR / name
    if not NAME.match(name) or not (folder / "app.py").is_file():
        known = sorted(p.parent.name for p in ENVIRONMENTS_DIR.glob("*/app.py"))
        raise SuiteError(f"--env {name}: no environment folder {folder} (environments: {', '.join(known)})")
    configs = sorted((folder / "configs").glob("*.yaml"))
    config = folder / "configs" / f"{name}.yaml"
    if not config.is_file():
        if len(configs) != 1:
            raise SuiteError(f"--env {name}: {folder / 'configs'} has no {name}.yaml and not exactly one config; "
                             "write a suite that names the config")
        config = configs[0]
    tasks = folder / "data" / "example.jsonl"
    if not tasks.is_file():
        raise SuiteError(f"--env {name}: no task file {tasks}; write a suite that names one")
    return Environment(name, [config], tasks, only_agent([config], f"--env {name}"), repeats, limit,
                       pass_threshold, dict(params))


def only_agent(configs: list[Path], where: str) -> str:
    """The one agent the config files define; SuiteError naming `where` when they define none or several."""
    from ..config import ConfigError, load_stack

    try:
        stack = load_stack(list(configs))
    except ConfigError as exc:
        raise SuiteError(f"{where}: {exc}") from None
    agents = [name for name, spec in stack.servers.items() if spec.role == "agents"]
    if len(agents) != 1:
        raise SuiteError(f"{where}: say which agent ({', '.join(agents) or 'the configs define none'})")
    return agents[0]


def stack_files(suite: Suite | None, environments: list[Environment]) -> tuple[list[str], list[str]]:
    """One stack for the whole run: the suite's model configs and every environment's configs (each file
    once), and the suite's overrides."""
    files: list[str] = []
    for path in [*(resolve_path(p) for p in (suite.stack.configs if suite else []))] + \
            [path for env in environments for path in env.configs]:
        if str(path) not in files:
            files.append(str(path))
    return files, list(suite.stack.overrides if suite else [])


__all__ = ["Environment", "Suite", "SuiteError", "find_suite", "folder_environment", "load_suite", "resolve_path",
           "stack_files", "suite_environments"]
