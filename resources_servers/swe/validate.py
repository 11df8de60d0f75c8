"""Check every task through the environment as a model would use it (real HTTP, real sandboxes):

    python -m resources_servers.swe.validate resources_servers/swe/data/generated/*.jsonl

For each row: a scripted solver sends the gold patch through `str_replace_editor` and submits (reward
must be 1), and a wrong edit (a comment beside the bug) must score 0 with the FAIL_TO_PASS tests
failing and a reason. Before the gold edit, the task's sandbox is searched from inside (`bash`, as the model
would) for a copy of its fix: every readable file, outside the workspace, of the fixed file's name in a
folder of the same name that holds every line the fix adds (leaks.py's rule). A copy found there fails the
task; the copies this machine holds outside the sandbox (which the server shows empty) are counted on the
line as `copies N hidden`. Prints one line per task and a summary; exits 1 if any task is not as it should be.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
import time
from pathlib import Path, PurePosixPath
from typing import Any

import httpx

from rollgym.testing import final_response, serve_in_thread

from .app import SweServer, SweServerConfig
from .gold import editor_calls, wrong_calls
from .leaks import sandbox_roots, solution_copies
from .patch import split_patch
from .repos import DEFAULT_CACHE, DEFAULT_REPOS, build, read_rows

# Run inside the task's sandbox: every file the model could read, outside /workspace and the pseudo
# filesystems, that is a copy of the fix. Its argument: [[folder or "", file name, [added lines]], ...].
LEAK_SCAN = r'''
import json, os, sys
wanted = json.loads(sys.argv[1])
names = {name for _, name, _ in wanted}
found = []
for directory, folders, files in os.walk("/"):
    if directory in ("/proc", "/sys", "/dev", "/workspace"):
        folders[:] = []
        continue
    for name in names.intersection(files):
        path = os.path.join(directory, name)
        for folder, wanted_name, lines in wanted:
            if wanted_name != name or (folder and os.path.basename(directory) != folder):
                continue
            try:
                with open(path, errors="replace") as handle:
                    text = {line.strip() for line in handle.read().splitlines()}
            except OSError:
                continue
            if all(line in text for line in lines):
                found.append(path)
print("LEAKS " + json.dumps(sorted(set(found))))
'''


def leak_query(patch: str) -> list[list[Any]]:
    """[folder, name, added lines] of each file the fix changes (folder "" for a module at the root)."""
    query = []
    for change in split_patch(patch):
        added = [line[1:].strip() for line in change.text.splitlines()
                 if line.startswith("+") and not line.startswith("+++") and line[1:].strip()]
        if added:
            path = PurePosixPath(change.path)
            query.append([path.parent.name, path.name, added])
    return query


def leaks_inside(http: httpx.Client, patch: str) -> list[str] | str:
    """The copies of the fix the session's sandbox can read (a list), or why the scan did not answer."""
    query = leak_query(patch)
    if not query:
        return []
    command = f"python3 -c {_quote(LEAK_SCAN)} {_quote(json.dumps(query))}"
    answer = http.post("/bash", json={"command": command, "timeout": 120})
    for line in answer.text.replace("\\n", "\n").splitlines():
        if "LEAKS " in line:
            try:
                return json.loads(line.split("LEAKS ", 1)[1].rstrip('"').replace('\\"', '"'))
            except ValueError:
                break
    return f"the scan did not answer: {answer.text[:200]}"


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\"'\"'") + "'"


def attempt(url: str, row: dict[str, Any], calls: list[dict[str, Any]], scan: bool = False) -> dict[str, Any]:
    with httpx.Client(base_url=url, timeout=600) as http:
        seeded = http.post("/seed_session", json=row)
        if seeded.status_code != 200:
            return {"reward": None, "error": seeded.text[:300]}
        leaks = leaks_inside(http, row["patch"]) if scan else []
        for call in calls:
            edited = http.post("/str_replace_editor", json=call)
            if "has been edited" not in edited.text:
                return {"reward": None, "error": f"edit refused: {edited.text[:300]}"}
        http.post("/submit", json={})
        verified = http.post("/verify", json={**row, "response": final_response("done")})
        result = verified.json() if verified.status_code == 200 else {"reward": None, "error": verified.text[:300]}
        return {**result, "leaks_inside": leaks}


def check(url: str, row: dict[str, Any], roots: tuple[str, ...]) -> tuple[bool, str, int]:
    started = time.monotonic()
    gold = attempt(url, row, editor_calls(row["patch"]), scan=True)
    wrong = attempt(url, row, wrong_calls(row["patch"]))
    leaks = gold.get("leaks_inside", [])
    copies = len(solution_copies(row["patch"], roots))
    ok = (gold.get("reward") == 1.0 and wrong.get("reward") == 0.0 and bool(wrong.get("reason"))
          and set(wrong.get("fail_to_pass_failing", [])) == set(row["FAIL_TO_PASS"]) and leaks == [])
    why = (gold.get("error") or gold.get("reason") or wrong.get("error")
           or (f"fix readable in the sandbox: {leaks}" if leaks else None) or f"wrong edit: {wrong.get('reason')}")
    line = (f"{'ok ' if ok else 'BAD'} {row['instance_id']:60} gold {gold.get('reward')} wrong {wrong.get('reward')} "
            f"({(wrong.get('reason') or '')[:28]}) F2P {len(row['FAIL_TO_PASS'])} P2P {len(row['PASS_TO_PASS'])} "
            f"copies {copies}{' hidden' if copies and leaks == [] else ''} {time.monotonic() - started:.1f}s"
            + ("" if ok else f" {why}"))
    return ok, line, copies


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="gold patch -> 1, wrong patch -> 0, no copy of the fix in sight, "
                                                 "for every task")
    parser.add_argument("tasks", nargs="+")
    parser.add_argument("--repos", default=str(DEFAULT_REPOS))
    parser.add_argument("--cache", default=str(DEFAULT_CACHE), help="where the sdists are kept")
    parser.add_argument("--concurrency", type=int, default=2)
    args = parser.parse_args(argv)
    rows = read_rows(args.tasks)
    build(rows, Path(args.repos), Path(args.cache))
    server = SweServer(SweServerConfig(repos_dir=args.repos, pool_size=1), name="swe")
    roots = sandbox_roots(server.config.toolchain or sys.prefix)
    started = time.monotonic()
    with serve_in_thread(server) as url, concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
        results = list(pool.map(lambda row: check(url, row, roots), rows))
    for _, line, _ in results:
        print(line)
    good = sum(ok for ok, _, _ in results)
    hidden = sum(copies > 0 for ok, _, copies in results if ok)
    print(f"{good}/{len(rows)} tasks: gold patch reward 1, wrong patch reward 0 with a reason, no copy of the fix "
          f"readable in the sandbox ({hidden} have a copy on this machine, hidden from it) "
          f"({time.monotonic() - started:.0f} s)")
    return 0 if good == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
