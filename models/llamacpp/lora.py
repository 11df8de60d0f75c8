"""PEFT LoRA adapters → GGUF LoRA files that llama.cpp attaches to the served model.

TRL and PEFT save an adapter as a folder: `adapter_config.json` (rank, alpha, target modules) and
`adapter_model.safetensors` (`…q_proj.lora_A.weight` of shape (r, in), `…lora_B.weight` of shape
(out, r), in Hugging Face's layout). llama.cpp reads a GGUF LoRA instead: `general.type: adapter`,
`adapter.type: lora`, `adapter.lora.alpha`, and tensors `blk.N.attn_q.weight.lora_a` /
`.lora_b` named after the base model's tensors. Converting is what llama.cpp's
`convert_lora_to_gguf.py` does, without torch:

* names come from the `gguf` package's TensorNameMap of the served model's architecture;
* llama-architecture GGUFs store q and k with their rows permuted (rotary pairs interleaved, see
  `LlamaModel.permute` in llama.cpp's convert_hf_to_gguf.py), so B of q_proj/k_proj gets the same
  row permutation (A multiplies the input side and is left as is);
* llama.cpp scales an adapter by alpha / rank, PEFT by lora_alpha / r (or / sqrt(r) with rsLoRA,
  per module with rank_pattern / alpha_pattern): the file carries `lora_alpha`, and where a module's
  PEFT scale differs from alpha / its rank, the difference is folded into its B.

Every problem (missing file, truncated safetensors, a module the served model does not have, a
shape that belongs to another base model) is an `AdapterError` whose message names it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["AdapterError", "BaseModelInfo", "convert_peft_adapter", "gguf_lora_path", "permute_qk_rows"]

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
# Bumped when the converter's output changes, so cached files from older code are not reused.
CONVERTER_VERSION = 1
# Architectures whose HF → GGUF conversion keeps every linear weight as is, except llama's q/k permutation.
PERMUTED_ARCHS = frozenset({"llama"})
PLAIN_ARCHS = frozenset({"qwen2", "qwen3", "mistral3"})
_LORA_NAME_RE = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<part>[AB])(?:\.[^.]+)?\.weight$")


class AdapterError(ValueError):
    """An adapter that cannot be served; `status` is 404 for a path that does not exist, else 400."""

    def __init__(self, message: str, *, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class BaseModelInfo:
    """What the converter needs from the served model: architecture, heads and the shapes (out, in) of the
    linear weights a LoRA can target, by GGUF tensor name."""

    arch: str
    n_blocks: int
    n_head: int
    n_head_kv: int
    shapes: dict[str, tuple[int, ...]]
    identity: str

    @classmethod
    def from_metadata(cls, metadata: dict[str, str], identity: str) -> "BaseModelInfo":
        """From a GGUF's metadata (llama-cpp-python's `Llama.metadata`): the shapes of the linear weights
        a LoRA can target follow from the sizes it records (reading the tensor table takes seconds)."""
        arch = metadata.get("general.architecture", "")

        def number(key: str, default: int | None = None) -> int:
            value = metadata.get(f"{arch}.{key}")
            if value is None:
                if default is None:
                    raise AdapterError(f"the served model's metadata has no {arch}.{key}")
                return default
            return int(value)

        n_embd, n_ff, n_blocks = number("embedding_length"), number("feed_forward_length"), number("block_count")
        n_head = number("attention.head_count")
        n_head_kv = number("attention.head_count_kv", n_head)
        head_dim = number("attention.key_length", n_embd // n_head)
        per_block = {"attn_q": (n_head * head_dim, n_embd), "attn_k": (n_head_kv * head_dim, n_embd),
                     "attn_v": (n_head_kv * head_dim, n_embd), "attn_output": (n_embd, n_head * head_dim),
                     "ffn_gate": (n_ff, n_embd), "ffn_up": (n_ff, n_embd), "ffn_down": (n_embd, n_ff)}
        shapes = {f"blk.{block}.{name}.weight": shape for block in range(n_blocks) for name, shape in per_block.items()}
        return cls(arch=arch, n_blocks=n_blocks, n_head=n_head, n_head_kv=n_head_kv, shapes=shapes,
                   identity=f"{identity}:{arch}:{n_embd}:{n_blocks}")


def permute_qk_rows(weights: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """llama.cpp's row permutation of q (n_head) and k (n_head_kv) weights, applied to LoRA's B.

    Hugging Face orders each head's rotary dimensions as two halves; the GGUF llama layout
    interleaves them. `weights` has shape (rows, ...); rows = heads × head_dim.
    """
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    rows = weights.shape[0]
    return (weights.reshape(n_head, 2, rows // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2)
            .reshape(weights.shape))


def _read_config(folder: Path) -> dict[str, Any]:
    path = folder / CONFIG_NAME
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise AdapterError(f"{folder} has no {CONFIG_NAME}: not a PEFT adapter folder", status=404) from None
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{path} is not readable JSON: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{path} must hold a JSON object")
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"{path}: peft_type {config.get('peft_type')!r} is not LORA")
    if config.get("use_dora"):
        raise AdapterError(f"{path}: DoRA adapters (use_dora) are not supported by llama.cpp")
    if config.get("modules_to_save"):
        raise AdapterError(f"{path}: modules_to_save {config['modules_to_save']} are full weights, not LoRA; "
                           "llama.cpp adapters can only carry LoRA matrices")
    for key in ("r", "lora_alpha"):
        if not isinstance(config.get(key), (int, float)) or config[key] <= 0:
            raise AdapterError(f"{path}: '{key}' must be a positive number")
    return config


def _read_tensors(path: Path) -> dict[str, np.ndarray]:
    """All tensors of a safetensors file as float32 numpy arrays."""
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        raise AdapterError(f"{path} does not exist (a PEFT adapter folder holds {WEIGHTS_NAME})", status=404)
    tensors: dict[str, np.ndarray] = {}
    try:
        with safe_open(str(path), framework="numpy") as handle:
            for name in handle.keys():
                tensors[name] = np.asarray(handle.get_tensor(name), dtype=np.float32)
    except SafetensorError as exc:
        raise AdapterError(f"{path} is truncated or not a safetensors file: {exc}") from None
    except TypeError as exc:
        # numpy has no bfloat16: such adapters go through torch when it is installed.
        tensors = _read_tensors_with_torch(path, exc)
    return tensors


def _read_tensors_with_torch(path: Path, cause: Exception) -> dict[str, np.ndarray]:
    try:
        from safetensors.torch import load_file
        import torch
    except ImportError:
        raise AdapterError(f"{path} holds tensors numpy cannot read ({cause}); install torch or save the adapter "
                           "in float32") from None
    return {name: tensor.to(torch.float32).numpy() for name, tensor in load_file(str(path)).items()}


def _module_scale(config: dict[str, Any], module: str, rank: int) -> float:
    """PEFT's scaling of one module: alpha / r, or alpha / sqrt(r) with rsLoRA; patterns per module."""
    alpha = float(config["lora_alpha"])
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.search(rf"(^|\.){pattern}$", module):
            alpha = float(value)
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def _pairs(tensors: dict[str, np.ndarray], source: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{module path: (A, B)} from PEFT tensor names."""
    parts: dict[str, dict[str, np.ndarray]] = {}
    for name, value in tensors.items():
        match = _LORA_NAME_RE.match(name)
        if match is None:
            raise AdapterError(f"{source}: tensor {name!r} is not a LoRA A or B matrix")
        parts.setdefault(match["module"], {})[match["part"]] = value
    pairs = {}
    for module, found in parts.items():
        if set(found) != {"A", "B"}:
            raise AdapterError(f"{source}: module {module!r} has lora_{''.join(found)} but not both A and B")
        a, b = found["A"], found["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise AdapterError(f"{source}: module {module!r} has A {a.shape} and B {b.shape}, not (r, in) and (out, r)")
        pairs[module] = (a, b)
    if not pairs:
        raise AdapterError(f"{source} holds no LoRA tensors")
    return pairs


def convert_peft_adapter(folder: str | os.PathLike[str], base: BaseModelInfo, out: str | os.PathLike[str]) -> Path:
    """Write the GGUF LoRA of the PEFT adapter in `folder` for the served model `base` to `out`."""
    import gguf

    folder = Path(folder)
    config = _read_config(folder)
    weights = folder / WEIGHTS_NAME
    pairs = _pairs(_read_tensors(weights), weights)
    if base.arch not in PERMUTED_ARCHS | PLAIN_ARCHS:
        raise AdapterError(f"the served model's architecture {base.arch!r} has no PEFT conversion here; "
                           "convert the adapter with llama.cpp's convert_lora_to_gguf.py and load the GGUF")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[base.arch.upper()], base.n_blocks)
    alpha = float(config["lora_alpha"])
    writer = gguf.GGUFWriter(str(out), arch=base.arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    for module, (a, b) in sorted(pairs.items()):
        target = names.get_name(f"{module}.weight", try_suffixes=(".weight",))
        if target is None:
            raise AdapterError(f"{weights}: module {module!r} has no counterpart in a {base.arch} model")
        expected = base.shapes.get(target)
        if expected is None:
            raise AdapterError(f"{weights}: module {module!r} ({target}) is not a linear weight of the served model "
                               "that a LoRA can target here")
        if (b.shape[0], a.shape[1]) != expected:
            raise AdapterError(
                f"{weights}: module {module!r} is {b.shape[0]}x{a.shape[1]} but the served model's {target} is "
                f"{expected[0]}x{expected[1]}: the adapter was trained for another base model")
        rank = a.shape[0]
        # llama.cpp applies alpha / rank; fold whatever PEFT does differently into B.
        b = b * np.float32(_module_scale(config, module, rank) / (alpha / rank))
        if base.arch in PERMUTED_ARCHS and target.endswith(("attn_q.weight", "attn_k.weight")):
            b = permute_qk_rows(b, base.n_head, base.n_head if "attn_q" in target else base.n_head_kv)
        writer.add_tensor(f"{target}.lora_a", np.ascontiguousarray(a, dtype=np.float32))
        writer.add_tensor(f"{target}.lora_b", np.ascontiguousarray(b, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(out)


def _fingerprint(folder: Path, base: BaseModelInfo) -> str:
    digest = hashlib.sha256(f"{CONVERTER_VERSION}|{base.identity}|{folder.resolve()}".encode())
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        try:
            stat = (folder / name).stat()
        except OSError:
            continue
        digest.update(f"|{name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


def gguf_lora_path(path: str | os.PathLike[str], base: BaseModelInfo) -> tuple[Path, bool]:
    """The GGUF LoRA to attach for `path`, and whether it was converted just now.

    A `.gguf` file is used as is. A PEFT folder is converted once; the GGUF is cached next to the
    adapter (`adapter_model.rollgym-<fingerprint>.gguf`, or in the temp folder when the adapter's
    folder is read-only) and reused while the adapter's files and the served model stay the same.
    """
    source = Path(path).expanduser()
    if not source.exists():
        raise AdapterError(f"adapter path {str(path)!r} does not exist", status=404)
    if source.is_file():
        if source.suffix != ".gguf":
            raise AdapterError(f"adapter path {str(path)!r} is a file but not a .gguf LoRA; "
                               f"pass a PEFT folder ({CONFIG_NAME} + {WEIGHTS_NAME}) or a GGUF LoRA")
        return source, False
    name = f"adapter_model.rollgym-{_fingerprint(source, base)}.gguf"
    for folder in (source, Path(tempfile.gettempdir()) / "rollgym-lora"):
        cached = folder / name
        if cached.is_file():
            return cached, False
        try:
            folder.mkdir(parents=True, exist_ok=True)
            partial = folder / f".{name}.{os.getpid()}.partial"
            partial.touch()
        except OSError:
            continue
        try:
            convert_peft_adapter(source, base, partial)
            partial.replace(cached)
        finally:
            partial.unlink(missing_ok=True)
        return cached, True
    raise AdapterError(f"nowhere to write the converted adapter for {str(path)!r}")
