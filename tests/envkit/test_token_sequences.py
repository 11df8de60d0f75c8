"""Unit tests of the token arithmetic: merging a rollout into trainer sequences (rollgym.sequences), the
next prompt that extends the previous tokens (extend_tokens), and check-tokens' verdicts and report."""

from __future__ import annotations

import asyncio
from typing import Any

from rollgym.schema import Sequence
from rollgym.sequences import extend_tokens, merge_sequences, token_record
from rollgym.envkit.token_check import (Divergence, Report, RolloutReport, TokenChecker, TurnReport, format_report,
                                        prepare_task)

# A chatml-like vocabulary for extend_tokens: special tokens are single ids.
IM_START, IM_END, NL, ASSISTANT, USER, TOOL = 1, 2, 3, 4, 5, 6


def item(prompt: list[int], generation: list[int], version: str | None = None) -> dict:
    record = {"type": "message", "prompt_token_ids": prompt, "generation_token_ids": generation,
              "generation_log_probs": [-0.5] * len(generation)}
    if version is not None:
        record["model_version"] = version
    return record


def test_turns_that_extend_merge_into_one_sequence_with_versions() -> None:
    items = [item([1, 2], [3, 4], "v1"), {"type": "function_call_output", "call_id": "c", "output": "x"},
             item([1, 2, 3, 4, 9, 9], [5], "v2")]
    sequences, prefix_ok = merge_sequences(items)
    assert prefix_ok is True
    assert sequences == [{"prompt_ids": [1, 2], "completion_ids": [3, 4, 9, 9, 5], "completion_mask": [1, 1, 0, 0, 1],
                          "completion_logprobs": [-0.5, -0.5, 0.0, 0.0, -0.5], "model_versions": ["v1", "v2"]}]
    Sequence.model_validate(sequences[0])


def test_grammar_forced_tokens_are_carried_into_the_sequence() -> None:
    forced = {**item([1, 2], [3, 4, 5]), "generation_forced": [1, 0, 1]}
    items = [forced, item([1, 2, 3, 4, 5, 9], [6])]
    sequences, prefix_ok = merge_sequences(items)
    assert prefix_ok is True
    # Environment tokens and a call that reported nothing are 0: only what a grammar forced is 1.
    assert sequences[0]["completion_forced"] == [1, 0, 1, 0, 0]
    assert sequences[0]["completion_mask"] == [1, 1, 1, 0, 1]
    Sequence.model_validate(sequences[0])
    assert "completion_forced" not in merge_sequences([item([1], [2])])[0][0]
    # A list of the wrong length is not trusted.
    assert "completion_forced" not in merge_sequences([{**item([1], [2, 3]), "generation_forced": [1]}])[0][0]
    # Every token of a call under a grammar is marked constrained (forced or not); the free call is not.
    constrained = {**forced, "generation_constrained": [1, 1, 1]}
    sequences, _ = merge_sequences([constrained, item([1, 2, 3, 4, 5, 9], [6])])
    assert sequences[0]["completion_constrained"] == [1, 1, 1, 0, 0]
    Sequence.model_validate(sequences[0])
    assert "completion_constrained" not in merge_sequences(items)[0][0]


def test_drift_starts_a_new_sequence() -> None:
    sequences, prefix_ok = merge_sequences([item([1, 2], [3, 4]), item([1, 2, 7, 9], [5])])
    assert prefix_ok is False
    assert [s["prompt_ids"] for s in sequences] == [[1, 2], [1, 2, 7, 9]]
    assert "model_versions" not in sequences[0]  # only when a call reported one


def test_malformed_records_are_skipped_never_a_crash() -> None:
    bad = [
        {"prompt_token_ids": [1], "generation_token_ids": [2], "generation_log_probs": None},
        {"prompt_token_ids": [1], "generation_token_ids": [2, 3], "generation_log_probs": [-1.0]},
        {"prompt_token_ids": "1", "generation_token_ids": [2], "generation_log_probs": [-1.0]},
        {"prompt_token_ids": [1], "generation_token_ids": [2], "generation_log_probs": ["x"]},
        {"prompt_token_ids": [1, True], "generation_token_ids": [2], "generation_log_probs": [-1.0]},
        {"prompt_token_ids": [1], "generation_token_ids": [2.0], "generation_log_probs": [-1.0]},
        "not an item", None,
    ]
    assert all(token_record(entry) is None for entry in bad)
    assert merge_sequences(bad) == ([], None)
    sequences, prefix_ok = merge_sequences([*bad, item([1], [2])])
    assert prefix_ok is True and len(sequences) == 1


def turn(*body: int) -> list[int]:
    return [IM_START, ASSISTANT, NL, *body, IM_END, NL]


USER_TURN = [IM_START, USER, NL, 10, IM_END, NL]
BASE = [*USER_TURN, IM_START, ASSISTANT, NL]  # the conversation before the turn + the generation prompt
AFTER = [IM_START, TOOL, NL, 30, IM_END, NL, IM_START, ASSISTANT, NL]  # a tool result, then the next turn


def test_extend_when_the_model_closed_its_turn() -> None:
    # Real chat models generate the end-of-turn token; the template adds "\n" after it.
    generation = [20, 21, IM_END]
    head = [*USER_TURN, *turn(20, 21)]
    assert extend_tokens(BASE, generation, head, [*head, *AFTER], base=BASE) == [*BASE, *generation, NL, *AFTER]


def test_extend_when_the_template_closes_the_turn() -> None:
    # A generation without the end-of-turn token (a stop string, or the toy backend): the glue is added.
    generation = [20, 21]
    head = [*USER_TURN, *turn(20, 21)]
    assert extend_tokens(BASE, generation, head, [*head, *AFTER], base=BASE) == [*BASE, 20, 21, IM_END, NL, *AFTER]


def test_extend_keeps_sampled_tokens_when_the_history_retokenizes_differently() -> None:
    # The template re-tokenizes the generated text (99 merges 20 21); the sampled ids stay as sampled.
    generation = [20, 21, 22, 23, IM_END]
    head = [*USER_TURN, *turn(99, 22, 23)]
    assert extend_tokens(BASE, generation, head, [*head, *AFTER], base=BASE) == [*BASE, *generation, NL, *AFTER]


def test_extend_with_a_head_rendered_with_a_generation_prompt() -> None:
    # SGLang's /tokenize always appends the generation prompt: only what head and full share counts.
    generation = [20, IM_END]
    head = [*USER_TURN, *turn(20), IM_START, ASSISTANT, NL]
    full = [*USER_TURN, *turn(20), *AFTER]
    assert extend_tokens(BASE, generation, head, full, base=BASE) == [*BASE, *generation, NL, *AFTER]


def test_no_extension_when_the_template_rewrote_history() -> None:
    # Qwen3-style: once a new user message comes, the template drops the turn's thinking block, so
    # head and full part inside the turn. Aligning on an earlier end-of-turn token would duplicate
    # the turn: there is no cut, the caller renders afresh (and prefix_ok shows it).
    THINK, END_THINK = 50, 51
    generation = [THINK, 40, END_THINK, 20, IM_END]
    head = [*USER_TURN, *turn(THINK, 40, END_THINK, 20)]
    full = [*USER_TURN, *turn(20), IM_START, USER, NL, 5, IM_END, NL, IM_START, ASSISTANT, NL]
    assert extend_tokens(BASE, generation, head, full, base=BASE) is None
    assert extend_tokens(BASE, [], head, head, base=BASE) is None  # nothing generated: nothing to align
    assert extend_tokens(BASE, [77, 78], [9, 9], [8, 8]) is None  # nothing in common
    # Without a base render, the turn is assumed to start within `window` tokens of the head's end.
    assert extend_tokens(BASE, [20, 21, IM_END], [*USER_TURN, *turn(20, 21)], [*USER_TURN, *turn(20, 21), *AFTER],
                         window=8) == [*BASE, 20, 21, IM_END, NL, *AFTER]


def test_prepare_task_forces_the_first_tool() -> None:
    row = {"responses_create_params": {"input": "hi", "tools": [{"type": "function", "name": "get_weather"}]}}
    prepared = prepare_task(row, force_tool=True, max_output_tokens=32, index=4)
    assert prepared["responses_create_params"]["tool_choice"] == {"type": "function", "name": "get_weather"}
    assert prepared["responses_create_params"]["max_output_tokens"] == 32
    assert prepared["rollout_id"] == "check-tokens-4" and "tool_choice" not in row["responses_create_params"]
    kept = prepare_task({"responses_create_params": {**row["responses_create_params"], "tool_choice": "none"}},
                        force_tool=True, max_output_tokens=None, index=0)
    assert kept["responses_create_params"]["tool_choice"] == "none"


def report_with(turn2: TurnReport, retokenize_same: bool | None) -> Report:
    rollout = RolloutReport(task=1, status="ok", reward=1.0, prefix_ok=turn2.extends, sequences=1,
                            turns=[TurnReport(call=1, prompt_tokens=10, generated_tokens=3), turn2],
                            retokenize="checked", retokenize_same=retokenize_same)
    return Report(agent="a", model_server="m", input="tasks.jsonl", forced_tool=True, rollouts=[rollout])


def test_verdicts_and_report() -> None:
    exact = report_with(TurnReport(call=2, prompt_tokens=20, generated_tokens=2, extends=True, added_tokens=7), False)
    assert exact.ok() and not exact.ok(strict=True)
    text = format_report(exact)
    assert "call 2: prompt 20 tokens = the previous 13 exactly + 7 added between turns" in text
    assert text.splitlines()[-1].startswith("PASS: 1 turn boundaries in 1 rollouts")
    assert format_report(exact, strict=True).splitlines()[-1].startswith("FAIL (--strict)")

    drift = report_with(TurnReport(call=2, prompt_tokens=20, generated_tokens=2, extends=False,
                                   divergence=Divergence(11, 13, 20, "… 'a' | 'b'", "… 'a' | 'bc'")), True)
    assert not drift.ok()
    text = format_report(drift)
    assert "DRIFT: the prompt (20 tokens) stops extending the previous prompt + generation (13 tokens) at token 11" in text
    assert "previous tokens: … 'a' | 'b'" in text and "this prompt:     … 'a' | 'bc'" in text
    assert text.splitlines()[-1].startswith("FAIL: 1 of 1 turn boundaries drifted")

    single = Report(agent="a", model_server="m", input="t", forced_tool=False,
                    rollouts=[RolloutReport(task=1, status="ok", turns=[TurnReport(call=1, prompt_tokens=1, generated_tokens=1)])])
    assert not single.ok() and "nothing to compare" in format_report(single)


# --- why a new segment begins ----------------------------------------------------------------------

# A Qwen3-like vocabulary: the template opens the assistant turn, the model thinks, then answers.
PIECES = {1: "<|im_start|>", 2: "user", 3: "\n", 4: "Hi", 5: "<|im_end|>", 6: "assistant", 7: "<think>", 8: "plan",
          9: "</think>", 10: "Hello", 11: "Again", 12: "system", 13: "Summary", 14: "<tool_call>", 15: '{"a": 1}',
          16: "</tool_call>", 17: '{"a":1}'}
FIRST_PROMPT = [1, 2, 3, 4, 5, 3, 1, 6, 3]
FIRST_ANSWER = [7, 8, 9, 3, 10, 5]


class Reply:
    def __init__(self, status: int, body: dict[str, Any] | None = None) -> None:
        self.status, self.ok, self.body = status, status == 200, body or {}

    def json(self) -> dict[str, Any]:
        return self.body

    def error_message(self) -> str:
        return f"HTTP {self.status}"


class ScriptedServers:
    """The agent's /run answers one rollout of two calls; the model server decodes by PIECES."""

    def __init__(self, second_prompt: list[int], first_answer: list[int]) -> None:
        self.second_prompt, self.first_answer = second_prompt, first_answer

    async def post(self, server: str, path: str, json: dict[str, Any], **_: Any) -> Reply:
        if path == "/detokenize":
            return Reply(200, {"pieces": [PIECES[t] for t in json["tokens"]]})
        if path == "/tokenize":
            return Reply(404)
        calls = [(FIRST_PROMPT, self.first_answer), (self.second_prompt, [11, 5])]
        output = [{"type": "message", "prompt_token_ids": p, "generation_token_ids": g,
                   "generation_log_probs": [-0.5] * len(g)} for p, g in calls]
        return Reply(200, {"status": "ok", "reward": 1.0, "prefix_ok": False, "sequences": [{}, {}],
                           "response": {"output": output}})


def second_turn(second_prompt: list[int], first_answer: list[int] = FIRST_ANSWER) -> TurnReport:
    checker = TokenChecker(ScriptedServers(second_prompt, first_answer), "agent", "model")  # type: ignore[arg-type]
    row = {"responses_create_params": {"input": "Hi"}}
    report = asyncio.run(checker.check_one(0, row, timeout_s=10))
    assert [turn.extends for turn in report.turns] == [None, False]
    return report.turns[1]


def test_check_tokens_names_why_each_segment_begins() -> None:
    # The template dropped the earlier <think> block once a user turn followed (Qwen3, DeepSeek-R1).
    stripped = second_turn(FIRST_PROMPT + [10, 5, 3, 1, 2, 3, 11, 5, 3, 1, 6, 3])
    assert stripped.divergence is not None and stripped.divergence.index == len(FIRST_PROMPT)
    assert "reasoning is not in the history" in (stripped.reason or "")
    # The agent replaced its history by a summary (or a sub-agent began its own conversation).
    rewritten = second_turn([1, 12, 3, 13, 5, 3, 1, 2, 3, 11, 5, 3, 1, 6, 3])
    assert "history before the previous answer changed after 1 of its 9 tokens" in (rewritten.reason or "")
    # The same prompt again: a retry from before the previous answer.
    assert "goes back to an earlier point" in (second_turn(FIRST_PROMPT).reason or "")
    # The answer written back re-tokenized, no reasoning or tool call involved.
    retokenized = second_turn(FIRST_PROMPT + [7, 8, 9, 3, 11, 5, 3])
    assert "written back differently, not as sampled" in (retokenized.reason or "")
    assert "from token 4 of the answer" in (retokenized.reason or "")
    # A tool call the template wrote back with other JSON spacing.
    rewritten_call = second_turn(FIRST_PROMPT + [14, 17, 16, 5, 3], first_answer=[14, 15, 16, 5])
    assert "tool call was written back differently" in (rewritten_call.reason or "")

    report = Report(agent="a", model_server="m", input="t", forced_tool=False,
                    rollouts=[RolloutReport(task=1, status="ok", turns=[TurnReport(call=1, prompt_tokens=9,
                                                                                   generated_tokens=6), stripped])])
    assert f"      a new segment begins: {stripped.reason}" in format_report(report)
