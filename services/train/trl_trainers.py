"""The built-in trainer adapters: TRL's SFT, DPO and GRPO trainers on a PEFT LoRA.

All three train on the rollouts' exact tokens (no re-rendering of chat text, so no drift between
what the model was served and what it is trained on):

- `SFTTrainer` (`trl_sft`): records of `curation.to_sft`; loss on the model's own completion tokens
  only (`completion_mask`; tool outputs inside a multi-turn completion are masked out).
- `DPOTrainer` (`trl_dpo`): records of `curation.to_preferences`: `prompt_ids`, `chosen_ids`, `rejected_ids`.
- `GRPOTrainer` (`trl_grpo`): records of `curation.to_groups`: each group's collected rollouts with
  their sequences and sampling logprobs are handed to TRL's GRPOTrainer through its `rollout_func`,
  so TRL computes the group advantages from the environment's rewards and trains on exactly what
  was sampled. Before training it measures how far the trainer's logprobs of those tokens are from
  the sampling logprobs (`logprob_gap_mean`/`_max` in the metrics); `max_logprob_gap` bounds it.

Adapter arguments (the plan's `optimize.args`): `learning_rate`, `epochs` (passes over the data),
`max_steps`, `batch_size`, `lora` (`r`, `alpha`, `dropout`, `target_modules`), `threads`, and per
trainer `beta` (DPO, GRPO), `groups_per_step`, `temperature`, `max_logprob_gap` (GRPO); `trl` is a
dict passed to the TRL config as is.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from pathlib import Path
from typing import Any

import orjson

from .trainers import Artefact, TrainConfig, TrainingFailed


def read_records(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


def _common_args(config: TrainConfig, examples: int, batch: int, extra: dict[str, Any]) -> dict[str, Any]:
    import torch

    args = config.args
    epochs = float(args.get("epochs", 1))
    settings: dict[str, Any] = dict(
        output_dir=str(Path(config.output_dir) / "trainer"), report_to="none", save_strategy="no",
        logging_steps=1, seed=config.seed, data_seed=config.seed, learning_rate=float(args.get("learning_rate", 1e-4)),
        per_device_train_batch_size=batch, gradient_accumulation_steps=1, dataloader_num_workers=0,
        disable_tqdm=True, bf16=False, fp16=False, use_cpu=not torch.cuda.is_available(),
        max_steps=int(args.get("max_steps") or max(1, math.ceil(epochs * examples / batch))),
        lr_scheduler_type="constant", warmup_steps=0, remove_unused_columns=False,
    )
    settings.update(extra)
    return settings


def _config(cls: Any, settings: dict[str, Any], overrides: dict[str, Any]) -> Any:
    names = {field.name for field in dataclasses.fields(cls)}
    # No activation recomputation on CPU: memory is plenty, time is not (renamed in transformers 5).
    settings["activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"] = False
    settings.update(overrides)
    unknown = sorted(set(settings) - names)
    if unknown:
        raise TrainingFailed(f"{cls.__name__} has no option {', '.join(unknown)} (optimize.args.trl)")
    return cls(**settings)


class _LoraTrainer:
    """What the three share: load the policy, train, save the adapter, export the merged GGUF."""

    kind = ""

    def fit(self, dataset: Path, config: TrainConfig) -> Artefact:
        import torch

        threads = config.args.get("threads")
        if threads:
            torch.set_num_threads(int(threads))
        torch.manual_seed(config.seed)
        rows = read_records(Path(dataset))
        if not rows:
            raise TrainingFailed(f"{dataset}: no {self.kind} records to train on")
        started = time.perf_counter()
        model, tokenizer = _load(config)
        loaded = time.perf_counter()
        metrics: dict[str, float] = {"examples": float(len(rows)), "load_s": round(loaded - started, 3)}
        trainer = self.build(model, tokenizer, rows, config, metrics)
        result = trainer.train()
        trained = time.perf_counter()
        metrics.update(train_loss=float(result.training_loss), steps=float(result.global_step),
                       train_s=round(trained - loaded, 3))
        adapter_dir = Path(config.output_dir) / "adapter"
        trainer.model.save_pretrained(adapter_dir)
        serving = None
        if config.export_gguf != "none":
            from .gguf_export import lora_deltas, write_merged_gguf
            from .policy import gguf_of

            template = gguf_of(config.base_model)
            if template is None:
                raise TrainingFailed("export_gguf needs a GGUF base model ('bundled' or a *.gguf file)")
            serving = str(write_merged_gguf(template, lora_deltas(trainer.model),
                                            Path(config.output_dir) / f"{config.version}.gguf", config.export_gguf))
            metrics["export_s"] = round(time.perf_counter() - trained, 3)
        return Artefact(kind="lora", uri=str(adapter_dir.resolve()), base_model=config.base_model,
                        version=config.version, metrics=metrics, serving_uri=serving)

    def build(self, model: Any, tokenizer: Any, rows: list[dict[str, Any]], config: TrainConfig,
              metrics: dict[str, float]) -> Any:
        raise NotImplementedError


def _load(config: TrainConfig) -> tuple[Any, Any]:
    from .policy import load_policy

    return load_policy(config.base_model, config.init_adapter, config.args.get("lora"))


class SFTTrainer(_LoraTrainer):
    kind = "sft"

    def build(self, model: Any, tokenizer: Any, rows: list[dict[str, Any]], config: TrainConfig,
              metrics: dict[str, float]) -> Any:
        from datasets import Dataset
        from trl import SFTConfig
        from trl import SFTTrainer as TrlSFTTrainer

        examples = []
        for index, row in enumerate(rows):
            if not row.get("prompt_ids") or not row.get("completion_ids"):
                raise TrainingFailed(f"sft record {index} ({row.get('rollout_id')}) has no token ids")
            examples.append({"input_ids": list(row["prompt_ids"]) + list(row["completion_ids"]),
                             "completion_mask": [0] * len(row["prompt_ids"]) + list(row["completion_mask"])})
        metrics["tokens_trained"] = float(sum(sum(e["completion_mask"]) for e in examples))
        batch = int(config.args.get("batch_size", 4))
        settings = _common_args(config, len(examples), batch, dict(completion_only_loss=True, packing=False,
                                                                    max_length=None))
        args = _config(SFTConfig, settings, dict(config.args.get("trl", {})))
        return TrlSFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(examples),
                             processing_class=tokenizer)


class DPOTrainer(_LoraTrainer):
    kind = "preferences"

    def build(self, model: Any, tokenizer: Any, rows: list[dict[str, Any]], config: TrainConfig,
              metrics: dict[str, float]) -> Any:
        from datasets import Dataset
        from trl import DPOConfig
        from trl import DPOTrainer as TrlDPOTrainer

        class TokenDPOTrainer(TrlDPOTrainer):
            """TRL's DPO on pairs that are already token ids (its collator reads these three columns)."""

            def _prepare_dataset(self, dataset: Any, *args: Any, **kwargs: Any) -> Any:
                return dataset

        examples = [{"prompt_ids": list(r["prompt_ids"]), "chosen_ids": list(r["chosen_ids"]),
                     "rejected_ids": list(r["rejected_ids"])} for r in rows]
        batch = int(config.args.get("batch_size", 2))
        settings = _common_args(config, len(examples), batch, dict(beta=float(config.args.get("beta", 0.1)),
                                                                    max_length=None))
        args = _config(DPOConfig, settings, dict(config.args.get("trl", {})))
        return TokenDPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(examples),
                               processing_class=tokenizer)


def collected_reward(prompts: list[Any], completions: list[Any], collected_reward: list[float],
                     **kwargs: Any) -> list[float]:
    """TRL reward function: the environment's verified reward of each collected rollout."""
    return list(collected_reward)


class GroupRollouts:
    """A TRL `rollout_func` that hands back collected groups instead of generating: the prompt is the
    group id; consecutive equal prompts get the group's members in order."""

    def __init__(self, groups: list[dict[str, Any]]) -> None:
        self.groups = {str(g["group_id"]): g["rollouts"] for g in groups}
        self.calls = 0

    def __call__(self, prompts: list[str], trainer: Any = None) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {k: [] for k in ("prompt_ids", "completion_ids", "logprobs", "env_mask",
                                                     "collected_reward")}
        seen: dict[str, int] = {}
        for prompt in prompts:
            members = self.groups[prompt]
            index = seen.get(prompt, 0)
            seen[prompt] = index + 1
            member = members[index % len(members)]
            sequence = member["sequence"]
            out["prompt_ids"].append(list(sequence["prompt_ids"]))
            out["completion_ids"].append(list(sequence["completion_ids"]))
            out["logprobs"].append([float(x) for x in sequence["completion_logprobs"]])
            out["env_mask"].append([int(x) for x in sequence["completion_mask"]])
            out["collected_reward"].append(float(member["reward"]))
        self.calls += 1
        return out


def logprob_gap(model: Any, groups: list[dict[str, Any]], temperature: float) -> tuple[float, float]:
    """(mean, max) |trainer logprob − sampling logprob| over the model's tokens of every rollout."""
    import torch

    total, count, largest = 0.0, 0, 0.0
    model.eval()
    with torch.no_grad():
        for group in groups:
            for member in group["rollouts"]:
                seq = member["sequence"]
                ids = torch.tensor([list(seq["prompt_ids"]) + list(seq["completion_ids"])])
                logits = model(input_ids=ids).logits[0, len(seq["prompt_ids"]) - 1:-1].float() / temperature
                logps = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(seq["completion_ids"])[:, None])[:, 0]
                mask = torch.tensor(seq["completion_mask"], dtype=torch.bool)
                gap = (logps - torch.tensor(seq["completion_logprobs"], dtype=torch.float32)).abs()[mask]
                if gap.numel():
                    total += float(gap.sum())
                    count += int(gap.numel())
                    largest = max(largest, float(gap.max()))
    model.train()
    return (total / count if count else 0.0), largest


class GRPOTrainer(_LoraTrainer):
    kind = "groups"

    def build(self, model: Any, tokenizer: Any, rows: list[dict[str, Any]], config: TrainConfig,
              metrics: dict[str, float]) -> Any:
        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
        from datasets import Dataset
        from trl import GRPOConfig
        from trl import GRPOTrainer as TrlGRPOTrainer

        sizes = {len(group["rollouts"]) for group in rows}
        if len(sizes) != 1 or min(sizes) < 2:
            raise TrainingFailed(f"GRPO needs groups of one size >= 2 (the collect repeats); got sizes {sorted(sizes)}")
        size = sizes.pop()
        args = config.args
        temperature = float(args.get("temperature", 1.0))
        mean_gap, max_gap = logprob_gap(model, rows, temperature)
        metrics.update(logprob_gap_mean=round(mean_gap, 5), logprob_gap_max=round(max_gap, 5))
        bound = args.get("max_logprob_gap")
        if bound is not None and mean_gap > float(bound):
            raise TrainingFailed(
                f"the served model's sampling logprobs differ from the trainer's by {mean_gap:.3f} per token on "
                f"average (max_logprob_gap {bound}): the rollouts were not sampled from these weights (a quantized "
                "or stale model is serving); serve the merged weights unquantized (apply: merged, serve_dtype: f16)")
        # A batch larger than the data would give TRL's sampler no full batch, and zero steps.
        groups_per_step = max(1, min(int(args.get("groups_per_step", 2)), len(rows)))
        longest = max(len(m["sequence"]["completion_ids"]) for g in rows for m in g["rollouts"])
        settings = _common_args(config, len(rows), groups_per_step * size, dict(
            num_generations=size, max_completion_length=longest, temperature=temperature,
            beta=float(args.get("beta", 0.0)), num_iterations=1, use_vllm=False, shuffle_dataset=True,
        ))
        settings["max_steps"] = int(args.get("max_steps") or max(1, math.ceil(float(args.get("epochs", 1))
                                                                               * len(rows) / groups_per_step)))
        grpo_args = _config(GRPOConfig, settings, dict(args.get("trl", {})))
        dataset = Dataset.from_list([{"prompt": str(group["group_id"])} for group in rows])
        return TrlGRPOTrainer(model=model, processing_class=tokenizer, args=grpo_args, train_dataset=dataset,
                              reward_funcs=collected_reward, rollout_func=GroupRollouts(rows))


__all__ = ["DPOTrainer", "GRPOTrainer", "GroupRollouts", "SFTTrainer", "collected_reward", "logprob_gap"]
