"""The task generator: the four kinds of injected bug on a small module, and a real generation from
a pinned PyPI library (inflection, the fastest suite) whose tasks rebuild to the same commits elsewhere."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from resources_servers.swe.generate import generate_library, split_of
from resources_servers.swe.mutate import mutations
from resources_servers.swe.repos import DEFAULT_CACHE, LIBRARIES, RepoError, build, load_libraries, read_rows

GENERATED = Path(__file__).resolve().parents[1] / "data" / "generated"
SOURCE = '''\
def clamp(value, low, high):
    """Docstrings are never mutated: 1 < 2."""
    if value < low:
        return low
    if high is None:
        return value
    return min(value, high) + 0
'''


def test_each_kind_of_bug_is_a_one_statement_edit() -> None:
    found = {(m.kind, m.before, m.after) for m in mutations(SOURCE)}
    assert ("flip_operator", "value < low", "value >= low") in found
    assert ("flip_operator", "high is None", "high is not None") in found
    assert ("change_constant", "0", "1") in found
    assert ("swap_arguments", "min(value, high)", "min(high, value)") in found
    assert ("drop_branch", "if value < low:", "") in found
    for mutation in mutations(SOURCE):
        ast.parse(mutation.source)  # every mutant compiles
        changed = [a for a, b in zip(SOURCE.splitlines(), mutation.source.splitlines()) if a != b]
        assert mutation.kind == "drop_branch" or len(changed) == 1, mutation
        assert "Docstrings are never mutated: 1 < 2." in mutation.source


def test_generated_tasks_fail_as_given_and_rebuild_identically(tmp_path: Path) -> None:
    try:
        rows = generate_library(LIBRARIES["inflection"], 2, tmp_path / "repos", DEFAULT_CACHE,
                                log=lambda *_: None)
    except Exception as exc:  # noqa: BLE001 - only PyPI being unreachable skips
        if "pip download" in str(exc):
            pytest.skip(f"the pinned sdist is not cached and PyPI is unreachable: {exc}")
        raise
    assert len(rows) == 2 and {r["mutation"]["kind"] for r in rows} == {"drop_branch", "change_constant"}
    # Generation is deterministic: these are the first inflection tasks of the shipped data, commit for commit.
    shipped = {row["instance_id"]: row["base_commit"] for row in read_rows(GENERATED.glob("*.jsonl"))}
    assert all(shipped.get(r["instance_id"]) == r["base_commit"] for r in rows)
    for row in rows:
        assert row["FAIL_TO_PASS"] and not set(row["FAIL_TO_PASS"]) & set(row["PASS_TO_PASS"])
        assert all(test.split("::")[0] in row["problem_statement"] for test in row["FAIL_TO_PASS"][:3])
        assert row["mutation"]["function"] not in row["problem_statement"].split("`")[0]
        assert split_of(row["instance_id"], 0.2) in ("train", "validation")
    # The same rows, rebuilt from the sdist alone in another folder, give the same commits.
    assert build(rows, tmp_path / "elsewhere") == {r["instance_id"]: r["base_commit"] for r in rows}


def test_the_libraries_are_a_data_file_checked_line_by_line(tmp_path: Path) -> None:
    assert set(LIBRARIES) == {"inflection", "parse", "toolz", "cachetools", "isodate", "voluptuous", "webcolors"}
    assert LIBRARIES["cachetools"].pythonpath == "src" and LIBRARIES["voluptuous"].pythonpath == "."
    entry = {"name": "x", "version": "1", "sha256": "0" * 64, "modules": ["x/__init__.py"]}
    for broken, message in (({**entry, "sha256": "abc"}, "'sha256'"), ({k: v for k, v in entry.items() if k != "modules"}, "'modules'"),
                            ({**entry, "module": []}, "unknown key 'module'")):
        path = tmp_path / "libraries.jsonl"
        path.write_text(json.dumps(entry) + "\n" + json.dumps(broken) + "\n")
        with pytest.raises(RepoError, match=f"libraries.jsonl:2: .*{message}"):
            load_libraries(path)
    path.write_text(json.dumps(entry) + "\n")
    assert load_libraries(path)["x"].test_cmd.startswith("PYTHONPATH=. ")
