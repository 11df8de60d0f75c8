"""The module the GRPO trainer trains: logprobs of chosen tokens at chosen positions in one forward pass of a
causal LM (what DDP wraps and FSDP shards), the softmax over the vocabulary taken a chunk of loss tokens at a
time; and the decoder layers FSDP shards one by one.
"""

from __future__ import annotations

from typing import Any

from .base import TrainingFailed

# Loss tokens per chunk of the softmax over the vocabulary (a 152k vocabulary: 1.2 GiB of fp32 per chunk).
LOGIT_CHUNK = 2048


def _chosen_logprobs(logits: Any, targets: Any, temperatures: Any) -> Any:
    """log softmax(logits / T) at the targets, in fp32."""
    scaled = logits.float() / temperatures[:, None]
    return scaled.gather(-1, targets[:, None]).squeeze(-1) - scaled.logsumexp(-1)


def token_logprobs_module() -> Any:
    import torch

    class TokenLogprobs(torch.nn.Module):
        """Logprobs of chosen tokens at chosen positions in one forward pass: the module DDP wraps.

        The logits come from the model's own `forward`, so what it does after its output layer
        (Gemma 2's final soft-capping, Granite's `logits_scaling`, Cohere's `logit_scale`) is kept; a
        hook on the output layer hands it only the positions that enter the loss, so the logits are
        (loss tokens × vocabulary), not (all tokens × vocabulary)."""

        def __init__(self, lm: Any, precision: str) -> None:
            super().__init__()
            self.lm = lm
            self.precision = precision

        def causal(self) -> Any:
            return self.lm.get_base_model() if hasattr(self.lm, "get_base_model") else self.lm

        def forward(self, input_ids: Any, attention_mask: Any, positions: Any, targets: Any,
                    temperatures: Any, position_ids: Any = None, segments: tuple[Any, int] | None = None) -> Any:
            causal = self.causal()
            # Packed rows on the varlen attention: each rollout's boundaries, under transformers' names.
            bounds = {} if segments is None else {"cu_seq_lens_q": segments[0], "cu_seq_lens_k": segments[0],
                                                  "max_length_q": segments[1], "max_length_k": segments[1]}

            def picked(_module: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
                hidden = args[0]
                return (hidden.reshape(-1, hidden.shape[-1])[positions].unsqueeze(0), *args[1:])

            handle = causal.get_output_embeddings().register_forward_pre_hook(picked)
            device_type = "cuda" if input_ids.is_cuda else "cpu"
            try:
                with torch.autocast(device_type=device_type, dtype=torch.bfloat16, enabled=self.precision == "bf16"):
                    logits = causal(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                    use_cache=False, **bounds).logits
            finally:
                handle.remove()
            logits = logits.reshape(-1, logits.shape[-1])
            # The fp32 softmax a chunk of loss tokens at a time, recomputed in the backward pass: whole, its
            # (loss tokens × vocabulary) fp32 copies were most of a large model's activations.
            from torch.utils.checkpoint import checkpoint

            return torch.cat([checkpoint(_chosen_logprobs, logits[start:start + LOGIT_CHUNK],
                                         targets[start:start + LOGIT_CHUNK], temperatures[start:start + LOGIT_CHUNK],
                                         use_reentrant=False)
                              for start in range(0, max(len(targets), 1), LOGIT_CHUNK)])

    return TokenLogprobs


def decoder_layers(model: Any) -> list[Any]:
    """The model's repeated blocks (what FSDP shards one by one), found by the classes the model itself
    declares unsplittable (`_no_split_modules`), so that GPT-2's `transformer.h` serves as Llama's
    `model.layers` does."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [module for module in model.modules() if type(module).__name__ in names]
    if not layers:
        raise TrainingFailed(f"{type(model).__name__} declares no decoder layer class (_no_split_modules): "
                             "full weights cannot be sharded over processes; use finetune: lora or processes: 1")
    return layers


__all__ = ["LOGIT_CHUNK", "decoder_layers", "token_logprobs_module"]
