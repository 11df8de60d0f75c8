"""Benchmark: the streaming orchestrator against plain collection, through a real stack.

    .venv/bin/python scripts/bench_orchestrator.py [--latencies 0,1000] [--batch-size 64]
        [--rollouts-per-example 8] [--steps 8] [--concurrency 64] [--trainer-s 0,3]

The stack is chat_completions + simple_agent + weather (`rollgym.Stack`, forked children) in front of
scripts/scripted_backend.py (`--latency-ms L`, a subprocess). One weather rollout makes two model calls,
so at 1000 ms a rollout takes about 2 s. For every backend latency the same number of rollouts
(`steps * batch_size`, in groups of `rollouts_per_example`, `concurrency` in flight) runs twice or more:

- plain: `rollgym.Collector` (tasks x repeats to a JSONL file), the baseline;
- orchestrator: `Orchestrator.batches()` with an in-process trainer that takes `trainer_s` per step
  (0: the trainer is never the bottleneck) and `max_async_level` 1.

Printed per run: wall time, rollouts/s, CPU-ms per rollout (this process plus the three servers; the
scripted backend excluded) and the orchestrator's CPU overhead against plain collection, how busy the
rollout slots were (time-weighted share of `concurrency` in use, over every step but the last, which
drains the run: nothing is dispatched once its groups are in flight), and the trainer's and inference's
waits from history.jsonl. Targets: slots busy >= 90% while the trainer is not the bottleneck, and
<= 10% CPU over plain collection.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
import psutil

# The same scripted-backend subprocess as the collection benchmark (this folder is on sys.path).
from bench_rollouts import Backend

REPO = Path(__file__).resolve().parents[1]
WEATHER_YAML = REPO / "resources_servers/weather/configs/weather.yaml"
CHAT_YAML = REPO / "models/chat_completions/configs/chat_completions.yaml"
CITIES = [("Paris", ["sunny", "22"]), ("London", ["rainy", "14"]), ("Tokyo", ["cloudy"]), ("Oslo", ["snowy", "-3"])]
TOOL = {"type": "function", "name": "get_weather", "description": "Get the current weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def write_tasks(path: Path, count: int) -> None:
    """`count` distinct weather tasks (a `task_index` keeps them apart for dedupe)."""
    with path.open("wb") as handle:
        for index in range(count):
            city, expected = CITIES[index % len(CITIES)]
            row = {"responses_create_params": {
                "input": [{"role": "system", "content": "Use the get_weather tool, then answer with the condition."},
                          {"role": "user", "content": f"What is the weather in {city}?"}], "tools": [TOOL]},
                "city": city, "expected": expected, "task_index": index}
            handle.write(orjson.dumps(row) + b"\n")


def cpu_s(pids: list[int]) -> float:
    """CPU seconds of the stack's processes plus this one."""
    total = 0.0
    for pid in pids:
        try:
            times = psutil.Process(pid).cpu_times()
            total += times.user + times.system
        except psutil.Error:
            pass
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return total + usage.ru_utime + usage.ru_stime


def own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def run_plain(registry: dict, tasks: Path, groups: int, args: argparse.Namespace, workdir: Path) -> dict:
    from rollgym import CollectOptions, Collector, ServerClient

    output = workdir / f"plain-{time.monotonic_ns()}.jsonl"
    client = ServerClient(registry, timeout_s=3600, max_retries=2)
    options = CollectOptions(input=tasks, output=output, repeats=args.rollouts_per_example, limit=groups,
                             concurrency=args.concurrency, max_attempts=3, progress=False)
    try:
        summary = await Collector(client, "weather_agent", options, log=lambda m: None).run()
    finally:
        await client.close()
    return {"rollouts": summary["rollouts"], "failed": summary["failed"]}


async def run_orchestrator(registry: dict, tasks: Path, trainer_s: float, args: argparse.Namespace,
                           workdir: Path) -> dict:
    from rollgym.train.orchestrator.orchestrator import Orchestrator
    from rollgym.train.orchestrator.config import OrchestratorConfig

    config = OrchestratorConfig(
        batch_size=args.batch_size, rollouts_per_example=args.rollouts_per_example, max_steps=args.steps,
        max_async_level=1, max_off_policy_steps=2, concurrency=args.concurrency, model_servers=[],
        hash_keys=["task_index"], envs=[{"name": "weather", "input": str(tasks), "agent": "weather_agent"}])
    output = workdir / f"orchestrator-{time.monotonic_ns()}"
    orchestrator = Orchestrator(config, registry, output, log=lambda m: None)
    rollouts = 0
    async for batch in orchestrator.batches():
        rollouts += len(batch.rollouts)
        await asyncio.sleep(trainer_s)
        await orchestrator.finish_step(batch.step, None)
    history = [orjson.loads(line) for line in (output / "history.jsonl").read_bytes().splitlines()]
    steady = history[:-1] or history  # the last step drains: nothing more is dispatched once it is covered
    span = sum(h["interval_s"] for h in steady)
    return {
        "rollouts": rollouts,
        "slots_busy": sum(h["slots_busy"] * h["interval_s"] for h in steady) / span,
        "slots_busy_min": min(h["slots_busy"] for h in steady),
        "slots_busy_last": history[-1]["slots_busy"],
        "trainer_wait_s": sum(h["trainer_wait_s"] for h in history),
        "inference_wait_s": sum(h["inference_wait_s"] for h in history),
        "staleness": _merge(h["staleness"] for h in history),
    }


def _merge(histograms: Any) -> dict[str, int]:
    total: dict[str, int] = {}
    for histogram in histograms:
        for lag, count in histogram.items():
            total[lag] = total.get(lag, 0) + count
    return dict(sorted(total.items()))


def measure(label: str, coro_factory: Any, stack_pids: list[int]) -> dict:
    cpu0, own0, wall0 = cpu_s(stack_pids), own_cpu_s(), time.perf_counter()
    result = asyncio.run(coro_factory())
    wall = time.perf_counter() - wall0
    result.update(label=label, wall_s=wall, cpu_ms=(cpu_s(stack_pids) - cpu0) * 1000 / result["rollouts"],
                  driver_cpu_ms=(own_cpu_s() - own0) * 1000 / result["rollouts"],
                  rollouts_per_s=result["rollouts"] / wall)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latencies", default="0,1000", help="backend latencies in ms, comma-separated")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--rollouts-per-example", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--trainer-s", default="0", help="seconds per trainer step, comma-separated runs")
    parser.add_argument("--repeats", type=int, default=2, help="rounds of (plain, orchestrator runs)")
    args = parser.parse_args()
    latencies = [float(x) for x in args.latencies.split(",") if x.strip()]
    trainer_times = [float(x) for x in args.trainer_s.split(",") if x.strip()]

    from rollgym import Stack, load_stack  # before any thread: the launcher forks its children

    print(f"machine: {os.cpu_count()} CPUs, load average {tuple(round(x, 2) for x in os.getloadavg())}")
    print(f"per run: {args.steps} steps x {args.batch_size} rollouts in groups of {args.rollouts_per_example}, "
          f"{args.concurrency} in flight")
    workdir = Path(tempfile.mkdtemp(prefix="bench-orchestrator-"))
    tasks = workdir / "tasks.jsonl"
    groups = args.steps * args.batch_size // args.rollouts_per_example
    write_tasks(tasks, groups * 4)
    rows = []
    try:
        for latency in latencies:
            backend = Backend(latency)
            stack = Stack(load_stack([str(WEATHER_YAML), str(CHAT_YAML)],
                                     [f"policy_model.base_url={backend.url}", "policy_model.model=scripted"]))
            try:
                registry = stack.start()
                pids = [process.pid for process in stack.processes.values()]
                asyncio.run(run_plain(registry, tasks, 2 * args.concurrency // args.rollouts_per_example, args,
                                      workdir))  # warm-up: connections, first-call costs
                for _ in range(args.repeats):  # interleaved, so load from others hits both alike
                    plain = measure("plain collector", lambda: run_plain(registry, tasks, groups, args, workdir),
                                    pids)
                    rows.append((latency, plain, None))
                    for trainer_s in trainer_times:
                        result = measure(f"orchestrator, trainer {trainer_s:g} s/step",
                                         lambda: run_orchestrator(registry, tasks, trainer_s, args, workdir), pids)
                        rows.append((latency, result, plain))
            finally:
                stack.stop()
                backend.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print("\n| backend ms | run | rollouts | wall s | rollouts/s | CPU-ms/rollout (all) | CPU overhead | "
          "driver CPU-ms/rollout | slots busy (min step; last step) | trainer wait s | inference wait s | "
          "lag histogram |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for latency, result, plain in rows:
        overhead = f"{(result['cpu_ms'] / plain['cpu_ms'] - 1) * 100:+.1f}%" if plain else "baseline"
        busy = (f"{result['slots_busy'] * 100:.1f}% ({result['slots_busy_min'] * 100:.0f}%; "
                f"{result['slots_busy_last'] * 100:.0f}%)"
                if "slots_busy" in result else "")
        print(f"| {latency:g} | {result['label']} | {result['rollouts']} | {result['wall_s']:.2f} | "
              f"{result['rollouts_per_s']:.1f} | {result['cpu_ms']:.2f} | {overhead} | {result['driver_cpu_ms']:.2f} | "
              f"{busy} | {result.get('trainer_wait_s', 0):.2f} | {result.get('inference_wait_s', 0):.2f} | "
              f"{result.get('staleness', '')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
