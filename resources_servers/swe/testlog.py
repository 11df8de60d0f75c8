"""Reading a pytest run: each test's outcome from the `-rA` summary, and the grade of a task's lists."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

OUTCOMES = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")
_LINE = re.compile(r"^(PASSED|FAILED|ERROR|XFAIL|XPASS) (.+?)(?: - (.*))?$")
GOOD = {"PASSED", "XFAIL"}  # an expected failure that fails is a pass, as SWE-bench counts it


def parse_pytest(log: str) -> dict[str, str]:
    """{node id: outcome} from the `-rA` short summary ("PASSED tests/a.py::t", "FAILED x::y - msg")."""
    results: dict[str, str] = {}
    for line in log.splitlines():
        match = _LINE.match(line.rstrip())
        if match:
            outcome, test = match.group(1), match.group(2).strip()
            if outcome == "ERROR" and test.startswith("collecting "):
                continue
            results.setdefault(test, outcome)
    return results


def failure_messages(log: str) -> dict[str, str]:
    """{node id: the summary's one-line message} for the failed tests."""
    messages = {}
    for line in log.splitlines():
        match = _LINE.match(line.rstrip())
        if match and match.group(1) in ("FAILED", "ERROR") and match.group(3):
            messages[match.group(2).strip()] = match.group(3).strip()
    return messages


@dataclass
class Grade:
    resolved: bool
    f2p: dict[str, str]  # each FAIL_TO_PASS test's outcome (MISSING: it did not run)
    p2p: dict[str, str]
    components: dict[str, float] = field(default_factory=dict)

    def details(self) -> dict[str, Any]:
        broken = sorted(t for t, o in self.p2p.items() if o not in GOOD)
        return {"resolved": self.resolved, "tests": {"FAIL_TO_PASS": self.f2p, "PASS_TO_PASS": self.p2p},
                "fail_to_pass_failing": sorted(t for t, o in self.f2p.items() if o not in GOOD),
                "pass_to_pass_broken": broken}


def grade(results: dict[str, str], fail_to_pass: list[str], pass_to_pass: list[str]) -> Grade:
    """Resolved when every FAIL_TO_PASS test passes and no PASS_TO_PASS test breaks."""
    f2p = {t: results.get(t, "MISSING") for t in fail_to_pass}
    p2p = {t: results.get(t, "MISSING") for t in pass_to_pass}
    f2p_ok = sum(o in GOOD for o in f2p.values())
    p2p_ok = sum(o in GOOD for o in p2p.values())
    resolved = f2p_ok == len(f2p) and p2p_ok == len(p2p)
    components = {
        "resolved": float(resolved),
        "fail_to_pass": f2p_ok / len(f2p) if f2p else 1.0,
        "pass_to_pass": p2p_ok / len(p2p) if p2p else 1.0,
    }
    return Grade(resolved, f2p, p2p, components)
