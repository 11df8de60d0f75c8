"""Writes example.jsonl (5 rows) and train.jsonl (200 rows) of reverse-text tasks, deterministically.

    python resources_servers/reverse_text/data/generate.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = """apple river stone light cloud green table window music paper garden silver orange
bread candle forest yellow winter summer pencil rocket planet ocean island mountain coffee
tiger rabbit purple simple quick brown jumps over lazy dog happy little bright morning
sunset castle dragon wizard lemon cherry mango basket bottle button camera doctor engine
family friend guitar hammer jacket kitten ladder marble needle pillow puzzle school spoon
ticket violin wallet yogurt zebra anchor bridge circle desert feather harbor jungle""".split()

SYSTEM = "You reverse text. Reply with the reversed text only, nothing else."


def task(text: str) -> dict:
    return {
        "responses_create_params": {
            "input": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Reverse this text: {text}"},
            ],
            "max_output_tokens": 48,
        },
        "text": text,
    }


def texts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    chosen = []
    for _ in range(count):
        chosen.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3))))
    return chosen


def main() -> None:
    folder = Path(__file__).parent
    for name, count, seed in (("example.jsonl", 5, 1), ("train.jsonl", 200, 2)):
        with (folder / name).open("w") as handle:
            for text in texts(count, seed):
                handle.write(json.dumps(task(text)) + "\n")


if __name__ == "__main__":
    main()
