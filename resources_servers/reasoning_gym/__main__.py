"""`python -m resources_servers.reasoning_gym generate|list`: task files from reasoning-gym generators.

    generate --dataset leg_counting --set max_animals=2 --seed 1 --count 200 --output train.jsonl \\
             --validation 50 --validation-output validation.jsonl
    generate --mixture resources_servers/reasoning_gym/mixtures/easy.yaml --count 8 --output tasks.jsonl
    list                      every generator, its config keys and one example task
    list leg_counting --json  the example as a task row

Bad input (an unknown generator, a config key it does not have, an unreadable mixture file) is one
line `error: ...` naming it, and exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import yaml
from pydantic import ValidationError

from rollgym.errors import validation_errors

from .generators import DEFAULT_PROMPT, GeneratorError, Generators, check_name, config_fields, generator_names
from .tasks import DatasetSpec, Mixture, generate, task_row

EXAMPLE_CHARS = 160
KNOB_CHARS = 40


class UsageError(Exception):
    """Bad input on the command line: printed as one line, exit status 2."""


def _value(text: str) -> Any:
    """A --set value as YAML reads it: 3 → int, true → bool, [+, -] → list, anything else a string."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _config(args: argparse.Namespace) -> dict[str, Any]:
    config: dict[str, Any] = {}
    if args.config:
        try:
            config = json.loads(args.config)
        except json.JSONDecodeError as exc:
            raise UsageError(f"--config is not JSON: {exc}") from None
        if not isinstance(config, dict):
            raise UsageError("--config must be a JSON object of config keys")
    for item in args.set or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--set {item!r}: expected KEY=VALUE")
        config[key] = _value(value)
    return config


def load_mixture(path: Path) -> Mixture:
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise UsageError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise UsageError(f"{path}: not YAML: {str(exc).splitlines()[0]}") from None
    try:
        return Mixture.model_validate(data)
    except ValidationError as exc:
        first = validation_errors(exc.errors())[0]
        raise UsageError(f"{path}: field '{first['field']}': {first['message'].removeprefix('Value error, ')}") from None


def _mixture(args: argparse.Namespace) -> Mixture:
    if bool(args.mixture) == bool(args.dataset):
        raise UsageError("give either --mixture FILE or --dataset NAME")
    if args.mixture:
        if args.config or args.set:
            raise UsageError("--config and --set go with --dataset; a mixture file holds each generator's config")
        mixture = load_mixture(Path(args.mixture))
    else:
        mixture = Mixture(datasets=[DatasetSpec(name=args.dataset, config=_config(args))])
    updates: dict[str, Any] = {}
    if args.seed is not None:
        updates["seed"] = args.seed
    if args.system_prompt is not None:
        updates["system_prompt"] = args.system_prompt
    if args.max_output_tokens is not None:
        updates["max_output_tokens"] = args.max_output_tokens
    try:
        return Mixture.model_validate({**mixture.model_dump(), **updates})
    except ValidationError as exc:
        first = validation_errors(exc.errors())[0]
        message = first["message"].removeprefix("Value error, ")
        raise UsageError(f"--{first['field'].replace('_', '-')}: {message}") from None


def _quiet() -> contextlib.AbstractContextManager:
    """A few generators print while they work (bf prints dots); the command's output is only its own."""
    return contextlib.redirect_stdout(io.StringIO())


def _questions(paths: list[str]) -> set[str]:
    """The user messages (the questions) of task files, for --exclude; UsageError naming a bad file."""
    questions: set[str] = set()
    for path in paths:
        try:
            rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
            questions.update(message["content"] for row in rows for message in row["responses_create_params"]["input"]
                             if message.get("role") == "user" and isinstance(message.get("content"), str))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise UsageError(f"--exclude {path}: not a task file ({type(exc).__name__}: {exc})") from None
    return questions


def _write(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")


def cmd_generate(args: argparse.Namespace) -> int:
    if args.validation and not args.validation_output:
        raise UsageError("--validation N needs --validation-output FILE")
    if args.validation_output and not args.validation:
        raise UsageError("--validation-output needs --validation N (N > 0)")
    if args.validation_output and Path(args.validation_output).resolve() == Path(args.output).resolve():
        raise UsageError("--validation-output is the --output file: the splits go to two files")
    mixture = _mixture(args)
    started = time.perf_counter()
    counts = {"train": args.count, **({"validation": args.validation} if args.validation else {})}
    exclude = _questions(args.exclude or [])
    try:
        with _quiet():
            splits = generate(mixture, counts, exclude=exclude)
    except GeneratorError as exc:
        where = args.mixture or "--dataset"
        raise UsageError(f"{where}: {exc.field}: {exc}" if args.mixture else f"{exc}") from None
    outputs = {"train": Path(args.output), "validation": Path(args.validation_output or "-")}
    for split, rows in splits.items():
        _write(outputs[split], rows)
        by_name: dict[str, int] = {}
        for row in rows:
            by_name[row["dataset"]] = by_name.get(row["dataset"], 0) + 1
        mix = ", ".join(f"{name} {count}" for name, count in by_name.items())
        print(f"{outputs[split]}: {len(rows)} rows ({mix})")
    left_out = f", none of the {len(exclude)} in --exclude" if exclude else ""
    print(f"seed {mixture.seed}, no question in two rows{left_out}; {time.perf_counter() - started:.1f} s")
    return 0


def _one_line(text: Any, limit: int = EXAMPLE_CHARS) -> str:
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def cmd_list(args: argparse.Namespace) -> int:
    names = args.names or generator_names()
    for name in names:
        try:
            check_name(name)
        except GeneratorError as exc:
            raise UsageError(str(exc)) from None
    generators = Generators(max_datasets=1, max_entries=1)
    mixture = Mixture(datasets=[DatasetSpec(name=names[0])], system_prompt=args.system_prompt or DEFAULT_PROMPT)
    full = bool(args.names)
    for name in names:
        defaults = config_fields(name)
        try:
            with _quiet():
                entry = generators.entry(name, {}, 0, 1, 0)
        except GeneratorError as exc:
            entry, failure = None, str(exc)
        if args.json:
            record = {"dataset": name, "config": defaults,
                      "example": task_row(mixture, name, {}, 0, 1, 0, entry) if entry else None}
            if entry is None:
                record["error"] = failure
            print(json.dumps(record, ensure_ascii=False, default=repr))
            continue
        knobs = ", ".join(f"{key}={_one_line(repr(value), KNOB_CHARS)}" for key, value in defaults.items())
        print(f"{name}  [{knobs}]")
        if entry is None:
            print(f"  (no example: {failure})")
        elif full:
            print(f"  question: {entry['question'].rstrip()}\n  answer: {entry['answer']}")
        else:
            print(f"  question: {_one_line(entry['question'])}\n  answer: {_one_line(entry['answer'])}")
    if not args.json and not args.names:
        print(f"{len(names)} generators (seed 0, index 0, default config); "
              "`list NAME` shows one in full, --json as task rows")
    return 0


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="python -m resources_servers.reasoning_gym",
                                  description="Task files from reasoning-gym's generators.")
    commands = top.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="task rows from one generator or a mixture file",
                              description="Deterministic task rows: the same arguments write the same bytes.")
    gen.add_argument("--mixture", help="a mixture YAML (generators, weights, configs, seed, prompt)")
    gen.add_argument("--dataset", help="one generator by name")
    gen.add_argument("--config", help="its config as a JSON object")
    gen.add_argument("--set", action="append", metavar="KEY=VALUE", help="one config key (repeatable)")
    gen.add_argument("--seed", type=int, help="the seed (default: the mixture's, else 0)")
    gen.add_argument("--count", type=int, required=True, help="rows of the training split")
    gen.add_argument("--output", required=True, help="the training split's JSONL")
    gen.add_argument("--validation", type=int, default=0, help="rows of the held-out split (other indices)")
    gen.add_argument("--validation-output", help="the held-out split's JSONL")
    gen.add_argument("--exclude", nargs="+", metavar="FILE", help="task files whose questions are never drawn "
                                                                  "(a held-out set disjoint from a training split)")
    gen.add_argument("--system-prompt", help="a reasoning-gym prompt name (default, direct, simple, "
                                             "DeepSeekZero, chain_of_draft) or a text asking for <answer> tags")
    gen.add_argument("--max-output-tokens", type=int, help="the rows' max_output_tokens (default 1024)")
    gen.set_defaults(handler=cmd_generate)
    lst = commands.add_parser("list", help="every generator with its config keys and one example task")
    lst.add_argument("names", nargs="*", help="only these generators, shown in full")
    lst.add_argument("--json", action="store_true", help="one JSON object per generator, its example a task row")
    lst.add_argument("--system-prompt", help="the prompt of the --json example rows")
    lst.set_defaults(handler=cmd_list)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "generate" and (args.count < 1 or args.validation < 0):
        print("error: --count must be at least 1 and --validation at least 0", file=sys.stderr)
        return 2
    try:
        return args.handler(args)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
