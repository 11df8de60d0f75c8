"""`rollgym prepare-data`: check task rows against their environment, route them, split them.

    rollgym prepare-data --input weather.jsonl --input reverse.jsonl \\
        --config resources_servers/weather/configs/weather.yaml resources_servers/reverse_text/configs/reverse_text.yaml \\
        --output-dir data/prepared --validation-fraction 0.1 --seed 0

For every row: find its agent (the `--agent` given for its input, else the row's own `agent_ref`,
else the stack's only agent, else the one agent of the only environment whose task model accepts
the row), validate the row with that environment's `task_model` (an invalid row is reported as
`FILE:LINE: field 'x': message` and skipped), stamp `agent_ref: {"type": "agents", "name": AGENT}`
(what `collect-rollouts` routes by) and put it in train or validation by a hash of the row and the
seed: reruns, and reorderings of the input, give the same split. The stack config is only read;
no server is started. Inputs are JSONL files or Hugging Face datasets saved with `save_to_disk`.
"""

from __future__ import annotations

import hashlib
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import orjson
from pydantic import ValidationError

from ..config import StackConfig, load_stack, split_configs
from .export import DataError, import_datasets
from .jsonl import iter_jsonl

Report = Callable[[str], None]


@dataclass
class Environment:
    """A resources server of the stack and the agents that run it."""

    name: str
    agents: list[str]
    spec: Any
    _task_model: Any = None

    @property
    def task_model(self) -> Any:
        if self._task_model is None:
            from ..server import load_server_class

            try:
                self._task_model = load_server_class(self.spec).task_model
            except Exception as exc:  # an import error in the environment's own code
                raise DataError(f"cannot load environment '{self.name}' ({self.spec.role}/{self.spec.folder}/"
                                f"{self.spec.entrypoint}): {type(exc).__name__}: {exc}") from None
        return self._task_model


class Router:
    """Which agent, and so which environment, a row belongs to."""

    def __init__(self, config: StackConfig) -> None:
        self.environments: dict[str, Environment] = {}
        self.agent_env: dict[str, str] = {}
        for spec in config.by_role("agents"):
            ref = spec.options.get("resources_server")
            env = ref.get("name") if isinstance(ref, dict) else ref
            if not env or env not in config.servers or config.servers[env].role != "resources_servers":
                continue  # an agent without an environment of the stack cannot take task rows
            self.agent_env[spec.name] = env
            self.environments.setdefault(env, Environment(env, [], config.servers[env])).agents.append(spec.name)
        if not self.agent_env:
            raise DataError("the stack has no agent with a resources_server; give the configs of an environment and its agent")

    def check_agent(self, name: str) -> str:
        if name not in self.agent_env:
            raise DataError(f"--agent: no agent named '{name}' in the stack (agents: {', '.join(self.agent_env)})")
        return name

    def route(self, row: dict[str, Any], agent: str | None, usual_env: str | None = None) -> tuple[str | None, str | None]:
        """(agent, None) for a valid row, else (None, the problem as "field 'x': message").

        `usual_env`, the environment most earlier rows of the same input went to, is the one whose
        validation error is reported for a row that fits no environment."""
        if agent is None:
            ref = row.get("agent_ref")
            named = ref.get("name") if isinstance(ref, dict) else ref
            if named:
                if named not in self.agent_env:
                    return None, f"field 'agent_ref': no agent '{named}' in the stack (agents: {', '.join(self.agent_env)})"
                agent = str(named)
            elif len(self.agent_env) == 1:
                agent = next(iter(self.agent_env))
        if agent is not None:
            problem = self.problem(row, self.agent_env[agent])
            return (None, problem) if problem else (agent, None)
        problems = {env: self.problem(row, env) for env in self.environments}
        fits = [env for env, problem in problems.items() if problem is None]
        if not fits and usual_env is not None:
            return None, problems[usual_env]
        if not fits:
            detail = "; ".join(f"{env}: {problem}" for env, problem in problems.items())
            return None, f"no environment of the stack accepts the row ({detail})"
        if len(fits) > 1:
            return None, f"the row fits several environments ({', '.join(fits)}); pick the agent with --agent"
        agents = self.environments[fits[0]].agents
        if len(agents) > 1:
            return None, f"environment '{fits[0]}' has several agents ({', '.join(agents)}); pick one with --agent"
        return agents[0], None

    def problem(self, row: dict[str, Any], env: str) -> str | None:
        from ..errors import validation_errors

        try:
            self.environments[env].task_model.model_validate(row)
        except ValidationError as exc:
            first = validation_errors(exc.errors())[0]
            return f"field '{first['field']}': {first['message']}"
        return None


def split_of(row: dict[str, Any], fraction: float, seed: int) -> str:
    """"validation" for about `fraction` of rows, chosen by a hash of the row (without its agent_ref)
    and the seed, else "train". The same row always lands on the same side."""
    if fraction <= 0:
        return "train"
    content = {key: value for key, value in row.items() if key != "agent_ref"}
    digest = hashlib.sha256(f"{seed}\n".encode() + orjson.dumps(content, option=orjson.OPT_SORT_KEYS)).digest()
    return "validation" if int.from_bytes(digest[:8], "big") / 2**64 < fraction else "train"


def _drop_nulls(value: Any) -> Any:
    """Arrow gives every struct the union of its rows' keys, absent ones as None: drop those."""
    if isinstance(value, dict):
        return {key: _drop_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [_drop_nulls(item) for item in value]
    return value


def iter_rows(path: Path, report: Report) -> Iterator[tuple[str, dict[str, Any]]]:
    """(location, row) for each row of a JSONL file or a saved Hugging Face dataset folder."""
    if path.is_dir():
        datasets = import_datasets()
        try:
            loaded = datasets.load_from_disk(str(path))
        except Exception as exc:
            raise DataError(f"--input: {path} is a folder but not a saved Hugging Face dataset: {exc}") from None
        parts = [(f"{path}[{name}]", loaded[name]) for name in sorted(loaded)] if isinstance(loaded, datasets.DatasetDict) \
            else [(str(path), loaded)]
        for label, dataset in parts:
            for index, row in enumerate(dataset, start=1):
                yield f"{label}:{index}", _drop_nulls(dict(row))
        return
    if not path.is_file():
        raise DataError(f"--input: no such file or dataset folder: {path}")
    for line, _, _, row in iter_jsonl(path, lambda number, message: report(f"{path}:{number}: {message}")):
        yield f"{path}:{line}", row


@dataclass
class PrepareStats:
    counts: Counter = field(default_factory=Counter)  # (environment, agent, split) → rows
    invalid: int = 0
    problems: list[str] = field(default_factory=list)

    def lines(self, train: Path, validation: Path) -> list[str]:
        keys = sorted({(env, agent) for env, agent, _ in self.counts})
        rows = [(env, agent, self.counts[env, agent, "train"], self.counts[env, agent, "validation"]) for env, agent in keys]
        rows.append(("total", "", sum(r[2] for r in rows), sum(r[3] for r in rows)))
        env_w = max(len("environment"), *(len(r[0]) for r in rows))
        agent_w = max(len("agent"), *(len(r[1]) for r in rows))
        out = [f"{'environment':<{env_w}}  {'agent':<{agent_w}}  {'train':>7}  {'validation':>10}"]
        out += [f"{env:<{env_w}}  {agent:<{agent_w}}  {t:>7}  {v:>10}" for env, agent, t, v in rows]
        out.append(f"skipped {self.invalid} invalid rows")
        out.append(f"train -> {train}   validation -> {validation}")
        return out


def prepare(
    inputs: list[tuple[Path, str | None]],
    config: StackConfig,
    output_dir: Path,
    *,
    agent: str | None = None,
    validation_fraction: float = 0.1,
    seed: int = 0,
    report: Report | None = None,
) -> PrepareStats:
    """Validate, route and split the rows of `inputs` ((path, that input's agent or None) pairs);
    writes output_dir/train.jsonl and output_dir/validation.jsonl."""
    if not 0.0 <= validation_fraction < 1.0:
        raise DataError(f"--validation-fraction must be in [0, 1), got {validation_fraction}")
    router = Router(config)
    if agent is not None:
        router.check_agent(agent)
    for path, own in inputs:
        if own is not None:
            router.check_agent(own)
        if not path.exists():
            raise DataError(f"--input: no such file or dataset folder: {path}")
    stats = PrepareStats()

    def problem(text: str) -> None:
        stats.invalid += 1
        stats.problems.append(text)
        if report is not None:
            report(text)

    output_dir.mkdir(parents=True, exist_ok=True)
    with (output_dir / "train.jsonl").open("wb") as train, (output_dir / "validation.jsonl").open("wb") as validation:
        sinks = {"train": train, "validation": validation}
        for path, own in inputs:
            routed: Counter = Counter()  # environments of this input's rows so far
            for location, row in iter_rows(path, problem):
                usual = routed.most_common(1)[0][0] if routed else None
                chosen, trouble = router.route(row, own or agent, usual)
                if chosen is None:
                    problem(f"{location}: {trouble}")
                    continue
                routed[router.agent_env[chosen]] += 1
                side = split_of(row, validation_fraction, seed)
                stamped = {**row, "agent_ref": {"type": "agents", "name": chosen}}
                sinks[side].write(orjson.dumps(stamped) + b"\n")
                stats.counts[router.agent_env[chosen], chosen, side] += 1
    return stats


# ---------------------------------------------------------------------------
# The command (its options are declared in rollgym.cli)
# ---------------------------------------------------------------------------


def command(args: Any) -> int:
    files, overrides = split_configs(args.config)
    config = load_stack(files, overrides)
    output_dir = Path(args.output_dir)
    stats = prepare(
        [(Path(path), agent) for path, agent in args.inputs], config, output_dir, agent=args.agent,
        validation_fraction=args.validation_fraction, seed=args.seed, report=lambda text: print(text, file=sys.stderr),
    )
    print("\n".join(stats.lines(output_dir / "train.jsonl", output_dir / "validation.jsonl")))
    return 0


__all__ = ["Environment", "PrepareStats", "Router", "iter_rows", "prepare", "split_of"]
