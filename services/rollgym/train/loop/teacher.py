"""On-policy distillation: a teacher model server scores every trained token of a stage's curated rollouts.

    stages:
      - name: distill
        teacher: {server: teacher_model, model: teacher, lora_path: runs/train-weather/epoch-001/train/adapter}
        optimize: {trainer: grpo, args: {loss: {objective: surogate, adv_tau: 0.0, teacher_tau: 1.0}}}

After curation, every sequence of every curated rollout is sent to the teacher's `POST /v1/score`
(rollgym.scoring: prompt ids + completion ids → one logprob per completion token), `concurrency` calls at
a time; the answers go on the sequence as `teacher_logprobs`, which the GRPO trainer's surogate objective
weighs by `loss.teacher_tau` (docs/train-objective.md). A failed call fails the epoch's curation with its cause:
a missing teacher logprob is never a zero. The token ids are the student's, so before the first call the
teacher and the policy model server tokenize one probe text and must agree (and the teacher refuses ids
outside its vocabulary at every call). The teacher scores at each rollout's sampling temperature, the one
the trainer computes the student's logprobs at (unless `temperature` says otherwise), and tokens sampled
under a grammar (`completion_constrained`) are scored but outside the KL (grpo_loss says why).
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any, Mapping

from pydantic import Field, field_validator

from ...adapters import load_everywhere
from ...client import ServerCallError, ServerClient
from ...config import StrictModel
from ...data.records import model_token_mask
from ...sampling_contract import temperature_of
from ...scoring import PROBE_TEXT, tokenizer_problem

POLICY = "policy_model"  # the student: the model server the stack's agents name


class TeacherError(RuntimeError):
    """The teacher could not score a rollout (or is not the student's tokenizer): the cause, by rollout."""


class TeacherConfig(StrictModel):
    """A stage's `teacher`: which model server scores the student's tokens, and how."""

    server: str = Field(description="a model server of the stack, by name, or its base URL (http://host:port)")
    model: str | None = Field(default=None, description="the `model` every score asks for (an adapter's name); "
                              "default: the server's own choice (its latest adapter, else its base)")
    lora_path: str | None = Field(default=None, description="a PEFT adapter the loop loads on the teacher (as "
                                  "`model`, default name 'teacher') before the first score")
    temperature: float | None = Field(default=None, gt=0, description="the teacher's logits / T; default: each "
                                      "rollout's sampling temperature, at which the trainer compares the student")
    concurrency: int = Field(default=4, ge=1, description="score calls in flight")
    timeout_s: float = Field(default=300.0, gt=0, description="each score call's time limit")
    check_tokenizer: bool = Field(default=True, description="compare the teacher's tokenization of a probe text "
                                  "with the policy model's before the first score")

    @field_validator("server")
    @classmethod
    def _named(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("name a model server of the stack or give its URL")
        return value

    @property
    def model_name(self) -> str | None:
        return self.model or ("teacher" if self.lora_path else None)


def teacher_plan_problems(places: list[tuple[str, TeacherConfig | None, Any]]) -> list[str]:
    """A plan's teacher settings that cannot work, by key. `places`: (the key a teacher goes under, that
    teacher, the optimize section that trains on it): each stage of mode: epochs, or the top level of mode:
    async. A built-in trainer other than grpo has no use for teacher logprobs; with grpo, a teacher needs
    the surogate objective's teacher_tau > 0, and teacher_tau > 0 needs a teacher. A trainer of one's own
    (an import path) reads them as it likes: `teacher_logprobs` on every sequence."""
    problems = []
    for key, teacher, optimize in places:
        loss_key = key.removesuffix("teacher") + "optimize"  # stages[i].optimize, or the async plan's optimize
        tau = optimize.grpo.loss.teacher_tau if optimize.grpo is not None else 0.0
        custom = ":" in optimize.trainer
        if teacher is not None and optimize.trainer != "grpo" and not custom:
            problems.append(f"{key}: only the grpo trainer trains on teacher logprobs ({loss_key}.trainer is "
                            f"{optimize.trainer})")
        elif teacher is not None and tau <= 0 and not custom:
            problems.append(f"{key}: set {loss_key}.args.loss.teacher_tau above 0 (with objective: surogate), or "
                            "the teacher's logprobs weigh nothing")
        if teacher is None and tau > 0:
            problems.append(f"{loss_key}.args.loss.teacher_tau {tau} needs {key} (a model server that scores every "
                            "trained token)")
    return problems


def teacher_file_problems(places: list[tuple[str, TeacherConfig | None, Any]]) -> list[tuple[str, str]]:
    """(key, what is wrong) for a teacher's lora_path that is not a folder here, where the teacher is one
    of the stack's servers (a teacher at a URL loads it from its own disk)."""
    return [(f"{key}.lora_path", f"no such adapter folder: {teacher.lora_path}") for key, teacher, _ in places
            if teacher is not None and teacher.lora_path and not teacher.server.startswith(("http://", "https://"))
            and not Path(teacher.lora_path).is_dir()]


def score_records(records: list[dict[str, Any]], config: TeacherConfig,
                  registry: Mapping[str, Any]) -> dict[str, Any]:
    """Put `teacher_logprobs` on every sequence of the curated group records (in place); what was scored:
    sequences, `tokens` (model tokens sampled without a grammar), and `teacher_kl_sampled`, their mean of
    log μ − log π_T (the sampling logprob against the teacher's: the reverse KL to the teacher, estimated on
    the student's own samples, before this epoch's update). TeacherError on any failure."""
    return asyncio.run(score_records_async(records, config, registry))


async def score_records_async(records: list[dict[str, Any]], config: TeacherConfig,
                              registry: Mapping[str, Any]) -> dict[str, Any]:
    """score_records from a running event loop (mode: async, beside the orchestrator's generation)."""
    client = ServerClient(registry, timeout_s=config.timeout_s, max_retries=2)
    try:
        await _prepare(client, config, registry)
        jobs = [(member, sequence) for record in records for member in record.get("rollouts", [])
                for sequence in (member.get("sequences") or [member["sequence"]])]
        gate = asyncio.Semaphore(config.concurrency)

        async def one(member: dict[str, Any], sequence: dict[str, Any]) -> None:
            async with gate:
                sequence["teacher_logprobs"] = await _score(client, config, sequence, member)

        await asyncio.gather(*(one(member, sequence) for member, sequence in jobs))
    finally:
        await client.close()
    gaps = [sampled - taught for _, sequence in jobs
            for sampled, taught, keep, constrained in zip(
                sequence["completion_logprobs"], sequence["teacher_logprobs"], model_token_mask(sequence),
                sequence.get("completion_constrained") or [0] * len(sequence["completion_ids"]))
            if keep and not constrained]
    return {"server": config.server, "model": config.model_name, "sequences": len(jobs), "tokens": len(gaps),
            "teacher_kl_sampled": sum(gaps) / len(gaps) if gaps else None}


async def _prepare(client: ServerClient, config: TeacherConfig, registry: Mapping[str, Any]) -> None:
    """Load the teacher's adapter (when the plan gives one) and compare the two tokenizers."""
    if config.lora_path:
        try:
            if config.server.startswith(("http://", "https://")):
                reply = await client.post(config.server, "/v1/load_lora_adapter", json={
                    "lora_name": config.model_name, "lora_path": config.lora_path, "load_inplace": True})
                if not reply.ok:
                    raise TeacherError(f"HTTP {reply.status}: {reply.error_message()}")
            else:
                await load_everywhere(registry, [config.server], config.model_name, config.lora_path, timeout_s=120.0)
        except Exception as exc:  # refused, unreachable, malformed: the cause goes in the message
            raise TeacherError(f"teacher {config.server}: loading lora_path {config.lora_path}: {exc}") from None
    if not config.check_tokenizer:
        return
    student = await _probe(client, POLICY) if POLICY in registry else None
    teacher = await _probe(client, config.server)
    if student is None or teacher is None:
        return  # a server without /tokenize: the vocabulary check of every score call stays
    if problem := tokenizer_problem(student, teacher):
        raise TeacherError(f"teacher {config.server} cannot score the student's tokens: {problem} (teacher and "
                           f"{POLICY} must share a tokenizer; check_tokenizer: false skips this check)")


async def _probe(client: ServerClient, server: str) -> list[int] | None:
    try:
        reply = await client.post(server, "/tokenize", json={"text": PROBE_TEXT})
    except ServerCallError as exc:
        raise TeacherError(f"teacher check: {server} did not answer /tokenize: {exc}") from None
    tokens = reply.json().get("tokens") if reply.ok else None
    return tokens if isinstance(tokens, list) else None


async def _score(client: ServerClient, config: TeacherConfig, sequence: dict[str, Any],
                 member: dict[str, Any]) -> list[float]:
    rollout_id = member.get("rollout_id")
    temperature = config.temperature or temperature_of(member.get("sampling") or {})
    body = {"prompt_token_ids": sequence["prompt_ids"], "completion_token_ids": sequence["completion_ids"],
            "temperature": temperature}
    if config.model_name:
        body["model"] = config.model_name
    where = f"teacher {config.server}: rollout {rollout_id}"
    try:
        reply = await client.post(config.server, "/v1/score", json=body)
    except ServerCallError as exc:
        raise TeacherError(f"{where}: {exc}") from None
    if not reply.ok:
        raise TeacherError(f"{where}: HTTP {reply.status}: {reply.error_message()}")
    logprobs = reply.json().get("logprobs")
    if (not isinstance(logprobs, list) or len(logprobs) != len(sequence["completion_ids"])
            or not all(isinstance(x, (int, float)) and math.isfinite(x) for x in logprobs)):
        raise TeacherError(f"{where}: the answer has no finite logprob for each of the "
                           f"{len(sequence['completion_ids'])} completion tokens")
    return [float(x) for x in logprobs]


__all__ = ["TeacherConfig", "TeacherError", "score_records", "teacher_plan_problems"]
