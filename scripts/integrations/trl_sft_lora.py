"""Train a small LoRA with TRL's `SFTTrainer` on the embedded SmolLM2-135M and save it as PEFT does.

The saved folder (`adapter_config.json` + `adapter_model.safetensors`) is what a running stack's
model server hot-loads: `rollgym adapters load NAME FOLDER --registry-file runs/stack.json`, or
`POST /v1/load_lora_adapter {"lora_name", "lora_path"}` on the model server (vLLM's route).

The rows are reverse_text tasks turned into chat examples (the user's request, the reversed text as
the answer); a few steps at a high learning rate are enough to move the model's logprobs visibly.

    python scripts/integrations/trl_sft_lora.py --input resources_servers/reverse_text/data/train.jsonl \
        --limit 8 --max-steps 4 --output runs/lora/sft-4
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def sft_rows(path: Path, limit: int) -> list[dict[str, Any]]:
    """reverse_text task rows → chat examples: the task's messages plus the reversed text as the answer."""
    rows = []
    for line in path.read_text().splitlines()[:limit]:
        task = json.loads(line)
        messages = [{"role": m["role"], "content": m["content"]} for m in task["responses_create_params"]["input"]]
        rows.append({"messages": [*messages, {"role": "assistant", "content": task["text"][::-1]}]})
    return rows


def train_lora(rows: list[dict[str, Any]], output: Path, *, max_steps: int = 4, learning_rate: float = 1e-3,
               rank: int = 8, alpha: int = 16, cache_dir: str | None = None) -> Path:
    """Fit a LoRA on `rows` (chat examples) and save the PEFT adapter folder at `output`."""
    from datasets import Dataset
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    sys.path.insert(0, str(HERE))
    from trl_grpo import load_gguf_policy

    sys.path.insert(0, str(HERE.parents[1]))
    from models.llamacpp.engine import bundled_model_path

    model, tokenizer = load_gguf_policy(bundled_model_path(), cache_dir)
    config = SFTConfig(output_dir=str(output.parent / f".{output.name}-trainer"), max_steps=max_steps,
                       per_device_train_batch_size=4, learning_rate=learning_rate, lr_scheduler_type="constant",
                       logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, bf16=False,
                       seed=0, disable_tqdm=True, dataloader_num_workers=0)
    peft_config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, task_type="CAUSAL_LM",
                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    trainer = SFTTrainer(model=model, processing_class=tokenizer, args=config,
                         train_dataset=Dataset.from_list(rows), peft_config=peft_config)
    trainer.train()
    trainer.model.save_pretrained(output)
    return output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Train a small SFT LoRA on the embedded SmolLM2-135M (CPU).")
    parser.add_argument("--input", default="resources_servers/reverse_text/data/train.jsonl",
                        help="reverse_text task rows JSONL")
    parser.add_argument("--limit", type=int, default=8, help="use the first N rows")
    parser.add_argument("--max-steps", type=int, default=4)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--output", required=True, help="the adapter folder to write")
    parser.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "rollgym" / "hf"),
                        help="where the GGUF's transformers conversion is kept between runs")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    folder = train_lora(sft_rows(Path(args.input), args.limit), Path(args.output), max_steps=args.max_steps,
                        learning_rate=args.learning_rate, cache_dir=args.cache_dir)
    print(f"adapter saved to {folder} in {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
