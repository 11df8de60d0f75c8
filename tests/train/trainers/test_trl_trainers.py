"""The built-in TRL + PEFT adapters, one real step each on CPU on tiny data, and the merged GGUF.

One base model is loaded for the module (the bundled SmolLM2-135M, dequantized from its GGUF, from
the conversion cache shared with tests/test_trl_grpo.py); each test trains a fresh LoRA on a copy.
Skipped only when the training extras are not installed (`pip install -e '.[train,llamacpp]'`).
"""

from __future__ import annotations

import copy
import importlib.util
import math
from pathlib import Path
from typing import Any

import orjson
import pytest

pytestmark = pytest.mark.slow

MISSING = next((m for m in ("torch", "trl", "peft", "gguf", "llama_cpp", "datasets")
                if importlib.util.find_spec(m) is None), None)
if MISSING:
    pytest.skip(f"{MISSING} is not installed (pip install -e '.[train,llamacpp]')", allow_module_level=True)

from rollgym.train.trainers import trl_trainers as T  # noqa: E402
from rollgym.train.trainers.policy import bundled_gguf  # noqa: E402
from rollgym.train.trainers.base import TrainConfig, TrainingFailed  # noqa: E402

try:
    bundled_gguf()
except FileNotFoundError as exc:
    pytest.skip(str(exc), allow_module_level=True)


@pytest.fixture(scope="module")
def base() -> tuple[Any, Any]:
    from rollgym.train.trainers.policy import load_base

    model, tokenizer = load_base("bundled")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


@pytest.fixture()
def shared_base(base: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any]:
    """The trainers get a fresh LoRA on a copy of the module's base model instead of loading one."""
    from peft import LoraConfig, get_peft_model

    from rollgym.train.trainers.policy import LORA_TARGETS

    model, tokenizer = base

    def load(config: TrainConfig) -> tuple[Any, Any]:
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
        return get_peft_model(copy.deepcopy(model), lora), tokenizer

    monkeypatch.setattr(T, "_load", load)
    return base


def encode(tokenizer: Any, question: str, answer: str) -> tuple[list[int], list[int]]:
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                           tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    completion = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    return prompt, completion


def write(tmp_path: Path, records: list[dict[str, Any]]) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    return path


def config(tmp_path: Path, **args: Any) -> TrainConfig:
    return TrainConfig(base_model="bundled", output_dir=str(tmp_path / "out"), version="policy-e001",
                       args={"learning_rate": 1e-3, "max_steps": 1, **args})


def lora_b_norm(adapter_dir: str) -> float:
    from safetensors.numpy import load_file

    weights = load_file(str(Path(adapter_dir) / "adapter_model.safetensors"))
    return float(sum(abs(w).sum() for name, w in weights.items() if "lora_B" in name))


def trainer_logprobs(model: Any, prompt: list[int], completion: list[int]) -> list[float]:
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1]
    return torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(completion)[:, None])[:, 0].tolist()


def test_sft_one_step_trains_the_completion_only(shared_base: Any, tmp_path: Path) -> None:
    _, tokenizer = shared_base
    records = []
    for city, answer in (("Paris", "Paris: sunny, 22 C"), ("Oslo", "Oslo: snowy, -3 C")):
        prompt, completion = encode(tokenizer, f"Weather in {city}?", answer)
        records.append({"prompt_ids": prompt, "completion_ids": completion, "completion_mask": [1] * len(completion)})
    artefact = T.SFTTrainer().fit(write(tmp_path, records), config(tmp_path, batch_size=2))
    assert artefact.kind == "lora" and artefact.version == "policy-e001" and artefact.base_model == "bundled"
    assert math.isfinite(artefact.metrics["train_loss"]) and artefact.metrics["steps"] == 1
    assert artefact.metrics["tokens_trained"] == sum(len(r["completion_ids"]) for r in records)
    assert (Path(artefact.uri) / "adapter_config.json").is_file()
    assert lora_b_norm(artefact.uri) > 0, "one SFT step left the LoRA at B = 0"


def test_dpo_one_step_on_token_pairs(shared_base: Any, tmp_path: Path) -> None:
    _, tokenizer = shared_base
    prompt, good = encode(tokenizer, "Weather in Paris?", "Paris: sunny, 22 C")
    _, bad = encode(tokenizer, "Weather in Paris?", "I do not know.")
    records = [{"prompt_ids": prompt, "chosen_ids": good, "rejected_ids": bad}] * 2
    artefact = T.DPOTrainer().fit(write(tmp_path, records), config(tmp_path, batch_size=2, beta=0.1))
    assert math.isfinite(artefact.metrics["train_loss"]) and artefact.metrics["steps"] == 1
    assert lora_b_norm(artefact.uri) > 0
    # The step reached the loop's optimize line (trainers/progress.py): 1 of 1, its loss, both answers' tokens.
    progress = orjson.loads((Path(artefact.uri).parent / "progress.json").read_bytes())
    assert (progress["step"], progress["steps"]) == (1, 1) and math.isfinite(progress["loss"])
    assert progress["tokens"] == 2 * (2 * len(prompt) + len(good) + len(bad))


def grpo_groups(model: Any, tokenizer: Any, offset: float = 0.0) -> list[dict[str, Any]]:
    """Two groups of made-up rollouts whose sampling logprobs are the model's own (+ offset)."""
    groups = []
    for city in ("Paris", "Oslo"):
        members = []
        for index, (answer, reward) in enumerate(((f"{city}: sunny", 1.0), ("No idea.", 0.0))):
            prompt, completion = encode(tokenizer, f"Weather in {city}?", answer)
            logprobs = [x + offset for x in trainer_logprobs(model, prompt, completion)]
            members.append({"rollout_id": f"{city}-r{index}", "reward": reward, "advantage": 1.0 - 2 * index,
                            "sampling": {"temperature": 1.0, "top_p": 1.0, "logprobs": "processed"},
                            "sequence": {"prompt_ids": prompt, "completion_ids": completion,
                                         "completion_mask": [1] * len(completion), "completion_logprobs": logprobs}})
        groups.append({"group_id": city, "rollouts": members})
    return groups


def test_grpo_one_step_on_the_bundled_model(shared_base: Any) -> None:
    """rollgym's RL trainer on the real SmolLM2: its logprobs are the reference forward pass's (the
    behaviour ratio is 1 on the model's own samples), one step moves the LoRA, a gap is refused."""
    from rollgym.train.trainers.grpo_config import GRPOConfig
    from rollgym.train.trainers.grpo_trainer import PolicyTrainer

    model, tokenizer = shared_base
    trainer = PolicyTrainer(GRPOConfig(learning_rate=1e-3, max_logprob_gap=0.01, threads=2,
                                   lora={"r": 4, "alpha": 8, "layers": "top:2"}), "bundled")
    trainer.load(None)
    metrics = trainer.train_records(grpo_groups(model, tokenizer))
    assert metrics["steps"] == 1 and math.isfinite(metrics["loss"])
    assert metrics["logprob_gap_mean"] < 1e-3 and abs(metrics["importance_ratio_mean"] - 1) < 1e-3
    assert metrics["tokens"] == sum(len(r["sequence"]["completion_ids"]) for g in grpo_groups(model, tokenizer)
                                    for r in g["rollouts"])
    b_norm = sum(float(p.norm()) for n, p in trainer.model.named_parameters() if "lora_B" in n)
    assert b_norm > 0, "one step left the LoRA at B = 0"
    with pytest.raises(TrainingFailed, match=r"differ from the trainer's by 0\.3\d\d per token on average \(max_logprob_gap 0\.01\)"):
        trainer.train_records(grpo_groups(model, tokenizer, offset=-0.3))


def test_merged_gguf_serves_the_trained_weights(shared_base: Any, tmp_path: Path) -> None:
    """The merged F32 GGUF, run by llama.cpp, gives the PEFT model's logprobs (q/k row order included)."""
    import numpy as np
    import torch
    from llama_cpp import Llama
    from peft import LoraConfig, get_peft_model

    from rollgym.train.trainers.gguf_export import lora_deltas, rebuild_merged_gguf, write_merged_gguf

    model, tokenizer = shared_base
    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM",
                                                                 target_modules=["q_proj", "k_proj", "down_proj"]))
    torch.manual_seed(0)
    with torch.no_grad():  # a LoRA that changes the output: B = 0 would prove nothing
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.02)
    path = write_merged_gguf(bundled_gguf(), lora_deltas(peft_model), tmp_path / "merged.gguf", "f32")
    # A rewind rebuilds a pruned GGUF from the adapter the step kept: the very file the trainer exported.
    peft_model.save_pretrained(tmp_path / "adapter")
    rebuilt = rebuild_merged_gguf("bundled", tmp_path / "adapter", tmp_path / "rebuilt.gguf", "f32")
    assert rebuilt.read_bytes() == path.read_bytes(), "the GGUF rebuilt from the saved adapter differs"
    prompt, completion = encode(tokenizer, "Weather in Paris?", "Paris: sunny, 22 C")
    expected = np.asarray(trainer_logprobs(peft_model, prompt, completion))
    base_logprobs = np.asarray(trainer_logprobs(model, prompt, completion))
    llm = Llama(model_path=str(path), n_ctx=256, logits_all=True, verbose=False, n_threads=1)
    llm.eval(prompt + completion)
    logits = np.asarray(llm.scores[: len(prompt) + len(completion)])[len(prompt) - 1:-1]
    logits = logits - logits.max(-1, keepdims=True)
    served = (logits - np.log(np.exp(logits).sum(-1, keepdims=True)))[np.arange(len(completion)), completion]
    gap = float(np.abs(served - expected).mean())
    moved = float(np.abs(base_logprobs - expected).mean())
    assert moved > 0.04, f"the LoRA barely changed the model ({moved}): the test would prove nothing"
    assert gap < 0.01, f"served logprobs differ from the trainer's by {gap} per token (LoRA moved them by {moved})"


def test_merged_q8_0_gguf_holds_the_merged_weights_in_8_bits(tmp_path: Path) -> None:
    """serve_dtype q8_0: every matrix is stored as Q8_0 and holds base + delta up to 8-bit rounding (one
    step of its block's scale), norms stay F32; the delta is far larger than that rounding."""
    import gguf
    import numpy as np

    from rollgym.train.trainers.gguf_export import write_merged_gguf

    delta = np.random.default_rng(0).normal(0, 0.05, (576, 1536)).astype(np.float32)
    deltas = {"model.layers.3.mlp.down_proj": delta}
    reader = gguf.GGUFReader(str(write_merged_gguf(bundled_gguf(), deltas, tmp_path / "q8.gguf", "q8_0")))
    base_tensors = {t.name: t for t in gguf.GGUFReader(bundled_gguf()).tensors}
    assert set(base_tensors) == {t.name for t in reader.tensors}
    for tensor in reader.tensors:  # the exact merged weights: the template's, dequantized, plus the delta
        want = gguf.quants.dequantize(base_tensors[tensor.name].data, base_tensors[tensor.name].tensor_type)
        if tensor.name == "blk.3.ffn_down.weight":
            want = want + delta
        if want.ndim == 1:
            assert tensor.tensor_type == gguf.GGMLQuantizationType.F32, tensor.name
            continue
        assert tensor.tensor_type == gguf.GGMLQuantizationType.Q8_0, tensor.name
        got = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        # Q8_0: 32 values per block share one F16 scale d = max|x| / 127; rounding costs d/2, the F16 scale a bit more
        step = np.abs(want.reshape(-1, 32)).max(axis=1) / 127
        error = np.abs(got - want).reshape(-1, 32) / np.maximum(step[:, None], 1e-12)
        assert error.max() < 0.6, f"{tensor.name}: off by {error.max():.2f} of its block's step"
    merged = {t.name: t for t in reader.tensors}["blk.3.ffn_down.weight"]
    got = gguf.quants.dequantize(merged.data, merged.tensor_type)
    base = base_tensors["blk.3.ffn_down.weight"]
    assert np.abs((got - gguf.quants.dequantize(base.data, base.tensor_type)) - delta).mean() < 0.1 * np.abs(delta).mean()


def test_dpo_counts_only_the_tokens_the_model_sampled() -> None:
    """A multi-turn completion's environment tokens (mask 0) are outside the preference loss."""
    collator = T.model_token_collator(pad_token_id=0)
    batch = collator([{"prompt_ids": [5, 6], "chosen_ids": [7, 8, 9, 10], "rejected_ids": [11, 12],
                       "chosen_mask": [1, 0, 0, 1], "rejected_mask": [1, 1]}])
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10], [5, 6, 11, 12, 0, 0]]
    assert batch["completion_mask"].tolist() == [[0, 0, 1, 0, 0, 1], [0, 0, 1, 1, 0, 0]]
