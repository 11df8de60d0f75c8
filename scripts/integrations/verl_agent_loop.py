"""rollgym → verl: an agent loop whose trajectories are rollgym `POST /run` rollouts.

verl (0.9.1, `verl.experimental.agent_loop`) runs one agent loop per sample: it instantiates the
class registered under the sample's `agent_name` with hydra and awaits
`run(sampling_params, **dataset_fields)`, which returns an `AgentLoopOutput`. This loop sends the
sample's rollgym task row to an agent's `/run` (through `RolloutClient`, with its bounded retries)
and maps the verified rollout onto the output:

    AgentLoopOutput field   ← rollgym /run answer
    prompt_ids              ← sequences[0].prompt_ids
    response_ids            ← sequences[0].completion_ids   (model tokens and environment tokens)
    response_mask           ← sequences[0].completion_mask  (1 = model token, 0 = tool output/chat glue)
    response_logprobs       ← sequences[0].completion_logprobs (0.0 where the mask is 0)
    reward_score            ← reward (the environment's verified reward; verl puts it on the last token)
    num_turns               ← 1 (the prompt) + model calls + tool outputs (verl's own loops count the same way)
    metrics                 ← AgentLoopMetrics(generate_sequences=model_latency_s, tool_calls=env_latency_s)
    extra_fields["rollgym"] ← status, rollout_id, group_id, reward_components, metrics

When verl is importable, `RollgymAgentLoop` subclasses verl's real `AgentLoopBase`, returns its real
`AgentLoopOutput` and is registered as `rollgym_agent`. Without verl (it pins transformers < 5.11
and pulls ray), the module falls back to stand-ins with verl 0.9.1's field set, so the mapping can
be used and tested anywhere; `VERL_AVAILABLE` says which.

Wiring it into verl:

1. Turn task rows into a verl dataset (one `prompt` for verl's length filter, the row itself as a
   JSON string in `rollgym_task`, `agent_name: rollgym_agent`):

       python scripts/integrations/verl_agent_loop.py prepare --input tasks.jsonl --output train.parquet

2. Name the loop and the agent in an agent-loop config file, e.g. `rollgym_agent_loop.yaml`:

       - name: rollgym_agent
         _target_: verl_agent_loop.RollgymAgentLoop
         target: http://127.0.0.1:8123      # the agent's URL, or a registry file from `rollgym run --registry-file`
         agent: null                         # with a registry: which agent (else the row's agent_ref / the only one)

   and pass `actor_rollout_ref.rollout.agent.agent_loop_config_path=rollgym_agent_loop.yaml`,
   `data.train_files=train.parquet`, `actor_rollout_ref.rollout.mode=async` (agent loops need it)
   to `python -m verl.trainer.main_ppo`, with `PYTHONPATH=scripts/integrations` so that verl's workers
   import this file as `verl_agent_loop` (verl ships a top-level `scripts` package of its own, so
   `scripts.integrations...` does not import where verl is installed). The `ROLLGYM_AGENT`
   environment variable can stand in for `target`.

3. Point the stack's model server (`chat_completions`, `return_token_ids: true`) at the inference
   server verl trains (its OpenAI-compatible vLLM/SGLang endpoint), so rollouts are on-policy.

A rollout that never succeeds, or that does not give one clean token sequence, raises: verl has no
"unscorable" sample, and rollgym never turns a failure into a reward of 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import orjson
from pydantic import BaseModel

from rollgym import RolloutClient
from rollgym.data.export import prompt_messages

AGENT_NAME = "rollgym_agent"
VERL_FIELDS_VERSION = "0.9.1"  # the verl release whose AgentLoopOutput fields the fallback copies

try:  # the real thing, when verl is installed
    from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput, register

    VERL_AVAILABLE = True
except ImportError:  # stand-ins with verl 0.9.1's field set
    VERL_AVAILABLE = False

    class AgentLoopMetrics(BaseModel):  # type: ignore[no-redef]
        """verl 0.9.1 `AgentLoopMetrics`."""

        generate_sequences: float = 0.0
        tool_calls: float = 0.0
        compute_score: float = 0.0
        num_preempted: int = -1

    class AgentLoopOutput(BaseModel):  # type: ignore[no-redef]
        """verl 0.9.1 `AgentLoopOutput` (fields only; verl's `as_dict` needs torch)."""

        prompt_ids: list[int]
        response_ids: list[int]
        response_mask: list[int]
        response_logprobs: Optional[list[float]] = None
        routed_experts: Optional[Any] = None
        multi_modal_data: Optional[dict[str, Any]] = None
        reward_score: Optional[float] = None
        num_turns: int = 0
        metrics: AgentLoopMetrics
        extra_fields: dict[str, Any] = {}

    class AgentLoopBase:  # type: ignore[no-redef]
        """verl 0.9.1 `AgentLoopBase`'s constructor contract: trainer_config and data_config come wrapped."""

        def __init__(self, trainer_config: Any = None, server_manager: Any = None, tokenizer: Any = None,
                     processor: Any = None, dataset_cls: Any = None, data_config: Any = None, **kwargs: Any) -> None:
            self.config = getattr(trainer_config, "config", trainer_config)
            rollout = _get(_get(self.config, "actor_rollout_ref"), "rollout")
            self.rollout_config = rollout
            self.server_manager = server_manager
            self.tokenizer = tokenizer
            self.processor = processor
            self.dataset_cls = dataset_cls
            self.data_config = getattr(data_config, "config", data_config)

        async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
            raise NotImplementedError

    def register(agent_name: str):  # type: ignore[no-redef]
        def decorator(subclass: type) -> type:
            return subclass

        return decorator


def _get(config: Any, key: str, default: Any = None) -> Any:
    if config is None:
        return default
    if isinstance(config, Mapping):
        return config.get(key, default)
    getter = getattr(config, "get", None)
    if callable(getter):
        return getter(key, default)
    return getattr(config, key, default)


# One client per (target, agent) per process: verl makes a new agent loop object for every sample.
_CLIENTS: dict[tuple[str, str | None, float, int], RolloutClient] = {}
_CLIENTS_LOCK = threading.Lock()


def shared_client(target: str, agent: str | None = None, timeout_s: float = 3600.0,
                  max_attempts: int = 3) -> RolloutClient:
    key = (target, agent, timeout_s, max_attempts)
    with _CLIENTS_LOCK:
        client = _CLIENTS.get(key)
        if client is None:
            client = _CLIENTS[key] = RolloutClient(target, agent, timeout_s=timeout_s, max_attempts=max_attempts)
        return client


def close_clients() -> None:
    with _CLIENTS_LOCK:
        clients = list(_CLIENTS.values())
        _CLIENTS.clear()
    for client in clients:
        client.close()


class UnusableRollout(RuntimeError):
    """A rollout that cannot be one (prompt, response) pair for verl."""


def task_row(fields: Mapping[str, Any]) -> dict[str, Any]:
    """The rollgym task row of a verl sample: `rollgym_task` (JSON text or a dict), or in `extra_info`."""
    task = fields.get("rollgym_task")
    if task is None and isinstance(fields.get("extra_info"), Mapping):
        task = fields["extra_info"].get("rollgym_task")
    if task is None:
        raise KeyError("the sample has no rollgym_task field: build the dataset with `verl_agent_loop.py prepare`")
    if isinstance(task, (str, bytes)):
        task = orjson.loads(task)
    return dict(task)


def rollout_to_output(rollout: Mapping[str, Any], response_length: int | None = None) -> AgentLoopOutput:
    """verl's AgentLoopOutput from a rollgym /run answer (see the module docstring for the mapping)."""
    sequences = rollout.get("sequences") or []
    if not sequences:
        raise UnusableRollout(f"rollout {rollout.get('rollout_id')} carries no token ids (the model server must "
                              "return them: chat_completions needs return_token_ids: true)")
    if len(sequences) > 1 or rollout.get("prefix_ok") is False:
        raise UnusableRollout(f"rollout {rollout.get('rollout_id')} has {len(sequences)} token sequences: a turn's "
                              "prompt did not extend the tokens before it (prefix_ok false)")
    if rollout.get("reward") is None:
        raise UnusableRollout(f"rollout {rollout.get('rollout_id')} has no reward (status {rollout.get('status')})")
    sequence = sequences[0]
    response_ids = list(sequence["completion_ids"])
    response_mask = [int(x) for x in sequence["completion_mask"]]
    logprobs = [float(x) for x in sequence["completion_logprobs"]]
    cut = response_length is not None and len(response_ids) > response_length
    if cut:  # verl pads every response to rollout.response_length; its own tool loop cuts the same way
        response_ids, response_mask, logprobs = (x[:response_length] for x in (response_ids, response_mask, logprobs))
    output_items = (rollout.get("response") or {}).get("output") or rollout.get("output") or []  # /run's or a line's
    metrics = rollout.get("metrics") or {}
    tool_outputs = sum(1 for item in output_items if item.get("type") == "function_call_output")
    return AgentLoopOutput(
        prompt_ids=list(sequence["prompt_ids"]),
        response_ids=response_ids,
        response_mask=response_mask,
        response_logprobs=logprobs,
        reward_score=float(rollout["reward"]),
        num_turns=1 + int(metrics.get("turns", 0)) + tool_outputs,
        metrics=AgentLoopMetrics(generate_sequences=float(metrics.get("model_latency_s", 0.0)),
                                 tool_calls=float(metrics.get("env_latency_s", 0.0))),
        extra_fields={"rollgym": {
            "status": rollout.get("status"), "rollout_id": rollout.get("rollout_id"),
            "group_id": rollout.get("group_id"), "reward_components": rollout.get("reward_components"),
            "metrics": metrics, "response_cut_to": response_length if cut else None,
        }},
    )


@register(AGENT_NAME)
class RollgymAgentLoop(AgentLoopBase):
    """A verl agent loop that runs the sample's task through a rollgym agent's `/run`.

    Init keywords (from the agent-loop config file): `target` (an agent URL or a registry file;
    default: the `ROLLGYM_AGENT` environment variable), `agent`, `timeout_s`, `max_attempts`.
    verl's sampling params `temperature` and `top_p` go into `responses_create_params`, and
    `rollout.response_length` becomes `max_output_tokens` (each model call's limit) and cuts the
    merged response to the length verl pads to.
    """

    def __init__(self, *args: Any, target: str | None = None, agent: str | None = None, timeout_s: float = 3600.0,
                 max_attempts: int = 3, **kwargs: Any) -> None:
        kwargs.pop("name", None)  # the agent-loop config entry's own name, passed along by hydra
        super().__init__(*args, **kwargs)
        target = target or os.environ.get("ROLLGYM_AGENT")
        if not target:
            raise ValueError("RollgymAgentLoop needs target= (in the agent-loop config) or ROLLGYM_AGENT")
        self.client = shared_client(str(target), agent, timeout_s, max_attempts)

    def rollout_params(self, sampling_params: Mapping[str, Any]) -> dict[str, Any]:
        params: dict[str, Any] = {}
        if sampling_params.get("temperature") is not None:
            params["temperature"] = float(sampling_params["temperature"])
        top_p = sampling_params.get("top_p")
        if top_p is not None and 0.0 < float(top_p) < 1.0:
            params["top_p"] = float(top_p)
        response_length = _get(self.rollout_config, "response_length")
        if response_length:
            params["max_output_tokens"] = int(response_length)
        return params

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        row = task_row(kwargs)
        [[rollout]] = await self.client.run([row], repeats=1, params=self.rollout_params(sampling_params))
        return rollout_to_output(rollout, _get(self.rollout_config, "response_length"))


def to_verl_rows(rows: Sequence[Mapping[str, Any]], agent_name: str = AGENT_NAME) -> list[dict[str, Any]]:
    """verl dataset rows: `prompt` (chat messages, for verl's length filter), `data_source`,
    `agent_name`, `rollgym_task` (the task row as JSON text), `reward_model`, `extra_info.index`."""
    out = []
    for index, row in enumerate(rows):
        row = dict(row)
        ref = row.get("agent_ref")
        source = row.get("task_type") or (ref.get("name") if isinstance(ref, Mapping) else ref) or "rollgym"
        out.append({
            "prompt": prompt_messages(row),
            "data_source": f"rollgym/{source}",
            "agent_name": agent_name,
            "rollgym_task": orjson.dumps(row).decode(),
            "reward_model": {"style": "rollgym", "ground_truth": ""},
            "extra_info": {"index": index},
        })
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="rollgym ↔ verl helpers")
    commands = parser.add_subparsers(dest="command", required=True)
    prepare = commands.add_parser("prepare", help="task rows JSONL → a verl parquet dataset")
    prepare.add_argument("--input", required=True)
    prepare.add_argument("--output", required=True, help="a .parquet file")
    prepare.add_argument("--agent-name", default=AGENT_NAME, help="the agent loop name the rows ask for")
    args = parser.parse_args(argv)
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [orjson.loads(line) for line in Path(args.input).read_bytes().splitlines() if line.strip()]
    table = pa.Table.from_pylist(to_verl_rows(rows, args.agent_name))
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, args.output)
    print(f"wrote {len(rows)} rows to {args.output}")
    return 0


__all__ = ["AGENT_NAME", "VERL_AVAILABLE", "AgentLoopOutput", "RollgymAgentLoop", "UnusableRollout",
           "close_clients", "rollout_to_output", "shared_client", "task_row", "to_verl_rows"]

if __name__ == "__main__":
    sys.exit(main())
