"""The model-server role: a stateless OpenAI-compatible endpoint (`/v1/responses`, chat, models).

A model server subclasses `ModelServer` and implements `responses` (and usually
`chat_completions`); `build_response` assembles a valid Responses API response around the output
items it generated, with the token fields trainers need on the generated items. Every model server
also serves vLLM's LoRA adapter routes (see `adapters.py`); a server that can load adapters
implements `attach_adapter` and `detach_adapter`.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any, ClassVar

from fastapi import FastAPI, Request, Response

from pydantic import Field, field_validator

from .adapters import (Adapter, AdapterRegistry, LoadLoraAdapterRequest, UnloadLoraAdapterRequest, content_digest,
                       model_card, stamp_version)
from .policies import PolicyRoute, PolicyRouter, UnclaimedCall, check_routes, stamp_policy
from .sampling_contract import RESHAPING, SERVER_KNOBS, record as sampling_record
from .schema import ResponsesCreateParams
from .scoring import ScoreRequest
from .server import BadRequest, BaseServer, JSONBytesResponse, ServerConfig, parse_body, read_json


class ModelServerConfig(ServerConfig):
    """Options every model server that serves named policies has (rollgym.policies)."""

    policies: dict[str, PolicyRoute] = Field(
        default_factory=dict, description="named policies served at once on this base: each answers the calls it "
                                          "claims with the adapter loaded under its name (the base weights while "
                                          "none is); a call no policy claims is refused. Empty: one policy, as before")

    @field_validator("policies")
    @classmethod
    def _routes(cls, value: dict[str, PolicyRoute]) -> dict[str, PolicyRoute]:
        if problems := check_routes(value):
            raise ValueError("; ".join(problems))
        return value
from .streaming import stream_chat_completion, stream_response, wants_usage


# Sampling knobs beyond the Responses API's (the sampling contract's SERVER_KNOBS). A server lists in `applies`
# those its sampler honours; a request that sets another is refused (422 naming it) rather than sampled without
# it under a record that says otherwise.
def sampling_knob_problem(payload: dict[str, Any], applies: frozenset[str], server: str) -> None:
    """BadRequest naming the first sampling knob of `payload` that is malformed or that the server cannot apply."""
    for key in SERVER_KNOBS:
        value, neutral = payload.get(key), RESHAPING[key]
        if value is None:
            continue
        if key == "min_tokens" and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise BadRequest("must be a non-negative integer", field=key)
        if key == "repetition_penalty" and (isinstance(value, bool) or not isinstance(value, (int, float))
                                            or value <= 0):
            raise BadRequest("must be a number above 0", field=key)
        if float(value) != neutral and key not in applies:
            raise BadRequest(f"model server {server!r} does not apply {key}; send it to one that does "
                             "(chat_completions in front of vLLM or SGLang)", field=key)


class ModelServer(BaseServer):
    """Base of every model server."""

    role: ClassVar[str] = "models"
    applies: ClassVar[frozenset[str]] = frozenset()  # which SERVER_KNOBS the server's sampler honours

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.adapters = AdapterRegistry()
        self._adapter_lock = asyncio.Lock()
        self.router = PolicyRouter(getattr(self.config, "policies", None) or {})

    def model_names(self) -> list[str]:
        """The base model ids listed by `GET /v1/models`."""
        return [self.name]

    # ------------------------------------------------------------------ adapters

    def adapter_for(self, payload: dict[str, Any]) -> Adapter | None:
        """The adapter a request's `model` selects (None: the base). Call it before the first await."""
        return self.serving_for(payload)[0]

    def serving_for(self, payload: dict[str, Any]) -> tuple[Adapter | None, str | None]:
        """(the adapter that answers a request, None: the base; the policy it belongs to, None without policies).
        With policies, the policy's adapter (loaded under its name) or the base weights while it has none; a call
        no policy claims is a 404 naming it. Call it before the first await."""
        if not self.router:
            return self.adapters.resolve(payload.get("model"), self.model_names()), None
        try:
            policy = self.router.policy_of(payload)
        except UnclaimedCall as exc:
            raise BadRequest(str(exc), field="model", status=404) from None
        return self.adapters.get(policy), policy

    def version_of(self, adapter: Adapter | None) -> str:
        """`model_version` of the weights that answer: the adapter's `name@DIGEST`, or the base model's name."""
        return adapter.version if adapter is not None else self.model_names()[0]

    async def attach_adapter(self, request: LoadLoraAdapterRequest) -> Any:
        """Make the adapter at `request.lora_path` servable and return its handle; BadRequest (4xx) if it cannot be.

        Must leave what is served unchanged when it fails."""
        raise BadRequest(f"model server {self.name!r} ({type(self).__name__}) cannot load LoRA adapters", status=404)

    async def detach_adapter(self, adapter: Adapter) -> dict[str, Any] | None:
        """Release an adapter no new request can select (unloaded, or replaced under its name by a newer load);
        requests in flight may still use it. Returns extra fields for the unload's answer."""
        return None

    def adapter_details(self, adapter: Adapter) -> dict[str, Any]:
        """Extra fields for the answer of a load (e.g. per-backend results)."""
        return {}

    async def load_adapter(self, request: LoadLoraAdapterRequest) -> Adapter:
        """Attach and register an adapter; the previous one of that name (load_inplace) is detached."""
        registry = self.adapters
        name = request.lora_name
        if name in self.model_names():
            raise BadRequest(f"'{name}' is the base model's name; choose another lora_name", field="lora_name",
                             status=400)
        async with self._adapter_lock:  # one load at a time: the latest load is the policy
            if name in registry and not request.load_inplace:
                raise BadRequest(f"The lora adapter '{name}' has already been loaded; send load_inplace: true "
                                 "to replace its weights", field="lora_name", status=400)
            started = time.perf_counter()
            handle = await self.attach_adapter(request)
            digest = await asyncio.to_thread(content_digest, request.lora_path)
            adapter = Adapter(name=name, path=request.lora_path, load_id=registry.next_id(), digest=digest,
                              handle=handle, load_s=time.perf_counter() - started)
            previous = registry.put(adapter)
        if previous is not None:
            await self.detach_adapter(previous)
        return adapter

    async def unload_adapter(self, request: UnloadLoraAdapterRequest) -> dict[str, Any]:
        """Stop serving an adapter (requests in flight finish on it); the answer of the unload route."""
        adapter = self.adapters.pop(request.lora_name)
        if adapter is None:
            raise BadRequest(f"The lora adapter '{request.lora_name}' cannot be found.", field="lora_name", status=404)
        report = self.adapter_report(adapter, "removed")
        report.update(await self.detach_adapter(adapter) or {})
        return report

    async def responses(self, params: ResponsesCreateParams, payload: dict[str, Any]) -> dict[str, Any]:
        """Answer a Responses API request; `payload` is the validated request as plain JSON."""
        raise NotImplementedError

    async def chat_completions(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Answer a Chat Completions request (plain JSON in, plain JSON out)."""
        raise BadRequest("this model server does not serve /v1/chat/completions", status=404)

    async def score(self, request: ScoreRequest, adapter: Adapter | None) -> dict[str, Any]:
        """Answer `POST /v1/score` (rollgym.scoring): the logprob of every completion token under the weights
        `adapter` selects (None: the base)."""
        raise BadRequest(f"model server {self.name!r} ({type(self).__name__}) cannot score tokens", status=404)

    def add_routes(self, app: FastAPI) -> None:
        @app.post("/v1/score")
        async def score(request: Request) -> JSONBytesResponse:
            body = parse_body(ScoreRequest, await read_json(request))
            if body.model is not None and body.model not in self.model_names() and body.model not in self.adapters:
                # A teacher scored by the wrong weights would go unnoticed: an unknown name is not the policy.
                raise BadRequest(f"model server {self.name!r} serves no model {body.model!r}", field="model",
                                 status=404)
            return JSONBytesResponse(await self.score(body, self.adapter_for({"model": body.model})))

        @app.post("/v1/responses")
        async def responses(request: Request) -> Response:
            payload = await read_json(request)
            params = parse_body(ResponsesCreateParams, payload)
            sampling_knob_problem(payload, self.applies, self.name)
            stream = payload.pop("stream", None)
            if stream not in (None, True, False):
                raise BadRequest("must be a boolean", field="stream")
            if isinstance(payload.get("input"), str):
                payload = {**payload, "input": [{"role": "user", "content": payload["input"]}]}
            answer = await self.responses(params, payload)
            # Generated whole, then sent as the SDK's event sequence (see rollgym.streaming).
            return stream_response(answer) if stream else JSONBytesResponse(answer)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request) -> Response:
            payload = await read_json(request)
            if not isinstance(payload, dict) or not isinstance(payload.get("messages"), list):
                raise BadRequest("required: a list of chat messages", field="messages")
            sampling_knob_problem(payload, self.applies, self.name)
            stream = payload.pop("stream", None)
            if stream not in (None, True, False):
                raise BadRequest("must be a boolean", field="stream")
            include_usage = wants_usage(payload)
            payload.pop("stream_options", None)
            answer = await self.chat_completions(payload)
            return stream_chat_completion(answer, include_usage=include_usage) if stream else JSONBytesResponse(answer)

        @app.get("/v1/models")
        async def models() -> JSONBytesResponse:
            base = self.model_names()
            data = [{"id": name, "object": "model", "created": 0, "owned_by": "rollgym",
                     "model_version": self.version_of(None) if name == base[0] else name} for name in base]
            data += [model_card(adapter, base[0]) for adapter in self.adapters.all()]
            return JSONBytesResponse({"object": "list", "data": data})

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(request: Request) -> JSONBytesResponse:
            adapter = await self.load_adapter(adapter_body(LoadLoraAdapterRequest, await read_json(request)))
            return JSONBytesResponse({**self.adapter_report(adapter, "added"), **self.adapter_details(adapter)})

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(request: Request) -> JSONBytesResponse:
            return JSONBytesResponse(await self.unload_adapter(adapter_body(UnloadLoraAdapterRequest,
                                                                            await read_json(request))))

    def adapter_report(self, adapter: Adapter, verb: str) -> dict[str, Any]:
        """The JSON answer of a load or unload: vLLM's success sentence, and what is served now."""
        return {"success": True, "message": f"Success: LoRA adapter '{adapter.name}' {verb} successfully.",
                "lora_name": adapter.name, "model_version": adapter.version, "load_s": round(adapter.load_s, 4),
                "policy": self.version_of(self.adapters.policy())}


def adapter_body(model: type[Any], payload: Any) -> Any:
    """An adapter route's body; invalid ones are 400, as vLLM answers them."""
    try:
        return parse_body(model, payload)
    except BadRequest as exc:
        exc.status = 400
        raise


def stamp_sampling(output: list[dict[str, Any]], sampling: dict[str, Any]) -> None:
    """Put `sampling` on every item that carries a model call's tokens."""
    for item in output:
        if isinstance(item, dict) and item.get("generation_token_ids") is not None:
            item.setdefault("sampling", sampling)


def build_response(
    payload: dict[str, Any],
    output: list[dict[str, Any]],
    *,
    model: str,
    usage: dict[str, Any] | None = None,
    status: str = "completed",
    incomplete_details: dict[str, Any] | None = None,
    model_version: str | None = None,
    logprobs_mode: str | None = None,
    policy: str | None = None,
) -> dict[str, Any]:
    """A Responses API response (as JSON) for a request `payload` and the generated `output` items.

    `model_version` (the weights that generated them) goes on the response and on every item; with
    `logprobs_mode` ("raw": before temperature and truncation, vLLM's default; "processed": of the
    distribution sampled from), every item with tokens records what they were sampled under."""
    usage = usage or {}
    stamp_version(output, model_version)
    stamp_policy(output, policy)  # the named policy that answered (rollgym.policies), when the server has some
    if logprobs_mode is not None:
        stamp_sampling(output, sampling_record(payload, logprobs_mode))  # the server applied its knobs
    input_tokens = int(usage.get("input_tokens", 0))
    output_tokens = int(usage.get("output_tokens", 0))
    input_details = usage.get("input_tokens_details") or {}
    output_details = usage.get("output_tokens_details") or {}
    return {
        "id": f"resp_{secrets.token_hex(12)}",
        "object": "response",
        "created_at": int(time.time()),  # seconds, an integer as OpenAI and NeMo Gym send it
        "model": model,
        "status": status,
        "output": output,
        "usage": {
            "input_tokens": input_tokens,
            "input_tokens_details": {
                "cached_tokens": int(input_details.get("cached_tokens", 0)),
                "cache_write_tokens": int(input_details.get("cache_write_tokens", 0)),
            },
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": int(output_details.get("reasoning_tokens", 0))},
            "total_tokens": input_tokens + output_tokens,
        },
        "error": None,
        "incomplete_details": incomplete_details,
        "instructions": payload.get("instructions"),
        "metadata": payload.get("metadata"),
        "parallel_tool_calls": payload.get("parallel_tool_calls", True) is not False,
        "temperature": payload.get("temperature"),
        "top_p": payload.get("top_p"),
        "max_output_tokens": payload.get("max_output_tokens"),
        "tool_choice": payload.get("tool_choice") or "auto",
        "tools": payload.get("tools") or [],
        **({"model_version": model_version} if model_version is not None else {}),
        **({"policy": policy} if policy is not None else {}),
    }
