"""Benchmark floor: the eight-hop HTTP chain of a weather rollout with bare handlers doing no work.

    .venv/bin/python scripts/bench_http_floor.py --rollouts 2000 --concurrency 256 [--backend-latency-ms 0]
        [--warmup 200] [--variants aiohttp,fastapi]

The same process layout as a rollgym stack (one process per server: agent, model, environment, and a
backend standing in for vLLM) and the same chain per rollout:

    driver -> agent /run
              agent -> env /seed_session
              agent -> model /v1/responses -> backend /v1/chat/completions
              agent -> env /get_weather
              agent -> model /v1/responses -> backend /v1/chat/completions
              agent -> env /verify

eight HTTP requests, every handler reading its body and answering a canned JSON reply; the outbound
calls use one pooled aiohttp ClientSession per process (what rollgym's ServerClient uses). Two
variants of the servers, same driver and concurrency:

- aiohttp: bare aiohttp.web servers (uvloop);
- fastapi: bare FastAPI apps on uvicorn (uvloop, httptools), rollgym's server stack without rollgym.

The backend is a bare aiohttp server in both variants (with --backend-latency-ms) and, as in
scripts/bench_rollouts.py, its CPU is left out. Printed per variant: rollouts/s in steady state,
p50/p99 latency, CPU-ms per rollout of agent + model + env + the driver process, and a markdown row.
This is the floor that rollgym's overhead (scripts/bench_rollouts.py, aiohttp driver, same
arguments) is measured against.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_rollouts as bench  # noqa: E402 - the same driver, meter and machine report

CHAT = b'{"id":"chatcmpl-1","object":"chat.completion","created":0,"model":"scripted","choices":[{"index":0,' \
       b'"message":{"role":"assistant","content":"The weather in Paris: sunny, 22 C","tool_calls":[]},' \
       b'"finish_reason":"stop"}],"usage":{"prompt_tokens":40,"completion_tokens":10,"total_tokens":50}}'
RESPONSE = b'{"id":"resp_1","object":"response","created_at":0,"model":"scripted","status":"completed","output":' \
           b'[{"type":"message","id":"msg_1","role":"assistant","status":"completed","content":[{"type":' \
           b'"output_text","text":"The weather in Paris: sunny, 22 C","annotations":[]}]}],"usage":' \
           b'{"input_tokens":40,"output_tokens":10,"total_tokens":50}}'
CHAT_REQUEST = b'{"model":"scripted","messages":[{"role":"user","content":"What is the weather in Paris?"}],' \
               b'"tools":[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object"}}}]}'
RESPONSES_REQUEST = b'{"input":[{"role":"user","content":"What is the weather in Paris?"}],"tools":[{"type":' \
                    b'"function","name":"get_weather","parameters":{"type":"object"}}]}'
VERIFIED = b'{"reward":1.0,"looked_up":["Paris"]}'
RUN_RESULT = b'{"status":"ok","reward":1.0,"error":null}'
JSON = {"Content-Type": "application/json"}


# --- the servers (run in child processes: `--serve ROLE`) ---------------------------------------------------


class Chain:
    """What each role does: read the body, make its outbound calls, answer canned bytes."""

    def __init__(self, role: str, upstream: dict[str, str], latency_s: float) -> None:
        self.role = role
        self.upstream = upstream
        self.latency_s = latency_s
        self.http: Any = None

    async def open(self) -> None:
        import aiohttp

        if self.role in ("agent", "model"):
            connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=None, keepalive_timeout=60)
            self.http = aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.DummyCookieJar(),
                                              auto_decompress=False)

    async def close(self) -> None:
        if self.http is not None:
            await self.http.close()

    async def _post(self, url: str, body: bytes) -> bytes:
        async with self.http.post(url, data=body, headers=JSON) as reply:
            return await reply.read()

    async def handle(self, path: str, body: bytes) -> bytes:
        if self.role == "backend":
            if self.latency_s:
                await asyncio.sleep(self.latency_s)
            return CHAT
        if self.role == "env":
            return {"/seed_session": b"{}", "/get_weather": b'"Paris: sunny, 22 C"'}.get(path, VERIFIED)
        if self.role == "model":
            await self._post(self.upstream["backend"] + "/v1/chat/completions", CHAT_REQUEST)
            return RESPONSE
        # agent: /run
        env, model = self.upstream["env"], self.upstream["model"]
        await self._post(env + "/seed_session", body)
        await self._post(model + "/v1/responses", RESPONSES_REQUEST)
        await self._post(env + "/get_weather", b'{"city":"Paris"}')
        await self._post(model + "/v1/responses", RESPONSES_REQUEST)
        await self._post(env + "/verify", body)
        return RUN_RESULT


ROUTES = {"backend": ["/v1/chat/completions"], "env": ["/seed_session", "/get_weather", "/verify"],
          "model": ["/v1/responses"], "agent": ["/run"]}


def serve_aiohttp(chain: Chain, sock: socket.socket) -> None:
    import uvloop
    from aiohttp import web

    async def main() -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)

        async def health(_: web.Request) -> web.Response:
            return web.Response(body=b'{"status":"ok"}', content_type="application/json")

        def route(path: str) -> Any:
            async def handler(request: web.Request) -> web.Response:
                return web.Response(body=await chain.handle(path, await request.read()), content_type="application/json")
            return handler

        app.router.add_get("/health", health)
        for path in ROUTES[chain.role]:
            app.router.add_post(path, route(path))
        await chain.open()
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await runner.setup()
        await web.SockSite(runner, sock, shutdown_timeout=1.0).start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
        finally:
            await runner.cleanup()
            await chain.close()

    uvloop.run(main())


def serve_fastapi(chain: Chain, sock: socket.socket) -> None:
    from contextlib import asynccontextmanager

    import uvicorn
    from fastapi import FastAPI, Request, Response

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> Any:
        await chain.open()
        yield
        await chain.close()

    app = FastAPI(lifespan=lifespan)

    async def health() -> Response:
        return Response(content=b'{"status":"ok"}', media_type="application/json")

    def route(path: str) -> Any:
        async def handler(request: Request) -> Response:
            return Response(content=await chain.handle(path, await request.body()), media_type="application/json")
        # Real classes, not the strings `from __future__ import annotations` leaves: FastAPI must see Request.
        handler.__annotations__ = {"request": Request, "return": Response}
        return handler

    health.__annotations__ = {"return": Response}
    app.get("/health")(health)
    for path in ROUTES[chain.role]:
        app.post(path)(route(path))
    config = uvicorn.Config(app, loop="uvloop", http="httptools", log_level="warning", access_log=False,
                            lifespan="on", backlog=4096, timeout_keep_alive=75, timeout_graceful_shutdown=2)
    uvicorn.Server(config).run(sockets=[sock])


def serve(args: argparse.Namespace) -> int:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(4096)
    tmp = f"{args.port_file}.tmp"
    Path(tmp).write_text(str(sock.getsockname()[1]))
    os.replace(tmp, args.port_file)
    upstream = {"backend": args.backend, "model": args.model, "env": args.env}
    chain = Chain(args.serve, upstream, args.backend_latency_ms / 1000)
    variant = "aiohttp" if args.serve == "backend" else args.variant  # the backend is the same in both variants
    (serve_aiohttp if variant == "aiohttp" else serve_fastapi)(chain, sock)
    return 0


# --- the parent: start a variant's four processes, drive, measure ------------------------------------------------


class Servers:
    def __init__(self, variant: str, latency_ms: float, workdir: Path) -> None:
        self.processes: dict[str, subprocess.Popen] = {}
        self.urls: dict[str, str] = {}
        for role in ("backend", "env", "model", "agent"):
            port_file = workdir / f"{variant}-{role}.port"
            command = [sys.executable, __file__, "--serve", role, "--variant", variant, "--port-file", str(port_file),
                       "--backend-latency-ms", str(latency_ms)]
            for name in ("backend", "model", "env"):
                if name in self.urls:
                    command += [f"--{name}", self.urls[name]]
            self.processes[role] = subprocess.Popen(command)
            deadline = time.monotonic() + 60
            while not port_file.exists():
                if self.processes[role].poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise SystemExit(f"{variant} {role} did not start")
                time.sleep(0.02)
            self.urls[role] = f"http://127.0.0.1:{int(port_file.read_text())}"
        asyncio.run(self._healthy())

    async def _healthy(self) -> None:
        import aiohttp

        async with aiohttp.ClientSession() as http:
            for url in self.urls.values():
                for _ in range(600):
                    try:
                        async with http.get(url + "/health") as reply:
                            if reply.status == 200:
                                break
                    except aiohttp.ClientError:
                        pass
                    await asyncio.sleep(0.05)

    @property
    def measured_pids(self) -> list[int]:
        return [self.processes[role].pid for role in ("agent", "model", "env")]

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.terminate()
        for process in self.processes.values():
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--backend-latency-ms", type=float, default=0.0)
    parser.add_argument("--warmup", type=int, default=None, help="rollouts left out of the steady state (default 10%%)")
    parser.add_argument("--variants", default="aiohttp,fastapi")
    parser.add_argument("--timeout-s", type=float, default=900.0)
    parser.add_argument("--in-flight", type=int, default=0,
                        help="hold this many rollouts in flight at once and report the RSS they add (as "
                             "bench_rollouts.py --in-flight; use with --backend-latency-ms 1000)")
    # Child mode.
    parser.add_argument("--serve", choices=list(ROUTES), help=argparse.SUPPRESS)
    parser.add_argument("--variant", default="aiohttp", help=argparse.SUPPRESS)
    parser.add_argument("--port-file", help=argparse.SUPPRESS)
    parser.add_argument("--backend", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--env", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        return serve(args)
    if args.in_flight:
        args.rollouts = args.concurrency = args.in_flight
        args.warmup = 0
    if args.warmup is None:
        args.warmup = args.rollouts // 10

    soft, hard = bench.raise_fd_limit()
    info = bench.machine()
    print(f"machine: {info['nproc']} CPUs, load average {info['loadavg']}, Python {info['python']}; fd limit {soft}")
    print("floor: 8 HTTP requests per rollout, bare handlers; CPU = agent + model + env + driver (backend excluded)")
    header = ("| floor variant | rollouts | C | backend ms | rollouts/s | p50 ms | p99 ms | CPU-ms/rollout | "
              "peak RSS MB | nproc | load avg |\n|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    workdir = Path(tempfile.mkdtemp(prefix="bench-floor-"))
    failed = False
    for variant in [v.strip() for v in args.variants.split(",") if v.strip()]:
        servers = Servers(variant, args.backend_latency_ms, workdir)
        try:
            time.sleep(0.3)
            me = os.getpid()
            idle_rss = bench.rss(servers.measured_pids + [me])
            meter = bench.Meter(servers.measured_pids, args.warmup, rss_pids=servers.measured_pids + [me])
            asyncio.run(asyncio.wait_for(
                bench.drive_aiohttp(servers.urls["agent"], args.rollouts, args.concurrency, meter, args.timeout_s),
                args.timeout_s + 60))
            result = meter.summary()
        finally:
            servers.stop()
        load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
        print(f"\n== {variant}: {result['rollouts']} rollouts (failures {result['failures']}), concurrency "
              f"{args.concurrency}, backend latency {args.backend_latency_ms:g} ms")
        print(f"  steady state: {result['rollouts_per_s']:.1f} rollouts/s; latency p50 {result['p50_ms']:.1f} ms, "
              f"p99 {result['p99_ms']:.1f} ms")
        print(f"  CPU per rollout: {result['cpu_ms_per_rollout']:.2f} ms steady "
              f"({result['cpu_ms_per_rollout_all']:.2f} ms over the whole run); peak RSS {result['peak_rss'] / bench.MB:.0f} MB")
        if args.in_flight:
            grown = (result["peak_rss"] - idle_rss) / bench.MB / (args.in_flight / 1000)
            print(f"  in flight: {meter.peak_in_flight} at once; peak RSS {grown:.1f} "
                  f"MB above idle per 1000 in flight")
        if meter.failures:
            failed = True
            print(f"  FAILURES: {len(meter.failures)}; most common causes: {bench.failure_causes(meter.failures)}")
        print(f"  load average {load} on {os.cpu_count()} CPUs", flush=True)
        rows.append(f"| {variant} | {result['rollouts']} | {args.concurrency} | {args.backend_latency_ms:g} | "
                    f"{result['rollouts_per_s']:.1f} | {result['p50_ms']:.1f} | {result['p99_ms']:.1f} | "
                    f"{result['cpu_ms_per_rollout']:.2f} | {result['peak_rss'] / bench.MB:.0f} | {os.cpu_count()} | {load} |")
    print("\n" + header)
    print("\n".join(rows))
    for path in workdir.iterdir():
        path.unlink()
    workdir.rmdir()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
