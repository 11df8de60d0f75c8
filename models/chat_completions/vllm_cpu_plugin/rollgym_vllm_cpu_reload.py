"""A vLLM plugin for its CPU build: after an in-place full-weight reload (`/collective_rpc reload_weights`), the
lm_head tied to the token embedding serves the new embedding.

vLLM's CPU build packs every linear layer's weight for its GEMM kernel (oneDNN) when the layer's weights are
processed. A tied lm_head shares its weight with the embedding, and a checkpoint of a tied model has no
`lm_head.weight`: the in-place reload copies the new embedding into the shared tensor, but the lm_head is never
processed again, so its packed copy keeps the old embedding and every logit comes from the old head (measured on
SmolLM2-135M: sampled logprobs 2.9 nats from the trainer's after one reload). This re-processes each lm_head
after a reload. The CUDA build computes the head from the shared tensor itself and needs none of it.
"""

from __future__ import annotations

from typing import Any


def register() -> None:
    """vLLM's `vllm.general_plugins` entry point: loaded in the API server and in every worker."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.model_executor.model_loader.reload import inplace

    finalize = inplace.finalize_layerwise_reload
    if getattr(finalize, "repacks_lm_head", False):
        return

    def finalize_and_repack_lm_head(model: Any, *args: Any, **kwargs: Any) -> None:
        finalize(model, *args, **kwargs)
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

        for module in model.modules():
            if isinstance(module, ParallelLMHead) and hasattr(module, "quant_method"):
                module.quant_method.process_weights_after_loading(module)

    finalize_and_repack_lm_head.repacks_lm_head = True  # type: ignore[attr-defined]
    inplace.finalize_layerwise_reload = finalize_and_repack_lm_head
