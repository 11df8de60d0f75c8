"""How far a served model's logprobs are from the trainer's: the importance-ratio check of docs/train-loop.md.

    python scripts/train/logprob_gap.py ROLLOUTS.jsonl [--limit 6] [--gguf FILE ...]

For each rollout's model tokens (completion_mask = 1) it compares the trainer's logprob (the bundled
GGUF dequantized to fp32 by transformers, as `rollgym train` trains it) with the sampling logprob the
rollout recorded, and, for each --gguf, with that file's logprob of the same tokens under llama.cpp
(teacher-forced). Prints the mean and max absolute difference per token.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import orjson


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rollouts")
    parser.add_argument("--limit", type=int, default=6)
    parser.add_argument("--gguf", nargs="*", default=[])
    args = parser.parse_args()
    import torch

    from rollgym.train.trainers.policy import load_base

    rows = [orjson.loads(x) for x in Path(args.rollouts).read_bytes().splitlines() if x.strip()]
    sequences = [r["sequences"][0] for r in rows if r.get("sequences") and len(r["sequences"]) == 1][: args.limit]
    model, _ = load_base("bundled")
    torch.set_num_threads(1)
    trainer, recorded, masks = [], [], []
    with torch.no_grad():
        for seq in sequences:
            ids = seq["prompt_ids"] + seq["completion_ids"]
            logits = model(input_ids=torch.tensor([ids])).logits[0, len(seq["prompt_ids"]) - 1:-1].float()
            logps = torch.log_softmax(logits, -1).gather(1, torch.tensor(seq["completion_ids"])[:, None])[:, 0]
            trainer.append(logps.numpy())
            recorded.append(np.asarray(seq["completion_logprobs"], dtype=np.float32))
            masks.append(np.asarray(seq["completion_mask"], dtype=bool))

    def report(name: str, other: list[np.ndarray]) -> None:
        gaps = np.concatenate([np.abs(t - o)[m] for t, o, m in zip(trainer, other, masks)])
        print(f"{name:<40} tokens {gaps.size:>5}  mean |gap| {gaps.mean():.4f}  max {gaps.max():.4f}")

    report("sampling logprobs (as recorded)", recorded)
    for path in args.gguf:
        from llama_cpp import Llama

        llm = Llama(model_path=path, n_ctx=2048, logits_all=True, verbose=False, n_threads=1)
        served = []
        for seq in sequences:
            ids = seq["prompt_ids"] + seq["completion_ids"]
            llm.reset()
            llm.eval(ids)
            rows_ = np.asarray(llm.scores[: len(ids)])[len(seq["prompt_ids"]) - 1:-1]
            rows_ = rows_ - rows_.max(-1, keepdims=True)
            logps = rows_ - np.log(np.exp(rows_).sum(-1, keepdims=True))
            served.append(logps[np.arange(len(seq["completion_ids"])), seq["completion_ids"]])
        report(Path(path).name, served)


if __name__ == "__main__":
    main()
