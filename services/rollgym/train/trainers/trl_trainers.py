"""The built-in TRL adapters: TRL's SFT and DPO trainers on a PEFT LoRA.

Both train on the rollouts' exact tokens (no re-rendering of chat text, so no drift between what the
model was served and what it is trained on), and only on the tokens the model sampled:

- `SFTTrainer` (`trl_sft`): records of `curation.to_sft`; loss on the model's own completion tokens
  only (`completion_mask`; tool outputs inside a multi-turn completion are masked out).
- `DPOTrainer` (`trl_dpo`): records of `curation.to_preferences`: `prompt_ids`, `chosen_ids`,
  `rejected_ids`, with `chosen_mask`/`rejected_mask` keeping environment tokens out of the loss.

The policy-gradient step is not TRL's: its GRPOTrainer cannot take the sampling policy's logprobs
(its ratio is 1), so `grpo` is rollgym's own (loss.py, rl_trainer.py).

Adapter arguments (the plan's `optimize.args`): `learning_rate`, `epochs` (passes over the data),
`max_steps`, `batch_size`, `lora` (`r`, `alpha`, `dropout`, `target_modules`, `layers`), `threads`,
`beta` (DPO); `trl` is a dict passed to the TRL config as is.

Each optimizer step is reported to the step's progress file (`progress.py`), which the loop's optimize line shows.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Any

import orjson

from .base import Artefact, TrainConfig, TrainingFailed
from .progress import trl_callback


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
        per_step = trainer.args.per_device_train_batch_size * trainer.args.gradient_accumulation_steps
        trainer.add_callback(trl_callback(config.output_dir, per_step * sum(map(self.tokens, rows)) / len(rows)))
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

    @staticmethod
    def tokens(row: dict[str, Any]) -> int:
        """The tokens one record puts through the model (the progress line's tokens/s)."""
        raise NotImplementedError


def _load(config: TrainConfig) -> tuple[Any, Any]:
    from .policy import load_policy

    return load_policy(config.base_model, config.init_adapter, config.args.get("lora"))


class SFTTrainer(_LoraTrainer):
    kind = "sft"

    @staticmethod
    def tokens(row: dict[str, Any]) -> int:
        return len(row.get("prompt_ids") or ()) + len(row.get("completion_ids") or ())

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

    @staticmethod
    def tokens(row: dict[str, Any]) -> int:  # the prompt goes through twice, once with each answer
        return 2 * len(row["prompt_ids"]) + len(row["chosen_ids"]) + len(row["rejected_ids"])

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
                     "rejected_ids": list(r["rejected_ids"]),
                     "chosen_mask": list(r.get("chosen_mask") or [1] * len(r["chosen_ids"])),
                     "rejected_mask": list(r.get("rejected_mask") or [1] * len(r["rejected_ids"]))} for r in rows]
        batch = int(config.args.get("batch_size", 2))
        settings = _common_args(config, len(examples), batch, dict(beta=float(config.args.get("beta", 0.1)),
                                                                    max_length=None))
        args = _config(DPOConfig, settings, dict(config.args.get("trl", {})))
        return TokenDPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(examples),
                               processing_class=tokenizer,
                               data_collator=model_token_collator(tokenizer.pad_token_id))


def model_token_collator(pad_token_id: int) -> Any:
    """TRL's preference collator with the loss restricted to the tokens the model sampled: a multi-turn
    completion's environment tokens (tool results, chat glue; `chosen_mask`/`rejected_mask` = 0) count
    toward neither side's log-likelihood."""
    import torch
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    class ModelTokenPreferenceCollator(DataCollatorForPreference):
        def torch_call(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
            output = super().torch_call(examples)
            rows = ([[0] * len(e["prompt_ids"]) + list(e["chosen_mask"]) for e in examples]
                    + [[0] * len(e["prompt_ids"]) + list(e["rejected_mask"]) for e in examples])
            width = output["completion_mask"].shape[1]
            output["completion_mask"] = torch.tensor([row[:width] + [0] * (width - len(row[:width])) for row in rows],
                                                     dtype=output["completion_mask"].dtype)
            return output

    return ModelTokenPreferenceCollator(pad_token_id=pad_token_id)


__all__ = ["DPOTrainer", "SFTTrainer", "model_token_collator"]
