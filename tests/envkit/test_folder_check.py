"""`rollgym init` scaffolds an environment that passes `rollgym test` as is; `rollgym test` fails loudly."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import uuid

from rollgym.testing import REPO_ROOT


def rollgym(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rollgym.cli", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=300)


def test_init_then_test_passes_and_a_broken_check_fails() -> None:
    name = f"scaffold_{uuid.uuid4().hex[:8]}"
    folder = REPO_ROOT / "resources_servers" / name
    try:
        created = rollgym("init", f"resources_servers/{name}")
        assert created.returncode == 0, created.stderr
        for relative in ("app.py", f"configs/{name}.yaml", "data/example.jsonl", "data/checks.jsonl",
                         f"tests/test_{name}.py", "README.md"):
            assert (folder / relative).is_file(), relative
        checked = rollgym("test", f"resources_servers/{name}")
        assert checked.returncode == 0, checked.stdout + checked.stderr
        assert "5 of 5 example rows accepted by /seed_session" in checked.stdout
        assert "check 1: reward 1.0 (expected 1.0)" in checked.stdout
        assert checked.stdout.strip().endswith("1 passed, 0 failed")

        again = rollgym("init", f"resources_servers/{name}")
        assert again.returncode == 2 and "already exists" in again.stderr

        # A known-good answer that the environment does not reward is reported, with a non-zero exit.
        (folder / "data" / "checks.jsonl").write_text('{"example": 0, "answer": "wrong", "reward": 1.0}\n')
        broken = rollgym("test", "--no-tests", f"resources_servers/{name}")
        assert broken.returncode == 1
        assert "FAIL check 1: reward 0.0 (expected 1.0)" in broken.stdout
        assert "FAIL data/checks.jsonl has 1 known-good and 0 known-bad answers" in broken.stdout
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_bad_arguments() -> None:
    assert "must be lower_snake_case" in rollgym("init", "resources_servers/Bad-Name").stderr
    assert "goes in resources_servers/NAME" in rollgym("init", "elsewhere/thing").stderr
    result = rollgym("test", "docs")
    assert result.returncode == 1 and "FAIL docs is not a server folder" in result.stdout
    assert str(REPO_ROOT) not in result.stdout  # repository-relative, as every other message


def _port_open(port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(0.5)
        return probe.connect_ex(("127.0.0.1", port)) == 0


def test_all_says_skipped_without_a_backend_and_prints_no_library_logs() -> None:
    # The model config's default backend (127.0.0.1:8000) is not running: its generation check is
    # skipped, not "ok"; the math environment's grading prints no math-verify warnings.
    result = rollgym("test", "--no-tests", "models/chat_completions", "resources_servers/math")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "Timeout is disabled" not in output and "math_verify" not in output
    assert not [line for line in output.splitlines() if line.strip().startswith("ok") and "no backend" in line]
    if not _port_open(8000):
        assert "skip POST /v1/responses: no backend reachable" in result.stdout
        assert "2 passed, 0 failed (1 passed with checks skipped)" in result.stdout
        assert "  checks skipped: models/chat_completions (see its skip lines above)" in result.stdout
    assert "ok   check 1: reward 1.0 (expected 1.0)" in result.stdout  # the math checks did run


def test_a_server_that_needs_a_secret_says_why_it_is_not_checked_live(monkeypatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    result = rollgym("test", "--no-tests", "models/openai_responses")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "skip live check: needs an OpenAI API key (set OPENAI_API_KEY)" in result.stdout
