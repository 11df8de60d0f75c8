"""On-policy distillation through PolicyTrainer on a tiny model: the student (the tiny_model fixture) samples
fixed sequences, a differently seeded tiny model is the teacher, and several surogate steps with adv_tau 0
and teacher_tau 1 bring the student's reverse KL to the teacher down step after step; the history's
teacher_kl is the mean of log π_θ − log π_T over the sampled tokens the teacher term covers (none a grammar
restricted: `completion_constrained`), as computed here from the model's ordinary forward pass."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROMPT, COMPLETION, PROMPTS, SAMPLES, STEPS = 4, 6, 3, 16, 5


def sample(model, prompt: list[int], generator) -> tuple[list[int], list[int], list[float]]:
    """COMPLETION tokens after `prompt` sampled from `model` at temperature 1, with their logprobs."""
    ids = list(prompt)
    logprobs = []
    with torch.no_grad():
        for _ in range(COMPLETION):
            row = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1].double(), dim=-1)
            token = int(torch.multinomial(row.exp(), 1, generator=generator))
            ids.append(token)
            logprobs.append(float(row[token]))
    return ids[:PROMPT], ids[PROMPT:], logprobs


def distributions(model, sequence: dict) -> "torch.Tensor":
    """log π(· | prefix) at every completion position, over the whole vocabulary."""
    ids = torch.tensor([sequence["prompt_ids"] + sequence["completion_ids"]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double()
    return torch.log_softmax(logits, dim=-1)[PROMPT - 1:-1]


def test_distillation_steps_lower_the_reverse_kl_and_teacher_kl_tracks_it(tiny_model) -> None:
    from rollgym.train.trainers.grpo_config import GRPOConfig
    from rollgym.train.trainers.grpo_loss import LossConfig
    from rollgym.train.trainers.grpo_trainer import PolicyTrainer

    loss = LossConfig(objective="surogate", adv_tau=0.0, teacher_tau=1.0)
    trainer = PolicyTrainer(GRPOConfig(finetune="full", learning_rate=5e-3, loss=loss), tiny_model)
    trainer.load(None)
    torch.manual_seed(1)
    teacher = transformers.LlamaForCausalLM(transformers.AutoConfig.from_pretrained(tiny_model)).eval()
    with torch.no_grad():
        teacher.lm_head.weight.mul_(6.0)  # a sharp teacher: the random student's near-uniform π is far from it

    generator = torch.Generator().manual_seed(3)
    groups = []
    for g in range(PROMPTS):
        members = []
        prompt = torch.randint(0, 40, (PROMPT,), generator=generator).tolist()
        for r in range(SAMPLES):
            prompt, completion, logprobs = sample(trainer.model, prompt, generator)
            mask = [1] * COMPLETION
            mask[3] = 0  # an environment token
            sequence = {"prompt_ids": prompt, "completion_ids": completion, "completion_mask": mask,
                        "completion_logprobs": [lp if m else 0.0 for lp, m in zip(logprobs, mask)],
                        # every other rollout opened under a grammar: no teacher term there
                        "completion_constrained": [1, 1] + [0] * (COMPLETION - 2) if r % 2 else [0] * COMPLETION}
            taught = distributions(teacher, sequence)
            sequence["teacher_logprobs"] = [float(taught[j, t]) for j, t in enumerate(completion)]
            members.append({"rollout_id": f"{g}-{r}", "advantage": 0.0, "sequence": sequence,
                            "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "logprobs": "processed"}})
        groups.append({"group_id": str(g), "rollouts": members})
    sequences = [m["sequence"] for group in groups for m in group["rollouts"]]
    covered = [(s, j) for s in sequences for j in range(COMPLETION)
               if s["completion_mask"][j] and not s["completion_constrained"][j]]

    exact, estimated, reported = [], [], []
    for _ in range(STEPS):
        trainer.model.eval()
        student = {id(s): distributions(trainer.model, s) for s in sequences}
        taught = {id(s): distributions(teacher, s) for s in sequences}
        trainer.model.train()
        # The reverse KL itself at every covered position, Σ_v π_θ(v)·(log π_θ(v) − log π_T(v)), and its
        # one-sample estimate on the sampled token, which the history reports.
        exact.append(sum(float((student[id(s)][j].exp() * (student[id(s)][j] - taught[id(s)][j])).sum())
                         for s, j in covered) / len(covered))
        estimated.append(sum(float(student[id(s)][j, s["completion_ids"][j]]) - s["teacher_logprobs"][j]
                             for s, j in covered) / len(covered))
        metrics = trainer.train_records(groups)
        assert metrics["teacher_tokens"] == len(covered) and metrics["skipped_steps"] == 0
        reported.append(metrics["teacher_kl"])

    assert reported == pytest.approx(estimated, rel=1e-4, abs=1e-5)
    assert all(later < earlier for earlier, later in zip(exact, exact[1:])), exact
    assert all(later < earlier for earlier, later in zip(reported, reported[1:])), reported
    assert exact[-1] < 0.95 * exact[0] and estimated[0] > 0, exact
