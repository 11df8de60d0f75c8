"""Benchmark: weather rollouts through a real rollgym stack in front of the scripted backend.

    .venv/bin/python scripts/bench_rollouts.py --rollouts 2000 --concurrency 256 [--backend-latency-ms 0]
        [--warmup 200] [--drivers collector,aiohttp,cli]
    .venv/bin/python scripts/bench_rollouts.py --in-flight 16384 --backend-latency-ms 1000

The stack is chat_completions (model server) + simple_agent + weather, started with
`rollgym.Stack(load_stack([weather.yaml, chat_completions.yaml], [policy_model.base_url=...]))` from
this single-threaded script, so the launcher forks its children; scripts/scripted_backend.py (a
zero-work stand-in for vLLM, `--latency-ms L`) runs as a subprocess. One weather rollout is
seed + 2 model calls (each one backend call) + 1 tool call + verify: 8 HTTP requests with /run.

Drivers (each runs the same N rollouts at concurrency C against the same stack):
- collector: the real `rollgym.Collector` in this process, writing a temp JSONL;
- aiohttp:   a minimal aiohttp driver posting /run (no output file): the collector's own cost is
             the difference between the two;
- cli:       `rollgym collect-rollouts --registry-file` as a subprocess, for its fixed overhead:
             process start until the first /run is sent, and the last answer until exit.

Printed per driver: rollouts/s in steady state (after --warmup rollouts), p50/p99 rollout latency,
CPU-ms per rollout summed over the rollgym processes (the three servers + the driver process; the
scripted backend excluded), the idle and peak RSS of those processes, and a markdown table row.
Before the runs: the ready time of the stack (in this process, and of `rollgym run` as a user
starts it), and the machine (nproc, load average).

--in-flight M holds M rollouts in flight at once (N = C = M, aiohttp driver): it checks that every
rollout succeeds without a hang and reports peak RSS per thousand rollouts in flight. The file
descriptor limit is raised to the hard limit; the agent needs about 3 descriptors per rollout in
flight (its /run connection plus pooled connections to the model and the environment), so the
script says when the hard limit is too low.
"""

from __future__ import annotations

import time

SCRIPT_STARTED = time.perf_counter()

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import aiohttp  # noqa: E402
import orjson  # noqa: E402
import psutil  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
WEATHER_YAML = REPO / "resources_servers/weather/configs/weather.yaml"
CHAT_YAML = REPO / "models/chat_completions/configs/chat_completions.yaml"
BACKEND = REPO / "scripts/scripted_backend.py"
CITIES = [("Paris", ["sunny", "22"]), ("London", ["rainy", "14"]), ("Tokyo", ["cloudy"]), ("Oslo", ["snowy", "-3"])]
TOOL = {"type": "function", "name": "get_weather", "description": "Get the current weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
MB = 1024 * 1024


# --- machine, processes, resources ------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    return {"nproc": os.cpu_count(), "loadavg": tuple(round(x, 2) for x in os.getloadavg()),
            "python": sys.version.split()[0]}


def raise_fd_limit() -> tuple[int, int]:
    """Raise RLIMIT_NOFILE's soft limit to the hard limit (children inherit it); returns (soft, hard)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of these processes (their own, not their children's)."""
    total = 0.0
    for pid in pids:
        try:
            times = psutil.Process(pid).cpu_times()
            total += times.user + times.system
        except psutil.Error:
            pass
    return total


def rss(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.Error:
            pass
    return total


def pss(pids: list[int]) -> int:
    """Proportional set size: shared (forked, copy-on-write) pages counted once across the processes."""
    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_full_info().pss
        except (psutil.Error, AttributeError):
            return 0
    return total


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


# --- the measurement of one run ---------------------------------------------------------------------------------


@dataclass
class Meter:
    """Times each rollout, and samples CPU and RSS of the measured processes while a run goes on.

    `pids` are measured by /proc (psutil); `self_cpu` adds this process's own CPU (the in-process
    drivers). CPU is snapshotted at the start, when the warm-up rollouts are done and at the end, so
    the steady state excludes warm-up.
    """

    pids: list[int]
    warmup: int
    self_cpu: bool = True
    rss_pids: list[int] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    done_at: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    cpu: dict[str, float] = field(default_factory=dict)
    wall: dict[str, float] = field(default_factory=dict)
    peak_rss: int = 0
    peak_rss_by_pid: dict[int, int] = field(default_factory=dict)
    in_flight: int = 0
    peak_in_flight: int = 0
    _sampler: asyncio.Task | None = None

    def _cpu(self) -> float:
        own = 0.0
        if self.self_cpu:
            usage = resource.getrusage(resource.RUSAGE_SELF)
            own = usage.ru_utime + usage.ru_stime
        return cpu_s(self.pids) + own

    def start(self) -> None:
        self.cpu["start"] = self._cpu()
        self.wall["start"] = time.perf_counter()
        if self.warmup == 0:
            self.cpu["warm"], self.wall["warm"] = self.cpu["start"], self.wall["start"]
        self._sampler = asyncio.get_running_loop().create_task(self._sample())

    def _sample_rss(self) -> None:
        pids = self.rss_pids or self.pids
        self.peak_rss = max(self.peak_rss, rss(pids))
        for pid in pids:
            self.peak_rss_by_pid[pid] = max(self.peak_rss_by_pid.get(pid, 0), rss([pid]))

    async def _sample(self) -> None:
        while True:
            self._sample_rss()
            await asyncio.sleep(0.1)

    def sent(self) -> float:
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        return time.perf_counter()

    def done(self, sent_at: float, ok: bool, why: str = "") -> None:
        now = time.perf_counter()
        self.in_flight -= 1
        self.latencies.append(now - sent_at)
        self.done_at.append(now)
        if not ok:
            self.failures.append(why)
        if len(self.done_at) == self.warmup:
            self.cpu["warm"], self.wall["warm"] = self._cpu(), now

    async def finish(self) -> None:
        self.wall["end"] = time.perf_counter()
        self.cpu["end"] = self._cpu()
        if self._sampler is not None:
            self._sampler.cancel()
            try:
                await self._sampler
            except asyncio.CancelledError:
                pass
        self._sample_rss()

    def summary(self) -> dict[str, Any]:
        n = len(self.done_at)
        steady = n - self.warmup
        warm_wall = self.wall.get("warm", self.wall["start"])
        warm_cpu = self.cpu.get("warm", self.cpu["start"])
        last = self.done_at[-1] if self.done_at else self.wall["end"]
        rate = steady / (last - warm_wall) if steady > 0 and last > warm_wall else float("nan")
        lat = self.latencies[self.warmup:] or self.latencies
        return {
            "rollouts": n, "failures": len(self.failures), "rollouts_per_s": rate,
            "p50_ms": percentile(lat, 50) * 1000, "p99_ms": percentile(lat, 99) * 1000,
            "cpu_ms_per_rollout": (self.cpu["end"] - warm_cpu) * 1000 / steady if steady > 0 else float("nan"),
            "cpu_ms_per_rollout_all": (self.cpu["end"] - self.cpu["start"]) * 1000 / n if n else float("nan"),
            "wall_s": self.wall["end"] - self.wall["start"], "peak_rss": self.peak_rss,
            "peak_in_flight": self.peak_in_flight,
        }


# --- tasks --------------------------------------------------------------------------------------------------------


def task_rows(count: int) -> list[dict[str, Any]]:
    rows = []
    for index in range(count):
        city, expected = CITIES[index % len(CITIES)]
        rows.append({"responses_create_params": {
            "input": [{"role": "system", "content": "Use the get_weather tool, then answer with the condition."},
                      {"role": "user", "content": f"What is the weather in {city}?"}], "tools": [TOOL]},
            "city": city, "expected": expected})
    return rows


def write_tasks(path: Path, count: int) -> None:
    with path.open("wb") as handle:
        for row in task_rows(count):
            handle.write(orjson.dumps(row) + b"\n")


# --- drivers ------------------------------------------------------------------------------------------------------


async def drive_aiohttp(agent_url: str, count: int, concurrency: int, meter: Meter, timeout_s: float) -> None:
    """The minimal driver: POST /run, `concurrency` at a time, check the status; no output file."""
    bodies = [orjson.dumps({**row, "rollout_id": f"bench-{i}"}) for i, row in enumerate(task_rows(count))]
    connector = aiohttp.TCPConnector(limit=concurrency, limit_per_host=concurrency, keepalive_timeout=60)
    semaphore = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, cookie_jar=aiohttp.DummyCookieJar()) as http:

        async def one(body: bytes) -> None:
            async with semaphore:
                sent = meter.sent()
                try:
                    async with http.post(agent_url + "/run", data=body,
                                         headers={"Content-Type": "application/json"}) as reply:
                        payload = await reply.read()
                    answer = orjson.loads(payload) if reply.status == 200 else {}
                    status = answer.get("status")
                    why = f"{status}: {answer.get('error')}" if status else f"HTTP {reply.status}: {payload[:200]!r}"
                    meter.done(sent, status == "ok", why)
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                    meter.done(sent, False, f"{type(exc).__name__}: {exc}")

        meter.start()
        await asyncio.gather(*(one(body) for body in bodies))
        await meter.finish()


async def drive_collector(registry: dict, count: int, concurrency: int, meter: Meter, workdir: Path) -> dict[str, Any]:
    """The real Collector (rollgym.rollouts.collector) with a client that times each /run."""
    from rollgym import CollectOptions, Collector, ServerClient

    class TimedClient(ServerClient):
        async def post(self, server: str, path: str, json: Any = None, **kwargs: Any) -> Any:
            if path != "/run":
                return await super().post(server, path, json=json, **kwargs)
            sent = meter.sent()
            try:
                reply = await super().post(server, path, json=json, **kwargs)
            except Exception as exc:
                meter.done(sent, False, f"{type(exc).__name__}: {exc}")
                raise
            answer = reply.json() if reply.ok else {}
            status = answer.get("status")
            meter.done(sent, status == "ok", f"{status}: {answer.get('error')}" if status else f"HTTP {reply.status}")
            return reply

    tasks = workdir / f"tasks-{count}.jsonl"
    write_tasks(tasks, count)
    output = workdir / f"collector-{time.monotonic_ns()}.jsonl"
    client = TimedClient(registry, timeout_s=3600, max_retries=2)
    options = CollectOptions(input=tasks, output=output, concurrency=concurrency, max_attempts=1, progress=False)
    try:
        meter.start()
        summary = await Collector(client, "weather_agent", options, log=lambda m: None).run()
        await meter.finish()
    finally:
        await client.close()
    lines = output.read_bytes().count(b"\n")
    if lines != count:
        meter.failures.append(f"output has {lines} lines, expected {count}")
    return summary


CLI_WRAPPER = r"""
import json, os, resource, sys, time
marks = {"interpreter_up": time.time(), "done": []}
def usage():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
import rollgym.client as client
original = client.ServerClient.post
async def post(self, server, path, json=None, **kwargs):
    if path == "/run" and "first_send" not in marks:
        marks["first_send"], marks["cpu_first_send"] = time.time(), usage()
    sent = time.time()
    try:
        return await original(self, server, path, json=json, **kwargs)
    finally:
        if path == "/run":
            now = time.time()
            marks["done"].append(now)
            marks.setdefault("latency", []).append(now - sent)
            marks["cpu_last_reply"] = usage()
client.ServerClient.post = post
from rollgym.cli import main
code = main(sys.argv[1:])
marks["main_returned"], marks["cpu_main_returned"] = time.time(), usage()
with open(os.environ["BENCH_MARKS"], "w") as handle:
    json.dump(marks, handle)
sys.exit(code)
"""


def drive_cli(registry_file: Path, count: int, concurrency: int, warmup: int, stack_pids: list[int],
              workdir: Path, timeout_s: float) -> dict[str, Any]:
    """`rollgym collect-rollouts` as a subprocess; its fixed overhead around the /run calls."""
    tasks = workdir / f"tasks-{count}.jsonl"
    write_tasks(tasks, count)
    output = workdir / f"cli-{time.monotonic_ns()}.jsonl"
    marks_file = workdir / "marks.json"
    stack_cpu0 = cpu_s(stack_pids)
    launched = time.time()
    process = subprocess.Popen(
        [sys.executable, "-c", CLI_WRAPPER, "collect-rollouts", "--registry-file", str(registry_file),
         "--input", str(tasks), "--output", str(output), "--concurrency", str(concurrency), "--max-attempts", "1",
         "--no-progress"],
        cwd=REPO, env={**os.environ, "BENCH_MARKS": str(marks_file)}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    peak = 0
    deadline = time.monotonic() + timeout_s
    while True:  # wait4 gives the exit time and the child's own CPU (rusage) at once
        pid, status, usage = os.wait4(process.pid, os.WNOHANG)
        if pid:
            exited = time.time()
            break
        peak = max(peak, rss(stack_pids + [process.pid]))
        if time.monotonic() > deadline:
            process.kill()
            raise SystemExit(f"cli driver did not finish in {timeout_s} s")
        time.sleep(0.05)
    process.returncode = os.waitstatus_to_exitcode(status)
    stderr = process.stderr.read().decode(errors="replace")
    process.stderr.close()
    if process.returncode != 0:
        raise SystemExit(f"rollgym collect-rollouts failed ({process.returncode}):\n{stderr}")
    marks = json.loads(marks_file.read_text())
    stack_cpu = cpu_s(stack_pids) - stack_cpu0
    child_cpu = usage.ru_utime + usage.ru_stime
    done = sorted(marks["done"])
    steady = done[warmup:] if len(done) > warmup else done
    rate = (len(steady) - 1) / (steady[-1] - steady[0]) if len(steady) > 1 else float("nan")
    lines = output.read_bytes().count(b"\n")
    latency = marks.get("latency", [])[warmup:] or marks.get("latency", [])
    return {
        "rollouts": lines, "failures": count - lines, "rollouts_per_s": rate,
        "p50_ms": percentile(latency, 50) * 1000, "p99_ms": percentile(latency, 99) * 1000,
        "start_to_first_run_s": marks["first_send"] - launched,
        "interpreter_start_s": marks["interpreter_up"] - launched,
        "last_reply_to_exit_s": exited - done[-1],
        "wall_s": exited - launched,
        "collector_cpu_s": child_cpu,
        "collector_fixed_cpu_s": marks["cpu_first_send"] + (child_cpu - marks["cpu_last_reply"]),
        "cpu_ms_per_rollout_all": (stack_cpu + child_cpu) * 1000 / count,
        "cpu_ms_per_rollout": (stack_cpu + marks["cpu_last_reply"] - marks["cpu_first_send"]) * 1000 / count,
        "peak_rss": peak,
    }


# --- the stack ----------------------------------------------------------------------------------------------------


class Backend:
    """scripts/scripted_backend.py as a subprocess."""

    def __init__(self, latency_ms: float) -> None:
        self.dir = tempfile.TemporaryDirectory(prefix="bench-backend-")
        port_file = Path(self.dir.name) / "port"
        self.process = subprocess.Popen(
            [sys.executable, str(BACKEND), "--host", "127.0.0.1", "--port", "0", "--port-file", str(port_file),
             "--latency-ms", str(latency_ms)], stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the scripted backend did not start")
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{int(port_file.read_text())}/v1"

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.dir.cleanup()


def rollgym_run_ready(backend_url: str, workdir: Path) -> dict[str, float]:
    """`rollgym run` as a user starts it: its own "stack ready in" figure and the wall time until ready."""
    registry = workdir / "run-registry.json"
    launched = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, "-m", "rollgym.cli", "run", str(WEATHER_YAML), str(CHAT_YAML),
         f"policy_model.base_url={backend_url}", "policy_model.model=scripted", "--registry-file", str(registry)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = process.stdout.readline()
        wall = time.perf_counter() - launched
        reported = float(line.split("ready in ")[1].split()[0]) if "ready in" in line else float("nan")
        return {"reported_s": reported, "wall_s": wall}
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
        process.stdout.close()


def backend_hops(backend_url: str, agent_url: str) -> str:
    """Backend requests per rollout, from the scripted backend's request log (if it has one)."""
    async def main() -> str:
        root = backend_url.rsplit("/v1", 1)[0]
        async with aiohttp.ClientSession() as http:
            async with http.post(root + "/scripted/clear") as reply:
                if reply.status != 200:
                    return "n/a"
            for row in task_rows(4):
                async with http.post(agent_url + "/run", json=row) as reply:
                    await reply.read()
            async with http.get(root + "/scripted/requests") as reply:
                log = await reply.json()
        entries = log.get("requests", log) if isinstance(log, dict) else log
        paths: dict[str, int] = {}
        for entry in entries:
            path = entry.get("path", "?") if isinstance(entry, dict) else "?"
            paths[path] = paths.get(path, 0) + 1
        return ", ".join(f"{path} x{n / 4:g}" for path, n in sorted(paths.items())) or "none"

    try:
        return asyncio.run(main())
    except Exception as exc:  # noqa: BLE001 - informative only
        return f"n/a ({type(exc).__name__})"


def failure_causes(failures: list[str], top: int = 4) -> str:
    """The most common failure messages, with numbers and addresses blanked so that alike ones group."""
    import re
    from collections import Counter

    counts = Counter(re.sub(r"\d+(\.\d+)?", "N", why)[:160] for why in failures)
    return "; ".join(f"{n} x {why}" for why, n in counts.most_common(top))


# --- report -------------------------------------------------------------------------------------------------------

HEADER = ("| driver | rollouts | C | backend ms | rollouts/s | p50 ms | p99 ms | CPU-ms/rollout | idle RSS MB | "
          "peak RSS MB | ready s | nproc | load avg |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def report(driver: str, result: dict[str, Any], args: argparse.Namespace, idle_rss: int, ready_s: float,
           extra: list[str]) -> str:
    load = ", ".join(str(x) for x in machine()["loadavg"])
    lines = [f"\n== driver: {driver}",
             f"  rollouts {result['rollouts']} (failures {result['failures']}), concurrency {args.concurrency}, "
             f"backend latency {args.backend_latency_ms:g} ms, warm-up {args.warmup}",
             f"  steady state: {result['rollouts_per_s']:.1f} rollouts/s"]
    if "p50_ms" in result:
        lines.append(f"  latency per rollout: p50 {result['p50_ms']:.1f} ms, p99 {result['p99_ms']:.1f} ms")
    lines.append(f"  CPU per rollout (rollgym processes, backend excluded): {result['cpu_ms_per_rollout']:.2f} ms "
                 f"steady, {result['cpu_ms_per_rollout_all']:.2f} ms over the whole run")
    lines.append(f"  RSS of the rollgym processes: idle {idle_rss / MB:.0f} MB, peak {result['peak_rss'] / MB:.0f} MB")
    lines.extend(f"  {line}" for line in extra)
    lines.append(f"  load average {load} on {os.cpu_count()} CPUs")
    lines.append(f"| {driver} | {result['rollouts']} | {args.concurrency} | {args.backend_latency_ms:g} | "
                 f"{result['rollouts_per_s']:.1f} | {result.get('p50_ms', float('nan')):.1f} | "
                 f"{result.get('p99_ms', float('nan')):.1f} | {result['cpu_ms_per_rollout']:.2f} | "
                 f"{idle_rss / MB:.0f} | {result['peak_rss'] / MB:.0f} | {ready_s:.2f} | {os.cpu_count()} | {load} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--backend-latency-ms", type=float, default=0.0)
    parser.add_argument("--warmup", type=int, default=None, help="rollouts left out of the steady state (default 10%%)")
    parser.add_argument("--drivers", default="collector,aiohttp,cli", help="comma-separated: collector, aiohttp, cli")
    parser.add_argument("--in-flight", type=int, default=0, help="hold this many rollouts in flight at once")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="a run longer than this is a hang")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="a stack override, e.g. weather_agent.tracing.otlp_endpoint=http://127.0.0.1:6006")
    parser.add_argument("--no-cli-ready", action="store_true", help="skip timing `rollgym run`'s start-up")
    args = parser.parse_args()
    if args.in_flight:
        args.rollouts = args.concurrency = args.in_flight
        args.drivers = "aiohttp"
        if args.warmup is None:
            args.warmup = 0
    if args.warmup is None:
        args.warmup = args.rollouts // 10
    drivers = [d.strip() for d in args.drivers.split(",") if d.strip()]

    soft, hard = raise_fd_limit()
    info = machine()
    print(f"machine: {info['nproc']} CPUs, load average {info['loadavg']}, Python {info['python']}")
    print(f"fd limit: {soft} (hard {hard})")
    if args.in_flight:
        need = 3 * args.in_flight + 256
        if hard < need:
            print(f"WARNING: the fd hard limit {hard} is too low for {args.in_flight} rollouts in flight: the agent "
                  f"alone needs about {need} (1 inbound + ~2 pooled outbound connections per rollout); raise it "
                  f"(ulimit -Hn / limits.conf) or expect connection errors")

    from rollgym import Stack, load_stack  # noqa: E402 - after the fd limit, before any thread

    workdir = Path(tempfile.mkdtemp(prefix="bench-rollouts-"))
    backend = Backend(args.backend_latency_ms)
    stack = None
    try:
        run_ready = None if args.no_cli_ready else rollgym_run_ready(backend.url, workdir)
        config = load_stack([str(WEATHER_YAML), str(CHAT_YAML)],
                            [f"policy_model.base_url={backend.url}", "policy_model.model=scripted", *args.override])
        forks = threading.active_count() == 1
        stack = Stack(config)
        started = time.perf_counter()
        registry = stack.start()
        ready_s = time.perf_counter() - started
        stack_pids = [process.pid for process in stack.processes.values()]
        registry_file = workdir / "registry.json"
        registry_file.write_bytes(orjson.dumps({n: a.to_json() for n, a in registry.items()}))
        agent_url = registry["weather_agent"].url
        time.sleep(0.5)
        me = os.getpid()
        idle_rss = rss(stack_pids + [me])
        idle_rss_by_pid = {pid: rss([pid]) for pid in stack_pids + [me]}
        process_names = {**dict(zip(stack_pids, stack.processes)), me: "driver"}
        idle_pss = pss(stack_pids + [me])
        print(f"stack ready in {ready_s:.2f} s in this process ({'forked' if forks else 'spawned'} children: "
              + ", ".join(f"{n}={p}" for n, p in zip(stack.processes, stack_pids)) + f"), "
              f"{time.perf_counter() - SCRIPT_STARTED:.2f} s after this script started")
        if run_ready:
            print(f"`rollgym run` ready: it reports {run_ready['reported_s']:.2f} s; "
                  f"{run_ready['wall_s']:.2f} s from launching the command")
        print(f"idle: RSS {idle_rss / MB:.0f} MB, PSS {idle_pss / MB:.0f} MB (3 servers + this driver process)")
        print(f"backend requests per rollout: {backend_hops(backend.url, agent_url)}")
        print(HEADER)

        rows = []
        for driver in drivers:
            if driver == "aiohttp":
                meter = Meter(stack_pids, args.warmup, rss_pids=stack_pids + [me])
                try:
                    asyncio.run(asyncio.wait_for(
                        drive_aiohttp(agent_url, args.rollouts, args.concurrency, meter, args.timeout_s),
                        args.timeout_s + 60))
                except asyncio.TimeoutError:
                    print(f"HANG: the aiohttp driver did not finish in {args.timeout_s} s "
                          f"({len(meter.done_at)} of {args.rollouts} done)")
                    return 1
                result = meter.summary()
                extra = [f"peak in flight: {meter.peak_in_flight}"]
                if meter.failures:
                    extra.append(f"FAILURES: {len(meter.failures)}; most common causes: {failure_causes(meter.failures)}")
                if args.in_flight:
                    grown = result["peak_rss"] - idle_rss
                    extra.append(f"in flight: {meter.peak_in_flight} at once, {len(meter.failures)} failures, "
                                 f"{result['wall_s']:.1f} s; peak RSS {result['peak_rss'] / MB:.0f} MB = "
                                 f"{grown / MB / (args.in_flight / 1000):.1f} MB above idle per 1000 in flight "
                                 f"({result['peak_rss'] / MB / (args.in_flight / 1000):.1f} MB total per 1000)")
                    extra.append("peak RSS above idle per 1000 in flight, per process: " + ", ".join(
                        f"{process_names[pid]} {(peak - idle_rss_by_pid[pid]) / MB / (args.in_flight / 1000):.1f} MB"
                        for pid, peak in meter.peak_rss_by_pid.items()))
                    extra.append(f"PSS after the run: {pss(stack_pids + [me]) / MB:.0f} MB")
                rows.append(report("aiohttp", result, args, idle_rss, ready_s, extra))
            elif driver == "collector":
                meter = Meter(stack_pids, args.warmup, rss_pids=stack_pids + [me])
                summary = asyncio.run(drive_collector(registry, args.rollouts, args.concurrency, meter, workdir))
                result = meter.summary()
                extra = [f"collector metrics: {summary['status_counts']}, mean reward {summary['mean_reward']}"]
                if meter.failures:
                    extra.append(f"FAILURES: {len(meter.failures)}; most common causes: {failure_causes(meter.failures)}")
                rows.append(report("collector", result, args, idle_rss, ready_s, extra))
            elif driver == "cli":
                result = drive_cli(registry_file, args.rollouts, args.concurrency, args.warmup, stack_pids, workdir,
                                   args.timeout_s)
                extra = [
                    f"fixed overhead: {result['start_to_first_run_s']:.2f} s from launch to the first /run "
                    f"(interpreter up after {result['interpreter_start_s']:.2f} s), "
                    f"{result['last_reply_to_exit_s']:.2f} s from the last answer to exit",
                    f"collector process CPU: {result['collector_cpu_s']:.2f} s, of which "
                    f"{result['collector_fixed_cpu_s']:.2f} s outside the /run window (imports, start, summary); "
                    f"{(result['collector_cpu_s'] - result['collector_fixed_cpu_s']) * 1000 / result['rollouts']:.3f} "
                    f"CPU-ms per rollout inside it",
                    f"whole command: {result['wall_s']:.2f} s wall",
                ]
                rows.append(report("cli", result, args, idle_rss, ready_s, extra))
            else:
                raise SystemExit(f"unknown driver {driver!r}")
            print(rows[-1], flush=True)
        print("\n" + HEADER)
        for row in rows:
            print(row.splitlines()[-1])
        failed = any("FAILURES" in row for row in rows)
        return 1 if failed else 0
    finally:
        if stack is not None:
            stack.stop()
        backend.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
