"""`rollgym test FOLDER` / `--all`: a server folder's tests, then a live check of the server itself.

For an environment the live check starts its server (and the servers its config refers to),
checks `data/example.jsonl` (5 rows, each accepted by `/seed_session`) and runs every line of
`data/checks.jsonl` through the real routes: seed the example row, call the listed tools in that
session, then `/verify` a final answer and compare the reward. A check line looks like

    {"example": 0, "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}],
     "answer": "Sunny, 22 C", "reward": 1.0}
    {"example": 0, "answer": "I don't know", "reward_below": 1.0}

and an environment needs at least one known-good (reward 1.0) and one known-bad (reward below 1.0)
check. A model folder's check starts the model and asks it for a short answer; an agent folder's
runs one example row of an environment that uses that agent through `/run`.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from ..client import ServerAddress, ServerClient
from ..data.jsonl import JsonlError, read_jsonl
from ..config import ROLES, ConfigError, StackConfig, load_stack
from ..server import load_server_class
from ..stack.launcher import LaunchError, Stack
from ..testing import final_response
from .packages import installed_environments


@dataclass
class FolderReport:
    folder: Path
    root: Path | None = None  # paths under it are printed relative to it, as the rest of the CLI does
    lines: list[tuple[bool, str]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def add(self, ok: bool, message: str) -> None:
        message = self._relative(message)
        self.lines.append((ok, message))
        mark = "ok  " if ok else "FAIL"
        print(f"  {mark} {message}", flush=True)

    def skip(self, message: str) -> None:
        """A check that could not run here (no backend, no checks): neither passed nor failed."""
        message = self._relative(message)
        self.skipped.append(message)
        print(f"  skip {message}", flush=True)

    def _relative(self, message: str) -> str:
        return message.replace(f"{self.root}/", "") if self.root is not None else message

    @property
    def ok(self) -> bool:
        return all(ok for ok, _ in self.lines)


def server_folders(root: Path) -> list[Path]:
    """Every server folder (one with an app.py) under the three role directories."""
    return sorted(path.parent for role in ROLES for path in (root / role).glob("*/app.py"))


def check_folder(folder: Path, *, run_tests: bool = True) -> FolderReport:
    folder = folder.resolve()
    role = folder.parent.name
    root = folder.parent.parent
    if role not in ROLES and folder in {env.path.resolve() for env in installed_environments().values()}:
        # An installed environment package: its tests and live check run from here, where the agents
        # and the stand-in model of its config are found.
        role, root = "resources_servers", Path.cwd().resolve()
    report = FolderReport(folder, root=root if role in ROLES else Path.cwd().resolve())
    print(f"{role}/{folder.name}", flush=True)
    if role not in ROLES or not (folder / "app.py").is_file():
        report.add(False, f"{folder} is not a server folder (expected models/, agents/ or resources_servers/NAME with app.py)")
        return report
    if run_tests:
        _run_pytest(folder, root, report)
    try:
        if role == "resources_servers":
            _live_environment(folder, root, report)
        elif role == "models":
            _live_model(folder, root, report)
        else:
            _live_agent(folder, root, report)
    except (ConfigError, LaunchError) as exc:
        report.add(False, f"live check: {exc}")
    return report


def _run_pytest(folder: Path, root: Path, report: FolderReport) -> None:
    if not (folder / "tests").is_dir():
        report.add(False, "tests: no tests/ folder")
        return
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "--no-header", str(folder / "tests")],
                            cwd=root, capture_output=True, text=True)
    summary = (result.stdout.strip().splitlines() or ["(no output)"])[-1]
    if result.returncode != 0:
        print(result.stdout[-4000:], result.stderr[-2000:], sep="\n")
    report.add(result.returncode == 0, f"tests: {summary}")


def _stack_for(configs: list[Path], wanted: set[str]) -> StackConfig:
    """The stack of `configs` reduced to the `wanted` servers and those they refer to."""
    full = load_stack(configs)
    keep: set[str] = set()
    pending = list(wanted)
    while pending:
        name = pending.pop()
        if name in keep:
            continue
        keep.add(name)
        for key, value in full.servers[name].options.items():
            if key.endswith("_server") and isinstance(value, dict) and value.get("name") in full.servers:
                pending.append(value["name"])
    return StackConfig({name: spec for name, spec in full.servers.items() if name in keep})


def _own_servers(stack: StackConfig, folder: Path) -> list[str]:
    return [name for name, spec in stack.servers.items() if spec.path.resolve() == folder]


def _configs(folder: Path) -> list[Path]:
    return sorted((folder / "configs").glob("*.yaml"))


def _live_environment(folder: Path, root: Path, report: FolderReport) -> None:
    configs = _configs(folder)
    if not configs:
        report.add(False, "live check: no configs/*.yaml")
        return
    full = load_stack(configs)
    names = _own_servers(full, folder)
    if not names:
        report.add(False, f"live check: {configs[0].name} defines no {folder.parent.name}/{folder.name} server")
        return
    examples = _read_jsonl(folder / "data" / "example.jsonl", report)
    if examples is None:
        return
    report.add(len(examples) == 5, f"data/example.jsonl has {len(examples)} rows (5 expected)")
    checks_path = folder / "data" / "checks.jsonl"
    checks = _read_jsonl(checks_path, report) if checks_path.exists() else []
    if checks is None:
        return
    stack = Stack(_stack_for(configs, {names[0]}))
    registry = stack.start()
    try:
        report.add(True, f"server '{names[0]}' started and healthy")
        asyncio.run(_environment_calls(registry, names[0], examples, checks, report))
    finally:
        stack.stop()


async def _environment_calls(registry: dict[str, ServerAddress], env: str, examples: list[dict],
                             checks: list[dict], report: FolderReport) -> None:
    client = ServerClient(registry, timeout_s=120, max_retries=0)
    try:
        seeded = 0
        for index, row in enumerate(examples):
            reply = await client.post(env, "/seed_session", json=row, cookies={})
            if reply.ok:
                seeded += 1
            else:
                report.add(False, f"example row {index} refused by /seed_session: HTTP {reply.status} {reply.error_message()}")
        report.add(seeded == len(examples), f"{seeded} of {len(examples)} example rows accepted by /seed_session")
        skips = [c for c in checks if "skip" in c]
        if skips:
            report.skip(f"verify checks: {skips[0]['skip']}")
            return
        good = [c for c in checks if c.get("reward") == 1.0]
        bad = [c for c in checks if "reward_below" in c or ("reward" in c and c["reward"] < 1.0)]
        report.add(bool(good) and bool(bad), f"data/checks.jsonl has {len(good)} known-good and {len(bad)} known-bad answers"
                   + ("" if good and bad else " (at least one of each is needed)"))
        for number, check in enumerate(checks, start=1):
            await _one_check(client, env, examples, number, check, report)
    finally:
        await client.close()


async def _one_check(client: ServerClient, env: str, examples: list[dict], number: int, check: dict,
                     report: FolderReport) -> None:
    row = examples[int(check.get("example", 0))]
    cookies: dict[str, str] = {}
    await client.post(env, "/seed_session", json=row, cookies=cookies)
    output: list[dict[str, Any]] = []
    for index, call in enumerate(check.get("tool_calls", [])):
        reply = await client.post(env, f"/{call['name']}", json=call.get("arguments", {}), cookies=cookies)
        if not reply.ok:
            report.add(False, f"check {number}: tool {call['name']} answered HTTP {reply.status}: {reply.error_message()}")
            return
        call_id = f"call_check_{index}"
        output.append({"type": "function_call", "id": f"fc_{index}", "call_id": call_id, "name": call["name"],
                       "arguments": orjson.dumps(call.get("arguments", {})).decode(), "status": "completed"})
        output.append({"type": "function_call_output", "call_id": call_id, "output": reply.text})
    response = final_response(check.get("answer", ""), output)
    reply = await client.post(env, "/verify", json={**row, "response": response}, cookies=cookies)
    if not reply.ok:
        report.add(False, f"check {number}: /verify answered HTTP {reply.status}: {reply.error_message()}")
        return
    reward = reply.json().get("reward")
    if "reward_below" in check:
        report.add(reward is not None and reward < check["reward_below"],
                   f"check {number}: reward {reward} (expected below {check['reward_below']})")
    else:
        report.add(reward == check.get("reward"), f"check {number}: reward {reward} (expected {check.get('reward')})")


def _live_model(folder: Path, root: Path, report: FolderReport) -> None:
    configs = _configs(folder)
    if not configs:
        report.add(False, "live check: no configs/*.yaml")
        return
    full = load_stack(configs, add_default_model=False)
    names = _own_servers(full, folder)
    spec = full.servers[names[0]]
    server_class = load_server_class(spec)
    reason = server_class.live_check_skip_reason(server_class.config_class.model_validate(spec.options))
    if reason:
        report.skip(f"live check: {reason}")
        return
    stack = Stack(_stack_for(configs, set(names[:1])))
    registry = stack.start(timeout_s=180)
    try:
        report.add(True, f"server '{names[0]}' started and healthy")
        asyncio.run(_model_calls(registry, names[0], report))
    finally:
        stack.stop()


async def _model_calls(registry: dict[str, ServerAddress], name: str, report: FolderReport) -> None:
    client = ServerClient(registry, timeout_s=120, max_retries=0)
    try:
        models = await client.get(name, "/v1/models")
        report.add(models.ok and bool(models.json().get("data")), f"GET /v1/models: HTTP {models.status}")
        reply = await client.post(name, "/v1/responses", json={"input": "Say hello.", "max_output_tokens": 8})
        if reply.status in (502, 504):
            report.skip(f"POST /v1/responses: no backend reachable ({reply.error_message()[:80]}); "
                        "point base_url at one to check generation")
        else:
            report.add(reply.ok and bool(reply.json().get("output")), f"POST /v1/responses: HTTP {reply.status}")
    finally:
        await client.close()


def _live_agent(folder: Path, root: Path, report: FolderReport) -> None:
    """Run one example row through an environment whose config uses this agent."""
    for env_folder in server_folders(root):
        if env_folder.parent.name != "resources_servers":
            continue
        for config in _configs(env_folder):
            try:
                stack_config = load_stack([config])
            except ConfigError:
                continue
            agents = _own_servers(stack_config, folder)
            examples_path = env_folder / "data" / "example.jsonl"
            if not agents or not examples_path.exists():
                continue
            row = orjson.loads(examples_path.read_bytes().splitlines()[0])
            stack = Stack(_stack_for([config], {agents[0]}))
            registry = stack.start(timeout_s=180)
            try:
                report.add(True, f"stack of {config.relative_to(root)} started and healthy")
                reply = asyncio.run(_post_once(registry, agents[0], "/run", {**row, "rollout_id": "check-0"}))
                body = reply.json() if reply.ok else {}
                report.add(reply.ok and body.get("status") in ("ok", "truncated", "max_steps"),
                           f"POST /run on {env_folder.name}: HTTP {reply.status}, status {body.get('status')}, "
                           f"reward {body.get('reward')}")
            finally:
                stack.stop()
            return
    report.add(False, "live check: no environment config uses this agent")


async def _post_once(registry: dict[str, ServerAddress], name: str, path: str, payload: dict) -> Any:
    client = ServerClient(registry, timeout_s=600, max_retries=0)
    try:
        return await client.post(name, path, json=payload)
    finally:
        await client.close()


def _read_jsonl(path: Path, report: FolderReport) -> list[dict] | None:
    if not path.exists():
        report.add(False, f"{path.parent.name}/{path.name} is missing")
        return None
    try:
        return read_jsonl(path)
    except JsonlError as exc:
        report.add(False, f"{path.name}{str(exc).removeprefix(str(path))}")
        return None
