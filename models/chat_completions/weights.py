"""Full weights on every backend of the pool: a checkpoint folder each backend reloads, under a version.

The trainer's full weights reach the backends as a folder of safetensors files that every backend can read
(`/dev/shm` on one machine, a shared filesystem across machines). `POST /update_weights_from_disk
{model_path, weight_version, pause_mode?}` on this server reloads it on each backend, all at once:

* vLLM (0.32, started with `VLLM_SERVER_DEV_MODE=1`), per backend, in this order (`reload_backend`):
  `POST /pause?mode=wait` (in-flight generations finish on the old weights; `abort` cuts them short),
  `POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR, "is_checkpoint_format":
  true}}`, `POST /reset_prefix_cache` (cached K/V of the old weights), `POST /update_weight_version
  {"new_version": VERSION}`, and `POST /resume`, which comes also when
  the reload failed, so that a backend that did not take the weights keeps serving its old ones;
* SGLang: `POST /update_weights_from_disk {model_path, weight_version}`.

vLLM's OpenAI answers do not say which weights generated them, so this server keeps each backend's version
(`Backend.weight_version`) and stamps it on what the backend generates. While a backend reloads, requests for
it wait here (`WeightsGate.admit`) instead of queueing in the paused engine: a generation is dispatched either
before the pause (and finishes on the old weights, `mode=wait`) or after the resume, so the version read at
dispatch is the one that sampled it. A backend that failed a request and comes back (a restarted vLLM or SGLang
starts on its base weights, version "default") is checked (vLLM: `GET /weight_info`, SGLang: `GET /get_model_info`,
each with its `weight_version`) before it gets traffic again and
reloaded to the pool's current weights first (when it serves other weights than it was last given); so is every
backend at most `weights_check_s` after its last
check (a restart no request saw).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from rollgym.server import BadRequest

from .routing import Backend, BackendUnavailable

PauseMode = Literal["wait", "abort", "keep"]
RELOAD_TIMEOUT_S = 600.0
INITIAL_VERSION = "default"  # what vLLM and SGLang report before a reload names another version
VERSION_ROUTES = {"vllm": "/weight_info", "sglang": "/get_model_info"}  # GET -> {..., "weight_version"}


@dataclass
class WeightsGate:
    """The pool's current full weights (None: those the backends started with) and the backends reloading now."""

    path: str | None = None
    version: str | None = None
    reloading: dict[str, asyncio.Event] = field(default_factory=dict)  # backend url -> set once it is done
    checking: dict[str, asyncio.Event] = field(default_factory=dict)  # the same, while it is asked what it serves

    async def admit(self, server: Any, backend: Backend) -> None:
        """Wait while `backend` reloads or is checked; a backend that failed a request since its last check, or
        was not checked for `weights_check_s`, is asked what it serves first, and one that serves other weights
        than it was last given (a restart) is brought to the current ones (BackendUnavailable if it cannot be:
        the caller picks another)."""
        for gates in (self.reloading, self.checking):
            while (done := gates.get(backend.url)) is not None:
                await done.wait()
        if self.path is None or server.config.backend not in VERSION_ROUTES:
            return
        now = time.monotonic()
        if not backend.needs_weights_check and now - backend.weights_checked_at < server.config.weights_check_s:
            return
        done = self.checking[backend.url] = asyncio.Event()
        try:
            served = await served_version(server, backend)
            # A failed reload keeps its old version (the next update tries it again): only a restart differs.
            if served is not None and served != (backend.weight_version or INITIAL_VERSION):
                result = await reload_backend(server, backend, self.path, self.version or "", "wait")
                if not result["ok"]:
                    raise BackendUnavailable(f"backend {backend.url} serves {served!r} and did not reload "
                                             f"{self.version!r}: {result['message']}")
            backend.needs_weights_check = False
            backend.weights_checked_at = time.monotonic()
        finally:
            del self.checking[backend.url]
            done.set()


async def served_version(server: Any, backend: Backend) -> str | None:
    """The `weight_version` the backend says it serves (None: it did not say)."""
    route = VERSION_ROUTES[server.config.backend]
    try:
        reply = await server.client.get(backend.root, route, timeout_s=30.0, max_retries=0, headers=_auth(server))
    except Exception as exc:  # noqa: BLE001 - a backend that does not answer is down
        raise BackendUnavailable(f"backend {backend.url}: {route}: {exc}") from None
    if not reply.ok:
        return None
    version = reply.json().get("weight_version") if isinstance(reply.json(), dict) else None
    return str(version) if version is not None else None


def _auth(server: Any) -> dict[str, str] | None:
    return {"Authorization": f"Bearer {server.config.api_key}"} if server.config.api_key else None


async def _call(server: Any, backend: Backend, path: str, body: dict[str, Any] | None) -> tuple[bool, str]:
    """One POST to the backend's root; (ok, what it said)."""
    try:
        reply = await server.client.post(backend.root, path, json=body if body is not None else {},
                                         timeout_s=RELOAD_TIMEOUT_S, max_retries=0, headers=_auth(server))
    except Exception as exc:  # noqa: BLE001 - no connection, a timeout: the backend did not take it
        return False, f"{path}: {type(exc).__name__}: {exc}"
    if reply.ok:
        return True, reply.text.strip()[:500]
    return False, f"{path}: HTTP {reply.status}: {reply.error_message()}"


async def reload_backend(server: Any, backend: Backend, path: str, version: str,
                         pause_mode: PauseMode = "wait") -> dict[str, Any]:
    """Make one backend serve the weights in folder `path` as `version`; its result as `{base_url, ok, status,
    message, seconds}`. vLLM: pause, reload, name the version, resume (always); SGLang: one reload."""
    started = time.perf_counter()
    result: dict[str, Any] = {"base_url": backend.url, "ok": False, "status": 502}
    if server.config.backend == "sglang":
        from .adapters import call_backend

        answer = await call_backend(server, backend, "update", {"model_path": path, "weight_version": version},
                                    route="/update_weights_from_disk")
        if answer["ok"]:
            backend.weight_version = version
        return {**answer, "seconds": {"reload": round(time.perf_counter() - started, 3)}}
    gates = server.weights.reloading
    while (previous := gates.get(backend.url)) is not None:  # one reload of a backend at a time
        await previous.wait()
    done = gates[backend.url] = asyncio.Event()
    seconds: dict[str, float] = {}
    try:
        step = time.perf_counter()
        ok, message = await _call(server, backend, f"/pause?mode={pause_mode}", None)
        seconds["pause"] = round(time.perf_counter() - step, 3)
        if ok:
            step = time.perf_counter()
            ok, message = await _call(server, backend, "/collective_rpc", {
                "method": "reload_weights", "kwargs": {"weights_path": path, "is_checkpoint_format": True}})
            seconds["reload"] = round(time.perf_counter() - step, 3)
            if ok:
                # The prefix cache holds K/V the old weights computed: a prompt sharing a prefix with an earlier
                # one would be sampled from them, so it goes before the new weights serve anything.
                step = time.perf_counter()
                ok, message = await _call(server, backend, "/reset_prefix_cache", None)
                seconds["cache"] = round(time.perf_counter() - step, 3)
            if ok:
                step = time.perf_counter()
                ok, message = await _call(server, backend, "/update_weight_version", {"new_version": version})
                seconds["version"] = round(time.perf_counter() - step, 3)
            step = time.perf_counter()
            resumed, resume_message = await _call(server, backend, "/resume", None)
            seconds["resume"] = round(time.perf_counter() - step, 3)
            if ok and not resumed:
                ok, message = False, resume_message
        if ok:
            backend.weight_version = version
        return {**result, "ok": ok, "status": 200 if ok else 502, "message": message,
                "seconds": {**seconds, "total": round(time.perf_counter() - started, 3)}}
    finally:
        del gates[backend.url]
        done.set()


async def update_weights_everywhere(server: Any, model_path: str, weight_version: str | None,
                                    pause_mode: PauseMode = "wait") -> list[dict[str, Any]]:
    """Reload full weights from `model_path` on every backend at once; each backend's result. BadRequest (502,
    or the 4xx a backend answered) naming each backend that did not take them: those keep their old weights
    and version, and the next update (or the backend's next request, for vLLM) tries them again."""
    if server.config.backend == "openai":
        raise BadRequest("backend 'openai' cannot reload weights; serve them with vLLM or SGLang", status=501)
    version = weight_version or model_path
    results = await asyncio.gather(*(reload_backend(server, backend, model_path, version, pause_mode)
                                     for backend in server.pool.backends))
    if any(result["ok"] for result in results):
        server.weights.path, server.weights.version = model_path, version
    failed = [result for result in results if not result["ok"]]
    if failed:
        statuses = [result["status"] for result in failed if 400 <= result["status"] < 500]
        raise BadRequest([{"field": f"backends[{result['base_url']}]", "message": result["message"]}
                          for result in failed], status=max(statuses) if statuses else 502)
    return list(results)


def pool_version(server: Any) -> str | None:
    """The full-weight version every backend serves (None: they started on the configured model, or disagree)."""
    versions = {backend.weight_version for backend in server.pool.backends}
    return versions.pop() if len(versions) == 1 else None


__all__ = ["PauseMode", "WeightsGate", "pool_version", "reload_backend", "served_version",
           "update_weights_everywhere"]
