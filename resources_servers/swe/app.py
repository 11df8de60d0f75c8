"""swe: fix a repository so its failing tests pass, in a workspace sandbox; graded by the tests.

A task is a SWE-bench instance (instance_id, repo, base_commit, problem_statement, FAIL_TO_PASS,
PASS_TO_PASS, patch, test_patch, ...; SWE-bench / SWE-smith / SWE-Gym rows load unchanged). Each
session gets a workspace (rollgym.sandbox) holding the repository at `base_commit` at /workspace;
the tools are `bash`, `str_replace_editor` and `submit`, every command running in the session's
sandbox. `/verify` takes the patch (the submitted one, else the workspace's: the base tree against the
workspace's files, whatever the model did to git), leaves out what could change how the tests are
collected or reported (patch.py), applies the rest and then `test_patch` to a fresh copy in a fresh
sandbox, runs both test lists with the grader's own runner (pytest_runner.py, whose report carries a
one-time key) and gives reward 1 when every FAIL_TO_PASS test passes and no PASS_TO_PASS test breaks
(or, with `partial_credit`, the share of FAIL_TO_PASS passing while none breaks). Every 0 has a
`reason`. A failure of the sandbox itself raises (env_error) and closes the session's workspace.
"""

from __future__ import annotations

import asyncio
import base64
import inspect
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field, field_validator

from rollgym import ResourcesServer, ResourcesServerConfig, RunRequest, Verdict, tool
from rollgym.resources import EmptyArgs, ToolSpec
from rollgym.sandbox import (FileAccessError, SandboxError, SandboxResult, WorkspaceLimits, WorkspaceProvider,
                             make_provider)
from rollgym.server import BadRequest, JSONBytesResponse, ServerStartError

from . import grader
from .editor import EditError, EditorArgs, insert, str_replace, view_file
from .leaks import hidden_paths, sandbox_roots, solution_copies
from .patch import describe, graded_part, printable, task_test_paths
from .repos import DEFAULT_REPOS, TEST_CMD, RepoError, git, repo_dir_name
from .testlog import GOOD, grade

FOLDER = Path(__file__).resolve().parent
UNDO_DEPTH = 5
BASE_GIT = "/run/base.git"  # where the diff command sees the template's repository (read-only)


def _test_cmd(value: str | None) -> str | None:
    if value is not None:
        try:
            grader.parse_test_cmd(value)
        except grader.TestCommandError as exc:
            raise ValueError(str(exc)) from None
    return value


class SweTask(RunRequest):
    model_config = ConfigDict(extra="allow")  # SWE-bench's other fields (version, hints_text, ...) ride along

    instance_id: str = Field(min_length=1)
    repo: str = Field(pattern=r"^[\w.-]+/[\w.-]+$", description='"owner/name", found as owner__name under repos_dir')
    base_commit: str = Field(pattern=r"^[0-9a-f]{7,40}$")
    problem_statement: str = ""
    FAIL_TO_PASS: list[str] = Field(min_length=1)
    PASS_TO_PASS: list[str] = Field(default_factory=list)
    patch: str = Field(default="", description="the gold patch (not shown to the model)")
    test_patch: str = Field(default="", description="applied before the tests run at /verify")
    test_cmd: str | None = Field(default=None, description="the test command (node ids appended); default: the server's")

    _check_test_cmd = field_validator("test_cmd")(_test_cmd)

    @field_validator("FAIL_TO_PASS", "PASS_TO_PASS", mode="before")
    @classmethod
    def _json_list(cls, value: Any) -> Any:
        """SWE-bench's datasets store the lists as JSON text."""
        if isinstance(value, str):
            try:
                return json.loads(value)
            except ValueError:
                raise ValueError("must be a list of test ids (or its JSON text)") from None
        return value


class BashArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # Bounds are checked here, not declared in the schema: a length bound of 100000 becomes a grammar
    # repetition that llama.cpp cannot build when the tool call is forced.
    command: str = Field(description="a bash command, run in /workspace")
    timeout: float | None = Field(default=None, description="seconds (default: the server's)")

    @field_validator("command")
    @classmethod
    def _command(cls, value: str) -> str:
        if not value.strip() or len(value) > 100_000:
            raise ValueError("must be a non-empty command of at most 100000 characters")
        if "\0" in value:
            raise ValueError("cannot hold a NUL byte")
        return value

    @field_validator("timeout")
    @classmethod
    def _timeout(cls, value: float | None) -> float | None:
        if value is not None and not 0 < value <= 3600:
            raise ValueError("must be between 0 and 3600 seconds")
        return value


class SweServerConfig(ResourcesServerConfig):
    repos_dir: str = Field(default=str(DEFAULT_REPOS), description="git repositories, one per repo: owner__name")
    templates_dir: str | None = Field(default=None, description="checked-out task states; default: a temp folder")
    provider: Literal["local", "ray"] = "local"
    ray_hosts: int = Field(default=1, ge=1, description="provider ray: workspace actors")
    toolchain: str | None = Field(default=None, description="the venv whose python runs in the sandbox (it needs pytest); "
                                                            "default: the server's own")
    isolation: Literal["auto", "namespaces", "basic", "minimal"] = "auto"
    allow_weak_isolation: bool = Field(default=False, description="start even where namespaces do not work")
    pool_size: int = Field(default=2, ge=0, description="ready workspaces kept per task state")
    max_concurrent: int = Field(default=8, ge=1, description="commands running at once")
    command_timeout_s: float = Field(default=60.0, gt=0)
    test_timeout_s: float = Field(default=300.0, gt=0, description="the /verify test run")
    cpu_time_s: float = Field(default=120.0, gt=0)
    memory_mb: int = Field(default=2048, ge=128)
    max_processes: int = Field(default=64, ge=8)
    disk_mb: int = Field(default=512, ge=16)
    session_memory_mb: int = Field(default=4096, ge=64, description="every process of a session together (cgroup)")
    session_cpu_s: float = Field(default=3600.0, gt=0, description="CPU seconds of a whole session (cgroup)")
    output_chars: int = Field(default=10_000, ge=500, description="a tool's output shown to the model")
    partial_credit: bool = Field(default=False, description="reward = share of FAIL_TO_PASS passing (0 if one PASS_TO_PASS breaks)")
    test_cmd: str = Field(default=TEST_CMD, description="when the row has no test_cmd")
    max_patch_kb: int = Field(default=4096, ge=1, description="a larger patch is graded 0 (patch_too_large)")

    _check_test_cmd = field_validator("test_cmd")(_test_cmd)
    sandbox_uid_base: int = Field(default=62000, ge=1000)
    sandbox_uid_count: int = Field(default=512, ge=1)


def clip(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n... [{len(text) - 2 * half} characters omitted] ...\n{text[-half:]}"


def format_result(result: SandboxResult, limit: int) -> str:
    """A command's answer: its output (stdout then stderr), and how it ended when not with status 0."""
    output = result.stdout + (("\n" if result.stdout and not result.stdout.endswith("\n") else "") + result.stderr
                              if result.stderr else "")
    text = clip(output, limit)
    if result.killed_reason == "timeout":
        text += f"\n[the command was killed: it ran past its time limit ({result.wall_s:g} s)]"
    elif result.killed_reason:
        text += f"\n[the command was killed: {result.killed_reason}]"
    elif result.exit_code:
        text += f"\n[exit status {result.exit_code}]"
    if result.output_truncated:
        text += "\n[output truncated]"
    return text or "[no output]"


def tool_schemas() -> list[dict[str, Any]]:
    """The tools as a task row's `responses_create_params.tools` carries them (what GET /tools answers)."""
    return [ToolSpec(name, inspect.getdoc(getattr(SweServer, name)) or "", model, name).schema()
            for name, model in (("bash", BashArgs), ("str_replace_editor", EditorArgs), ("submit", EmptyArgs))]


class SweServer(ResourcesServer):
    task_model = SweTask
    config_class = SweServerConfig

    def __init__(self, config: SweServerConfig | None = None, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        c = self.config
        limits = WorkspaceLimits(cpu_time_s=c.cpu_time_s, timeout_s=c.command_timeout_s,
                                 max_timeout_s=max(c.test_timeout_s, c.command_timeout_s), memory_mb=c.memory_mb,
                                 max_processes=c.max_processes, disk_mb=c.disk_mb,
                                 session_memory_mb=c.session_memory_mb, session_cpu_s=c.session_cpu_s,
                                 max_output_bytes=max(64 * 1024, c.output_chars * 4))
        options: dict[str, Any] = {"isolation": c.isolation, "toolchain": c.toolchain, "uid_base": c.sandbox_uid_base,
                                   "uid_count": c.sandbox_uid_count, "pool_size": c.pool_size,
                                   "max_concurrent": c.max_concurrent}
        if c.provider == "ray":
            options["hosts"] = c.ray_hosts
        self.provider: WorkspaceProvider = make_provider(c.provider, limits, **options)
        self._own_templates = c.templates_dir is None  # a temp folder of this server's: removed at shutdown
        self.templates = Path(c.templates_dir or tempfile.mkdtemp(prefix="rollgym-swe-templates-"))
        self._template_locks: dict[str, asyncio.Lock] = {}
        self._last_used: dict[str, float] = {}
        self._namespaced = True
        self._hidden: dict[str, tuple[str, ...]] = {}

    async def startup(self) -> None:
        info = await self.provider.prepare()
        modes = {host.get("mode") for host in info.get("hosts", [info])}
        self._namespaced = modes == {"namespaces"}
        # The index of what the sandbox shows (for hidden()) takes seconds: made now, not at the first seed.
        self._index_task = asyncio.create_task(asyncio.to_thread(solution_copies, "", self._roots()))
        if modes != {"namespaces"} and not self.config.allow_weak_isolation:
            raise ServerStartError(f"swe: workspaces here run in mode {sorted(modes)}, without namespaces; "
                                   "set allow_weak_isolation: true to accept that")

    async def shutdown(self) -> None:
        await asyncio.to_thread(self.provider.shutdown)
        if self._own_templates:
            shutil.rmtree(self.templates, ignore_errors=True)
        await super().shutdown()

    def add_routes(self, app: FastAPI) -> None:
        super().add_routes(app)

        @app.get("/sandbox_info")
        async def sandbox_info() -> JSONBytesResponse:
            return JSONBytesResponse(await self.provider.prepare())

    # --- the task's repository ---------------------------------------------------------------------
    def _make_template(self, task: SweTask, target: Path) -> None:
        """The repository's tree at base_commit, as a one-commit repository (no later history to peek at)."""
        source = Path(self.config.repos_dir) / repo_dir_name(task.repo)
        if not source.is_dir():
            raise RepoError(f"repository {task.repo!r} is not under repos_dir ({source} is missing)")
        staging = Path(tempfile.mkdtemp(prefix="staging-", dir=self.templates))
        try:
            archive = subprocess.run(["git", "-C", str(source), "archive", "--format=tar", task.base_commit],
                                     capture_output=True)
            if archive.returncode != 0:
                raise RepoError(f"{task.repo} has no commit {task.base_commit}: {archive.stderr.decode()[-300:]}")
            subprocess.run(["tar", "-x", "-C", str(staging)], input=archive.stdout, check=True)
            git(staging, "init", "-q", "-b", "main")
            git(staging, "add", "-A", "-f")
            git(staging, "commit", "-q", "-m", f"{task.repo} at {task.base_commit}")
            os.rename(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    async def template(self, task: SweTask) -> str:
        target = self.templates / repo_dir_name(task.repo) / task.base_commit
        if not target.is_dir():
            lock = self._template_locks.setdefault(str(target), asyncio.Lock())
            async with lock:
                if not target.is_dir():
                    target.parent.mkdir(parents=True, exist_ok=True)
                    await asyncio.to_thread(self._make_template, task, target)
        return str(target)

    # --- sessions ---------------------------------------------------------------------------------
    def _roots(self) -> tuple[str, ...]:
        return sandbox_roots(self.config.toolchain or sys.prefix)

    async def hidden(self, task: SweTask) -> tuple[str, ...]:
        """The folders of the system or the toolchain that hold a copy of the task's fix: its sandboxes see
        them empty (leaks.py; a vendored copy of the library would hand the model the answer)."""
        if task.instance_id not in self._hidden:
            self._hidden[task.instance_id] = await asyncio.to_thread(hidden_paths, task.patch, self._roots())
        return self._hidden[task.instance_id]

    async def seed(self, task: SweTask, state: dict[str, Any]) -> None:
        await self._close_idle()
        template = await self.template(task)
        ws = await self.provider.open(template, await self.hidden(task))
        self._last_used[ws] = time.monotonic()
        state.update(workspace=ws, template=template, history={}, submitted=None, commands=0)

    async def _close_idle(self) -> None:
        """Workspaces of sessions that never reached /verify are closed after the session TTL."""
        now = time.monotonic()
        for ws, used in list(self._last_used.items()):
            if now - used > self.config.session_ttl_s:
                self._last_used.pop(ws, None)
                await self.provider.close(ws)

    def _workspace(self, state: dict[str, Any]) -> str:
        ws = state.get("workspace")
        if not ws:
            why = state.get("closed") or "call /seed_session first"
            raise BadRequest(f"this session has no workspace ({why})", field="session", status=409)
        self._last_used[ws] = time.monotonic()
        return ws

    async def _close(self, state: dict[str, Any], why: str) -> None:
        ws = state.get("workspace")
        state.update(workspace=None, closed=why)
        if ws:
            self._last_used.pop(ws, None)
            await self.provider.close(ws)

    @asynccontextmanager
    async def _closing_on_failure(self, state: dict[str, Any]):
        """A sandbox failure ends the session: its workspace is closed now, not at the session's timeout."""
        try:
            yield
        except SandboxError as exc:
            await self._close(state, f"closed after a sandbox failure: {str(exc)[:200]}")
            raise

    @tool
    async def bash(self, args: BashArgs, state: dict[str, Any]) -> str:
        """Run a bash command in the repository (/workspace) and see its output. Each call is a fresh shell: the
        files persist, background processes and `cd` do not. No network."""
        ws = self._workspace(state)
        state["commands"] = state.get("commands", 0) + 1
        async with self._closing_on_failure(state):
            # One stream, in the order it was written, as a terminal (and the agents' own bash tools) shows it.
            result = await self.provider.exec(ws, "exec 2>&1\n" + args.command, args.timeout)
        return format_result(result, self.config.output_chars)

    @tool
    async def str_replace_editor(self, args: EditorArgs, state: dict[str, Any]) -> str:
        """View, create and edit files. `view` shows a file with line numbers (or a directory's files two levels
        deep); `create` writes a new file; `str_replace` replaces old_str, which must occur exactly once, by
        new_str; `insert` puts new_str after line insert_line; `undo_edit` reverts the last edit of a file."""
        ws = self._workspace(state)
        async with self._closing_on_failure(state):
            return await self._edit(ws, args, state)

    async def _edit(self, ws: str, args: EditorArgs, state: dict[str, Any]) -> str:
        history: dict[str, list[str | None]] = state.setdefault("history", {})
        path = args.path
        try:
            if args.command == "view":
                listing = await self.provider.exec(
                    ws, f"p={shlex.quote(path)}; if [ -d \"$p\" ]; then find \"$p\" -maxdepth 2 -not -path '*/.*' | sort; "
                        "else exit 9; fi", 30)
                if listing.exit_code == 0:
                    return (f"Here's the files and directories up to 2 levels deep in {path}, excluding hidden items:\n"
                            + clip(listing.stdout, self.config.output_chars))
                return view_file(path, await self.provider.read_file(ws, path), args.view_range)
            if args.command == "create":
                exists = await self.provider.exec(ws, f"test -e {shlex.quote(path)}", 30)
                if exists.exit_code == 0:
                    return f"File already exists at: {path}. Cannot overwrite files using command `create`."
                await self.provider.write_file(ws, path, args.file_text or "")
                history.setdefault(path, []).append(None)
                return f"File created successfully at: {path}"
            if args.command == "undo_edit":
                if not history.get(path):
                    return f"No edit history found for {path}."
                previous = history[path].pop()
                if previous is None:
                    await self.provider.exec(ws, f"rm -f -- {shlex.quote(path)}", 30)
                    return f"Last edit to {path} undone successfully (the file it created is removed)."
                await self.provider.write_file(ws, path, previous)
                return f"Last edit to {path} undone successfully. {view_file(path, previous, None)}"
            content = await self.provider.read_file(ws, path)
            if args.command == "str_replace":
                updated, message = str_replace(path, content, args.old_str or "", args.new_str or "")
            else:
                updated, message = insert(path, content, args.insert_line or 0, args.new_str or "")
            await self.provider.write_file(ws, path, updated)
            history.setdefault(path, []).append(content)
            del history[path][:-UNDO_DEPTH]
            return message
        except (EditError, FileAccessError) as exc:
            return f"Error: {exc}" if isinstance(exc, FileAccessError) else str(exc)

    async def _diff(self, ws: str, template: str) -> tuple[bytes | None, str | None]:
        """The task's base tree against the workspace's files: (patch, None) or (None, why not)."""
        max_bytes = self.config.max_patch_kb * 1024
        base_git = str(Path(template) / ".git")
        inside = BASE_GIT if self._namespaced else base_git
        result = await self.provider.exec(ws, 'bash "$SANDBOX_INPUT/diff.sh"', 120,
                                          files={"diff.sh": grader.diff_script(inside, max_bytes)},
                                          read_only=((base_git, BASE_GIT),),
                                          output_bytes=grader.diff_output_bytes(max_bytes))
        if result.killed_reason:
            return None, f"patch_unreadable: the diff was killed ({result.killed_reason})"
        if result.exit_code != 0:
            return None, f"patch_unreadable: {' '.join(result.stderr.split())[-300:] or f'exit status {result.exit_code}'}"
        return grader.read_diff(result.stdout)

    @tool
    async def submit(self, args: EmptyArgs, state: dict[str, Any]) -> str:
        """Submit your changes to the repository (its diff) as the solution; the task ends here."""
        ws = self._workspace(state)
        async with self._closing_on_failure(state):
            patch, why = await self._diff(ws, state["template"])
        if patch is None:
            return f"Error: the patch could not be taken ({why}); nothing was submitted."
        state["submitted"] = base64.b64encode(patch).decode()
        return describe(patch.decode("utf-8", "surrogateescape"))

    # --- the reward -------------------------------------------------------------------------------
    async def verify(self, request: SweTask, state: dict[str, Any]) -> Verdict:
        ws, submitted = state.get("workspace"), state.get("submitted")
        patch: bytes | None = base64.b64decode(submitted) if submitted is not None else None
        why: str | None = None
        try:
            if patch is None and ws:
                patch, why = await self._diff(ws, state["template"])
        finally:
            if ws:  # whatever happened, the model's workspace is done with
                await self._close(state, "closed at /verify")
        text = (patch or b"").decode("utf-8", "surrogateescape")
        details: dict[str, Any] = {"model_patch": printable(text), "submitted": submitted is not None,
                                   "commands": state.get("commands", 0)}
        zero = {"resolved": 0.0, "fail_to_pass": 0.0, "pass_to_pass": 0.0}

        def nothing(reason: str, **more: Any) -> Verdict:
            return Verdict(0.0, zero, {**details, **more, "reason": reason, "resolved": False})

        if why:
            return nothing(why)
        if not text.strip():
            return nothing("empty_patch")
        files, folders = task_test_paths([*request.FAIL_TO_PASS, *request.PASS_TO_PASS], request.test_patch)
        graded, left_out = graded_part(text, files, folders)
        details["left_out"] = [{**item, "path": printable(item["path"])} for item in left_out]
        if not graded.strip():
            return nothing("nothing_graded: every change is to a file left out of the graded copy ("
                           + ", ".join(f"{printable(i['path'])}: {i['why']}" for i in left_out[:5]) + ")")
        return await self._run_tests(request, graded.encode("utf-8", "surrogateescape"), details, nothing)

    async def _run_tests(self, request: SweTask, graded: bytes, details: dict[str, Any], nothing: Any) -> Verdict:
        env, args = grader.parse_test_cmd(request.test_cmd or self.config.test_cmd)
        tests = [*request.FAIL_TO_PASS, *request.PASS_TO_PASS]
        key = grader.new_key()
        files: dict[str, str | bytes] = {"model.patch": graded, "runner.py": grader.runner_source()}
        if request.test_patch.strip():
            files["test.patch"] = request.test_patch
        fresh = await self.provider.open(await self.template(request), await self.hidden(request))
        try:
            run = await self.provider.exec(fresh, 'bash "$SANDBOX_INPUT/grade.sh"', self.config.test_timeout_s,
                                           stdin=f"{key}\n".encode(),
                                           files={**files, "grade.sh": grader.grade_script(env, args, tests,
                                                                                          "test.patch" in files)})
        finally:
            await self.provider.close(fresh)
        log = clip(run.stderr, 2000)
        if run.killed_reason:
            return nothing(f"tests_killed: {run.killed_reason}", test_log_tail=log, test_wall_s=run.wall_s)
        for which in ("model", "test"):
            if run.stdout.startswith(f"not_applied: {which}\n"):
                return nothing(f"{which}_patch_does_not_apply: {' '.join(run.stderr.split())[-300:]}")
        report = grader.read_report(run.stdout, key)
        if report is None:
            return nothing("no_test_report: the test process ended without the runner's report"
                           + (f" ({grader.log_reason(run.stderr)})" if grader.log_reason(run.stderr) else ""),
                           test_log_tail=log, test_exit_code=run.exit_code)
        results = {str(k): str(v) for k, v in report["tests"].items()}
        graded_tests = grade(results, request.FAIL_TO_PASS, request.PASS_TO_PASS)
        details.update(graded_tests.details(), test_exit_code=report.get("exit_status"), test_wall_s=run.wall_s,
                       test_counts={"FAIL_TO_PASS": len(request.FAIL_TO_PASS), "PASS_TO_PASS": len(request.PASS_TO_PASS)})
        tampered = [str(name) for name in report.get("tampered") or []]
        if tampered:
            return nothing(f"runner_tampered: the code under test replaced {', '.join(tampered[:8])}",
                           tampered=tampered, test_log_tail=log)
        reward = graded_tests.components["resolved"]
        if self.config.partial_credit and graded_tests.components["pass_to_pass"] == 1.0:
            reward = graded_tests.components["fail_to_pass"]
        if not graded_tests.resolved:
            details["reason"] = failure_reason(graded_tests.f2p, graded_tests.p2p, report, run.stderr)
            details["test_log_tail"] = log
        return Verdict(reward, graded_tests.components, details)


def failure_reason(f2p: dict[str, str], p2p: dict[str, str], report: dict[str, Any], log: str) -> str:
    """Why a run that reported did not resolve the task, in one line."""
    errors = report.get("collect_errors") or []
    failing = sorted(t for t, o in f2p.items() if o not in GOOD)
    broken = sorted(t for t, o in p2p.items() if o not in GOOD)
    if errors and any(o == "MISSING" for o in (*f2p.values(), *p2p.values())):
        detail = grader.log_reason(str(errors[0].get("error", ""))) or grader.log_reason(log)
        return f"collection_error: {errors[0].get('node') or 'the test files'}: {detail or 'could not be collected'}"
    if all(o == "MISSING" for o in (*f2p.values(), *p2p.values())):
        detail = grader.log_reason(log)
        return f"no_tests_ran: pytest's exit status {report.get('exit_status')}" + (f" ({detail})" if detail else "")
    if failing:
        outcomes = sorted({f2p[t] for t in failing})
        return f"fail_to_pass_failing: {len(failing)} of {len(f2p)} ({', '.join(outcomes)})"
    return f"pass_to_pass_broken: {len(broken)} of {len(p2p)} ({', '.join(sorted({p2p[t] for t in broken}))})"
