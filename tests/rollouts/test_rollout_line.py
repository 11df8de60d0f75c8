"""The rollout line as the format specification writes it (top-level `output` and `metadata`), and every
reader taking both it and the older shape (`response.output`) alike."""

from __future__ import annotations

import copy
from typing import Any

from rollgym.data.export import rollout_messages, rollout_problem
from rollgym.data.records import model_versions, output_items
from rollgym.eval.report import _versions
from rollgym.rollouts.sink import rollout_line
from rollgym.schema import RolloutLine, RunResponse
from rollgym.train.loop.curation import sampling_of, tool_failed
from rollgym.view.index import model_version_of
from rollgym.view.rollout import table_row

TASK = {"responses_create_params": {"input": [{"role": "user", "content": "Weather in Oslo?"}]},
        "city": "Oslo", "expected": ["snowy"], "agent_ref": {"name": "weather_agent"}}
SAMPLING = {"temperature": 0.7, "top_p": 1.0, "top_k": 0, "logprobs": "processed"}
OUTPUT = [
    {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}',
     "status": "completed", "model_version": "policy@abc", "sampling": SAMPLING},
    {"type": "function_call_output", "call_id": "call_1", "output": "Error: no such city"},
    {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed", "model_version": "policy@abc",
     "content": [{"type": "output_text", "text": "It is snowy.", "annotations": []}]},
]


def run_answer() -> dict[str, Any]:
    """What /run answers: the task echoed, the response with its output, rollgym's fields."""
    return {**copy.deepcopy(TASK), "rollout_id": "g-r0", "group_id": "g", "reward": 1.0, "status": "ok",
            "response": {"id": "resp_1", "object": "response", "created_at": 0.0, "model": "policy",
                         "status": "completed", "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
                         "output": copy.deepcopy(OUTPUT)},
            "metrics": {"turns": 2}}


def test_the_line_moves_the_output_to_the_top_and_adds_the_tasks_metadata() -> None:
    answer = run_answer()
    line = rollout_line(answer, TASK)
    assert line["output"] == OUTPUT and "output" not in line["response"]  # moved, written once
    assert line["response"]["id"] == "resp_1" and line["response"]["model"] == "policy"
    assert line["metadata"] == {"city": "Oslo", "expected": ["snowy"], "agent_ref": {"name": "weather_agent"}}
    assert answer["response"]["output"] == OUTPUT  # the /run answer itself is left as it was
    RolloutLine.model_validate(line)
    RunResponse.model_validate(answer)


def test_a_failed_answer_without_a_response_is_written_as_it_came() -> None:
    failed = {**TASK, "rollout_id": "g-r1", "reward": None, "status": "timeout", "response": None}
    assert rollout_line(failed, TASK) is failed


def test_every_reader_gives_the_same_answer_for_both_shapes() -> None:
    old, new = run_answer(), rollout_line(run_answer(), TASK)
    for row in (old, new):
        assert output_items(row) == OUTPUT
        assert model_versions(row) == {"policy@abc"} and _versions(row) == {"policy@abc"}
        assert model_version_of(row) == "policy@abc"
        assert tool_failed(row) is True and sampling_of(row) == SAMPLING
        assert rollout_problem(row) is None
        assert table_row(1, row)["answer"] == "It is snowy."
        prompt, completion = rollout_messages(row)
        assert [m["role"] for m in prompt] == ["user"]
        assert [m["role"] for m in completion] == ["assistant", "tool", "assistant"]


def test_a_task_field_named_output_does_not_hide_the_responses_items() -> None:
    row = {**run_answer(), "output": "an expected answer of the task"}  # the old shape, a task field `output`
    assert output_items(row) == OUTPUT
    assert rollout_problem({**TASK, "reward": 1.0, "response": {"id": "r"}}) is not None  # neither shape
