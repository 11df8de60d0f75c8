"""The transformers model server and rollgym's GRPO trainer in one process, on one device (co-locate mode,
verl's and prime-rl's hybrid engine): the served model's parameters ARE the trainer's, so a step is
published in memory, as a new `model_version`, with no weight file written (the step's checkpoint, for
resuming, apart).

    POST /colocate/train_step {"dataset": curated.jsonl, "config": a TrainConfig}  -> the step's Artefact
    POST /colocate/load_adapter {"adapter_path": a LoRA step's adapter, "version"}  -> served as NAME@VERSION

The step runs on the server's worker thread, alone, once the running batch has drained (`Scheduler.run`):
generation pauses while the trainer steps, and the first request after it samples from the new weights.
`finetune: full` trains the served weights themselves; `finetune: lora` wraps the served model with the
trainer's adapter (PEFT injects its layers in place), so the server samples through it.

The memory split: the trainer's estimate (weights' gradients and AdamW's two moments, plus activations)
is set aside from the device's memory, and the KV cache gets what is left less `kv_margin` (capped by
max_batch × n_ctx); `kv_tokens` overrides it. `rollgym train` with `colocate: true` starts this server as
the stack's policy_model (rollgym.train.loop.colocate).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from rollgym import BadRequest
from rollgym.errors import ServerStartError
from rollgym.server import JSONBytesResponse, parse_body, read_json

from .app import TransformersConfig, TransformersModel
from .weights import load_weights

# Bytes per trained parameter beside the weight itself: its fp32 gradient and AdamW's two fp32 moments.
TRAINER_BYTES_PER_PARAM = 12
# What one token's activations cost the trainer, per hidden unit and layer (fp32, saved for backward:
# the attention and MLP inputs and outputs, a generous round figure).
ACTIVATION_BYTES_PER_UNIT = 64


class ColocateConfig(TransformersConfig):
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = Field(
        default="fp32", description="the trainer's master weights are fp32 (bf16 is its autocast); the server "
                                    "serves those very tensors")
    finetune: Literal["lora", "full"] = Field(default="full", description="what the trainer will train: sizes "
                                                                          "its memory estimate")
    train_tokens: int = Field(default=4096, ge=1, description="tokens of one forward/backward pass of the trainer "
                                                            "(its micro_batch_tokens): sizes the activations")
    kv_margin: float = Field(default=0.1, ge=0.0, lt=1.0, description="the share of the device's memory left "
                                                                      "unused by the KV cache")


class TrainStepRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dataset: str = Field(description="the step's curated records (JSONL)")
    config: dict[str, Any] = Field(description="the step's TrainConfig")


class LoadAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    adapter_path: str = Field(description="a LoRA step's adapter folder (its checkpoint's adapter/)")
    version: str = Field(description="the step's version: the server then lists NAME@VERSION")


def device_bytes(device: Any) -> int:
    """Memory the device has free now: CUDA's own count, else the host's available RAM."""
    import torch

    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:  # Linux's estimate of what can be allocated without swapping
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def trainer_estimate(model: Any, finetune: str, train_tokens: int) -> int:
    """Bytes the trainer adds to the served weights: gradients and AdamW's moments of what it trains
    (full: every weight; lora: about 1 % of them), and one pass's activations."""
    params = sum(p.numel() for p in model.parameters())
    trained = params if finetune == "full" else params // 100
    config = model.config
    activations = train_tokens * int(config.hidden_size) * int(config.num_hidden_layers) * ACTIVATION_BYTES_PER_UNIT
    logits = train_tokens * int(config.vocab_size) * 4 * 2  # the logits and their gradient, fp32
    return trained * TRAINER_BYTES_PER_PARAM + activations + logits


def kv_bytes_per_token(model: Any) -> int:
    config = model.config
    heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    return 2 * heads * head_dim * int(config.num_hidden_layers) * next(model.parameters()).element_size()


class ColocatedModel(TransformersModel):
    config_class = ColocateConfig
    config: ColocateConfig

    async def startup(self) -> None:
        self.trainer: Any = None
        self.served_adapter: Any = None  # a LoRA step's adapter loaded from its checkpoint, with no trainer yet
        self.trained = 0  # steps published
        self.split: dict[str, Any] = {}
        await super().startup()

    def kv_budget(self) -> int | None:
        """The KV cache's tokens: what the trainer's estimate leaves of the device's free memory, less the
        margin (capped by max_batch × n_ctx), unless kv_tokens is given. The figures go to /health."""
        config, engine = self.config, self.engine
        estimate = trainer_estimate(engine.model, config.finetune, config.train_tokens)
        free = device_bytes(engine.device)
        per_token = kv_bytes_per_token(engine.model)
        left = int(free * (1 - config.kv_margin)) - estimate
        tokens = config.kv_tokens if config.kv_tokens is not None else min(config.max_batch * engine.n_ctx,
                                                                            left // per_token)
        if tokens < config.max_batch * 2:
            raise ServerStartError(f"the trainer's estimate ({estimate / 2**30:.2f} GiB) leaves no KV cache on "
                                   f"{engine.device} ({free / 2**30:.2f} GiB free, margin {config.kv_margin:.0%}): "
                                   "lower max_batch or train_tokens, or set kv_tokens")
        self.split = {"trainer_bytes": estimate, "free_bytes": free, "kv_tokens": tokens,
                      "kv_bytes": tokens * per_token}
        return tokens

    def health_details(self) -> dict[str, Any]:
        return {**super().health_details(), "colocate": {**getattr(self, "split", {}),
                                                         "steps": getattr(self, "trained", 0)}}

    # ------------------------------------------------------------------ the step

    def _train(self, dataset: Path, config: Any) -> dict[str, Any]:
        """On the worker thread, alone: one trainer step on the served weights; the step's Artefact."""
        from rollgym.train.trainers.base import Artefact
        from rollgym.train.trainers.grpo_process import grpo_args
        from rollgym.train.trainers.progress import ProgressWriter
        from rollgym.train.trainers.trl_trainers import read_records

        args = grpo_args(config)
        started = time.perf_counter()
        if self.trainer is None or self.trainer.args != args or not _same(self.trainer.checkpoint, config.init_adapter):
            self.trainer = self._trainer(args, config)
        model = self.engine.model  # a new LoRA trainer may have unwrapped the last one's
        loaded = time.perf_counter() - started
        trainer = self.trainer
        model.train()
        try:
            metrics = trainer.train_records(read_records(dataset), ProgressWriter(config.output_dir))
        finally:
            model.eval()
            model.config.use_cache = True
        train_s = time.perf_counter() - started - loaded
        output_dir = Path(config.output_dir)
        trainer.save_checkpoint(output_dir / "checkpoint")  # the resume point; serving needs no file
        self.trained += 1
        self.base_version = f"{self.model_name}@{config.version}"
        metrics.update(load_s=round(loaded, 3), train_s=round(train_s, 3),
                       checkpoint_s=round(time.perf_counter() - started - loaded - train_s, 3))
        artefact = Artefact(kind="full_weights" if args.finetune == "full" else "lora",
                            uri=str(Path(trainer.checkpoint).resolve()), base_model=config.base_model,
                            version=config.version, metrics={k: float(v) for k, v in metrics.items()})
        trainer.checkpoint = artefact.uri
        return {"artefact": artefact.model_dump(), "model_version": self.base_version}

    def _trainer(self, args: Any, config: Any) -> Any:
        """A PolicyTrainer over the served model, from the step's starting point (a checkpoint: its weights
        copied in place and its optimizer state restored)."""
        from rollgym.train.trainers.grpo_trainer import PolicyTrainer, checkpoint_of

        if args.processes > 1:
            raise BadRequest("colocate runs one trainer process (processes: 1)", field="processes")
        trainer = PolicyTrainer(args, config.base_model, config.seed)
        checkpoint = checkpoint_of(config.init_adapter)
        model = self.engine.model
        if args.finetune == "full":
            if checkpoint:
                load_weights(model, str(Path(checkpoint) / "model"))
            trainer.use_model(model)
        else:
            model = self._lora(model, args, str(Path(checkpoint) / "adapter") if checkpoint else config.init_adapter)
            trainer.use_model(model)
        if checkpoint:
            trainer._restore_state(Path(checkpoint))  # noqa: SLF001 - the trainer's own restore, on this model
        trainer.checkpoint = config.init_adapter
        return trainer

    def _unwrap(self) -> Any:
        """Take the served model's LoRA layers out (the last trainer's, or a checkpoint's); the bare model."""
        from peft import PeftModel

        for wrapped in (getattr(self.trainer, "model", None), self.served_adapter):
            if isinstance(wrapped, PeftModel):
                self.engine.model = wrapped.unload()
                break
        self.served_adapter = None
        return self.engine.model

    def _serve_adapter(self, adapter: str, version: str) -> str:
        """On the worker thread: serve a LoRA step from its checkpoint's adapter (a resumed run, the guard's best
        model); the trainer of the next step wraps the model with it again, with its optimizer state."""
        from peft import PeftModel

        wrapped = self.served_adapter is not None or isinstance(getattr(self.trainer, "model", None), PeftModel)
        model = self._unwrap()
        self.trainer = None
        try:
            self.served_adapter = PeftModel.from_pretrained(model, adapter, is_trainable=False)
        except Exception as exc:  # PEFT and safetensors raise many kinds; each means this adapter does not fit
            if wrapped:  # the adapter it served is gone: the base weights answer, under their own name
                self.base_version = self.model_name
            raise BadRequest(f"cannot load the adapter at {adapter}: {type(exc).__name__}: {exc}"[:2000],
                             field="adapter_path") from None
        model.eval()
        self.base_version = f"{self.model_name}@{version}"
        return self.base_version

    def _lora(self, model: Any, args: Any, adapter: str | None) -> Any:
        """The trainer's PEFT model around the served one (its LoRA layers injected in place)."""
        from peft import PeftModel, get_peft_model

        from rollgym.train.trainers.policy import LORA_TARGETS

        model = self._unwrap()  # the last adapter goes first
        if adapter:
            return PeftModel.from_pretrained(model, adapter, is_trainable=True)
        from peft import LoraConfig

        options = dict(args.lora or {})
        layers = options.get("layers")
        count = model.config.num_hidden_layers
        chosen = None
        if layers:
            chosen = (list(range(max(0, count - int(layers[4:])), count)) if isinstance(layers, str)
                      and layers.startswith("top:") else [int(i) for i in layers])
        return get_peft_model(model, LoraConfig(
            r=int(options.get("r", 16)), lora_alpha=int(options.get("alpha", 32)),
            lora_dropout=float(options.get("dropout", 0.0)), task_type="CAUSAL_LM",
            target_modules=list(options.get("target_modules", LORA_TARGETS)), layers_to_transform=chosen))

    async def train_step(self, body: TrainStepRequest) -> dict[str, Any]:
        from pydantic import ValidationError

        from rollgym.train.trainers.base import TrainConfig

        try:
            config = TrainConfig.model_validate(body.config)
        except ValidationError as exc:
            raise BadRequest(str(exc.errors()[0]["msg"]), field="config") from None
        dataset = Path(body.dataset)
        if not dataset.is_file():
            raise BadRequest(f"{dataset} is not a file", field="dataset", status=404)
        return await self.queue.run(lambda: self._train(dataset, config))

    def add_routes(self, app: FastAPI) -> None:
        super().add_routes(app)

        @app.post("/colocate/load_adapter")
        async def colocate_load_adapter(request: Request) -> JSONBytesResponse:
            """A LoRA step's adapter (its checkpoint's adapter/) served as the step `version`: a resumed run."""
            body = parse_body(LoadAdapterRequest, await read_json(request))
            folder = Path(body.adapter_path)
            if not (folder / "adapter_config.json").is_file():
                raise BadRequest(f"{folder} has no adapter_config.json: not a PEFT adapter folder",
                                 field="adapter_path", status=404)
            version = await self.queue.run(lambda: self._serve_adapter(str(folder), body.version))
            return JSONBytesResponse({"model_version": version})

        @app.post("/colocate/train_step")
        async def colocate_train_step(request: Request) -> JSONBytesResponse:
            """One trainer step on the served weights, published as a new model_version when it returns."""
            body = parse_body(TrainStepRequest, await read_json(request))
            try:
                return JSONBytesResponse(await self.train_step(body))
            except BadRequest:
                raise
            except Exception as exc:  # noqa: BLE001 - the step fails with its cause; the server serves on
                self.trainer = None  # half-updated state: the next step restores its starting point
                return JSONBytesResponse({"error": {"type": "training_failed",
                                                    "message": f"{type(exc).__name__}: {exc}"}}, 500)


def _same(a: str | None, b: str | None) -> bool:
    if not a and not b:
        return True
    return bool(a and b) and Path(a).resolve() == Path(b).resolve()  # type: ignore[arg-type]


__all__ = ["ColocateConfig", "ColocatedModel", "device_bytes", "kv_bytes_per_token", "trainer_estimate"]

