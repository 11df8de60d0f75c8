"""The settings of rollgym's GRPO trainer (`optimize.args` of a plan whose trainer is `grpo`).

Validated when the plan is loaded, so a misspelt argument fails before the first collection, not in the
trainer after it. The objective's own settings are `loss` (`grpo_loss.LossConfig`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from .grpo_loss import LossConfig


class GRPOConfig(BaseModel):
    """The `grpo` adapter's arguments (the plan's `optimize.args`)."""

    model_config = ConfigDict(extra="forbid")

    learning_rate: float = Field(default=1e-5, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float | None = Field(default=1.0, gt=0, description="clip the gradient's norm (None: no clip)")
    warmup_steps: int = Field(default=0, ge=0)
    lr_decay: Literal["constant", "linear", "cosine"] = "constant"
    total_steps: int | None = Field(default=None, ge=1, description="the schedule's length; the loop fills it in")
    groups_per_step: int | None = Field(default=None, ge=1, description="groups per optimizer step (None: all)")
    mini_batches: int = Field(default=1, ge=1, description="optimizer steps per batch (PPO-style; the clip acts)")
    micro_batch_tokens: int | None = Field(default=None, ge=1, description="token budget of one forward/backward "
                                           "pass (None: 4096 on a CPU; on CUDA the largest of 16k, 8k, 4k whose "
                                           "estimated peak fits the free memory less a margin: step_settings)")
    seq_len: int | None = Field(default=None, ge=1, description="pack rollouts into rows of this many tokens "
                                "(attention does not cross them; None: one rollout per row, padded)")
    loss: LossConfig = Field(default_factory=LossConfig)
    temperature: float | None = Field(default=None, gt=0, description="must equal the collection's, when given")
    max_logprob_gap: float | None = Field(default=None, gt=0, description="refuse a batch whose mean |log ρ| is above")
    finetune: Literal["lora", "full"] = "lora"
    lora: dict[str, Any] = Field(default_factory=dict, description="r, alpha, dropout, target_modules, layers")
    precision: Literal["fp32", "bf16"] | None = Field(
        default=None, description="bf16: autocast, logprobs stay fp32; fp32: plain fp32; unset: bf16 with TF32 "
                                  "matmuls on CUDA, fp32 on a CPU")
    gradient_checkpointing: bool = False
    compile: bool | None = Field(default=None, description="torch.compile each decoder layer (its norms, SwiGLU and "
                                 "rotary embeddings fused); the first steps of each shape compile (None: on CUDA, "
                                 "not on a CPU)")
    threads: int | None = Field(default=None, ge=1)
    processes: int = Field(default=1, ge=1, description="data-parallel processes per node (torchrun's "
                           "--nproc-per-node)")
    devices: list[int] | None = Field(default=None, min_length=1, description="the CUDA devices (indices among "
                                      "those visible to the loop) the trainer's processes on this node use, one "
                                      "each: e.g. [1, 2, 3] beside a model server on cuda:0. Default: the first "
                                      "`processes` devices")
    # Several nodes: torchrun's rendezvous instead of --standalone; full weights are then sharded within each
    # node and replicated across nodes (HSDP). The loop's node starts its part; each other node runs the same
    # torchrun command with its own --node-rank (docs/train-gpus.md).
    nnodes: int = Field(default=1, ge=1, description="nodes the trainer runs on (torchrun's --nnodes)")
    node_rank: int = Field(default=0, ge=0, description="the rank of the node the loop runs on (torchrun's "
                           "--node-rank)", validate_default=True)
    rdzv_endpoint: str | None = Field(default=None, validate_default=True,
                                      description="HOST:PORT every node's torchrun meets at (c10d rendezvous)")
    rdzv_id: str = Field(default="rollgym", min_length=1, pattern=r"^[A-Za-z0-9_.-]+$",
                         description="the run's rendezvous id: the same on every node")
    rdzv_backend: Literal["c10d"] = "c10d"
    epochs: float = Field(default=1.0, gt=0, description="passes over the curated groups")
    checkpoint_every: int = Field(default=1, ge=1, description="write the resumable checkpoint (weights, AdamW, "
                                  "schedule, RNG) every N steps and when the trainer stops; the steps between "
                                  "keep only what serving reads (a LoRA's adapter). Sharded, AdamW's shards are "
                                  "written in the background")

    @field_validator("node_rank")
    @classmethod
    def _node_rank(cls, value: int, info: ValidationInfo) -> int:
        nodes = info.data.get("nnodes", 1)
        if value >= nodes:
            raise ValueError(f"{value} is not a node of nnodes {nodes} (0 to {nodes - 1})")
        return value

    @field_validator("devices")
    @classmethod
    def _devices(cls, value: list[int] | None, info: ValidationInfo) -> list[int] | None:
        if value is not None:
            if len(set(value)) != len(value) or min(value) < 0:
                raise ValueError(f"{value}: distinct device indices from 0")
            processes = info.data.get("processes", 1)
            if len(value) != processes:
                raise ValueError(f"{len(value)} devices for processes: {processes} (one device per process)")
        return value

    @field_validator("rdzv_endpoint")
    @classmethod
    def _endpoint(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None:
            if info.data.get("nnodes", 1) > 1:
                raise ValueError("required when nnodes > 1: HOST:PORT of the rendezvous (node 0's address)")
            return None
        host, _, port = value.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{value!r} is not HOST:PORT (e.g. node0.cluster:29500)")
        return value

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1

    def precision_on(self, device_type: str) -> Literal["fp32", "bf16"]:
        """The precision the trainer runs at on a device of this type: the one given, else bf16 on CUDA
        (fp32 matmuls there are several times slower) and fp32 on a CPU (no bf16 speed-up to gain)."""
        return self.precision or ("bf16" if device_type == "cuda" else "fp32")


__all__ = ["GRPOConfig"]
