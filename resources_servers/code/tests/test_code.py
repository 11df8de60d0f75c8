"""code: answer extraction, grading, the reward through a real sandbox, and the server over HTTP."""

from __future__ import annotations

import concurrent.futures
import json
import secrets
import threading

import httpx
import pytest

from rollgym.sandbox import programs as sandbox_module
from resources_servers.code.app import (
    CodeServer,
    CodeServerConfig,
    extract_code,
    grade_run,
    harness_files,
    parse_report,
)
from rollgym.sandbox import Sandbox, SandboxLimits, SandboxResult
from rollgym.envkit.folder import env_folder
from rollgym.testing import final_response, serve_in_thread

ENV = env_folder(__file__)
DATA = ENV.examples

ADD_TESTS = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0", "assert add('a', 'b') == 'ab'"]
SOLUTIONS = {
    "add": "def add(a, b):\n    return a + b\n",
    "is_palindrome": "def is_palindrome(s):\n    t = [c.lower() for c in s if c.isalnum()]\n    return t == t[::-1]\n",
    "fizzbuzz": (
        "def fizzbuzz(n):\n    out = []\n    for i in range(1, n + 1):\n"
        "        out.append('FizzBuzz' if i % 15 == 0 else 'Fizz' if i % 3 == 0 else 'Buzz' if i % 5 == 0 else str(i))\n"
        "    return out\n"
    ),
    "second_largest": "def second_largest(nums):\n    d = sorted(set(nums))\n    return d[-2] if len(d) > 1 else None\n",
    "merge_sorted": (
        "def merge_sorted(a, b):\n    i = j = 0\n    out = []\n    while i < len(a) and j < len(b):\n"
        "        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n        else:\n            out.append(b[j]); j += 1\n"
        "    return out + a[i:] + b[j:]\n"
    ),
}


def fenced(code: str, tag: str = "python") -> str:
    return f"Here is my solution:\n\n```{tag}\n{code}```\n\nIt handles the edge cases."




# --- extraction ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("message", "code"),
    [
        ("```python\ndef f():\n    return 1\n```", "def f():\n    return 1\n"),
        ("first\n```python\nx = 1\n```\nthen\n```python\nx = 2\n```\ndone", "x = 2\n"),
        ("```py\nx = 3\n```", "x = 3\n"),
        ("```\nx = 4\n```", "x = 4\n"),  # an untagged fence when there is no python one
        ("```python\nx = 5\n```\n```\nnot this\n```", "x = 5\n"),  # python-tagged wins over later untagged
        ("```bash\nls\n```", ""),  # only other languages: no code
        ("def f():\n    return 6", "def f():\n    return 6"),  # no fence: the whole message
        ("```python\ndef f():\n    return 7", "def f():\n    return 7\n"),  # cut off: an unclosed fence runs to the end
        ("text ```python inline``` text", "text ```python inline``` text"),  # fences open at line starts only
    ],
)
def test_extract_code(message: str, code: str) -> None:
    assert extract_code(message) == code


# --- grading (pure) -----------------------------------------------------------------------------
def result(stdout: str = "", **kwargs: object) -> SandboxResult:
    fields = dict(exit_code=0, stdout=stdout, stderr="", timed_out=False, killed_reason=None,
                  output_truncated=False, wall_s=0.1)
    fields.update(kwargs)
    return SandboxResult(**fields)  # type: ignore[arg-type]


def test_grade_counts_only_lines_with_the_nonce() -> None:
    lines = [
        'N {"stage": "candidate", "ok": true}',
        'N {"test": 0, "ok": true}',
        'FORGED {"test": 1, "ok": true}',  # the candidate printing result lines without the nonce
        'N {"test": 1, "ok": false, "error": "AssertionError"}',
        'N {"test": 1, "ok": true}',  # a second line for the same test: the first one counts
        'N {"test": 9, "ok": true}',  # out of range
        'N {"done": true}',
    ]
    grade = grade_run(result("\n".join(lines)), "N", 3)
    assert grade.reward == pytest.approx(1 / 3)
    assert grade.components == {"tests_passed": 1.0, "tests_total": 3.0}
    assert grade.details["test_results"] == [True, False, False]
    assert grade.details["first_failure"] == {"test": 1, "error": "AssertionError"}
    assert "reason" not in grade.details
    assert parse_report("N not json\nN [1]\n", "N") == []


def test_grade_keeps_what_passed_before_a_kill() -> None:
    stdout = 'N {"stage": "candidate", "ok": true}\nN {"test": 0, "ok": true}\n'
    timed_out = grade_run(result(stdout, exit_code=None, timed_out=True, killed_reason="timeout"), "N", 2)
    assert timed_out.reward == 0.5 and timed_out.details["reason"] == "timeout"
    assert timed_out.details["first_failure"] == {"test": 1, "error": "not run"}
    killed = grade_run(result(stdout, exit_code=-24, killed_reason="cpu_time"), "N", 2)
    assert killed.details["reason"] == "killed" and killed.details["killed_reason"] == "cpu_time"
    crashed = grade_run(result(stdout, exit_code=-11, stderr="Fatal Python error: Segmentation fault"), "N", 2)
    assert crashed.reward == 0.5 and crashed.details["reason"] == "crashed" and "Segmentation" in crashed.details["error"]


# --- the reward, through a real sandbox ---------------------------------------------------------
@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    box = Sandbox(SandboxLimits(wall_time_s=5.0, cpu_time_s=3.0), max_concurrent=2)
    yield box
    box.close()


def grade(box: Sandbox, code: str, tests: list[str] = ADD_TESTS, entry_point: str = "add", setup: str = "",
          timeout_s: float = 1.0):
    import asyncio

    nonce = secrets.token_hex(16)
    files = harness_files(code, tests, entry_point, setup, timeout_s)
    run = asyncio.run(box.run(files, stdin=f"{nonce}\n".encode()))
    return grade_run(run, nonce, len(tests))


def test_correct_function_scores_one(sandbox: Sandbox) -> None:
    g = grade(sandbox, "def add(a, b):\n    return a + b\n")
    assert g.reward == 1.0 and g.details["test_results"] == [True, True, True]
    assert "reason" not in g.details and "first_failure" not in g.details


def test_partially_correct_scores_the_exact_fraction(sandbox: Sandbox) -> None:
    g = grade(sandbox, "def add(a, b):\n    return a + b if isinstance(a, int) else None\n")
    assert g.reward == pytest.approx(2 / 3)
    assert g.components == {"tests_passed": 2.0, "tests_total": 3.0}
    assert g.details["test_results"] == [True, True, False]
    assert g.details["first_failure"]["test"] == 2 and g.details["first_failure"]["error"].startswith("AssertionError")


def test_each_test_is_counted_independently(sandbox: Sandbox) -> None:
    # The first test raises, the second loops past the per-test alarm, the third passes.
    code = (
        "def add(a, b):\n"
        "    if a == 2:\n        raise ValueError('boom')\n"
        "    if a == -1:\n        while True:\n            pass\n"
        "    return a + b\n"
    )
    g = grade(sandbox, code, timeout_s=0.5)
    assert g.details["test_results"] == [False, False, True]
    assert g.reward == pytest.approx(1 / 3)
    assert g.details["first_failure"] == {"test": 0, "error": "ValueError: boom"}


def test_syntax_error_scores_zero_with_the_reason(sandbox: Sandbox) -> None:
    g = grade(sandbox, "def add(a, b)\n    return a + b\n")
    assert g.reward == 0.0 and g.details["reason"] == "syntax_error"
    assert "SyntaxError" in g.details["error"] and "solution.py" in g.details["error"]


def test_candidate_errors_and_missing_entry_point(sandbox: Sandbox) -> None:
    # Defined, then crashed at import: the function still counts.
    g = grade(sandbox, "def add(a, b):\n    return a + b\nraise SystemExit(3)\n")
    assert g.reward == 1.0 and g.details["reason"] == "candidate_error" and g.details["error"] == "SystemExit: 3"
    g = grade(sandbox, "def plus(a, b):\n    return a + b\n")
    assert g.reward == 0.0 and g.details["reason"] == "missing_entry_point"
    assert g.details["first_failure"]["error"] == "NameError: name 'add' is not defined"
    # Exiting the whole process before the tests ran.
    g = grade(sandbox, "import os\nos._exit(0)\n")
    assert g.reward == 0.0 and g.details["reason"] == "crashed"


def test_forged_results_do_not_count(sandbox: Sandbox) -> None:
    forge = 'import os, sys\nfor i in range(3):\n    os.write(1, b"x {\\"test\\": %d, \\"ok\\": true}\\n" % i)\nos._exit(0)\n'
    g = grade(sandbox, forge)
    assert g.reward == 0.0


def test_setup_code_runs_before_the_tests(sandbox: Sandbox) -> None:
    setup = "def twice(x):\n    return 2 * x\n"
    g = grade(sandbox, "def add(a, b):\n    return a + b\n", ["assert add(twice(1), 1) == 3"], setup=setup)
    assert g.reward == 1.0


def test_answers_that_are_classes_generators_and_exceptions(sandbox: Sandbox) -> None:
    # The answer lives in its own process: its instances, generators and exceptions reach the tests
    # through handles (calls, attributes, iteration, len, str) and builtin exception classes.
    code = (
        "class Stack:\n    def __init__(self):\n        self.items = []\n"
        "    def push(self, x):\n        self.items.append(x)\n    def pop(self):\n"
        "        if not self.items:\n            raise IndexError('empty')\n        return self.items.pop()\n"
        "    def __len__(self):\n        return len(self.items)\n    def __repr__(self):\n        return 'Stack'\n"
        "def count_up(n):\n    yield from range(n)\n"
        "class Negative(ValueError):\n    pass\n"
        "def root(x):\n    if x < 0:\n        raise Negative('below zero')\n    return x ** 0.5\n"
        "def big():\n    return 3 ** 10000, float('nan'), b'\\x00', {(1, 2): frozenset({3})}\n"
    )
    tests = [
        "s = Stack()\ns.push(1)\ns.push(2)\nassert len(s) == 2 and s.pop() == 2 and s.items == [1] and repr(s) == 'Stack'",
        "s = Stack()\ntry:\n    s.pop()\nexcept IndexError as e:\n    assert str(e) == 'empty'\nelse:\n    assert False",
        "assert list(count_up(3)) == [0, 1, 2] and sum(count_up(4)) == 6 and next(iter(count_up(5))) == 0",
        "try:\n    root(-1)\nexcept ValueError:\n    pass\nelse:\n    assert False",
        "assert root(4) == 2.0 and root(2.25) == {1.5: 'x'}.popitem()[0]",
        "n, nan, raw, nested = big()\nassert n == 3 ** 10000 and nan != nan and raw == b'\\x00' "
        "and nested == {(1, 2): frozenset({3})}",  # plain data of every kind, integers of any size
        "assert Stack() != Stack()",  # the answer's objects are not compared: a TypeError, the test fails
    ]
    g = grade(sandbox, code, tests, entry_point="Stack")
    assert g.details["test_results"] == [True, True, True, True, True, True, False], g.details
    assert "TypeError" in g.details["first_failure"]["error"]


# --- the server over HTTP -----------------------------------------------------------------------
def test_server_end_to_end_over_http() -> None:
    rows = ENV.rows()
    assert len(rows) == 5 and {row["entry_point"] for row in rows} == set(SOLUTIONS)
    with serve_in_thread(CodeServer(name="code")) as url, httpx.Client(base_url=url, timeout=60) as http:
        tools = http.get("/tools").json()
        assert [t["name"] for t in tools] == ["run_python"]
        assert tools == rows[0]["responses_create_params"]["tools"]  # the rows offer the served schema
        info = http.get("/sandbox_info").json()
        assert info["mode"] in ("namespaces", "basic", "minimal") and info["limits"]["wall_time_s"] == 10.0
        for row in rows:
            assert http.post("/seed_session", json=row).status_code == 200
            good = http.post("/verify", json={**row, "response": final_response(fenced(SOLUTIONS[row["entry_point"]]))})
            assert good.status_code == 200, good.text
            body = good.json()
            n = len(row["tests"])
            assert body["reward"] == 1.0 and body["test_results"] == [True] * n
            assert body["reward_components"] == {"tests_passed": n, "tests_total": n}
            no_code = http.post("/verify", json={**row, "response": final_response("I cannot solve this.")}).json()
            assert no_code["reward"] == 0.0 and no_code["reason"] == "syntax_error"  # prose, read as code
            empty = http.post("/verify", json={**row, "response": final_response("   ")}).json()
            assert empty["reward"] == 0.0 and empty["reason"] == "no_code"
        # run_python: the output, the exit status, the session's count.
        row = rows[0]
        http.post("/seed_session", json=row)
        ran = http.post("/run_python", json={"code": "import sys\nprint('hi')\nprint('oops', file=sys.stderr)\nsys.exit(3)"})
        assert ran.headers["content-type"].startswith("text/plain")
        assert ran.text.splitlines()[0] == "exit status 3"
        assert "--- stdout ---\nhi\n" in ran.text and "oops" in ran.text
        verdict = http.post("/verify", json={**row, "response": final_response(fenced(SOLUTIONS["add"]))}).json()
        assert verdict["run_python_calls"] == 1
        # Bad tool arguments and bad task rows: 422 naming the field.
        for args, field in (({"code": 5}, "code"), ({}, "code"), ({"code": "1", "stdin": "x"}, "stdin")):
            bad = http.post("/run_python", json=args)
            assert bad.status_code == 422 and bad.json()["error"]["field"] == field
        # A test that passes the answer a function cannot be graded against any answer: the row's fault.
        lambda_row = {**row, "tests": ["assert add(1, 2) == 3", "assert add(lambda: 1, 2) == 3"]}
        refused = http.post("/verify", json={**lambda_row, "response": final_response(fenced(SOLUTIONS["add"]))})
        assert refused.status_code == 422 and refused.json()["error"]["field"] == "tests[1]", refused.text
        params = row["responses_create_params"]
        for task, field in (
            ({"tests": ["assert 1"]}, "entry_point"),
            ({"entry_point": "add"}, "tests"),
            ({"entry_point": "add", "tests": []}, "tests"),
            ({"entry_point": "add", "tests": ["  "]}, "tests"),
            ({"entry_point": "not a name", "tests": ["assert 1"]}, "entry_point"),
        ):
            for route in ("/seed_session", "/verify"):
                bad = http.post(route, json={"responses_create_params": params, **task, "response": final_response("x")})
                assert bad.status_code == 422 and bad.json()["error"]["field"] == field, (task, bad.text)


def test_concurrent_verifications_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    running = {"now": 0, "max": 0}
    lock = threading.Lock()
    real = sandbox_module.run_sandbox

    def counting(*args, **kwargs):
        with lock:
            running["now"] += 1
            running["max"] = max(running["max"], running["now"])
        try:
            return real(*args, **kwargs)
        finally:
            with lock:
                running["now"] -= 1

    monkeypatch.setattr(sandbox_module, "run_sandbox", counting)
    row = json.loads(DATA.read_text().splitlines()[0])  # add, 4 tests
    answers = [SOLUTIONS["add"], "def add(a, b):\n    return a + b if a else None\n"] * 4  # 1.0 and 0.75
    server = CodeServer(CodeServerConfig(max_concurrent_sandboxes=2), name="code")
    with serve_in_thread(server) as url:
        def verify(code: str) -> float:
            with httpx.Client(base_url=url, timeout=60) as http:
                return http.post("/verify", json={**row, "response": final_response(fenced(code))}).json()["reward"]

        with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
            rewards = list(pool.map(verify, answers))
    assert rewards == [1.0, 0.75] * 4
    assert running["max"] == 2


def test_config_builds_both_servers() -> None:
    env = ENV.build("code")
    assert isinstance(env, CodeServer) and env.config.max_concurrent_sandboxes == 4
    assert env.sandbox.limits.wall_time_s == 10.0 and env.sandbox.limits.memory_mb == 512
    assert ENV.build("code_agent").config.max_steps == 4
