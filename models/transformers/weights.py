"""A full-weight reload in place: a folder of safetensors (a Hugging Face checkpoint, e.g. what
`save_pretrained` writes after a full fine-tuning step) copied into the served model's parameters.

Every tensor is checked against the model (names, shapes) before the first is copied, so a
checkpoint that does not fit changes nothing. LoRA adapters loaded beside the base stay loaded
(PEFT keeps the base weights as `base_layer`; the checkpoint's names are matched without it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

__all__ = ["WeightLoadError", "load_weights"]


class WeightLoadError(ValueError):
    """A checkpoint the served model cannot take; nothing was changed."""


def load_weights(model: Any, folder: str) -> int:
    """Copy every tensor of the `*.safetensors` files of `folder` into `model`'s parameters; returns how
    many. Every parameter of the base model must be in the checkpoint (tied ones once)."""
    from safetensors import safe_open

    root = Path(folder).expanduser()
    files = sorted(root.glob("*.safetensors")) if root.is_dir() else []
    if not files:
        raise WeightLoadError(f"{root} is not a folder of *.safetensors files (a Hugging Face checkpoint)")
    targets = {name.replace(".base_layer", ""): tensor for name, tensor in model.state_dict(keep_vars=True).items()
               if "lora_" not in name}
    # named_parameters lists a tied tensor once: those are what the checkpoint must hold.
    required = {name.replace(".base_layer", "") for name, _ in model.named_parameters() if "lora_" not in name}
    located: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                if key not in targets:
                    raise WeightLoadError(f"{file.name}: tensor {key!r} is not a weight of the served model")
                shape = tuple(handle.get_slice(key).get_shape())
                if shape != tuple(targets[key].shape):
                    raise WeightLoadError(f"{file.name}: tensor {key!r} has shape {list(shape)}, the served model's "
                                          f"{list(targets[key].shape)}")
                located[key] = file
    missing = sorted(required - located.keys())
    if missing:
        raise WeightLoadError(f"the checkpoint lacks {len(missing)} of the model's weights, e.g. {missing[:3]}")
    with torch.no_grad():
        for file in files:
            with safe_open(str(file), framework="pt") as handle:
                for key in handle.keys():
                    target = targets[key]
                    target.copy_(handle.get_tensor(key).to(dtype=target.dtype, device=target.device))
    return len(located)
