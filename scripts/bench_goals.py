"""Benchmark check (not a test): the hot-path goals as ratios, from the project's benchmarks run in one window.

    .venv/bin/python scripts/bench_goals.py [--reps 3] [--rollouts 1000] [--concurrency 64,256]
        [--in-flight 2048] [--skip in_flight,proxy]

Runs, as subprocesses and alternating so that both see the same machine load:
- scripts/bench_rollouts.py --drivers collector and scripts/bench_http_floor.py --variants fastapi,
  `--reps` times at each concurrency: the median CPU-ms per rollout of each, and their ratio;
- scripts/bench_rollouts.py --drivers cli, `--reps` times (medians): the collector's fixed cost (launch to the
  first /run, plus the last answer to exit), its own CPU per rollout, and `rollgym run`'s start until the stack
  is ready (three servers);
- scripts/bench_rollouts.py --in-flight M (1 s backend latency): RSS above idle per 1,000 rollouts in flight,
  and the same for scripts/bench_http_floor.py's FastAPI chain;
- scripts/bench_proxy.py --rollouts 400, `--reps` times (median): the proxy agent's CPU per model call.

Prints each figure with its goal and whether it is met, then the raw rows. CPU per rollout is the figure to
compare on a shared machine (throughput moves with the neighbours' load); the load average is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
# The goals of the hot-path issue: (label, goal, True when lower is better).
GOALS = {
    "cpu_ratio": 1.5,  # CPU per rollout / the FastAPI floor's, at each concurrency
    "fixed_cost_s": 0.3,  # a collection's cost outside the /run window (wall − collection)
    "run_ready_s": 1.0,  # `rollgym run` to ready, three servers
    "mb_per_1000_in_flight": 20.0,
    "proxy_cpu_ms_per_call": 1.05,  # half of the 2.1 ms measured when the goal was set
}


def run(args: list[str], timeout_s: float = 900) -> str:
    done = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed (exit {done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return done.stdout


def table_row(output: str, first_cell: str) -> list[str]:
    """The cells of the last markdown row whose first cell is `first_cell`."""
    rows = [line for line in output.splitlines() if line.startswith(f"| {first_cell} |")]
    if not rows:
        raise SystemExit(f"no '{first_cell}' row in:\n{output[-2000:]}")
    return [cell.strip() for cell in rows[-1].strip("|").split("|")]


def cpu_ms(output: str, first_cell: str) -> float:
    # Both benchmarks' tables: | name | rollouts | C | backend ms | rollouts/s | p50 | p99 | CPU-ms/rollout | ...
    return float(table_row(output, first_cell)[7])


def number_after(output: str, pattern: str) -> float:
    match = re.search(pattern, output)
    if match is None:
        raise SystemExit(f"no match for {pattern!r} in:\n{output[-2000:]}")
    return float(match.group(1))


def verdict(value: float, goal: float) -> str:
    return "met" if value <= goal else "NOT met"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--rollouts", type=int, default=1000)
    parser.add_argument("--concurrency", default="64,256")
    parser.add_argument("--in-flight", type=int, default=2048)
    parser.add_argument("--skip", default="", help="comma-separated: cpu, cli, in_flight, proxy")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    lines: list[str] = []
    raw: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    say(f"machine: {os.cpu_count()} CPUs, load average {tuple(round(x, 2) for x in os.getloadavg())} at the start")
    if "cpu" not in skip:
        for concurrency in [int(c) for c in args.concurrency.split(",")]:
            common = ["--rollouts", str(args.rollouts), "--concurrency", str(concurrency)]
            rollgym, floor = [], []
            for _ in range(args.reps):
                out = run([str(SCRIPTS / "bench_rollouts.py"), *common, "--drivers", "collector", "--no-cli-ready"])
                rollgym.append(cpu_ms(out, "collector"))
                raw.append(table_row(out, "collector"))
                out = run([str(SCRIPTS / "bench_http_floor.py"), *common, "--variants", "fastapi"])
                floor.append(cpu_ms(out, "fastapi"))
                raw.append(table_row(out, "fastapi"))
            ratio = statistics.median(rollgym) / statistics.median(floor)
            say(f"C={concurrency}: CPU-ms per rollout, median of {args.reps}: rollgym {statistics.median(rollgym):.2f} "
                f"{rollgym}, FastAPI floor {statistics.median(floor):.2f} {floor}: ratio {ratio:.2f} "
                f"(goal <= {GOALS['cpu_ratio']}: {verdict(ratio, GOALS['cpu_ratio'])})")
    if "cli" not in skip:
        figures: dict[str, list[float]] = {"ready": [], "to_first": [], "to_exit": [], "collector_ms": []}
        for _ in range(args.reps):  # start-up times are noisy: medians
            out = run([str(SCRIPTS / "bench_rollouts.py"), "--rollouts", str(args.rollouts), "--concurrency", "64",
                       "--drivers", "cli"])
            raw.append(table_row(out, "cli"))
            figures["ready"].append(number_after(out, r"`rollgym run` ready: it reports [0-9.]+ s; ([0-9.]+) s from launching"))
            figures["to_first"].append(number_after(out, r"fixed overhead: ([0-9.]+) s from launch to the first /run"))
            figures["to_exit"].append(number_after(out, r"([0-9.]+) s from the last answer to exit"))
            figures["collector_ms"].append(number_after(out, r"([0-9.]+) CPU-ms per rollout inside it"))
        ready, to_first, to_exit, collector_ms = (statistics.median(figures[key]) for key in figures)
        fixed = to_first + to_exit
        say(f"`rollgym run` to ready (three servers), median of {args.reps}: {ready:.2f} s {figures['ready']} "
            f"(goal <= {GOALS['run_ready_s']} s: {verdict(ready, GOALS['run_ready_s'])})")
        say(f"collection fixed cost (launch to first /run {to_first:.2f} s + last answer to exit {to_exit:.2f} s): "
            f"{fixed:.2f} s (goal <= {GOALS['fixed_cost_s']} s: {verdict(fixed, GOALS['fixed_cost_s'])})")
        say(f"the collector process's own CPU per rollout (C=64), median of {args.reps}: {collector_ms:.3f} ms "
            f"{figures['collector_ms']} (goal: half the figure of the code before, run through this script)")
    if "in_flight" not in skip:
        out = run([str(SCRIPTS / "bench_rollouts.py"), "--in-flight", str(args.in_flight), "--backend-latency-ms",
                   "1000", "--no-cli-ready"])
        per_1000 = number_after(out, r"= ([0-9.]+) MB above idle per 1000 in flight")
        floor_out = run([str(SCRIPTS / "bench_http_floor.py"), "--variants", "fastapi", "--in-flight",
                         str(args.in_flight), "--backend-latency-ms", "1000"])
        floor_1000 = number_after(floor_out, r"peak RSS ([0-9.]+) MB above idle per 1000 in flight")
        say(f"memory of the FastAPI floor's chain (bare handlers, same libraries): {floor_1000:.1f} MB above idle per "
            f"1,000 in flight; rollgym / floor: {per_1000 / floor_1000:.2f}")
        say(f"memory: {per_1000:.1f} MB above idle per 1,000 rollouts in flight ({args.in_flight} at once) "
            f"(goal <= {GOALS['mb_per_1000_in_flight']} MB: {verdict(per_1000, GOALS['mb_per_1000_in_flight'])})")
    if "proxy" not in skip:
        per_calls = []
        for _ in range(args.reps):  # a slope between two short runs: noisy, so a median
            out = run([str(SCRIPTS / "bench_proxy.py"), "--rollouts", "400"])
            per_calls.append(json.loads(out[out.index("{"):])["proxy_cpu_ms_per_model_call"])
        per_call = statistics.median(per_calls)
        say(f"proxy agent CPU per model call, median of {args.reps}: {per_call:.3f} ms {per_calls} "
            f"(goal <= {GOALS['proxy_cpu_ms_per_call']} ms: {verdict(per_call, GOALS['proxy_cpu_ms_per_call'])})")
    say(f"load average {tuple(round(x, 2) for x in os.getloadavg())} at the end")
    print("\nraw rows (name, rollouts, C, backend ms, rollouts/s, p50 ms, p99 ms, CPU-ms/rollout, ...):")
    for row in raw:
        print("| " + " | ".join(row) + " |")
    return 0 if not any("NOT met" in line for line in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
