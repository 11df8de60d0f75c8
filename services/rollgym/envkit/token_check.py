"""`rollgym check-tokens`: does this model server + agent + environment produce token-exact data?

It starts the stack (or uses a running one), runs a few multi-turn rollouts through the agent's
`POST /run` and, for every rollout, checks each model call's prompt against the tokens before it:

- per turn: does the prompt extend the previous call's prompt + generation exactly? If not, where
  does it diverge: the index and the decoded tokens around the first mismatch, on both sides, and
  why a new segment of the rollout begins there (`boundary_reason`);
- at the end: re-tokenizing the final conversation with the model server's chat template
  (`POST /tokenize` on the model server), does it give the ids that were sampled? A difference there
  is what a trainer that re-tokenizes conversations would train on instead of the sampled tokens; it
  is reported, and fails the check only with `--strict` (the rollout's `sequences` carry the sampled
  ids, which is what rollgym's training data uses).

Exit code 0 when every turn extended the previous tokens exactly, 1 on drift (or when nothing could
be checked: failed rollouts, no token ids, no multi-turn rollout), 2 on a usage error.

Decoding goes through the model server: `POST /detokenize {"tokens": [...], "pieces": true}` ->
`{"text", "pieces"}` and `POST /tokenize {"input": [...], "tools": [...], "add_generation_prompt":
false}` -> `{"tokens", "count"}` (models/llamacpp and models/chat_completions serve both).
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson

from ..client import ServerAddress, ServerCallError, ServerClient, load_registry_file
from ..config import StackConfig, load_stack, split_configs
from ..data.jsonl import JsonlError, read_jsonl
from ..statuses import FAILURE_STATUSES
from ..sequences import (Divergence, TokenRecord, boundary_reason, common_prefix_length, divergence_span,
                         first_divergence, make_divergence, token_record)


class CheckUsageError(Exception):
    """A command-line mistake (reported as a usage error)."""


@dataclass
class TurnReport:
    call: int
    prompt_tokens: int
    generated_tokens: int
    extends: bool | None = None  # None for the first call
    added_tokens: int = 0
    divergence: Divergence | None = None
    model_version: str | None = None
    reason: str | None = None  # why a new segment begins at this call (when it does not extend)


@dataclass
class RolloutReport:
    task: int
    status: str
    error: str | None = None
    reward: float | None = None
    prefix_ok: bool | None = None
    sequences: int | None = None
    turns: list[TurnReport] = field(default_factory=list)
    retokenize: str = "not checked"
    retokenize_same: bool | None = None
    retokenize_divergence: Divergence | None = None


@dataclass
class Report:
    agent: str
    model_server: str
    input: str
    forced_tool: bool
    rollouts: list[RolloutReport] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def boundaries(self) -> int:
        return sum(1 for r in self.rollouts for t in r.turns if t.extends is not None)

    @property
    def drifted(self) -> int:
        return sum(1 for r in self.rollouts for t in r.turns if t.extends is False)

    def ok(self, strict: bool = False) -> bool:
        if self.problems or self.drifted or self.boundaries == 0:
            return False
        return not (strict and any(r.retokenize_same is False for r in self.rollouts))


# ---------------------------------------------------------------------- running


def read_tasks(path: Path, count: int) -> list[dict[str, Any]]:
    """`count` task rows from `path`, cycling through them when it has fewer."""
    try:
        rows = read_jsonl(path)
    except JsonlError as exc:
        raise CheckUsageError(str(exc)) from None
    for number, row in enumerate(rows, start=1):
        if not isinstance(row.get("responses_create_params"), dict):
            raise CheckUsageError(f"{path}: row {number}: a task row needs responses_create_params")
    if not rows:
        raise CheckUsageError(f"{path}: no tasks")
    return [rows[i % len(rows)] for i in range(count)]


def prepare_task(row: dict[str, Any], *, force_tool: bool, max_output_tokens: int | None, index: int) -> dict[str, Any]:
    """The row for /run: a forced first tool call (so rollouts are multi-turn), a token limit."""
    params = dict(row["responses_create_params"])
    tools = params.get("tools") or []
    if force_tool and tools and params.get("tool_choice") in (None, "auto"):
        first = tools[0]
        if isinstance(first, dict) and first.get("name"):
            params["tool_choice"] = {"type": "function", "name": first["name"]}
    if max_output_tokens is not None:
        params["max_output_tokens"] = max_output_tokens
    return {**row, "responses_create_params": params, "rollout_id": f"check-tokens-{index}"}


class TokenChecker:
    def __init__(self, client: ServerClient, agent: str, model: str) -> None:
        self.client = client
        self.agent = agent
        self.model = model
        self.can_decode = True

    async def run(self, rows: list[dict[str, Any]], timeout_s: float) -> list[RolloutReport]:
        return list(await asyncio.gather(*(self.check_one(i, row, timeout_s) for i, row in enumerate(rows))))

    async def check_one(self, index: int, row: dict[str, Any], timeout_s: float) -> RolloutReport:
        report = RolloutReport(task=index + 1, status="?")
        try:
            reply = await self.client.post(self.agent, "/run", json=row, timeout_s=timeout_s, max_retries=1)
        except ServerCallError as exc:
            report.status, report.error = "unreachable", str(exc)
            return report
        if not reply.ok:
            report.status, report.error = f"HTTP {reply.status}", reply.error_message()
            return report
        result = reply.json()
        report.status = str(result.get("status"))
        report.error = result.get("error")
        report.reward = result.get("reward")
        report.prefix_ok = result.get("prefix_ok")
        report.sequences = len(result["sequences"]) if isinstance(result.get("sequences"), list) else None
        output = ((result.get("response") or {}).get("output")) or []
        records = [(item, rec) for item in output if (rec := token_record(item)) is not None]
        previous: TokenRecord | None = None
        for number, (item, record) in enumerate(records, start=1):
            turn = TurnReport(call=number, prompt_tokens=len(record.prompt), generated_tokens=len(record.generation),
                              model_version=record.model_version)
            if previous is not None:
                expected = previous.prompt + previous.generation
                at = first_divergence(expected, record.prompt)
                turn.extends = at is None
                if at is None:
                    turn.added_tokens = len(record.prompt) - len(expected)
                else:
                    turn.divergence = await self.divergence(expected, record.prompt, at)
                    turn.reason = boundary_reason(len(previous.prompt), turn.divergence)
            report.turns.append(turn)
            previous = record
        if previous is not None:
            await self.retokenize(report, row, output, previous)
        return report

    async def divergence(self, expected: list[int], actual: list[int], at: int) -> Divergence:
        lo, hi = divergence_span(at)
        left, right = await asyncio.gather(self.pieces(expected[lo:hi]), self.pieces(actual[lo:hi]))
        return make_divergence(expected, actual, at, left, right)

    async def pieces(self, ids: list[int]) -> list[str]:
        """Each token's text, through the model server's /detokenize; the ids themselves if it has none."""
        if self.can_decode and ids:
            try:
                reply = await self.client.post(self.model, "/detokenize", json={"tokens": ids, "pieces": True},
                                               timeout_s=60, max_retries=1)
            except ServerCallError:
                reply = None
            if reply is not None and reply.ok:
                pieces = reply.json().get("pieces")
                if isinstance(pieces, list) and len(pieces) == len(ids):
                    return [repr(piece) for piece in pieces]
            if reply is not None and reply.status in (404, 405):
                self.can_decode = False
        return [f"#{token}" for token in ids]

    async def retokenize(self, report: RolloutReport, row: dict[str, Any], output: list[dict[str, Any]],
                         last: TokenRecord) -> None:
        """Re-render the final conversation with the chat template and compare it with the sampled ids."""
        params = row["responses_create_params"]
        given = params.get("input")
        conversation = ([{"role": "user", "content": given}] if isinstance(given, str) else list(given or [])) + output
        body = {"input": conversation, "tools": params.get("tools"), "instructions": params.get("instructions"),
                "add_generation_prompt": False}
        try:
            reply = await self.client.post(self.model, "/tokenize", json=body, timeout_s=120, max_retries=1)
        except ServerCallError as exc:
            report.retokenize = f"not available ({exc.kind})"
            return
        if not reply.ok:
            report.retokenize = f"not available (model server /tokenize: HTTP {reply.status})"
            return
        tokens = reply.json().get("tokens")
        if not isinstance(tokens, list):
            report.retokenize = "not available (no tokens in the answer)"
            return
        sampled = last.prompt + last.generation
        shared = common_prefix_length(sampled, tokens)
        if shared == min(len(sampled), len(tokens)):
            report.retokenize_same = True
            tail = len(tokens) - len(sampled)
            note = ("" if tail == 0 else f"; the re-render adds {tail} trailing template tokens" if tail > 0
                    else f"; the sampled ids have {-tail} more at the end (e.g. the end-of-turn token)")
            report.retokenize = f"same ids as sampled ({shared} tokens{note})"
            return
        report.retokenize_same = False
        report.retokenize_divergence = await self.divergence(sampled, tokens, shared)
        report.retokenize = (f"differs from the sampled ids at token {shared} of {len(sampled)} "
                             f"(re-rendered: {len(tokens)} tokens)")


# ---------------------------------------------------------------------- reporting


def format_report(report: Report, *, strict: bool = False) -> str:
    lines = [f"agent {report.agent}, model server {report.model_server}, {len(report.rollouts)} rollouts of "
             f"{report.input}{' (first tool call forced)' if report.forced_tool else ''}"]
    for rollout in report.rollouts:
        head = f"rollout {rollout.task}: status {rollout.status}"
        if rollout.reward is not None:
            head += f", reward {rollout.reward:g}"
        head += f", {len(rollout.turns)} model calls with token ids"
        if rollout.prefix_ok is not None:
            head += f"; agent: prefix_ok {str(rollout.prefix_ok).lower()}, {rollout.sequences} sequence(s)"
        lines.append(head)
        if rollout.error:
            lines.append(f"  error: {rollout.error}")
        for turn in rollout.turns:
            version = f" [model_version {turn.model_version}]" if turn.model_version else ""
            if turn.extends is None:
                lines.append(f"  call {turn.call}: prompt {turn.prompt_tokens} tokens, generated {turn.generated_tokens}{version}")
            elif turn.extends:
                lines.append(f"  call {turn.call}: prompt {turn.prompt_tokens} tokens = the previous "
                             f"{turn.prompt_tokens - turn.added_tokens} exactly + {turn.added_tokens} added between "
                             f"turns, generated {turn.generated_tokens}  ok{version}")
            else:
                d = turn.divergence
                assert d is not None
                lines.append(f"  call {turn.call}: DRIFT: the prompt ({d.actual_len} tokens) stops extending the previous "
                             f"prompt + generation ({d.expected_len} tokens) at token {d.index}{version}")
                lines.append(f"      previous tokens: {d.expected}")
                lines.append(f"      this prompt:     {d.actual}")
                if turn.reason:
                    lines.append(f"      a new segment begins: {turn.reason}")
        lines.append(f"  re-tokenized final conversation: {rollout.retokenize}")
        if rollout.retokenize_divergence is not None:
            d = rollout.retokenize_divergence
            lines.append(f"      sampled:      {d.expected}")
            lines.append(f"      re-tokenized: {d.actual}")
    for problem in report.problems:
        lines.append(f"problem: {problem}")
    same = sum(1 for r in report.rollouts if r.retokenize_same)
    checked = sum(1 for r in report.rollouts if r.retokenize_same is not None)
    retok = f"re-tokenized conversations identical to the sampled ids: {same} of {checked}"
    if checked and same < checked:
        retok += " (" + ("fails with --strict" if strict else "informational: train on `sequences`, not on re-tokenized text") + ")"
    if report.ok(strict):
        lines.append(f"PASS: {report.boundaries} turn boundaries in {len(report.rollouts)} rollouts; every prompt "
                     f"extended the previous tokens exactly. {retok}")
    elif report.drifted:
        lines.append(f"FAIL: {report.drifted} of {report.boundaries} turn boundaries drifted (see DRIFT above). {retok}")
    elif report.boundaries == 0 and not report.problems:
        lines.append("FAIL: no rollout had two model calls with token ids: nothing to compare "
                     "(use a multi-turn environment, or keep the forced first tool call)")
    elif strict and checked and same < checked:
        lines.append(f"FAIL (--strict): {retok}")
    else:
        lines.append(f"FAIL: {len(report.problems)} problem(s) above. {retok}")
    return "\n".join(lines)


def find_problems(report: Report) -> None:
    for rollout in report.rollouts:
        if rollout.status in FAILURE_STATUSES or rollout.status.startswith(("HTTP", "unreachable")):
            report.problems.append(f"rollout {rollout.task} failed ({rollout.status}): {rollout.error}")
        elif not rollout.turns:
            report.problems.append(f"rollout {rollout.task}: the model server returned no token ids "
                                   "(models/chat_completions: set return_token_ids: true)")


# ---------------------------------------------------------------------- the command (options: rollgym.cli)


def _servers_for(config: StackConfig | None, registry: dict[str, ServerAddress], args: Any) -> tuple[str, str]:
    agents = [name for name, address in registry.items() if address.role in ("agents", "")]
    if args.agent:
        if args.agent not in registry:
            raise CheckUsageError(f"--agent: no server named '{args.agent}' (agents: {', '.join(agents) or 'none'})")
        agent = args.agent
    elif len(agents) == 1:
        agent = agents[0]
    elif not agents:
        raise CheckUsageError("the stack has no agent server")
    else:
        raise CheckUsageError(f"the stack has several agents ({', '.join(agents)}); pick one with --agent")
    model = args.model_server
    if model is None and config is not None:
        ref = config.servers[agent].options.get("model_server")
        model = ref.get("name") if isinstance(ref, dict) else None
    if model is None:
        models = [name for name, address in registry.items() if address.role == "models"]
        if len(models) != 1:
            raise CheckUsageError("say which model server decodes tokens: --model-server NAME")
        model = models[0]
    if model not in registry:
        raise CheckUsageError(f"--model-server: no server named '{model}'")
    return agent, model


def _default_input(config: StackConfig | None, agent: str) -> Path:
    if config is None:
        raise CheckUsageError("--input is required with --registry-file")
    ref = config.servers[agent].options.get("resources_server")
    name = ref.get("name") if isinstance(ref, dict) else None
    spec = config.servers.get(name) if name else None
    if spec is None:
        raise CheckUsageError(f"agent '{agent}' names no resources server; pass --input")
    path = spec.path / "data" / "example.jsonl"
    if not path.is_file():
        raise CheckUsageError(f"no {path}; pass --input")
    return path


def command(args: Any) -> int:
    from ..stack.launcher import Stack

    if args.rollouts < 1:
        raise CheckUsageError("--rollouts must be at least 1")
    if args.input and not Path(args.input).is_file():
        raise CheckUsageError(f"--input: no such file: {args.input}")
    started = time.perf_counter()
    stack = None
    config: StackConfig | None = None
    try:
        if args.config:
            files, overrides = split_configs(args.config)
            config = load_stack(files, overrides)
            agents = [spec.name for spec in config.by_role("agents")]
            if args.agent and args.agent not in agents:
                raise CheckUsageError(f"--agent: no agent named '{args.agent}' (agents: {', '.join(agents) or 'none'})")
            stack = Stack(config)
            registry = stack.start()
            print(f"rollgym check-tokens: stack ready in {time.perf_counter() - started:.2f} s", file=sys.stderr, flush=True)
        else:
            try:
                registry = load_registry_file(args.registry_file)
            except ValueError as exc:
                raise CheckUsageError(f"--registry-file: {exc}") from None
        agent, model = _servers_for(config, registry, args)
        input_path = Path(args.input) if args.input else _default_input(config, agent)
        max_tokens = args.max_output_tokens or None
        rows = [prepare_task(row, force_tool=not args.no_force_tool, max_output_tokens=max_tokens, index=i)
                for i, row in enumerate(read_tasks(input_path, args.rollouts))]
        report = Report(agent=agent, model_server=model, input=str(input_path), forced_tool=not args.no_force_tool)
        report.rollouts = asyncio.run(_run(registry, agent, model, rows, args.timeout))
    finally:
        if stack is not None:
            stack.stop()
    find_problems(report)
    print(format_report(report, strict=args.strict), flush=True)
    if args.json_path:
        Path(args.json_path).write_bytes(orjson.dumps({**asdict(report), "ok": report.ok(args.strict)},
                                                      option=orjson.OPT_INDENT_2))
    return 0 if report.ok(args.strict) else 1


async def _run(registry: dict[str, ServerAddress], agent: str, model: str, rows: list[dict[str, Any]],
               timeout_s: float) -> list[RolloutReport]:
    client = ServerClient(registry, timeout_s=timeout_s, max_retries=1)
    try:
        return await TokenChecker(client, agent, model).run(rows, timeout_s)
    finally:
        await client.close()
