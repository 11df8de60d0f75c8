"""Merged LoRA weights as a GGUF that the embedded llama.cpp model server can serve.

The base GGUF is the template: its metadata (tokenizer, chat template, hyper-parameters) is copied,
every tensor is dequantized with the `gguf` package (the same numbers transformers trains on), and
each LoRA delta (scale · B·A, from PEFT) is added to the tensor it adapts. The result is F32, F16 or
Q8_0: serving F32 or F16 means the sampling logprobs are those of the trainer's own weights, up to
that rounding (docs/train-loop.md, "The importance ratio on CPU"). Q8_0 generates about twice as
fast as F16 on a CPU (half the bytes per token), but llama.cpp then rounds activations to 8 bits as
well, which puts its logprobs as far from the trainer's as the bundled Q4_1 (~0.04 per token).

llama.cpp stores the q and k projections of LLaMA models with their rows permuted for its RoPE
layout (llama.cpp's convert_hf_to_gguf.py does it; transformers undoes it when it loads a GGUF), so
the deltas of those two get the same permutation.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from ...data.jsonl import replaced_atomically


# serve_dtype -> the file type the GGUF declares.
FILE_TYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "q8_0": "MOSTLY_Q8_0"}


def permute_rows(weights: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """llama.cpp's row order for q/k projections (convert_hf_to_gguf.py `LlamaModel.permute`)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def lora_deltas(peft_model: Any) -> dict[str, np.ndarray]:
    """{"model.layers.0.self_attn.q_proj": delta (out × in, float32)} for every LoRA layer of a PEFT model."""
    from peft.tuners.lora import LoraLayer

    deltas: dict[str, np.ndarray] = {}
    for name, module in peft_model.named_modules():
        if isinstance(module, LoraLayer) and module.active_adapters:
            adapter = module.active_adapters[0]
            if adapter not in module.lora_A:
                continue
            delta = module.get_delta_weight(adapter).detach().float().cpu().numpy()
            deltas[name.removeprefix("base_model.model.")] = delta
    return deltas


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def write_merged_gguf(template: str | os.PathLike[str], deltas: Mapping[str, np.ndarray],
                      output: str | os.PathLike[str], dtype: str = "f16") -> Path:
    """Write `template`'s weights plus `deltas` to `output` as an F32, F16 or Q8_0 GGUF (the 2-D
    tensors; 1-D ones, the norms, stay F32 as llama.cpp's converter writes them)."""
    import gguf

    if dtype not in FILE_TYPES:
        raise ValueError(f"dtype must be one of {', '.join(FILE_TYPES)}, got {dtype!r}")
    reader = gguf.GGUFReader(str(template))
    arch = _field(reader, gguf.Keys.General.ARCHITECTURE)
    if arch != "llama":
        raise ValueError(f"{template}: merging a LoRA is supported for llama GGUFs, not {arch!r}")
    n_blocks = int(_field(reader, f"{arch}.block_count"))
    n_head = int(_field(reader, f"{arch}.attention.head_count"))
    n_head_kv = int(_field(reader, f"{arch}.attention.head_count_kv") or n_head)
    names = gguf.TensorNameMap(gguf.MODEL_ARCH.LLAMA, n_blocks)
    by_tensor: dict[str, np.ndarray] = {}
    for module, delta in deltas.items():
        target = names.get_name(module)
        if target is None:
            raise ValueError(f"no GGUF tensor for the LoRA layer {module!r}")
        if module.endswith("q_proj"):
            delta = permute_rows(delta, n_head, n_head)
        elif module.endswith("k_proj"):
            delta = permute_rows(delta, n_head, n_head_kv)
        by_tensor[target + ".weight"] = delta

    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    with replaced_atomically(output) as partial:
        writer = gguf.GGUFWriter(str(partial), arch)
        file_type = getattr(gguf.LlamaFileType, FILE_TYPES[dtype])
        for field in reader.fields.values():
            if field.name in (gguf.Keys.General.ARCHITECTURE, gguf.Keys.General.FILE_TYPE) or field.name.startswith("GGUF."):
                continue
            value_type = field.types[0]
            sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
        writer.add_file_type(int(file_type))
        used = set()
        for tensor in reader.tensors:
            weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
            delta = by_tensor.get(tensor.name)
            if delta is not None:
                if delta.shape != weights.shape:
                    raise ValueError(f"{tensor.name}: LoRA delta {delta.shape} does not fit the tensor {weights.shape}")
                weights = weights + delta
                used.add(tensor.name)
            if dtype == "q8_0" and weights.ndim > 1 and weights.shape[-1] % 32 == 0:
                quantized = gguf.quants.quantize(np.ascontiguousarray(weights), gguf.GGMLQuantizationType.Q8_0)
                writer.add_tensor(tensor.name, quantized, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
                continue
            if dtype != "f32" and weights.ndim > 1:
                weights = weights.astype(np.float16)
            writer.add_tensor(tensor.name, np.ascontiguousarray(weights))
        missing = sorted(set(by_tensor) - used)
        if missing:
            raise ValueError(f"LoRA layers with no tensor in {template}: {', '.join(missing[:5])}")
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return output


def rebuild_merged_gguf(base_model: str, weights: str | os.PathLike[str], output: str | os.PathLike[str],
                        dtype: str = "f16") -> Path:
    """Write a step's merged GGUF again from the weights the step kept (its PEFT adapter folder, or a full
    model folder) after the GGUF was pruned: the same deltas over the same base GGUF the trainer exported
    from, so the file is the one the step served. ValueError when the base model is not a GGUF."""
    import torch

    from .policy import gguf_of, load_base

    template = gguf_of(base_model)
    if template is None:
        raise ValueError(f"a merged GGUF needs a GGUF base model ('bundled' or a *.gguf file), not {base_model!r}")
    model, _ = load_base(base_model)
    if (Path(weights) / "adapter_config.json").is_file():
        from peft import PeftModel

        deltas = lora_deltas(PeftModel.from_pretrained(model, str(weights)))
    else:  # full weights: what the trainer exports is the trained weights minus the base (grpo_trainer.merged_deltas)
        from transformers import AutoModelForCausalLM

        trained = AutoModelForCausalLM.from_pretrained(str(weights), torch_dtype=torch.float32)
        base = dict(model.named_parameters())
        deltas = {}
        for name, param in trained.named_parameters():
            if name in base and name.endswith(".weight"):  # an untied lm_head included (GGUF `output`)
                delta = (param.detach().float() - base[name].detach().float()).numpy()
                if delta.any():
                    deltas[name.removesuffix(".weight")] = delta
    return write_merged_gguf(template, deltas, output, dtype)


__all__ = ["lora_deltas", "permute_rows", "rebuild_merged_gguf", "write_merged_gguf"]
