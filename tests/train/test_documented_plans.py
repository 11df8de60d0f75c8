"""Every example plan the docs run reproduces as committed: a documented `rollgym train scripts/train/X.yaml ...`
command (docs/*.md and the README, read here) names a plan that exists and overrides none of its keys but
`output` (where the run goes) and `seed` (a result over several seeds runs the same plan with each), so the
numbers quoted beside it came from the file a reader runs. The distillation result is the one the issue
found missing from its plan: eight optimizer steps an epoch, `groups_per_step: 1`, now in the plan."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from rollgym.testing import REPO_ROOT

COMMAND = re.compile(r"rollgym train (scripts/train/[\w.\-]+\.yaml)([^\n`#)]*)")
ALLOWED = {"output", "seed"}


def documented_commands() -> list[tuple[str, str, list[str]]]:
    """(where, plan path, its KEY=VALUE overrides) for every documented `rollgym train scripts/train/...` command."""
    found = []
    for page in [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            for match in COMMAND.finditer(line):
                words = [word.strip("'\"[]") for word in match.group(2).split()]
                keys = [word.split("=", 1)[0] for word in words if "=" in word and not word.startswith("-")]
                found.append((f"{page.relative_to(REPO_ROOT)}:{number}", match.group(1), keys))
    return found


def test_documented_plan_commands_override_only_output_and_seed() -> None:
    commands = documented_commands()
    assert len(commands) >= 8, commands  # the docs' runs: weather, weather-rl, async, distill, reasoning-gym, ...
    templated = {"scripts/train/rg-grpo-TASK.yaml"}  # one line for the four rg-grpo-*.yaml plans
    for where, plan, keys in commands:
        paths = sorted(REPO_ROOT.glob(plan.replace("TASK", "*"))) if plan in templated else [REPO_ROOT / plan]
        assert paths and all(path.is_file() for path in paths), f"{where}: no plan {plan}"
        overridden = [key for key in keys if key.split(".")[0].split("[")[0] not in ALLOWED]
        assert not overridden, f"{where}: `rollgym train {plan}` overrides {overridden}: put them in the plan"


def test_the_distillation_plan_holds_the_settings_of_its_result() -> None:
    plan = yaml.safe_load((REPO_ROOT / "scripts/train/distill.yaml").read_text())
    args = plan["stages"][0]["optimize"]["args"]
    assert args["groups_per_step"] == 1 and plan["stages"][0]["epochs"] == 3
    assert plan["stages"][0]["collect"]["limit"] == 8 and plan["stages"][0]["collect"]["repeats"] == 2
    page = (REPO_ROOT / "docs/train-objective.md").read_text()
    assert "`rollgym train scripts/train/distill.yaml`, the plan as committed" in page
    assert "groups_per_step=1" not in page
