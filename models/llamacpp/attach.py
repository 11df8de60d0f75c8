"""LoRA adapters attached to a running llama.cpp model through llama-cpp-python's low-level API.

`llama_adapter_lora_init(model, path)` reads a GGUF LoRA against the loaded model (it validates the
architecture and every tensor's shape, and returns NULL when anything is wrong); it only reads the
model, so it runs beside generation. Which adapters a context applies is set with
`llama_set_adapters_lora(ctx, adapters, n, scales)`: that touches the context, so only the thread
that generates calls it, right before a generation whose adapter differs from the last one, and
the KV cache is dropped then (its keys and values were computed with other weights). Nothing is
reloaded: switching costs one call and a fresh prompt decode.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import llama_cpp


class LoraError(RuntimeError):
    """llama.cpp refused an adapter file."""


class LoraAttachments:
    """The LoRA adapters initialised on one `llama_cpp.Llama`, and the one its context applies."""

    def __init__(self, llama: llama_cpp.Llama) -> None:
        self._llama = llama
        self._active: Any = None

    def init(self, path: str | Path) -> Any:
        """Initialise the GGUF LoRA at `path` on the model; LoraError when llama.cpp rejects it."""
        handle = llama_cpp.llama_adapter_lora_init(self._llama.model, str(path).encode())
        if not handle:
            raise LoraError(f"llama.cpp rejected the LoRA {Path(path).name}: its architecture or tensor shapes "
                            "do not match the served model, or the file is damaged")
        return handle

    def activate(self, handle: Any) -> bool:
        """Make the context apply only `handle` (None: no adapter), dropping the KV cache when that changes
        what is applied. Returns whether anything changed. Call it from the generating thread only."""
        if handle is self._active:
            return False
        ctx = self._llama.ctx
        if handle is None:
            result = llama_cpp.llama_set_adapters_lora(ctx, None, 0, None)
        else:
            adapters = (llama_cpp.llama_adapter_lora_p_ctypes * 1)(handle)
            scales = (ctypes.c_float * 1)(1.0)
            result = llama_cpp.llama_set_adapters_lora(ctx, adapters, 1, scales)
        if result != 0:
            raise LoraError(f"llama.cpp could not apply the adapter (llama_set_adapters_lora returned {result})")
        self._active = handle
        self._llama.reset()  # the cached keys and values were computed with other weights
        return True

    def free(self, handle: Any) -> None:
        """Release an adapter no generation will use any more (generating thread only)."""
        if handle is self._active:
            self.activate(None)
        llama_cpp.llama_adapter_lora_free(handle)
