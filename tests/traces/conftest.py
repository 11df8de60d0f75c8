from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    """The embedded model's own tokenizer (SmolLM2's chat template): what `base_model: bundled` re-tokenizes with."""
    pytest.importorskip("transformers", reason="re-tokenizing needs transformers (the trl extra)")
    from rollgym.traces.tokens import load_tokenizer

    try:
        return load_tokenizer("bundled")
    except FileNotFoundError as exc:
        pytest.skip(f"the bundled SmolLM2 weights are not installed: {exc}")
