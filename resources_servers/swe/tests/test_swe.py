"""The swe environment over real HTTP: repositories rebuilt from their pinned PyPI sdists (the only
network access; cached in .cache/swe/sdists), workspaces in real namespace sandboxes,
the gold patch sent through str_replace_editor scoring 1 with per-test results, a wrong or empty
patch 0, a sandbox/repository failure an HTTP 5xx (env_error), a bad row a 422 naming its field."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from resources_servers.swe.app import SweServer, SweServerConfig
from resources_servers.swe.gold import editor_calls, wrong_calls
from resources_servers.swe.repos import build
from rollgym.envkit.folder import env_folder
from rollgym.testing import final_response, serve_in_thread

FOLDER = Path(__file__).resolve().parents[1]
ROWS = [json.loads(line) for line in (FOLDER / "data" / "example.jsonl").read_text().splitlines()]
PARSE_DROP, TOOLZ_SWAP, PARSE_SWAP = ROWS[0], ROWS[1], ROWS[2]  # two libraries, three kinds of bug
# A generated task of a src-layout library (PYTHONPATH=src), from the shipped data.
ISODATE = next(json.loads(line) for line in (FOLDER / "data" / "generated" / "train.jsonl").read_text().splitlines()
               if json.loads(line)["instance_id"] == "pypi__isodate-0.7.2.change_constant__5a03c757")


SERVERS: list[SweServer] = []  # the module's server, for the tests that break its sandbox on purpose


@pytest.fixture(scope="module")
def server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    repos = tmp_path_factory.mktemp("repos")
    try:
        build([PARSE_DROP, TOOLZ_SWAP, PARSE_SWAP, ISODATE], repos)  # every base_commit must come out as the row says
    except Exception as exc:  # noqa: BLE001 - only PyPI being unreachable skips
        if "pip download" in str(exc):
            pytest.skip(f"the pinned sdists are not cached and PyPI is unreachable: {exc}")
        raise
    config = SweServerConfig(repos_dir=str(repos), pool_size=1, sandbox_uid_base=random.randrange(40000, 59000, 100),
                             sandbox_uid_count=32, command_timeout_s=30, test_timeout_s=120)
    server = SweServer(config, name="swe")
    SERVERS.append(server)
    with serve_in_thread(server) as url:
        yield url


def verify(http: httpx.Client, row: dict[str, Any]) -> dict[str, Any]:
    answer = http.post("/verify", json={**row, "response": final_response("done")})
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_the_gold_patch_through_the_editor_resolves_each_task(server_url: str) -> None:
    for row in (PARSE_DROP, TOOLZ_SWAP, PARSE_SWAP, ISODATE):
        with httpx.Client(base_url=server_url, timeout=120) as http:
            assert http.post("/seed_session", json=row).status_code == 200
            for call in editor_calls(row["patch"]):
                edited = http.post("/str_replace_editor", json=call)
                assert edited.status_code == 200 and "has been edited" in edited.text, edited.text
            assert "touching 1 file(s)" in http.post("/submit", json={}).text
            result = verify(http, row)
        assert result["reward"] == 1.0 and result["resolved"] is True, result
        assert set(result["tests"]["FAIL_TO_PASS"]) == set(row["FAIL_TO_PASS"])
        assert set(result["tests"]["FAIL_TO_PASS"].values()) == {"PASSED"}
        assert result["reward_components"] == {"resolved": 1.0, "fail_to_pass": 1.0, "pass_to_pass": 1.0}


def test_a_wrong_or_empty_patch_scores_zero_with_per_test_results(server_url: str) -> None:
    row = TOOLZ_SWAP
    with httpx.Client(base_url=server_url, timeout=120) as http:
        http.post("/seed_session", json=row)
        for call in wrong_calls(row["patch"]):
            assert "has been edited" in http.post("/str_replace_editor", json=call).text
        result = verify(http, row)  # no submit: the workspace's diff is taken
    assert result["reward"] == 0.0 and not result["submitted"] and result["model_patch"].startswith("diff --git")
    assert result["fail_to_pass_failing"] == sorted(row["FAIL_TO_PASS"])
    assert set(result["tests"]["PASS_TO_PASS"].values()) == {"PASSED"}
    with httpx.Client(base_url=server_url, timeout=120) as http:
        http.post("/seed_session", json=row)
        assert verify(http, row)["reason"] == "empty_patch"


def test_tools_run_in_the_sessions_sandbox(server_url: str) -> None:
    row = PARSE_DROP
    with httpx.Client(base_url=server_url, timeout=120) as http:
        assert http.post("/seed_session", json=row).status_code == 200
        ran = http.post("/bash", json={"command": "pwd; id -u; git log --oneline | wc -l; ls"}).text.split("\n")
        assert ran[0] == "/workspace" and ran[1] != "0" and ran[2] == "1" and "parse" in ran[3:]
        assert "Network is unreachable" in http.post("/bash", json={"command": "python -c 'import socket; "
                                                                             "socket.create_connection((\"1.1.1.1\", 80))'"}).text
        assert "killed" in http.post("/bash", json={"command": "sleep 5", "timeout": 0.5}).text
        editor = lambda **call: http.post("/str_replace_editor", json=call).text  # noqa: E731
        assert "File created successfully" in editor(command="create", path="/workspace/notes.txt", file_text="a\nb\n")
        assert "Cannot overwrite" in editor(command="create", path="/workspace/notes.txt", file_text="x")
        assert "     2\tb" in editor(command="view", path="/workspace/notes.txt")
        assert "did not appear verbatim" in editor(command="str_replace", path="/workspace/notes.txt", old_str="zz", new_str="y")
        assert "has been edited" in editor(command="insert", path="/workspace/notes.txt", insert_line=1, new_str="between")
        assert http.post("/bash", json={"command": "cat notes.txt"}).text == "a\nbetween\nb\n"
        assert "undone successfully" in editor(command="undo_edit", path="/workspace/notes.txt")
        assert http.post("/bash", json={"command": "cat notes.txt"}).text == "a\nb\n"
        assert "/workspace/parse/__init__.py" in editor(command="view", path="/workspace")
        assert "Error: /etc/shadow: no such file" in editor(command="view", path="/etc/shadow")
        bad = http.post("/str_replace_editor", json={"command": "str_replace", "path": "x"})
        assert bad.status_code == 422 and "old_str" in bad.text


def test_the_sessions_tmp_proc_and_bad_calls(server_url: str) -> None:
    row = PARSE_DROP
    alone = httpx.post(f"{server_url}/bash", json={"command": "ls"}, timeout=60)  # no session cookie
    assert alone.status_code == 409 and "seed_session" in alone.json()["error"]["message"]
    with httpx.Client(base_url=server_url, timeout=120) as http:
        assert http.post("/seed_session", json=row).status_code == 200
        nul = http.post("/str_replace_editor", json={"command": "view", "path": "/workspace/a\u0000b"})
        assert nul.status_code == 422 and "NUL" in nul.text
        assert http.post("/bash", json={"command": "echo a\u0000b"}).status_code == 422
        made = http.post("/bash", json={"command": "t=$(mktemp) && echo kept > \"$t\" && echo \"$t\"; echo $TMPDIR; "
                                                   "python -c 'import tempfile; print(tempfile.mkdtemp())'; "
                                                   "cat /proc/1/cmdline; ls /proc | grep -c '^[0-9]'"}).text.split("\n")
        assert made[0].startswith("/tmp/tmp.") and made[1] == "/tmp" and made[2].startswith("/tmp/")
        assert "No such file" in made[3] and int(made[4]) <= 3  # only this command's own processes
        assert http.post("/bash", json={"command": f"cat {made[0]}"}).text == "kept\n"  # the session's /tmp persists
        assert http.post("/submit", json={}).text.startswith("Submitted an empty patch")  # /tmp is not the diff
    with httpx.Client(base_url=server_url, timeout=120) as http:
        http.post("/seed_session", json=row)
        http.post("/bash", json={"command": "rm tests/test_bugs.py; head -c 2000 /dev/urandom > blob.bin; echo '#' >> parse/__init__.py"})
        assert http.post("/submit", json={}).text.startswith(
            "Submitted a patch touching 3 file(s) (1 modified, 1 added, 1 deleted; 1 binary)")


def test_a_sandbox_failure_closes_the_workspace_at_once(server_url: str) -> None:
    (server,) = SERVERS
    spaces = server.provider.workspaces
    for call in ("/bash", "/verify"):
        with httpx.Client(base_url=server_url, timeout=120) as http:
            http.post("/seed_session", json=PARSE_DROP)
            ws = list(spaces._open.values())[-1]  # this session's: the newest one open
            os.rmdir(ws.tmp_path)  # the session's /tmp gone from under it: the launcher cannot set up
            body = {"command": "ls"} if call == "/bash" else {**PARSE_DROP, "response": final_response("done")}
            failed = http.post(call, json=body)
            assert failed.status_code >= 500 and ws.id not in spaces._open and not os.path.exists(ws.root)
            after = http.post("/bash", json={"command": "ls"})
            assert after.status_code == 409 and "closed" in after.json()["error"]["message"]


def test_bad_rows_and_missing_repositories(server_url: str) -> None:
    with httpx.Client(base_url=server_url, timeout=60) as http:
        bad = http.post("/seed_session", json={**PARSE_DROP, "FAIL_TO_PASS": []})
        assert bad.status_code == 422 and bad.json()["error"]["field"] == "FAIL_TO_PASS"
        not_pytest = http.post("/seed_session", json={**PARSE_DROP, "test_cmd": "make test"})
        assert not_pytest.status_code == 422 and not_pytest.json()["error"]["field"] == "test_cmd"
        # SWE-bench's datasets keep the lists as JSON text: accepted as such
        assert http.post("/seed_session", json={**PARSE_DROP, "PASS_TO_PASS": json.dumps(PARSE_DROP["PASS_TO_PASS"])}).status_code == 200
        missing = http.post("/seed_session", json={**PARSE_DROP, "repo": "nobody/nothing"})
        assert missing.status_code >= 500 and "nobody/nothing" in missing.text  # an env_error, never a reward


def test_the_config_builds_the_server_and_its_agent() -> None:
    env = env_folder(__file__)
    assert [row["instance_id"] for row in env.rows()] == [row["instance_id"] for row in ROWS]
    server = env.build("swe")
    assert isinstance(server, SweServer) and server.config.pool_size == 2 and server.config.provider == "local"
    assert env.build("swe_agent").config.max_steps == 30
