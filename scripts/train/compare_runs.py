"""Several `rollgym train` runs of one plan side by side (seeds): validation per epoch, the gain, the
seed-to-seed spread, the trainer's importance-ratio figures and the time.

    python scripts/train/compare_runs.py runs/weather-rl-s0 runs/weather-rl-s1 runs/weather-rl-s2
"""

from __future__ import annotations

import sys
from pathlib import Path

import orjson


def history(run: Path) -> list[dict]:
    return [orjson.loads(line) for line in (run / "history.jsonl").read_bytes().splitlines() if line.strip()]


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    runs = [Path(arg) for arg in argv]
    lines = {run: history(run) for run in runs}
    points = sorted({(line.get("step", line["epoch"])) for run in runs for line in lines[run]
                     if line.get("validation")})
    print("validation mean reward (pass@k)")
    print(f"{'epoch':>6} " + " ".join(f"{run.name:>18}" for run in runs) + f" {'mean':>7} {'spread':>7}")
    for point in points:
        values = []
        cells = []
        for run in runs:
            found = [line["validation"] for line in lines[run]
                     if line.get("validation") and line.get("step", line["epoch"]) == point]
            if found:
                summary = found[0]
                passes = [k for k in summary if k.startswith("pass@")]
                top = max(passes, key=lambda k: int(k[5:])) if passes else None
                values.append(summary["mean_reward"])
                cells.append(f"{summary['mean_reward']:.3f} ({summary[top]:.2f})" if top else f"{summary['mean_reward']:.3f}")
            else:
                cells.append("-")
        mean = sum(values) / len(values) if values else float("nan")
        spread = max(values) - min(values) if values else float("nan")
        print(f"{point:>6} " + " ".join(f"{cell:>18}" for cell in cells) + f" {mean:>7.3f} {spread:>7.3f}")
    print("\nper run: gain (last − first validation), steps, importance ratio ρ (min, max), tokens whose ρ was capped, "
          "rollouts masked, time")
    for run in runs:
        validated = [line for line in lines[run] if line.get("validation")]
        trained = [line["train"] for line in lines[run] if isinstance(line.get("train"), dict)
                   and "importance_ratio_mean" in line["train"]]
        gain = validated[-1]["validation"]["mean_reward"] - validated[0]["validation"]["mean_reward"]
        steps = sum(int(t.get("steps", 0)) for t in trained)
        rho_min = min((t["importance_ratio_min"] for t in trained), default=float("nan"))
        rho_max = max((t["importance_ratio_max"] for t in trained), default=float("nan"))
        tokens = sum(t.get("tokens", 0) * t.get("steps", 1) for t in trained)
        capped = sum(t.get("tis_capped_fraction", 0) * t.get("tokens", 0) * t.get("steps", 1) for t in trained)
        masked = sum(t.get("masked_rollouts", 0) * t.get("steps", 1) for t in trained)
        seconds = sum(sum(line.get("phases_s", {}).values()) for line in lines[run])
        overhead = sum(line.get("overhead_s") or 0 for line in lines[run])
        print(f"  {run.name}: gain {gain:+.3f}, {steps} steps, ρ in [{rho_min:.2f}, {rho_max:.2f}], "
              f"{capped / tokens if tokens else 0:.2%} of tokens capped (TIS), {masked:.0f} rollouts masked, "
              f"{seconds / 60:.1f} min in phases, loop overhead {overhead:.0f} s ({overhead / seconds:.1%})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
