"""Weights an inference engine can serve: a Hugging Face folder of safetensors (config, tokenizer, weights)
that vLLM or SGLang loads with `--model FOLDER`, written from a transformers model.

The bundled SmolLM2-135M is a Q4_1 GGUF; engines serve a GGUF poorly or not at all, so `servable_base`
writes the dequantized fp32 weights (the trainer's own: `policy.load_base`) once into a folder. What is
served is then exactly what the trainer computes its logprobs with.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from .policy import load_base

# What `save_servable` writes besides the tokenizer's files; a folder with all of them is complete.
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


def save_servable(model: Any, tokenizer: Any, folder: str | os.PathLike[str]) -> Path:
    """Write `model` (a transformers causal LM) and `tokenizer` to `folder` as an engine loads them:
    the weights in one safetensors file (a tied output layer left out: it is the embedding, and the
    engine ties it back), the config without a `quantization_config` (a GGUF-loaded model keeps one,
    which would tell the engine to quantize), and the tokenizer. Written beside and renamed into place,
    so a folder is whole or absent. Returns the folder."""
    from safetensors.torch import save_file

    folder = Path(folder)
    partial = folder.with_name(f"{folder.name}.partial{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    state = {name: tensor.detach().contiguous().cpu() for name, tensor in model.state_dict().items()
             if name not in tied}
    save_file(state, str(partial / WEIGHTS_FILE), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (partial / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True))
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    return folder


def servable_base(base_model: str, folder: str | os.PathLike[str]) -> Path:
    """`folder` holding `base_model` ('bundled', a GGUF file or a Hugging Face model, loaded in fp32 as
    the trainer loads it) as an engine serves it; written on the first call, reused after (the GGUF's
    conversion takes about a minute on two cores)."""
    folder = Path(folder)
    if (folder / WEIGHTS_FILE).is_file() and (folder / CONFIG_FILE).is_file():
        return folder
    model, tokenizer = load_base(base_model)
    if tokenizer is None:
        raise FileNotFoundError(f"base_model {base_model!r} has no tokenizer: an engine needs one to serve it")
    return save_servable(model, tokenizer, folder)


__all__ = ["save_servable", "servable_base"]
