"""The phase breakdown of `rollgym train` epochs: where an epoch's time goes, and the loop's overhead.

    python scripts/bench_train.py                 # run one epoch of the demo plan (rs-sft) and report it
    python scripts/bench_train.py runs/demo-s0    # report every epoch of a finished or running run

Overhead = everything but generation (collect, validate) and the trainer's train() call: curation,
the trainer process's start and model load, the merged GGUF export, apply, bookkeeping.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import orjson

REPO = Path(__file__).resolve().parents[1]
PLAN = REPO / "scripts/train/weather.yaml"


def report(run: Path) -> None:
    lines = [orjson.loads(x) for x in (run / "history.jsonl").read_bytes().splitlines() if x.strip()]
    print(f"{'epoch':>5} {'stage':<8} {'collect':>8} {'curate':>7} {'load':>6} {'train':>7} {'export':>7} "
          f"{'optimize':>8} {'apply':>6} {'validate':>8} {'total':>7} {'overhead':>9}")
    for line in lines:
        phases = line.get("phases_s", {})
        metrics = line.get("train") or {}
        total = sum(phases.values())
        overhead = line.get("overhead_s")
        share = f"{overhead:.1f} ({overhead / total:.1%})" if overhead is not None and total else "-"
        print(f"{line['epoch']:>5} {(line.get('stage') or 'base'):<8} {phases.get('collect', 0):>8.1f} "
              f"{phases.get('curate', 0):>7.2f} {metrics.get('load_s', 0):>6.1f} {metrics.get('train_s', 0):>7.1f} "
              f"{metrics.get('export_s', 0):>7.1f} {phases.get('optimize', 0):>8.1f} {phases.get('apply', 0):>6.2f} "
              f"{phases.get('validate', 0):>8.1f} {total:>7.1f} {share:>9}")


def main(argv: list[str]) -> int:
    if argv:
        report(Path(argv[0]))
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        import yaml

        plan = yaml.safe_load(PLAN.read_text())
        plan["stages"] = plan["stages"][:1]
        plan["output"] = str(Path(tmp) / "run")
        path = Path(tmp) / "plan.yaml"
        path.write_text(yaml.safe_dump(plan))
        subprocess.run([sys.executable, "-m", "rollgym.cli", "train", str(path), "--no-progress"], cwd=REPO,
                       check=True)
        report(Path(tmp) / "run")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
