"""Merged LoRA weights as a GGUF that the embedded llama.cpp model server can serve.

The base GGUF is the template: its metadata (tokenizer, chat template, hyper-parameters) is copied
as stored, without decoding the tokenizer's arrays (`GGUFTemplate`; the file is the one `gguf`'s
GGUFReader and GGUFWriter would write, in about a third of their time), every tensor is dequantized with the `gguf` package (the same numbers transformers trains on), and
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
import struct
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


# GGUF metadata value types: the bytes of each fixed-size one; 8 is a string, 9 an array.
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


class GGUFTemplate:
    """A GGUF file read as byte spans, without decoding its metadata arrays (the tokenizer's 49k tokens and
    merges, which `gguf.GGUFReader` decodes one numpy view at a time, most of a merged export's time):
    `entries` (key -> the entry's bytes as stored: key, type, value), `values` (key -> the value of each
    entry that is not an array), `tensors` (name, GGUF dims, type, bytes) in file order."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        import gguf

        self.path = str(path)
        data = self.data = Path(path).read_bytes()
        magic, version, n_tensors, n_kv = struct.unpack_from("<IIQQ", data, 0)
        if magic != gguf.GGUF_MAGIC or version not in (2, 3):
            raise ValueError(f"{path}: not a GGUF file of version 2 or 3")
        offset = 24
        self.entries: dict[str, bytes] = {}
        self.values: dict[str, Any] = {}
        for _ in range(n_kv):
            start = offset
            key, offset = self._string(offset)
            (kind,) = struct.unpack_from("<I", data, offset)
            if kind == _ARRAY:
                offset = self._skip_array(offset + 4)
            else:
                self.values[key], offset = self._value(kind, offset + 4)
            self.entries[key] = data[start:offset]
        alignment = int(self.values.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT))
        infos = []
        for _ in range(n_tensors):
            name, offset = self._string(offset)
            (n_dims,) = struct.unpack_from("<I", data, offset)
            dims = struct.unpack_from(f"<{n_dims}Q", data, offset + 4)
            kind, start = struct.unpack_from("<IQ", data, offset + 4 + 8 * n_dims)
            offset += 4 + 8 * n_dims + 12
            infos.append((name, tuple(int(d) for d in dims), gguf.GGMLQuantizationType(kind), int(start)))
        base = offset + (-offset % alignment)
        self.tensors: list[tuple[str, tuple[int, ...], Any, np.ndarray]] = []
        for name, dims, kind, start in infos:
            block, size = gguf.GGML_QUANT_SIZES[kind]
            rows = dims[1:][::-1]  # numpy order: the outer dimensions first, then one row's bytes
            count = int(np.prod(rows, dtype=np.int64)) * (dims[0] // block * size)
            raw = np.frombuffer(data, dtype=np.uint8, count=count, offset=base + start)
            self.tensors.append((name, dims, kind, raw.reshape(*rows, dims[0] // block * size)))

    def _string(self, offset: int) -> tuple[str, int]:
        (length,) = struct.unpack_from("<Q", self.data, offset)
        return self.data[offset + 8:offset + 8 + length].decode("utf-8"), offset + 8 + length

    def _value(self, kind: int, offset: int) -> tuple[Any, int]:
        if kind == _STRING:
            return self._string(offset)
        fmt = "<" + _SCALAR_FORMATS[kind]
        return struct.unpack_from(fmt, self.data, offset)[0], offset + struct.calcsize(fmt)

    def _skip_array(self, offset: int) -> int:
        kind, count = struct.unpack_from("<IQ", self.data, offset)
        offset += 12
        if kind in _SCALAR_FORMATS:
            return offset + count * struct.calcsize(_SCALAR_FORMATS[kind])
        if kind not in (_STRING, _ARRAY):
            raise ValueError(f"{self.path}: metadata array of unknown type {kind}")
        for _ in range(count):
            if kind == _STRING:
                (length,) = struct.unpack_from("<Q", self.data, offset)
                offset += 8 + length
            else:  # an array of arrays
                offset = self._skip_array(offset)
        return offset


def _entry(key: str, kind: int, value: Any) -> bytes:
    """One metadata entry's bytes: a string or a fixed-size scalar value."""
    encoded = key.encode("utf-8")
    head = struct.pack("<Q", len(encoded)) + encoded + struct.pack("<I", kind)
    if kind == _STRING:
        text = value.encode("utf-8")
        return head + struct.pack("<Q", len(text)) + text
    return head + struct.pack("<" + _SCALAR_FORMATS[kind], value)


def write_merged_gguf(template: str | os.PathLike[str], deltas: Mapping[str, np.ndarray],
                      output: str | os.PathLike[str], dtype: str = "f16") -> Path:
    """Write `template`'s weights plus `deltas` to `output` as an F32, F16 or Q8_0 GGUF (the 2-D
    tensors; 1-D ones, the norms, stay F32 as llama.cpp's converter writes them). The metadata entries
    are copied as stored (general.architecture first, general.file_type last, the layout of `gguf`'s
    GGUFWriter), and the tensors in the template's order, each aligned as the template aligns them."""
    import gguf

    if dtype not in FILE_TYPES:
        raise ValueError(f"dtype must be one of {', '.join(FILE_TYPES)}, got {dtype!r}")
    source = GGUFTemplate(template)
    arch = source.values.get(gguf.Keys.General.ARCHITECTURE)
    if arch != "llama":
        raise ValueError(f"{template}: merging a LoRA is supported for llama GGUFs, not {arch!r}")
    n_blocks = int(source.values[f"{arch}.block_count"])
    n_head = int(source.values[f"{arch}.attention.head_count"])
    n_head_kv = int(source.values.get(f"{arch}.attention.head_count_kv") or n_head)
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

    file_type = int(getattr(gguf.LlamaFileType, FILE_TYPES[dtype]))
    skipped = (gguf.Keys.General.ARCHITECTURE, gguf.Keys.General.FILE_TYPE)
    entries = ([source.entries[gguf.Keys.General.ARCHITECTURE]]
               + [entry for key, entry in source.entries.items() if key not in skipped]
               + [_entry(gguf.Keys.General.FILE_TYPE, 4, file_type)])
    alignment = int(source.values.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT))
    infos, blobs, used = bytearray(), [], set()
    position = 0
    for name, dims, kind, raw in source.tensors:
        weights = gguf.quants.dequantize(raw, kind).astype(np.float32, copy=False)
        delta = by_tensor.get(name)
        if delta is not None:
            if delta.shape != weights.shape:
                raise ValueError(f"{name}: LoRA delta {delta.shape} does not fit the tensor {weights.shape}")
            weights = weights + delta
            used.add(name)
        if dtype == "q8_0" and weights.ndim > 1 and weights.shape[-1] % 32 == 0:
            kind = gguf.GGMLQuantizationType.Q8_0
            blob = gguf.quants.quantize(np.ascontiguousarray(weights), kind).tobytes()
        elif dtype != "f32" and weights.ndim > 1:
            kind, blob = gguf.GGMLQuantizationType.F16, weights.astype(np.float16).tobytes()
        else:
            kind, blob = gguf.GGMLQuantizationType.F32, np.ascontiguousarray(weights).tobytes()
        encoded = name.encode("utf-8")
        infos += struct.pack("<Q", len(encoded)) + encoded + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims,
                                                                        int(kind), position)
        blobs.append(blob)
        position += len(blob) + (-len(blob) % alignment)
    missing = sorted(set(by_tensor) - used)
    if missing:
        raise ValueError(f"LoRA layers with no tensor in {template}: {', '.join(missing[:5])}")

    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    with replaced_atomically(output) as partial, open(partial, "wb") as out:
        out.write(struct.pack("<IIQQ", gguf.GGUF_MAGIC, gguf.GGUF_VERSION, len(blobs), len(entries)))
        out.write(b"".join(entries))
        out.write(infos)
        out.write(bytes(-out.tell() % alignment))
        for blob in blobs:
            out.write(blob)
            out.write(bytes(-len(blob) % alignment))
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


__all__ = ["GGUFTemplate", "lora_deltas", "permute_rows", "rebuild_merged_gguf", "write_merged_gguf"]
