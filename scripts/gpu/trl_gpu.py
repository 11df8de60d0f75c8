"""TRL's GRPOTrainer for a few steps on the card, its rollouts from rollgym `/run` (scripts/integrations/trl_grpo.py)
through a stack whose policy model is the transformers server on the same card. Run by scripts/gpu/check.sh.

    python scripts/gpu/trl_gpu.py --max-steps 2            # cuda when available (bf16), else the CPU (fp32)

It prints `trained N step(s) in S s; loss L` and one line per logged step, as trl_grpo.py does.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import orjson

REPO = Path(__file__).resolve().parents[2]
CONFIGS = ["resources_servers/weather/configs/weather.yaml", "models/transformers/configs/transformers.yaml"]
FORCED = {"type": "function", "name": "get_weather"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=4, help="task rows (each one GRPO group)")
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument("--max-steps", type=int, default=2)
    parser.add_argument("--max-completion-length", type=int, default=48)
    parser.add_argument("--output-dir", default="runs/gpu-check/trl")
    args = parser.parse_args(argv)
    for path in (REPO, REPO / "scripts" / "integrations"):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    import torch

    from rollgym import Stack, load_stack
    from rollgym.train.trainers.policy import bundled_gguf, hf_cache_dir, load_gguf_policy
    from trl_grpo import RollgymRollouts, grpo_config, rollgym_reward

    cuda = torch.cuda.is_available()
    rows = [orjson.loads(line) for line in (REPO / "resources_servers/weather/data/train.jsonl").read_bytes().splitlines()
            if line.strip()][: args.limit]
    for row in rows:  # the small model calls the tool only when told to
        row["responses_create_params"] = {**row["responses_create_params"], "tool_choice": FORCED, "temperature": 1.0,
                                          "max_output_tokens": args.max_completion_length}
    stack = Stack(load_stack([REPO / path for path in CONFIGS], ["policy_model.n_ctx=2048"]))
    registry = stack.start(timeout_s=300)
    try:
        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
        from trl import GRPOTrainer

        model, tokenizer = load_gguf_policy(bundled_gguf(), hf_cache_dir())
        rollouts = RollgymRollouts(registry, rows, agent="weather_agent")
        config = grpo_config(args.output_dir, num_generations=args.num_generations, max_steps=args.max_steps,
                             per_device_train_batch_size=args.num_generations * min(len(rows), 2),
                             max_completion_length=args.max_completion_length, use_cpu=not cuda, bf16=cuda)
        trainer = GRPOTrainer(model=model, processing_class=tokenizer, args=config, train_dataset=rollouts.dataset(),
                              reward_funcs=rollgym_reward, rollout_func=rollouts)
        started = time.perf_counter()
        output = trainer.train()
        print(f"trained {output.global_step} step(s) in {time.perf_counter() - started:.1f} s; "
              f"loss {output.training_loss:.6f}; device {'cuda' if cuda else 'cpu'}")
        for entry in trainer.state.log_history:
            if "reward" in entry:
                print(f"step {entry.get('step')}: reward {entry['reward']:.3f}")
        rollouts.close()
    finally:
        stack.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
