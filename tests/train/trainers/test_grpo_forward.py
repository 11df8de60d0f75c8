"""The trainer's logprobs are those of each model's own forward pass: what a model does after its output
layer (Gemma 2's final soft-capping, Granite's logits scaling, Cohere's logit scale) is kept, and models
without `.model.layers` (GPT-2, GPT-NeoX) train as Llama does. The reference is the model's ordinary
full forward, log-softmaxed by hand at the loss positions."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from rollgym.train.trainers.grpo_config import GRPOConfig  # noqa: E402
from rollgym.train.trainers.grpo_trainer import PolicyTrainer, TrainSequence, decoder_layers  # noqa: E402

SMALL = dict(vocab_size=48, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=2, max_position_embeddings=64)
MODELS = {
    # Soft-capping at 0.5 and the scales below move the logprobs far more than float rounding.
    "gemma2": lambda: transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        **SMALL, head_dim=8, final_logit_softcapping=0.5, attn_implementation="eager")),
    "granite": lambda: transformers.GraniteForCausalLM(transformers.GraniteConfig(**SMALL, logits_scaling=4.0)),
    "cohere": lambda: transformers.CohereForCausalLM(transformers.CohereConfig(**SMALL, logit_scale=0.25)),
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=48, n_embd=16, n_layer=2, n_head=2,
                                                                        n_positions=64, resid_pdrop=0.0,
                                                                        embd_pdrop=0.0, attn_pdrop=0.0)),
    "gpt_neox": lambda: transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        vocab_size=48, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=64)),
}


def sequences() -> list[TrainSequence]:
    generator = torch.Generator().manual_seed(2)
    out = []
    for prompt, completion in [(5, 6), (3, 9)]:
        ids = torch.randint(0, 48, (prompt + completion,), generator=generator).tolist()
        mask = [1] * completion
        mask[1] = 0
        out.append(TrainSequence(ids[:prompt], ids[prompt:], mask, [0.0] * completion, 1.0, temperature=0.7))
    return out


@pytest.mark.parametrize("name", sorted(MODELS))
def test_logprobs_come_from_the_models_own_forward(name, tmp_path) -> None:
    torch.manual_seed(0)
    model = MODELS[name]()
    model.save_pretrained(tmp_path / name)
    trainer = PolicyTrainer(GRPOConfig(finetune="full"), str(tmp_path / name))
    trainer.load(None)
    batch = sequences()
    with torch.no_grad():
        got = trainer._forward(trainer._tensors(batch))
        expected = []
        for seq in batch:
            logits = trainer.model(input_ids=torch.tensor([seq.prompt_ids + seq.completion_ids])).logits[0]
            logps = (logits.float() / seq.temperature).log_softmax(-1)
            expected += [logps[len(seq.prompt_ids) + j - 1, token] for j, token in enumerate(seq.completion_ids)
                         if seq.loss_mask[j]]
    assert torch.allclose(got, torch.stack(expected), atol=1e-5)
    assert len(decoder_layers(trainer.model)) == 2


def test_full_weight_deltas_carry_an_untied_output_layer(tmp_path) -> None:
    import gguf

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SMALL, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "untied")
    trainer = PolicyTrainer(GRPOConfig(finetune="full", learning_rate=1e-2), str(tmp_path / "untied"))
    trainer.load(None)
    base_head = trainer.model.lm_head.weight.detach().clone()
    batch = sequences()
    for seq in batch:
        seq.sampling_logprobs = [-3.9] * len(seq.completion_ids)
    batch[1].advantage = -1.0
    trainer.train_batch(batch)
    deltas = trainer.merged_deltas()
    assert "lm_head" in deltas and "model.embed_tokens" in deltas
    assert torch.allclose(torch.from_numpy(deltas["lm_head"]), trainer.model.lm_head.weight.detach() - base_head)
    # The name the merged GGUF's writer looks up: llama.cpp's `output` tensor.
    assert gguf.TensorNameMap(gguf.MODEL_ARCH.LLAMA, 2).get_name("lm_head") == "output"


def test_re_used_data_keeps_the_pi_old_of_its_first_use(tmp_path, monkeypatch) -> None:
    """epochs: 2 passes over the same groups: the second pass's π_old is the policy before the first
    update (computed once), so its ratio is not 1 and the clip can act; it was recomputed each pass."""
    from rollgym.train.trainers import grpo_trainer

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)).save_pretrained(tmp_path / "llama")
    seen = []
    real = grpo_trainer.policy_loss

    def recording(logprobs, old_logprobs, *args, **kwargs):
        seen.append((logprobs.detach().clone(), old_logprobs.detach().clone()))
        return real(logprobs, old_logprobs, *args, **kwargs)

    monkeypatch.setattr(grpo_trainer, "policy_loss", recording)
    trainer = PolicyTrainer(GRPOConfig(finetune="full", learning_rate=1e-2, epochs=2.0), str(tmp_path / "llama"))
    trainer.load(None)
    group = {"group_id": "g", "rollouts": [
        {"rollout_id": f"r{i}", "advantage": [1.0, -1.0][i], "sampling": {"temperature": 1.0, "logprobs": "processed"},
         "sequence": {"prompt_ids": seq.prompt_ids, "completion_ids": seq.completion_ids,
                      "completion_mask": [1] * len(seq.completion_ids),
                      "completion_logprobs": [-3.9] * len(seq.completion_ids)}}
        for i, seq in enumerate(sequences())]}
    metrics = trainer.train_records([group])
    assert metrics["steps"] == 2 and len(seen) == 2
    (first_now, first_old), (second_now, second_old) = seen
    assert torch.allclose(first_now, first_old, atol=1e-5)  # before any update: ratio 1
    assert torch.allclose(second_old.sort().values, first_old.sort().values, atol=1e-6)  # the same π_old
    assert (second_now - second_old).abs().max() > 1e-3  # the policy moved: the ratio is not 1
