"""Full weights over several processes: FSDP2's `fully_shard` over the process group's device mesh (flat on
one node, HSDP over several: `DistInfo.mesh`), and a load in which only rank 0 reads the whole model.

    model = full_model(source, dist)               # rank 0: the weights; the others: the same model on `meta`
    weights = whole_weights(model, dist)           # rank 0's full state dict, taken before sharding
    shard(module, model, dist)                     # each decoder layer, then the rest
    receive_weights(module, weights, dist)         # every process gets its shards (and the buffers) from rank 0

Every rank reading the whole fp32 model from disk costs each node N copies of it in host memory (a 7B
model: 28 GB per process); here the others build it on the meta device (no memory), and after sharding
allocate only their shards, which rank 0 broadcasts (torch.distributed.checkpoint's set_model_state_dict).
"""

from __future__ import annotations

from typing import Any

from .distributed import DistInfo
from .token_logprobs import decoder_layers


def full_model(source: str, dist: DistInfo) -> Any:
    """The causal LM of `source` in fp32: loaded by rank 0 only when several processes will shard it (the
    others build the same architecture, from rank 0's config, on the meta device)."""
    import torch
    import torch.distributed as torch_dist
    from transformers import AutoModelForCausalLM

    from .policy import load_base

    if not dist.distributed:
        return load_base(source)[0]
    # Rank 0 loads before any other process waits in a collective for long: the broadcast below is the
    # only wait, one load long (minutes at most, under the group's timeout).
    model = load_base(source)[0] if dist.rank == 0 else None
    shared = [model.config if model is not None else None]
    torch_dist.broadcast_object_list(shared, src=0, device=dist.device if dist.device.type == "cuda" else None)
    if model is None:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(shared[0], dtype=torch.float32)
    return model


def is_meta(model: Any) -> bool:
    return any(param.is_meta for param in model.parameters())


def whole_weights(module: Any, dist: DistInfo) -> dict[str, Any]:
    """Rank 0's full state dict of `module` (the weights it broadcasts after sharding), empty elsewhere."""
    return dict(module.state_dict()) if dist.rank == 0 else {}


def shard(module: Any, causal: Any, dist: DistInfo, precision: str = "fp32") -> None:
    """FSDP2 over the group's mesh: each decoder layer of `causal` (the model inside `module`) its own unit,
    then the rest (embeddings, final norm, output layer) with `module`. In bf16, FSDP's mixed precision:
    the fp32 master shards are cast to bf16 before each all-gather (half the traffic, and no autocast cast
    of every weight at every micro-batch), the gradients reduce-scattered in fp32; the forward's inputs are
    left as they are (the sampling temperatures stay fp32)."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = dist.mesh()
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)
              if precision == "bf16" else MixedPrecisionPolicy())
    for layer in decoder_layers(causal):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(module, mesh=mesh, mp_policy=policy)


def receive_weights(module: Any, weights: dict[str, Any], dist: DistInfo) -> None:
    """Every process's shards from rank 0's `weights` (its full state dict), and the buffers (rotary
    frequencies are not in a state dict) broadcast whole: a process that built the model on the meta device
    first allocates its shards (to_empty), uninitialised until the broadcast fills them."""
    import torch
    import torch.distributed as torch_dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if is_meta(module) or any(buffer.is_meta for buffer in module.buffers()):
        module.to_empty(device=dist.device)
    set_model_state_dict(module, weights, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    with torch.no_grad():
        for buffer in module.buffers():
            torch_dist.broadcast(buffer, src=0)


__all__ = ["full_model", "is_meta", "receive_weights", "shard", "whole_weights"]
