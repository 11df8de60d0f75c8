"""The hack suites of the graders that read model output, as markdown tables: grader × hack × the reward
it must get × the reward it got × the reason given.

    python scripts/hack_table.py [ENV ...]      (default: code math reasoning_gym instruction_following llm_judge mcq reverse_text)

Each table comes from the environment's `tests/test_hacks.py` (its `HACKS` and `grader()`): every row
goes through the environment's real `/verify` over HTTP, as the tests do. Exits 1 when a row got
another reward than it must, so it doubles as a check.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "services")]

from rollgym.testing.hacks import Hack, markdown_table  # noqa: E402

GRADERS = ("code", "math", "reasoning_gym", "instruction_following", "llm_judge", "mcq", "reverse_text")


def run(grader: str) -> tuple[str, int]:
    """The grader's table and how many rows missed the reward they must get."""
    module = importlib.import_module(f"resources_servers.{grader}.tests.test_hacks")
    rows: list[tuple[Hack, float, str]] = []
    missed = 0
    with module.grader() as verify:
        for case in module.HACKS:
            row, hack = case if isinstance(case, tuple) else (None, case)
            body = verify(hack) if row is None else verify(row, hack)
            reward = float(body["reward"])
            rows.append((hack, reward, str(body.get("reason", ""))))
            missed += abs(reward - hack.reward) > 1e-9
    return markdown_table(grader, rows), missed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("graders", nargs="*", default=list(GRADERS),
                        help="environments whose tests/test_hacks.py has HACKS and grader() (default: %(default)s)")
    args = parser.parse_args()
    missed = 0
    for grader in args.graders:
        started = time.monotonic()
        table, misses = run(grader)
        missed += misses
        print(table)
        print(f"\n{misses} row(s) off; {time.monotonic() - started:.1f} s\n")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
