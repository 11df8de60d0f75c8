"""`rollgym init resources_servers/NAME`: a new environment folder that passes `rollgym test` as is;
`rollgym init --package DIR`: the same environment as a pip-installable project (DIR/pyproject.toml,
DIR/NAME/...), found by stacks through its `rollgym.environments` entry point once installed.

The scaffold is a small working environment (a lookup tool and an exact-answer reward) with every
file a folder needs, for the user to edit into their own task.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

NAME_PATTERN = re.compile(r"^[a-z][a-z0-9_]*$")

APP = '''"""{name}: answer a question, using the `lookup` tool to read facts from the task.

Reward 1.0 when the final answer contains the expected answer (case-insensitive), else 0.0.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rollgym import ResourcesServer, RunRequest, Verdict, tool
from rollgym.text import final_message_text


class {cls}Task(RunRequest):
    facts: dict[str, str] = Field(description="what the lookup tool can read, by key")
    expected: str = Field(min_length=1, description="the answer the final message must contain")


class LookupArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    key: str = Field(min_length=1, description="the fact to read")


def score(answer: str, expected: str) -> float:
    """1.0 when the answer contains the expected text (case-insensitive), else 0.0."""
    return 1.0 if expected.casefold() in answer.casefold() else 0.0


class {cls}Server(ResourcesServer):
    task_model = {cls}Task

    async def seed(self, task: {cls}Task, state: dict[str, Any]) -> None:
        state["facts"] = dict(task.facts)

    @tool
    async def lookup(self, args: LookupArgs, state: dict[str, Any]) -> str:
        """Read one fact by its key."""
        facts = state.get("facts", {{}})
        if args.key not in facts:
            return f"No fact named {{args.key!r}}. Known keys: {{', '.join(sorted(facts))}}."
        return facts[args.key]

    async def verify(self, request: {cls}Task, state: dict[str, Any]) -> Verdict:
        answer = final_message_text(request.response.output)
        return Verdict(reward=score(answer, request.expected), details={{"answer": answer}})
'''

CONFIG = '''# {name} environment and the agent that runs it (the model is policy_model: the embedded default
# model unless another model config is given).
{name}:
  resources_servers:
    {name}:
      entrypoint: app.py

{name}_agent:
  agents:
    simple_agent:
      entrypoint: app.py
      model_server:
        name: policy_model
      resources_server:
        name: {name}
      max_steps: 4
'''

TESTS = '''"""{name}: the reward function, then the server over real HTTP."""

from __future__ import annotations

import httpx

from {module}.app import score
from rollgym.envkit.folder import env_folder
from rollgym.testing import final_response, serve_in_thread

ENV = env_folder(__file__)  # this folder: its data/ rows, and its servers built from configs/{name}.yaml


def test_score() -> None:
    assert score("It is Blue.", "blue") == 1.0
    assert score("It is red.", "blue") == 0.0


def test_server() -> None:
    with serve_in_thread(ENV.build("{name}")) as url, httpx.Client(base_url=url) as http:
        for row in ENV.rows():
            assert http.post("/seed_session", json=row).status_code == 200
            key = next(iter(row["facts"]))
            assert http.post("/lookup", json={{"key": key}}).text == row["facts"][key]
            assert http.post("/verify", json={{**row, "response": final_response(row["expected"])}}).json()["reward"] == 1.0
            assert http.post("/verify", json={{**row, "response": final_response("no idea")}}).json()["reward"] == 0.0
        bad = http.post("/lookup", json={{"key": 3}})
        assert bad.status_code == 422 and bad.json()["error"]["field"] == "key"
'''

README = '''# {name}

**Task.** Answer a question; the facts needed are behind the `lookup` tool.

**Tools.** `lookup(key)`: returns the fact stored under `key` in the task row (or the known keys).

**Reward.** 1.0 when the final assistant message contains `expected` (case-insensitive), else 0.0.

**Task row.**

```json
{row}
```

**Files.** `app.py` (server, tool, reward), `configs/{name}.yaml` (the environment and its agent),
`data/example.jsonl` (5 rows), `data/checks.jsonl` (known-good and known-bad answers that
`rollgym test` verifies), `tests/`.

```bash
rollgym test {folder}
rollgym collect-rollouts --config {folder}/configs/{name}.yaml \\
    --input {folder}/data/example.jsonl --output runs/{name}.jsonl --repeats 4
```
'''

PYPROJECT = '''[build-system]
requires = ["setuptools>=77"]
build-backend = "setuptools.build_meta"

[project]
name = "{dist}"
version = "0.1.0"
description = "{name}: a rollgym environment"
requires-python = ">=3.11"
# rollgym itself comes from its checkout (pip install -e path/to/rollgym); list your reward's own
# dependencies here.
dependencies = []

# How rollgym finds it: stacks name it `resources_servers: {{{name}: ...}}`, `rollgym env list` shows it.
[project.entry-points."rollgym.environments"]
{name} = "{name}"

# The folders ship whole (setuptools wants data folders listed as packages).
[tool.setuptools]
packages = ["{name}", "{name}.configs", "{name}.data", "{name}.tests"]

[tool.setuptools.package-data]
"{name}" = ["README.md"]
"{name}.configs" = ["*.yaml"]
"{name}.data" = ["*.jsonl"]
'''

PACKAGE_README = '''# {dist}

A rollgym environment, installable with pip. `{name}/` is the environment folder (see
`{name}/README.md`); the entry point in `pyproject.toml` is how rollgym finds it once installed.

```bash
pip install -e .                        # into rollgym's environment
cd path/to/rollgym                      # the checkout: its agents and models serve the stack
rollgym env list                        # {name} is listed, with its tools and an example task
rollgym test {name}                     # its tests, then a live check of its server
```

Publish it as any Python package (`python -m build`, then `twine upload dist/*`, or a git URL:
`pip install git+https://...`); whoever installs it runs it by name.
'''

EXAMPLES = [
    ("What colour is the sky on a clear day? Use the lookup tool.", {"sky": "blue", "grass": "green"}, "blue"),
    ("How many legs does a spider have? Use the lookup tool.", {"spider": "8", "ant": "6"}, "8"),
    ("What is the capital of France? Use the lookup tool.", {"france": "Paris", "spain": "Madrid"}, "Paris"),
    ("Which planet is known as the red planet? Use the lookup tool.", {"red_planet": "Mars"}, "Mars"),
    ("What gas do plants take in? Use the lookup tool.", {"plants_take_in": "carbon dioxide"}, "carbon dioxide"),
]


def example_rows() -> list[dict]:
    tool = {"type": "function", "name": "lookup", "description": "Read one fact by its key.",
            "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"],
                           "additionalProperties": False}, "strict": False}
    return [{"responses_create_params": {"input": [{"role": "user", "content": f"{question} Keys: {', '.join(facts)}."}],
                                         "tools": [tool]},
             "facts": facts, "expected": expected} for question, facts, expected in EXAMPLES]


def scaffold_package(project: Path) -> list[Path]:
    """Write a pip-installable environment project: project/pyproject.toml, README.md, and the
    environment folder project/NAME/ (NAME: the project folder's name)."""
    name = project.name
    if not NAME_PATTERN.match(name):
        raise ValueError(f"package name {name!r} must be lower_snake_case (it is also the import name)")
    if project.exists() and any(project.iterdir()):
        raise ValueError(f"{project} already exists and is not empty")
    written = _write_folder(project / name, module=name, shown=str(project / name))
    dist = name.replace("_", "-")
    for relative, text in {"pyproject.toml": PYPROJECT.format(name=name, dist=dist),
                           "README.md": PACKAGE_README.format(name=name, dist=dist)}.items():
        (project / relative).write_text(text)
        written.append(project / relative)
    return written


def scaffold(folder: Path) -> list[Path]:
    """Write a new environment folder; refuses to overwrite anything. Returns the files written."""
    name = folder.name
    if folder.parent.name != "resources_servers":
        raise ValueError(f"a new environment goes in resources_servers/NAME, not {folder} "
                         "(or make it a package: rollgym init --package DIR)")
    if not NAME_PATTERN.match(name):
        raise ValueError(f"environment name {name!r} must be lower_snake_case (a Python package name)")
    if folder.exists() and any(folder.iterdir()):
        raise ValueError(f"{folder} already exists and is not empty")
    written = _write_folder(folder, module=f"resources_servers.{name}", shown=f"resources_servers/{name}")
    init = folder.parent / "__init__.py"
    if not init.exists():
        init.write_text("")
    return written


def _write_folder(folder: Path, *, module: str, shown: str) -> list[Path]:
    name = folder.name
    cls = "".join(part.capitalize() for part in name.split("_"))
    rows = example_rows()
    first_key = next(iter(rows[0]["facts"]))
    checks = [
        {"example": 0, "tool_calls": [{"name": "lookup", "arguments": {"key": first_key}}],
         "answer": f"The answer is {rows[0]['expected']}.", "reward": 1.0},
        {"example": 0, "answer": "I do not know.", "reward_below": 1.0},
    ]
    files = {
        "__init__.py": "",
        "app.py": APP.format(name=name, cls=cls),
        f"configs/{name}.yaml": CONFIG.format(name=name),
        "data/example.jsonl": "".join(json.dumps(row) + "\n" for row in rows),
        "data/checks.jsonl": "".join(json.dumps(check) + "\n" for check in checks),
        f"tests/test_{name}.py": TESTS.format(name=name, cls=cls, module=module),
        "README.md": README.format(name=name, row=json.dumps(rows[0], indent=2), folder=shown),
    }
    written = []
    for relative, text in files.items():
        path = folder / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    return written
