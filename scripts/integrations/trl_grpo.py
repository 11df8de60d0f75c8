"""rollgym → TRL `GRPOTrainer`: a `rollout_func` whose generations are rollgym `POST /run` rollouts.

Written against TRL 1.16 (checked in its source, `GRPOTrainer._generate`): the trainer calls
`rollout_func(prompts, trainer)` with the prompts of its process's batch, each prompt already
repeated `num_generations` times in a row (its `RepeatSampler` does that), and wants one completion
per entry back: a dict with `prompt_ids`, `completion_ids`, `logprobs` and optionally `env_mask`
(1 = the model's token, trained on; 0 = a token the environment added, masked out of the loss);
every other key is handed to the reward functions as a keyword argument, one value per completion.

What this module returns per completion, from the rollout's merged token view (`sequences[0]`):
`prompt_ids`, `completion_ids`, `logprobs` = `completion_logprobs`, `env_mask` = `completion_mask`,
and `rollgym_reward` (the environment's verified reward), `rollgym_status`, `rollgym_rollout_id`.
Pass `reward_funcs=rollgym_reward` so the trainer uses the environment's reward.

    from trl_grpo import RollgymRollouts, rollgym_reward           # PYTHONPATH=scripts/integrations
    rollouts = RollgymRollouts("http://127.0.0.1:8123", rows)        # an agent URL or a stack registry
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, args=GRPOConfig(num_generations=4, ...),
                          train_dataset=rollouts.dataset(), reward_funcs=rollgym_reward, rollout_func=rollouts)

`rollout_func` only gets the prompts, so each prompt is looked up in the task rows it was built from
(`dataset()` makes the `prompt` column from them): two rows with the same prompt but different task
fields cannot be told apart and are refused up front.

A rollout that does not give one clean token sequence (an infrastructure failure after the client's
retries, no token ids from the model server, or a turn whose tokens did not extend the previous
ones, `prefix_ok: false`) is never turned into a reward of 0: with `on_unusable="raise"` (default)
the step fails with the reason; with `on_unusable="mask"` that completion becomes one end-of-sequence
token with `env_mask` 0 and reward None, which TRL 1.16 treats as unscorable (left out of the group
baseline, advantage 0) and which adds nothing to the loss.

The rollouts are sampled by whatever model the agent's model server runs. For on-policy training
that must be the trainer's current weights: run the stack's `chat_completions` model against the
vLLM server that TRL syncs (`use_vllm=True, vllm_mode="server"`, `trl vllm-serve`; TRL pushes the
weights before it calls `rollout_func`). The CPU demo below uses the embedded llama.cpp model, whose
weights do not follow the trainer: fine for a smoke test, off-policy after the first step.

Run a real GRPO step on CPU (the embedded SmolLM2-135M serves rollouts, the same GGUF is the policy):

    python scripts/integrations/trl_grpo.py --config resources_servers/reverse_text/configs/reverse_text.yaml \
        --input resources_servers/reverse_text/data/example.jsonl --limit 2 --num-generations 2 --max-steps 1
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import orjson

from rollgym import RolloutClient
from rollgym.data.export import prompt_messages
from rollgym.train.trainers.policy import load_gguf_policy

log = logging.getLogger("rollgym.trl_grpo")

TRL_VERSION_CHECKED = "1.16.0"
EXTRA_FIELDS = ("rollgym_reward", "rollgym_status", "rollgym_rollout_id")


class UnusableRollout(RuntimeError):
    """A rollout that cannot be one (prompt, completion) pair for the trainer."""


def _drop_none(value: Any) -> Any:
    """Arrow gives every struct the union of its rows' keys, filled with None: drop those again."""
    if isinstance(value, dict):
        return {key: _drop_none(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [_drop_none(item) for item in value]
    return value


def prompt_key(prompt: Any) -> str:
    """A canonical text for a prompt (chat messages or a string), the same before and after Arrow."""
    return orjson.dumps(_drop_none(prompt), option=orjson.OPT_SORT_KEYS).decode()


def task_prompt(row: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The chat messages of a task row's prompt (`instructions` as system, then the input items)."""
    return prompt_messages(dict(row))


class RollgymRollouts:
    """A TRL `rollout_func` that runs every generation as a rollgym rollout; also builds the dataset.

    `target` and the keyword arguments `agent`, `timeout_s`, `max_attempts`, `params` and
    `auth_token` go to `RolloutClient` (or pass `client=`). With `sampling_from_trainer` (default) each
    call also sends the trainer's `temperature`, `top_p` (when not 1) and `max_completion_length` (as
    `max_output_tokens`, the limit of each model call) in `responses_create_params`, so that the
    rollouts are sampled the way the trainer scores them.
    """

    def __init__(
        self,
        target: Any,
        rows: Sequence[Mapping[str, Any]],
        *,
        agent: str | None = None,
        client: RolloutClient | None = None,
        concurrency: int = 32,
        on_unusable: str = "raise",
        sampling_from_trainer: bool = True,
        **client_kwargs: Any,
    ) -> None:
        if on_unusable not in ("raise", "mask"):
            raise ValueError("on_unusable must be 'raise' or 'mask'")
        self.client = client or RolloutClient(target, agent, **client_kwargs)
        self._own_client = client is None
        self.concurrency = concurrency
        self.on_unusable = on_unusable
        self.sampling_from_trainer = sampling_from_trainer
        self.rows: dict[str, dict[str, Any]] = {}
        self.prompts: list[list[dict[str, Any]]] = []
        for index, row in enumerate(rows):
            prompt = task_prompt(row)
            key = prompt_key(prompt)
            known = self.rows.get(key)
            if known is None:
                self.rows[key] = dict(row)
                self.prompts.append(prompt)
            elif _row_digest(known) != _row_digest(row):
                raise ValueError(
                    f"rows[{index}] has the same prompt as an earlier row but other task fields; TRL hands "
                    "rollout_func only the prompt, so they cannot be told apart: make the prompts distinct"
                )
        self.last_rollouts: list[dict[str, Any] | None] = []
        self.calls = 0

    def dataset(self) -> Any:
        """A `datasets.Dataset` with one `prompt` (chat messages) per distinct task row."""
        from datasets import Dataset

        return Dataset.from_list([{"prompt": prompt} for prompt in self.prompts])

    def row_for(self, prompt: Any) -> dict[str, Any]:
        row = self.rows.get(prompt_key(prompt))
        if row is None:
            raise KeyError("no task row has this prompt (build the dataset with RollgymRollouts.dataset()): "
                           f"{prompt!r:.200}")
        return row

    def sampling_params(self, trainer: Any) -> dict[str, Any]:
        if not self.sampling_from_trainer or trainer is None:
            return {}
        args = trainer.args
        params: dict[str, Any] = {"temperature": float(args.temperature)}
        if getattr(args, "top_p", 1.0) not in (None, 1.0):
            params["top_p"] = float(args.top_p)
        if getattr(args, "max_completion_length", None):
            params["max_output_tokens"] = int(args.max_completion_length)
        return params

    def __call__(self, prompts: list[Any], trainer: Any = None) -> dict[str, list[Any]]:
        """TRL's rollout_func: one rollout per entry of `prompts` (consecutive equal prompts are one group)."""
        runs: list[tuple[dict[str, Any], list[int]]] = []  # (task row, positions in prompts)
        previous = None
        for position, prompt in enumerate(prompts):
            key = prompt_key(prompt)
            if key == previous:
                runs[-1][1].append(position)
            else:
                runs.append((self.row_for(prompt), [position]))
                previous = key
        result = self.client.run_detailed_sync(
            [row for row, _ in runs], repeats=[len(positions) for _, positions in runs],
            concurrency=self.concurrency, params=self.sampling_params(trainer),
        )
        failures = {(failure.index, failure.repeat): failure for failure in result.failures}
        eos = _eos_id(trainer)
        out: dict[str, list[Any]] = {name: [None] * len(prompts) for name in
                                     ("prompt_ids", "completion_ids", "logprobs", "env_mask", *EXTRA_FIELDS)}
        self.last_rollouts = [None] * len(prompts)
        for index, (_, positions) in enumerate(runs):
            for repeat, position in enumerate(positions):
                rollout = result.get(index, repeat)
                try:
                    if rollout is None:
                        failure = failures[(index, repeat)]
                        raise UnusableRollout(f"rollout {failure.rollout_id} failed after {failure.attempts} "
                                              f"attempt(s): {failure.status}: {failure.error}")
                    sequence = usable_sequence(rollout)
                except UnusableRollout as problem:
                    if self.on_unusable == "raise":
                        raise
                    _put(out, position, [eos], [eos], [0.0], [0], None,
                         rollout["status"] if rollout else failures[(index, repeat)].status,
                         rollout["rollout_id"] if rollout else failures[(index, repeat)].rollout_id)
                    log.warning("masked an unusable rollout (reward None, env_mask 0): %s", problem)
                    continue
                self.last_rollouts[position] = rollout
                _put(out, position, sequence["prompt_ids"], sequence["completion_ids"],
                     [float(x) for x in sequence["completion_logprobs"]], [int(x) for x in sequence["completion_mask"]],
                     float(rollout["reward"]), rollout["status"], rollout["rollout_id"])
        self.calls += 1
        return out

    def close(self) -> None:
        if self._own_client:
            self.client.close()


def usable_sequence(rollout: Mapping[str, Any]) -> dict[str, Any]:
    """The rollout's one token sequence, or UnusableRollout saying why there is none."""
    sequences = rollout.get("sequences")
    if not sequences:
        raise UnusableRollout(f"rollout {rollout.get('rollout_id')} carries no token ids (the model server must "
                              "return them: chat_completions needs return_token_ids: true)")
    if len(sequences) > 1 or rollout.get("prefix_ok") is False:
        raise UnusableRollout(f"rollout {rollout.get('rollout_id')} has {len(sequences)} token sequences: a turn's "
                              "prompt did not extend the tokens before it (prefix_ok false)")
    sequence = sequences[0]
    if not sequence["completion_ids"]:
        raise UnusableRollout(f"rollout {rollout.get('rollout_id')} generated no tokens")
    return sequence


def _put(out: dict[str, list[Any]], position: int, prompt_ids: list[int], completion_ids: list[int],
         logprobs: list[float], env_mask: list[int], reward: float | None, status: str, rollout_id: str) -> None:
    out["prompt_ids"][position] = list(prompt_ids)
    out["completion_ids"][position] = list(completion_ids)
    out["logprobs"][position] = logprobs
    out["env_mask"][position] = env_mask
    out["rollgym_reward"][position] = reward
    out["rollgym_status"][position] = status
    out["rollgym_rollout_id"][position] = rollout_id


def _eos_id(trainer: Any) -> int:
    tokenizer = getattr(trainer, "processing_class", None)
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
    eos = getattr(tokenizer, "eos_token_id", None)
    return int(eos) if eos is not None else 0


def _row_digest(row: Mapping[str, Any]) -> str:
    return hashlib.sha1(orjson.dumps(dict(row), option=orjson.OPT_SORT_KEYS)).hexdigest()


def rollgym_reward(prompts: list[Any], completions: list[Any], rollgym_reward: list[float | None] | None = None,
                   **kwargs: Any) -> list[float | None]:
    """TRL reward function: the environment's verified reward of each rollout (None = unscorable)."""
    if rollgym_reward is None:
        raise ValueError("rollgym_reward needs the rollgym_reward field: pass rollout_func=RollgymRollouts(...)")
    return list(rollgym_reward)


# ---------------------------------------------------------------------------- the GGUF policy on CPU


def grpo_config(output_dir: str, **overrides: Any) -> Any:
    """A small CPU GRPOConfig for smoke runs (no vLLM, fp32, no reporting); `overrides` win."""
    import dataclasses

    from trl import GRPOConfig

    settings: dict[str, Any] = dict(
        output_dir=output_dir, use_vllm=False, bf16=False, fp16=False, report_to="none", use_cpu=True,
        per_device_train_batch_size=4, num_generations=2, gradient_accumulation_steps=1, max_steps=1,
        max_completion_length=16, learning_rate=1e-4, logging_steps=1, save_strategy="no",
        dataloader_num_workers=0, seed=0, disable_tqdm=True,
    )
    # No recomputation on CPU: the memory is there, the time is not (the field was renamed in transformers 5).
    names = {field.name for field in dataclasses.fields(GRPOConfig)}
    settings["activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"] = False
    settings.update(overrides)
    return GRPOConfig(**settings)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="A real GRPO run with TRL whose rollouts come from rollgym /run.")
    parser.add_argument("--config", nargs="+", required=True, help="stack config files and key=value overrides")
    parser.add_argument("--input", required=True, help="task rows JSONL")
    parser.add_argument("--agent", help="which agent of the stack (default: the only one)")
    parser.add_argument("--limit", type=int, default=2, help="use the first N task rows")
    parser.add_argument("--num-generations", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=1)
    parser.add_argument("--max-completion-length", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--model", help="a GGUF file to train (default: the embedded SmolLM2-135M)")
    parser.add_argument("--output-dir", default="runs/trl-grpo")
    parser.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "rollgym" / "hf"),
                        help="where the GGUF's transformers conversion is kept between runs")
    args = parser.parse_args(argv)
    repo_root = str(Path(__file__).resolve().parents[2])  # server folders import from the repository root
    if repo_root not in sys.path:
        sys.path.insert(0, repo_root)

    from rollgym import Stack, load_stack
    from rollgym.config import split_configs

    files, overrides = split_configs(args.config)
    rows = [orjson.loads(line) for line in Path(args.input).read_bytes().splitlines() if line.strip()][: args.limit]
    gguf = args.model
    if gguf is None:
        from models.llamacpp.engine import bundled_model_path

        gguf = bundled_model_path()
    stack = Stack(load_stack(files, overrides))  # started before torch spins up threads, so servers fork fast
    registry = stack.start()
    try:
        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
        from trl import GRPOTrainer

        model, tokenizer = load_gguf_policy(gguf, args.cache_dir)
        rollouts = RollgymRollouts(registry, rows, agent=args.agent)
        config = grpo_config(args.output_dir, num_generations=args.num_generations, max_steps=args.max_steps,
                             per_device_train_batch_size=args.num_generations * min(len(rows), 2),
                             max_completion_length=args.max_completion_length, learning_rate=args.learning_rate)
        trainer = GRPOTrainer(model=model, processing_class=tokenizer, args=config, train_dataset=rollouts.dataset(),
                              reward_funcs=rollgym_reward, rollout_func=rollouts)
        started = time.perf_counter()
        output = trainer.train()
        print(f"trained {output.global_step} step(s) in {time.perf_counter() - started:.1f} s; "
              f"loss {output.training_loss:.6f}")
        for entry in trainer.state.log_history:
            if "reward" in entry:
                print(f"step {entry.get('step')}: reward {entry['reward']:.3f}  "
                      f"rollgym_reward {entry.get('rewards/rollgym_reward/mean', float('nan')):.3f}")
        rollouts.close()
    finally:
        stack.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
