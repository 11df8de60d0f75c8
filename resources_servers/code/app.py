"""code: the model writes a Python function; hidden unit tests run against it in a sandbox.

Reward = the fraction of the task's tests that pass. The answer's code is the last ```python fenced
block of the final assistant message (the whole message when it has no fence). One sandbox run
grades it with harness.py, in two processes: the grader holds the tests and runs them in its own
interpreter, and the answer runs in a second, fresh interpreter that never sees the tests and only
answers calls (values cross as plain data; see harness.py). Nothing the answer does in its process
(exiting, patching builtins or the runner, printing result lines, objects equal to everything,
reading the test files) reaches the verdict. A candidate that does not compile, crashes, loops or
is killed scores what it passed (0.0 if nothing ran), with the reason in the details: a bad program
is the policy's fault, never an env_error. A test that passes the answer something other than plain
data (a function, an object of the setup code) cannot be graded this way: the row is refused (422
naming `tests[i]`).

The `run_python` tool runs code in the same sandbox and shows its exit status, stdout and stderr.
The sandbox is rollgym.sandbox (shared with the workspace environments); docs/sandbox.md says what it contains.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field, field_validator

from rollgym import BadRequest, ResourcesServer, ResourcesServerConfig, RunRequest, Verdict, tool
from rollgym.server import JSONBytesResponse
from rollgym.text import final_answer_text, final_message_text

from rollgym.sandbox import SCRIPT_NAME, Sandbox, SandboxLimits, SandboxResult

PYTHON_TAGS = {"python", "py", "python3", "py3"}
ERROR_CHARS = 300  # a test's error message, as reported


class CodeTask(RunRequest):
    entry_point: str = Field(description="the name of the function the model must write")
    tests: list[str] = Field(min_length=1, description='Python assert statements or small blocks: "assert add(2, 3) == 5"')
    setup_code: str = Field(default="", description="run after the candidate's code and before the tests (imports, helpers)")

    @field_validator("entry_point")
    @classmethod
    def _identifier(cls, value: str) -> str:
        if not value.isidentifier():
            raise ValueError("must be a Python identifier")
        return value

    @field_validator("tests")
    @classmethod
    def _not_blank(cls, value: list[str]) -> list[str]:
        if any(not test.strip() for test in value):
            raise ValueError("tests must not be blank")
        return value

    @field_validator("setup_code", mode="before")
    @classmethod
    def _none_is_empty(cls, value: Any) -> Any:
        return "" if value is None else value


class RunPythonArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    code: str = Field(min_length=1, max_length=200_000, description="a complete Python program to run")


class CodeServerConfig(ResourcesServerConfig):
    cpu_time_s: float = Field(default=5.0, gt=0, description="CPU seconds per sandbox run (RLIMIT_CPU)")
    wall_time_s: float = Field(default=10.0, gt=0, description="wall-clock seconds per sandbox run")
    memory_mb: int = Field(default=512, ge=64, description="address space per process (RLIMIT_AS)")
    max_output_bytes: int = Field(default=64 * 1024, ge=1024, description="stdout and stderr kept, each")
    kill_output_bytes: int = Field(default=1024 * 1024, ge=1024, description="output beyond which the run is killed")
    file_size_mb: int = Field(default=16, ge=1, description="largest file a program may write (RLIMIT_FSIZE)")
    tmp_size_mb: int = Field(default=64, ge=1, description="size of the private /tmp (namespaces mode)")
    max_processes: int = Field(default=32, ge=4, description="processes and threads of one sandbox (RLIMIT_NPROC)")
    max_concurrent_sandboxes: int = Field(default=4, ge=1, le=256, description="sandboxes running at once")
    test_timeout_s: float = Field(default=3.0, gt=0, description="the answer's time per test in /verify")
    load_timeout_s: float = Field(default=5.0, gt=0, description="time to start the answer's interpreter and run "
                                                                 "its import-time code, per start in /verify")
    tool_output_chars: int = Field(default=4000, ge=200, description="stdout/stderr shown by run_python, each")
    python: str | None = Field(default=None, description="interpreter; default: the one behind the server's")
    isolation: Literal["auto", "namespaces", "basic", "minimal"] = Field(
        default="auto", description="sandbox mode; auto picks the strongest that works here")
    sandbox_uid_base: int = Field(default=60000, ge=1000, le=2**31 - 5000,
                                  description="sandboxes run as uids base .. base+count-1 (when the server is root)")
    sandbox_uid_count: int = Field(default=64, ge=1, le=4096,
                                   description="uids to share among every sandbox of this machine using this base")

    def limits(self) -> SandboxLimits:
        return SandboxLimits(
            cpu_time_s=self.cpu_time_s, wall_time_s=self.wall_time_s, memory_mb=self.memory_mb,
            max_output_bytes=self.max_output_bytes, kill_output_bytes=self.kill_output_bytes,
            file_size_mb=self.file_size_mb, tmp_size_mb=self.tmp_size_mb, max_processes=self.max_processes,
        )


# --- the answer ---------------------------------------------------------------------------------
def extract_code(message: str) -> str:
    """The code of an answer: the last ```python block, else the last untagged ``` block, else the
    whole message when it has no fence at all ("" when it only has fences of other languages).

    A fence opens at the start of a line (up to 3 spaces of indentation) and closes at a line that
    is only ``` ; an unclosed last fence runs to the end (an answer cut off by the token limit).
    """
    blocks: list[tuple[str, list[str]]] = []
    current: list[str] | None = None
    for line in message.splitlines():
        stripped = line.strip()
        if current is None:
            if line.startswith(("```", " ```", "  ```", "   ```")):
                tag = stripped[3:].strip().split(maxsplit=1)
                current = []
                blocks.append(((tag[0].lower() if tag else ""), current))
        elif stripped.startswith("```") and not stripped.strip("`"):
            current = None
        else:
            current.append(line)
    if not blocks:
        return message
    for wanted in (PYTHON_TAGS, {""}):
        for tag, lines in reversed(blocks):
            if tag in wanted:
                return "\n".join(lines) + "\n"
    return ""


# --- the harness (runs inside the sandbox) -----------------------------------------------------
# harness.py is the sandbox's main script; it is read here, never imported by the server.
HARNESS_SOURCE = (Path(__file__).parent / "harness.py").read_text(encoding="utf-8")


def harness_files(code: str, tests: list[str], entry_point: str, setup_code: str = "",
                  timeout_s: float = 3.0, load_s: float = 5.0) -> dict[str, str]:
    """The sandbox's files that grade `code`: the harness (main script), the answer, and the tests
    (which the harness reads and deletes before the answer's process starts). The harness reads the
    run's nonce from stdin."""
    grading = json.dumps({"tests": tests, "entry_point": entry_point, "setup": setup_code, "timeout_s": timeout_s,
                          "load_s": load_s})
    return {SCRIPT_NAME: HARNESS_SOURCE, "solution.py": code, "grading.json": grading}


@dataclass
class Grade:
    reward: float
    components: dict[str, float]
    details: dict[str, Any] = field(default_factory=dict)


def parse_report(stdout: str, nonce: str) -> list[dict[str, Any]]:
    """The harness's events: the lines of stdout tagged with this run's nonce."""
    events = []
    prefix = nonce + " "
    for line in stdout.splitlines():
        if line.startswith(prefix):
            try:
                event = json.loads(line[len(prefix):])
            except ValueError:
                continue
            if isinstance(event, dict):
                events.append(event)
    return events


class TaskTestError(ValueError):
    """A test of the task cannot run against any answer (it passes the answer a function, a setup-defined
    object...): the row's fault, refused naming `tests[i]`."""

    def __init__(self, index: int, error: str) -> None:
        super().__init__(error)
        self.index = index


def grade_run(result: SandboxResult, nonce: str, n_tests: int) -> Grade:
    """Reward, components and details from one harness run. Raises TaskTestError for a test the
    harness could not run against any answer; otherwise never raises."""
    events = parse_report(result.stdout, nonce)
    passed: dict[int, bool] = {}
    errors: dict[int, str] = {}
    timeouts: set[int] = set()
    stages: dict[str, dict[str, Any]] = {}
    done = False
    for event in events:
        if event.get("done") is True:
            done = True
        elif isinstance(event.get("test"), int) and 0 <= event["test"] < n_tests and event["test"] not in passed:
            passed[event["test"]] = event.get("ok") is True
            if event.get("ok") is not True:
                errors[event["test"]] = str(event.get("error", ""))[:ERROR_CHARS]
                if event.get("unsendable") is True:
                    raise TaskTestError(event["test"], errors[event["test"]])
                if event.get("timeout") is True:
                    timeouts.add(event["test"])
        elif isinstance(event.get("stage"), str) and event["stage"] not in stages:
            stages[event["stage"]] = event
    results = [passed.get(i, False) for i in range(n_tests)]
    k = sum(results)
    details: dict[str, Any] = {"test_results": results}
    failed = [i for i in range(n_tests) if not results[i]]
    if failed:
        first = failed[0]
        details["first_failure"] = {"test": first, "error": errors.get(first, "not run")}
    candidate = stages.get("candidate", {})
    reason, error = None, None
    if stages.get("compile", {}).get("ok") is False:
        reason, error = "syntax_error", stages["compile"].get("error")
    elif not done and result.timed_out:
        reason = "timeout"
    elif not done and result.killed_reason:
        reason = "killed"
        details["killed_reason"] = result.killed_reason
    elif not done:
        reason = "crashed"
        error = _tail(result.stderr) or f"exit status {result.exit_code}"
    elif candidate.get("timeout") is True:
        reason, error = "timeout", candidate.get("error")
    elif candidate.get("crashed") is True:
        reason, error = "crashed", candidate.get("error")
    elif candidate.get("ok") is False:
        reason, error = "candidate_error", candidate.get("error")
    elif stages.get("setup", {}).get("ok") is False:
        reason, error = "setup_error", stages["setup"].get("error")
    elif stages.get("entry_point", {}).get("ok") is False:
        reason = "missing_entry_point"
    elif k == 0:
        # Every reward of 0 says why: the answer's own time ran out, or its results were wrong.
        reason = "timeout" if timeouts else "tests_failed"
    if reason:
        details["reason"] = reason
    if error:
        details["error"] = str(error)[:ERROR_CHARS]
    details["exit_code"] = result.exit_code
    details["wall_s"] = result.wall_s
    return Grade(k / n_tests, {"tests_passed": float(k), "tests_total": float(n_tests)}, details)


def _tail(text: str, limit: int = ERROR_CHARS) -> str:
    text = text.strip()
    return text if len(text) <= limit else "..." + text[-(limit - 3):]


# --- the tool -----------------------------------------------------------------------------------
def _clip(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n... [{len(text) - 2 * half} characters omitted] ...\n{text[-half:]}"


def format_run(result: SandboxResult, limit_chars: int, limits: SandboxLimits) -> str:
    """What run_python shows the model."""
    if result.killed_reason == "timeout":
        status = f"killed: wall-time limit ({limits.wall_time_s:g} s) exceeded"
    elif result.killed_reason == "cpu_time":
        status = f"killed: CPU-time limit ({limits.cpu_time_s:g} s) exceeded"
    elif result.killed_reason == "output_limit":
        status = f"killed: output limit ({limits.kill_output_bytes} bytes) exceeded"
    elif result.killed_reason:
        status = f"killed: {result.killed_reason}"
    else:
        status = f"exit status {result.exit_code}"
    parts = [status, "--- stdout ---", _clip(result.stdout, limit_chars), "--- stderr ---", _clip(result.stderr, limit_chars)]
    if result.output_truncated:
        parts.append(f"[output truncated to the first {limits.max_output_bytes} bytes of each stream]")
    return "\n".join(parts)


class CodeServer(ResourcesServer):
    task_model = CodeTask
    config_class = CodeServerConfig

    def __init__(self, config: CodeServerConfig | None = None, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.sandbox = Sandbox(
            self.config.limits(),
            max_concurrent=self.config.max_concurrent_sandboxes,
            isolation=self.config.isolation,
            python=self.config.python,
            uid_base=self.config.sandbox_uid_base,
            uid_count=self.config.sandbox_uid_count,
        )

    async def startup(self) -> None:
        await self.sandbox.prepare()  # a machine where no sandbox works refuses to start

    async def shutdown(self) -> None:
        self.sandbox.close()
        await super().shutdown()

    def add_routes(self, app: FastAPI) -> None:
        super().add_routes(app)

        @app.get("/sandbox_info")
        async def sandbox_info() -> JSONBytesResponse:
            await self.sandbox.prepare()
            return JSONBytesResponse(self.sandbox.info())

    async def seed(self, task: CodeTask, state: dict[str, Any]) -> None:
        state["runs"] = 0

    @tool
    async def run_python(self, args: RunPythonArgs, state: dict[str, Any]) -> str:
        """Run a Python program in a sandbox (no network, no third-party packages, time and memory limits) and see its exit status, stdout and stderr."""
        state["runs"] = state.get("runs", 0) + 1
        result = await self.sandbox.run({SCRIPT_NAME: args.code})
        return format_run(result, self.config.tool_output_chars, self.sandbox.limits)

    async def verify(self, request: CodeTask, state: dict[str, Any]) -> Verdict:
        n = len(request.tests)
        output = request.response.output
        final = final_answer_text(output)
        code = extract_code(final)
        runs = {"run_python_calls": state.get("runs", 0)}
        if not code.strip():
            # Code written before a tool call, with no answer after it, is not the final answer.
            reason = "no_final_answer" if not final.strip() and final_message_text(output).strip() else "no_code"
            return Verdict(0.0, {"tests_passed": 0.0, "tests_total": float(n)},
                           {"test_results": [False] * n, "reason": reason, **runs})
        nonce = secrets.token_hex(16)
        files = harness_files(code, request.tests, request.entry_point, request.setup_code, self.config.test_timeout_s,
                              self.config.load_timeout_s)
        result = await self.sandbox.run(files, stdin=f"{nonce}\n".encode())
        try:
            grade = grade_run(result, nonce, n)
        except TaskTestError as exc:
            raise BadRequest(f"this test cannot run against an answer: {exc}", field=f"tests[{exc.index}]") from None
        return Verdict(grade.reward, grade.components, {**grade.details, **runs})
