"""Seconds from the optimizer step's end to every vLLM replica serving the step's weights (apply: weights).

    python scripts/bench_weight_sync.py --model bundled --replicas 1
    python scripts/bench_weight_sync.py --model qwen1.5b --replicas 2 --steps 3
    python scripts/bench_weight_sync.py --model bundled --dir checkpoint     # replicas read the checkpoint itself
    python scripts/bench_weight_sync.py --attach http://127.0.0.1:8000 --served-name smollm2 --bundled DIR

Real vLLM replicas (`make vllm`'s `.venv-vllm`, started as rollgym.testing.real_vllm starts them) behind one
models/chat_completions server, and the loop's own code (train/loop/weights.py) for what follows a step. The
"trainer" is this process: it holds the weights in memory (the bundled SmolLM2-135M in fp32, or a randomly
initialised Qwen2.5-1.5B-shaped model in bf16: no download), changes them as a step would, and then each
step is timed in parts:

    write     the step's checkpoint: model.safetensors into the run's step folder, as the trainer writes it
    check     its tensor names and shapes against the served model's (the safetensors headers)
    stage     the copy into the folder every replica reads (/dev/shm by default; 0 with --dir checkpoint)
    reload    vLLM's /collective_rpc reload_weights, the slowest replica
    version   the rest of the sequence on that replica: /pause, /update_weight_version, /resume
    total     write + everything until the last replica answered (every replica serves the version)

Each step ends with a generation through the pool that must report the new version. One JSON line per step,
then the median of each part; the machine's load average is printed beside them (the replicas share its
cores with whatever else runs).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "services"), str(REPO)]

from rollgym.client import ServerAddress  # noqa: E402
from rollgym.testing import serve_in_thread  # noqa: E402
from rollgym.train.loop.weights import FullWeights, WeightsConfig  # noqa: E402


def qwen_1_5b() -> Any:
    """Qwen2.5-1.5B's shape, randomly initialised (bf16): the weights a 1.5B step moves."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                         tie_word_embeddings=True, rope_theta=1e6)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def served_folder(model: str, cache: Path, bundled: Path | None = None) -> Path:
    """The folder the replicas start on: the bundled model's servable copy (`bundled`, else written into the
    cache), or the 1.5B shape with the bundled tokenizer (its ids are a subset of the 151936-row vocabulary)."""
    from rollgym.train.trainers.servable import save_servable, servable_base

    bundled = bundled or servable_base("bundled", cache / "smollm2-135m")
    if model == "bundled":
        return bundled
    folder = cache / "qwen2.5-1.5b-shaped"
    if not (folder / "model.safetensors").is_file():
        from transformers import AutoTokenizer

        save_servable(qwen_1_5b(), AutoTokenizer.from_pretrained(bundled), folder)
    return folder


def trainer_weights(folder: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def step(weights: dict[str, Any], number: int) -> None:
    """What an optimizer step leaves: every weight moved (in place, as AdamW moves them)."""
    for tensor in weights.values():
        tensor.mul_(1.0 + 1e-4 * number)


def write_checkpoint(weights: dict[str, Any], folder: Path) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})


def slowest(sync: Any) -> dict[str, float]:
    """The reload and the rest of the sequence on the replica that finished last."""
    backends = [backend for replica in sync.replicas for backend in replica.get("backends") or []]
    last = max(backends, key=lambda backend: backend["seconds"].get("total", 0.0))["seconds"]
    return {"reload": last.get("reload", 0.0),
            "version": round(last.get("pause", 0.0) + last.get("version", 0.0) + last.get("resume", 0.0), 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("bundled", "qwen1.5b"), default="bundled")
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dir", default=None, help="weights.dir: where replicas read (default /dev/shm/...); "
                                                     "'checkpoint': the checkpoint folder itself")
    parser.add_argument("--cache", default=str(REPO / ".cache" / "vllm"), help="where the served folders are kept")
    parser.add_argument("--bundled", default=None, help="the bundled model's servable folder, if made already")
    parser.add_argument("--attach", action="append", default=[], help="the root URL of a vLLM already serving "
                        "the model (dev mode), instead of starting one; repeat it for several")
    parser.add_argument("--served-name", default="policy", help="with --attach: the model name it serves")
    parser.add_argument("--run", default=None, help="the run folder the checkpoints go to (default: a temp folder)")
    args = parser.parse_args(argv)

    from rollgym.testing.real_vllm import DEFAULT_ARGS, real_vllm
    from models.chat_completions.app import ChatCompletionsConfig, ChatCompletionsModel

    folder = served_folder(args.model, Path(args.cache), Path(args.bundled) if args.bundled else None)
    dtype = "float32" if args.model == "bundled" else "bfloat16"
    vllm_args = ("--dtype", dtype, "--max-model-len", "2048", "--enforce-eager")
    results: list[dict[str, Any]] = []
    with ExitStack() as stack:
        run = Path(args.run) if args.run else Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-sync-")))
        started = time.perf_counter()
        urls = [f"{root.rstrip('/')}/v1" for root in args.attach]
        name = args.served_name if args.attach else "policy"
        urls += [stack.enter_context(real_vllm(folder, served_model_name=name, default_args=vllm_args)).url
                 for _ in range(args.replicas - len(urls))]
        print(f"{len(urls)} vLLM replica(s) of {folder.name} ready in {time.perf_counter() - started:.0f} s",
              file=sys.stderr)
        pool = ChatCompletionsModel(ChatCompletionsConfig(base_url=urls, model=name, max_retries=0),
                                    name="policy_model")
        url = stack.enter_context(serve_in_thread(pool))
        registry = {"policy_model": ServerAddress(url, role="models")}
        full = FullWeights(WeightsConfig(dir=args.dir), run, str(folder), log=lambda m: print(m, file=sys.stderr))
        stack.callback(full.close)
        weights = trainer_weights(folder)
        import httpx

        for number in range(1, args.steps + 1):
            step(weights, number)
            t0 = time.perf_counter()  # the optimizer step's end
            checkpoint = run / f"step-{number:03d}" / "model"
            write_checkpoint(weights, checkpoint)
            written = time.perf_counter() - t0
            version = f"{name}@step-{number:03d}"
            sync = full.publish(registry, "policy_model", checkpoint, version)
            total = time.perf_counter() - t0
            assert sync.counted, sync.summary()
            answer = httpx.post(f"{url}/v1/responses", timeout=600,
                                json={"input": "Hi", "max_output_tokens": 1}).json()
            assert answer["model_version"] == version, answer.get("model_version")
            line = {"model": args.model, "replicas": args.replicas, "step": number, "write": round(written, 3),
                    "check": sync.seconds["check"], "stage": sync.seconds["stage"], **slowest(sync),
                    "total": round(total, 3), "load_avg": round(os.getloadavg()[0], 2)}
            print(json.dumps(line), flush=True)
            results.append(line)
            if number > 1:
                shutil.rmtree(run / f"step-{number - 1:03d}", ignore_errors=True)
        if args.attach:  # attached servers go back to the weights they started on
            full.publish(registry, "policy_model", folder, "default")
    parts = ("write", "check", "stage", "reload", "version", "total")
    median = {part: round(statistics.median(line[part] for line in results), 3) for part in parts}
    print(json.dumps({"model": args.model, "replicas": args.replicas, "median": median,
                      "load_avg": [round(x, 2) for x in os.getloadavg()]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
