"""transformers: a model server on Hugging Face transformers, for a GPU without vLLM (or a CPU).

The same contract as the embedded model (models/llamacpp): `/v1/responses` and
`/v1/chat/completions`, every generated item carrying `prompt_token_ids`, `generation_token_ids`,
`generation_log_probs` (processed: of the distribution sampled from), the `sampling` record and
`model_version`; a turn that echoes the previous turn's items is built on exactly those tokens;
PEFT LoRA adapters load and unload while serving (vLLM's routes), and a request's `model` picks one.
Generation is continuously batched on one worker thread (batching.py): a request joins the running
batch at the next step, within a KV budget; past `max_queue` waiting requests the answer is 429 with
Retry-After. `POST /update_weights_from_disk` (SGLang's route) reloads the full weights from a
checkpoint folder and bumps `model_version`. See README.md.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, HTTPException, Request
from pydantic import Field

from rollgym import BadRequest
from rollgym.model import ModelServerConfig
from rollgym.adapters import Adapter, LoadLoraAdapterRequest, UpdateWeightsFromDiskRequest, content_digest
from rollgym.errors import ContextLengthError, ServerStartError
from rollgym.local_model import LocalModelServer, Turn
from rollgym.sampling_contract import DEFAULT_TEMPERATURE, DEFAULT_TOP_P
from rollgym.scoring import ScoreRequest
from rollgym.server import JSONBytesResponse, parse_body, read_json
from rollgym.tool_calls import parse_hermes_tool_calls

from .chat_format import resolve_tool_choice
from .batching import QueueFull, Scheduler
from .engine import Engine, Generation, GenerationRequest, pick_device, pick_dtype
from .weights import WeightLoadError, load_weights


class TransformersConfig(ModelServerConfig):
    model_path: str = Field(default="bundled", description="'bundled' (SmolLM2-135M), a *.gguf file, a Hugging Face "
                                                           "model folder or id")
    model_name: str | None = Field(default=None, description="the name /v1/models lists; default: a folder's name, a "
                                                            "Hugging Face id, or a GGUF's stem with the served precision "
                                                            "for its quantization (SmolLM2-135M-Instruct.fp32)")
    device: str = Field(default="auto", description="auto: cuda when available, else cpu; or cpu, cuda, cuda:1, mps")
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = Field(default="auto", description="auto: bf16 on cuda, else fp32")
    n_ctx: int = Field(default=4096, ge=64, description="prompt + generation tokens of one request")
    max_batch: int = Field(default=32, ge=1, description="requests decoded together (the slots of the KV cache)")
    kv_tokens: int | None = Field(default=None, ge=64, description="the KV cache's budget in tokens, split evenly "
                                  "among the max_batch slots (a request's prompt + generation fit in one); "
                                  "default: max_batch × n_ctx")
    max_queue: int = Field(default=256, ge=0, description="requests waiting for a slot; one more is answered 429 "
                                                          "with Retry-After")
    prefill_tokens: int = Field(default=512, ge=1, description="prompt tokens of the requests that join the batch in "
                                "one step, packed into one forward pass (a longer prompt joins alone); the packed "
                                "attention grows with its square, so more is not faster on a CPU")
    threads: int | None = Field(default=None, ge=1, description="torch's CPU threads (default: torch's, one per "
                                "core); on a CPU shared with other processes, more threads than free cores make "
                                "every operation wait for the slowest")
    seed: int = 0
    default_max_output_tokens: int = Field(default=256, ge=1)
    logprobs_mode: Literal["processed", "raw"] = Field(
        default="processed", description="processed: of the distribution sampled from (temperature, top-k, top-p); "
                                         "raw: log-softmax of the logits, vLLM's default")


class TransformersModel(LocalModelServer):
    config_class = TransformersConfig
    config: TransformersConfig

    async def startup(self) -> None:
        config = self.config
        self.engine = await asyncio.to_thread(load_engine, config)
        self.model_name = config.model_name or served_name(config.model_path, self.engine.model.dtype)
        self.base_version = self.model_name
        self._keys = 0
        # The budget in whole slots: each one holds a request's prompt and generation.
        budget = self.kv_budget() or config.max_batch * config.n_ctx
        slot_tokens = min(self.engine.n_ctx, budget // config.max_batch)
        if slot_tokens < 2:
            raise ServerStartError(f"kv_tokens {config.kv_tokens} leaves no room for {config.max_batch} requests")
        self.engine.n_ctx = slot_tokens
        self.queue = Scheduler(self.engine, self._select, max_batch=config.max_batch, slot_tokens=slot_tokens,
                               max_queue=config.max_queue, prefill_tokens=config.prefill_tokens,
                               version=lambda: self.base_version)

    def kv_budget(self) -> int | None:
        """The KV cache's tokens (None: max_batch × n_ctx), once the model is loaded; a co-located server
        sizes it from what its trainer leaves (colocate.py)."""
        return self.config.kv_tokens

    def version_of(self, adapter: Adapter | None) -> str:
        return adapter.version if adapter is not None else getattr(self, "base_version", self.model_names()[0])

    def health_details(self) -> dict[str, Any]:
        queue = getattr(self, "queue", None)
        return {} if queue is None else {"running": len(queue.rows), "waiting": queue.queued,
                                         "shared_prompts": queue.shared_prompts, "model_version": self.version_of(None)}

    # ------------------------------------------------------------------ adapters

    def _select(self, key: str | None) -> None:
        """On the worker thread: the weights of the next wave (an adapter's key, or None for the base)."""
        if not self.engine.adapter_keys:
            return
        from peft.tuners.tuners_utils import BaseTunerLayer

        # Layer by layer, as transformers' enable/disable_adapters do (they want a newer peft than load_adapter).
        for module in self.engine.model.modules():
            if isinstance(module, BaseTunerLayer):
                if key is None:
                    module.enable_adapters(False)
                else:
                    module.enable_adapters(True)
                    module.set_adapter(key)

    async def attach_adapter(self, request: LoadLoraAdapterRequest) -> Any:
        """Load a PEFT adapter folder beside the base weights, under a key of its own (so a replaced adapter
        keeps serving the requests that arrived under it)."""
        folder = Path(request.lora_path).expanduser()
        if not folder.is_dir():
            raise BadRequest(f"{folder} does not exist or is not a folder (a PEFT adapter folder)",
                             field="lora_path", status=404)
        if not (folder / "adapter_config.json").is_file():
            raise BadRequest(f"{folder} has no adapter_config.json: not a PEFT adapter folder", field="lora_path",
                             status=404)
        self._keys += 1
        key = f"rollgym_{self._keys}"
        try:
            await self.queue.run(lambda: load_peft(self.engine, str(folder), key))
        except AdapterLoadError as exc:
            raise BadRequest(str(exc), field="lora_path", status=400) from None
        return key

    async def detach_adapter(self, adapter: Adapter) -> None:
        # Queued behind every request that may still use it (FIFO).
        await self.queue.run(lambda: drop_peft(self.engine, adapter.handle))
        return None

    # ------------------------------------------------------------------ generation

    async def generate(self, chat: dict[str, Any], previous: Any, adapter: Adapter | None, *,
                       responses: bool) -> Turn:
        # Templates and tokenizing off the event loop; ContextLengthError goes to the caller.
        request, tools = await asyncio.to_thread(self._request, chat, previous, adapter)
        try:
            result = await self.queue.submit(request)
        except QueueFull as exc:  # the client's retry policy (rollgym's retries 429) decides when to come back
            raise HTTPException(429, str(exc), headers={"Retry-After": str(math.ceil(exc.retry_after_s))}) from None
        text, calls = self._parse(result, tools)
        finish = "tool_calls" if calls and not responses else result.finish_reason
        return Turn(text=text, tool_calls=calls, finish_reason=finish, prompt_token_ids=request.prompt_ids,
                    generation_token_ids=result.token_ids, generation_log_probs=result.logprobs,
                    generation_forced=result.forced,
                    # The base weights may have been replaced while it waited (a reload, a co-located step).
                    model_version=result.version if adapter is None else None)

    def _request(self, chat: dict[str, Any], previous: Any,
                 adapter: Adapter | None) -> tuple[GenerationRequest, list[Any]]:
        """A generation request from a chat request (validated: a bad value is a 400 naming its field)."""
        max_tokens = chat.get("max_tokens") or chat.get("max_completion_tokens") or self.config.default_max_output_tokens
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise BadRequest("must be a positive integer", field="max_tokens")
        sampling = {}
        for name, default, low, high in (("temperature", DEFAULT_TEMPERATURE, 0.0, 100.0), ("top_p", DEFAULT_TOP_P, 1e-9, 1.0)):
            value = chat.get(name)
            if value is None:
                value = default
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
                raise BadRequest(f"must be a number in [{low:g}, {high:g}]", field=name)
            sampling[name] = float(value)
        top_k = chat.get("top_k") or 0
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
            raise BadRequest("must be a non-negative integer", field="top_k")
        seed = chat.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise BadRequest("must be an integer", field="seed")
        stop = chat.get("stop")
        stops = [stop] if isinstance(stop, str) else stop or []
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise BadRequest("must be a string or a list of strings", field="stop")
        try:
            tools, opening = resolve_tool_choice(chat.get("tools"), chat.get("tool_choice"))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise BadRequest(str(exc), field="tool_choice") from None
        prompt, _ = self.engine.prompt_ids(chat["messages"], tools, previous)
        if len(prompt) > self.engine.n_ctx - 1:
            raise ContextLengthError(len(prompt), self.engine.n_ctx)
        forced = self.engine.tokenize(opening) if opening else []
        closing = self.engine.closing_ids if opening else []
        return GenerationRequest(prompt_ids=prompt, max_tokens=max_tokens, temperature=sampling["temperature"],
                                 top_p=sampling["top_p"], top_k=top_k, seed=seed, forced_ids=forced,
                                 closing_ids=closing, stop=stops,
                                 adapter=adapter.handle if adapter else None), tools

    def _parse(self, result: Generation, tools: list[Any]) -> tuple[str, list[dict[str, Any]]]:
        text = self.engine.detokenize([t for t in result.token_ids if t not in self.engine.eog_ids])
        if result.stop_cut is not None:
            text = text[: result.stop_cut]
        calls: list[dict[str, Any]] = []
        if tools:
            text, calls = parse_hermes_tool_calls(text)
        return text.strip(), calls

    def score_logprobs(self, request: ScoreRequest, adapter: Adapter | None) -> list[float]:
        """Teacher-forced logprobs of the completion tokens, under the adapter's weights."""
        if len(request.all_ids) > self.engine.n_ctx:
            raise ContextLengthError(len(request.all_ids), self.engine.n_ctx)
        self._select(adapter.handle if adapter else None)
        return score_tokens(self.engine, request.prompt_token_ids, request.completion_token_ids, request.temperature)

    async def reload_weights(self, folder: str, version: str | None) -> dict[str, Any]:
        """Replace the base weights with a checkpoint's, after the running batch drains; a new `model_version`."""
        started = time.perf_counter()

        def reload() -> int:  # on the worker: the requests that join next are stamped with the new version
            count = load_weights(self.engine.model, folder)
            self.base_version = version or f"{self.model_name}@{content_digest(folder)}"
            return count

        try:
            count = await self.queue.run(reload)
        except WeightLoadError as exc:
            raise BadRequest(str(exc), field="model_path", status=400) from None
        return {"success": True, "message": f"Succeeded to update model weights from {folder}.",
                "model_version": self.base_version, "tensors": count, "load_s": round(time.perf_counter() - started, 4)}

    def add_routes(self, app: FastAPI) -> None:
        super().add_routes(app)

        @app.post("/update_weights_from_disk")
        async def update_weights_from_disk(request: Request) -> JSONBytesResponse:
            """SGLang's route: {"model_path": a checkpoint folder, "weight_version"?} -> the new model_version."""
            body = parse_body(UpdateWeightsFromDiskRequest, await read_json(request))
            return JSONBytesResponse(await self.reload_weights(body.model_path, body.weight_version))

    def tokenize_text(self, text: str) -> list[int]:
        return self.engine.tokenize(text)

    def render_ids(self, messages: Any, tools: Any, add_generation_prompt: bool) -> list[int]:
        return self.engine.render(messages, tools, add_generation_prompt=add_generation_prompt)

    def detokenize(self, ids: Any) -> str:
        return self.engine.detokenize(ids)


class AdapterLoadError(ValueError):
    """A PEFT adapter the served model cannot take; nothing was changed."""


# A GGUF file's quantization tag at the end of its stem: SmolLM2-135M-Instruct.Q4_1, model-q8_0, x.F16, y-IQ4_XS.
GGUF_TYPE = re.compile(r"[.\-_](?:I?Q\d[\w]*|[BF]F?16|F32)$", re.IGNORECASE)
DTYPE_NAMES = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}


def served_name(model_path: str, dtype: Any = None) -> str:
    """The base model's name, after the weights this server holds: a folder's name or a Hugging Face id as it
    is; a GGUF (the bundled one's too) is dequantized, so its stem loses the file's quantization tag and names
    the served precision instead (`SmolLM2-135M-Instruct.Q4_1` served in fp32: `SmolLM2-135M-Instruct.fp32`)."""
    if model_path == "bundled":
        from rollgym.train.trainers.policy import bundled_gguf

        model_path = str(bundled_gguf())
    path = Path(model_path)
    if not model_path.endswith(".gguf"):
        return path.name if path.is_dir() else model_path
    precision = DTYPE_NAMES.get(str(dtype), "dequantized")
    return f"{GGUF_TYPE.sub('', path.stem)}.{precision}"


def load_engine(config: TransformersConfig) -> Engine:
    """Load the model and tokenizer (a GGUF is dequantized once and cached, as the trainer does) onto the device."""
    from rollgym.train.trainers.policy import load_base

    device = pick_device(config.device)
    if config.threads is not None:
        import torch

        torch.set_num_threads(config.threads)
    model, tokenizer = load_base(config.model_path)
    if tokenizer is None:
        raise ValueError(f"model_path {config.model_path!r} has no tokenizer: the server renders chat prompts")
    model = model.to(device=device, dtype=pick_dtype(config.dtype, device))
    n_ctx = min(config.n_ctx, int(getattr(model.config, "max_position_embeddings", config.n_ctx) or config.n_ctx))
    return Engine(model, tokenizer, n_ctx=n_ctx, seed=config.seed)


def load_peft(engine: Engine, folder: str, key: str) -> None:
    """On the worker thread: add the adapter under `key`; on failure, take back whatever was added."""
    model = engine.model
    try:
        model.load_adapter(folder, adapter_name=key, hotswap=False)
    except Exception as exc:  # PEFT and safetensors raise many kinds; each means this adapter does not fit
        if key in (getattr(model, "peft_config", None) or {}):
            drop_peft(engine, key)
        raise AdapterLoadError(f"cannot load the adapter at {folder}: {type(exc).__name__}: {exc}"[:2000]) from None
    engine.adapter_keys.add(key)
    model.to(engine.device)


def drop_peft(engine: Engine, key: str) -> None:
    """On the worker thread: remove the adapter `key` (the last one leaves the base weights alone). Through
    peft's own function: transformers' `delete_adapter` wants a newer peft than its `load_adapter` does."""
    from peft.functional import delete_adapter

    model = engine.model
    config = model.peft_config[key]
    delete_adapter(model, adapter_name=key, prefix=f"{config.peft_type.value.lower()}_")
    model.peft_config.pop(key, None)
    if not model.peft_config:
        del model.peft_config
        model._hf_peft_config_loaded = False
    engine.adapter_keys.discard(key)


def score_tokens(engine: Engine, prompt_ids: list[int], completion_ids: list[int], temperature: float) -> list[float]:
    """log softmax(logits / T) of each completion token given everything before it: one forward pass."""
    import torch

    ids = torch.tensor([prompt_ids + completion_ids], device=engine.device)
    with torch.no_grad():
        logits = engine.model(input_ids=ids, use_cache=False).logits[0, len(prompt_ids) - 1:-1].float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return logprobs.gather(-1, torch.tensor(completion_ids, device=engine.device)[:, None])[:, 0].tolist()
