"""Publishing a LoRA adapter to every backend of the pool, through vLLM's and SGLang's runtime routes.

* vLLM (started with `--enable-lora` and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`):
  `POST {base_url}/load_lora_adapter` `{lora_name, lora_path, load_inplace}` and
  `/unload_lora_adapter` `{lora_name}`; 200 with a plain-text sentence, 400/404 when it fails. A request
  selects the adapter with `model: <lora_name>`.
* SGLang (started with `--enable-lora`): `POST {root}/load_lora_adapter` `{lora_name, lora_path}` and
  `/unload_lora_adapter`, answering `{success, error_message, loaded_adapters}`. A request selects the
  adapter with `model: <base model>:<lora_name>`.

The backend reads `lora_path` itself, so the path must exist on every backend's machine (a shared
filesystem or the same path on each). A load succeeds only when every backend loaded the adapter; when
some did not, the ones that did unload it again and the answer names each backend's result.

Full weights (`finetune: full`) are published by weights.py: vLLM reloads a checkpoint folder through its
dev-mode routes, SGLang through `/update_weights_from_disk`.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from fastapi import HTTPException

from rollgym.adapters import LoadLoraAdapterRequest
from rollgym.client import Reply
from rollgym.server import BadRequest

from .routing import Backend, BackendPool, BackendUnavailable


class BackendServer(Protocol):
    """What publishing needs of the model server (ChatCompletionsModel in app.py): its config (`backend`:
    vllm, sglang or openai), its pool of backends, and one POST to a backend that raises
    BackendUnavailable when the backend did not answer or answered 5xx."""

    config: Any
    pool: BackendPool

    async def _post(self, backend: Backend, path: str, body: dict[str, Any], root: bool = False) -> Reply: ...


def backend_model(backend_kind: str, base_model: str, lora_name: str) -> str:
    """The `model` a backend expects for a request served by adapter `lora_name`."""
    return f"{base_model}:{lora_name}" if backend_kind == "sglang" else lora_name


async def call_backend(server: BackendServer, backend: Backend, action: str,
                       body: dict[str, Any], route: str | None = None) -> dict[str, Any]:
    """POST `/{action}_lora_adapter` (or `route`) to one backend; its result as `{base_url, ok, status, message}`."""
    sglang = server.config.backend == "sglang"
    result: dict[str, Any] = {"base_url": backend.url, "ok": False}
    try:
        reply = await server._post(backend, route or f"/{action}_lora_adapter", body, root=sglang)
    except BackendUnavailable as exc:
        return {**result, "status": 502, "message": str(exc)}
    except HTTPException as exc:  # a timeout
        return {**result, "status": exc.status_code, "message": str(exc.detail)}
    message = reply.text.strip()[:500]
    ok = reply.ok
    if sglang and ok:
        try:
            answer = reply.json()
        except ValueError:
            answer = {}
        if isinstance(answer, dict) and answer.get("success") is False:
            ok, message = False, str(answer.get("error_message") or answer.get("message") or message)
    elif not ok:
        try:  # SGLang answers a refused reload with {success: false, message}
            answer = reply.json()
        except ValueError:
            answer = None
        message = str(answer["message"]) if isinstance(answer, dict) and answer.get("message") else reply.error_message()
    return {**result, "ok": ok, "status": reply.status if reply.ok == ok else 400, "message": message}


async def load_everywhere(server: BackendServer, request: LoadLoraAdapterRequest) -> list[dict[str, Any]]:
    """Load the adapter on every backend; all or none (BadRequest naming each backend that failed)."""
    if server.config.backend == "openai":
        raise BadRequest("backend 'openai' has no runtime LoRA loading; serve the adapter with vLLM or SGLang",
                         status=404)
    body: dict[str, Any] = {"lora_name": request.lora_name, "lora_path": request.lora_path}
    if server.config.backend == "vllm" and request.load_inplace:
        body["load_inplace"] = True
    backends = server.pool.backends
    if server.config.backend == "sglang" and request.load_inplace:
        await unload_everywhere(server, request.lora_name)  # SGLang has no in-place reload
    results = await asyncio.gather(*(call_backend(server, backend, "load", body) for backend in backends))
    if all(result["ok"] for result in results):
        return list(results)
    if not request.load_inplace:
        # Take the adapter off the backends that did load it: the pool serves one set of weights.
        undo = {"lora_name": request.lora_name}
        await asyncio.gather(*(call_backend(server, backend, "unload", undo)
                               for backend, result in zip(backends, results) if result["ok"]))
    failed = [result for result in results if not result["ok"]]
    statuses = [result["status"] for result in failed if 400 <= result["status"] < 500]
    errors = [{"field": f"backends[{result['base_url']}]", "message": result["message"]} for result in failed]
    raise BadRequest(errors, status=max(statuses) if statuses else 502)


async def unload_everywhere(server: BackendServer, lora_name: str) -> list[dict[str, Any]]:
    """Unload the adapter from every backend; each backend's result (a backend that lost it reports 404)."""
    body = {"lora_name": lora_name}
    return list(await asyncio.gather(*(call_backend(server, backend, "unload", body)
                                       for backend in server.pool.backends)))
