"""Check every task through the environment as a model would use it (real HTTP, real sandboxes):

    python -m resources_servers.swe.validate resources_servers/swe/data/generated/*.jsonl

For each row: a scripted solver sends the gold patch through `str_replace_editor` and submits (reward
must be 1), and a wrong edit (a comment beside the bug) must score 0 with the FAIL_TO_PASS tests
failing. Prints one line per task and a summary; exits 1 if any task is not as it should be.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from rollgym.testing import final_response, serve_in_thread

from .app import SweServer, SweServerConfig
from .gold import editor_calls, wrong_calls
from .repos import DEFAULT_REPOS, build, read_rows


def attempt(url: str, row: dict[str, Any], calls: list[dict[str, Any]]) -> dict[str, Any]:
    with httpx.Client(base_url=url, timeout=600) as http:
        seeded = http.post("/seed_session", json=row)
        if seeded.status_code != 200:
            return {"reward": None, "error": seeded.text[:300]}
        for call in calls:
            edited = http.post("/str_replace_editor", json=call)
            if "has been edited" not in edited.text:
                return {"reward": None, "error": f"edit refused: {edited.text[:300]}"}
        http.post("/submit", json={})
        verified = http.post("/verify", json={**row, "response": final_response("done")})
        return verified.json() if verified.status_code == 200 else {"reward": None, "error": verified.text[:300]}


def check(url: str, row: dict[str, Any]) -> tuple[bool, str]:
    started = time.monotonic()
    gold = attempt(url, row, editor_calls(row["patch"]))
    wrong = attempt(url, row, wrong_calls(row["patch"]))
    ok = (gold.get("reward") == 1.0 and wrong.get("reward") == 0.0
          and set(wrong.get("fail_to_pass_failing", [])) == set(row["FAIL_TO_PASS"]))
    line = (f"{'ok ' if ok else 'BAD'} {row['instance_id']:60} gold {gold.get('reward')} wrong {wrong.get('reward')} "
            f"F2P {len(row['FAIL_TO_PASS'])} P2P {len(row['PASS_TO_PASS'])} {time.monotonic() - started:.1f}s"
            + ("" if ok else f" {gold.get('error') or gold.get('fail_to_pass_failing') or wrong.get('error')}"))
    return ok, line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="gold patch -> 1, wrong patch -> 0, for every task")
    parser.add_argument("tasks", nargs="+")
    parser.add_argument("--repos", default=str(DEFAULT_REPOS))
    parser.add_argument("--concurrency", type=int, default=2)
    args = parser.parse_args(argv)
    rows = read_rows(args.tasks)
    build(rows, Path(args.repos))
    server = SweServer(SweServerConfig(repos_dir=args.repos, pool_size=1), name="swe")
    started = time.monotonic()
    with serve_in_thread(server) as url, concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
        results = list(pool.map(lambda row: check(url, row), rows))
    for _, line in results:
        print(line)
    good = sum(ok for ok, _ in results)
    print(f"{good}/{len(rows)} tasks: gold patch reward 1 and wrong patch reward 0 "
          f"({time.monotonic() - started:.0f} s)")
    return 0 if good == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
