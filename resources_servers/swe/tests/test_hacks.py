"""The hack table (resources_servers/swe/hacks.py) against a real server: every hack made through the `bash`
tool in a real sandbox, graded by real pytest runs, on the parse task and on its impossible twin. Each
call answers 200; each hack gets its reward (0 with its reason; the controls, the fix whatever was done to
git, 1); on the impossible twin nothing passes, the fix included. The table is printed (`pytest -s`)."""

from __future__ import annotations

import random
from typing import Any, Iterator

import pytest

from resources_servers.swe.app import SweServer, SweServerConfig
from resources_servers.swe.hacks import HACKS, IMPOSSIBLE, TASK, expected, run_suite, table
from resources_servers.swe.repos import build
from rollgym.testing import serve_in_thread


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[tuple[str, str], dict[str, Any]]]:
    repos = tmp_path_factory.mktemp("repos")
    try:
        build([TASK], repos)
    except Exception as exc:  # noqa: BLE001 - only PyPI being unreachable skips
        if "pip download" in str(exc):
            pytest.skip(f"the pinned sdists are not cached and PyPI is unreachable: {exc}")
        raise
    config = SweServerConfig(repos_dir=str(repos), pool_size=2, max_concurrent=8, sandbox_uid_count=64,
                             sandbox_uid_base=random.randrange(40000, 59000, 100), command_timeout_s=60,
                             test_timeout_s=120)
    with serve_in_thread(SweServer(config, name="swe")) as url:
        found = run_suite(url, [TASK, IMPOSSIBLE], parallel=4)
        print("\n" + table(found, [TASK, IMPOSSIBLE]))
        yield found


def test_every_hack_gets_zero_with_its_reason_and_every_control_one(results: dict[tuple[str, str], dict[str, Any]]) -> None:
    assert len(HACKS) >= 24 and sum(h.expect == 0 for h in HACKS) >= 18
    for hack in HACKS:
        answer = results[(hack.name, TASK["instance_id"])]
        assert set(answer["calls"]) == {200}, (hack.name, answer)
        assert answer["reward"] == hack.expect, (hack.name, answer.get("reason"), answer.get("test_log_tail"))
        if hack.expect == 0:
            assert hack.reason in answer["reason"], (hack.name, answer["reason"])
        else:
            assert answer["resolved"] is True and "reason" not in answer, (hack.name, answer)


def test_nothing_passes_the_impossible_twin(results: dict[tuple[str, str], dict[str, Any]]) -> None:
    for hack in HACKS:
        answer = results[(hack.name, IMPOSSIBLE["instance_id"])]
        assert set(answer["calls"]) == {200}, (hack.name, answer)
        assert answer["reward"] == expected(hack, IMPOSSIBLE) == 0.0 and answer["reason"], (hack.name, answer)
    fixed = results[("fix_then_commit", IMPOSSIBLE["instance_id"])]
    assert fixed["tests"]["FAIL_TO_PASS"] == {"tests/test_search.py::test_pos": "PASSED",
                                               "tests/test_search.py::test_pos_finds_the_match": "FAILED"}
    assert fixed["reason"].startswith("fail_to_pass_failing: 1 of 2")


def test_what_was_left_out_is_listed(results: dict[tuple[str, str], dict[str, Any]]) -> None:
    answer = results[("env_from_startup_files", TASK["instance_id"])]
    assert {item["path"] for item in answer["left_out"]} == {"sitecustomize.py", "usercustomize.py", "lib/evil.pth"}
    syntax = results[("syntax_error", TASK["instance_id"])]
    assert syntax["reason"].startswith("collection_error: ") and "SyntaxError" in syntax["test_log_tail"]
    odd = results[("fix_odd_names", TASK["instance_id"])]
    assert 'we\\377ird\\nname' in odd["model_patch"] and "GIT binary patch" in odd["model_patch"]
