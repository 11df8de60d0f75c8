"""What the trainer tests share: a tiny random Llama saved as a Hugging Face folder (one per test module)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 2-layer Llama with a 40-token vocabulary, seeded: the same weights in every module."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    folder = tmp_path_factory.mktemp("tiny") / "model"
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return str(folder)
