"""Hack suites: answers a policy could write to be paid without doing the task, and what each must earn.

RL pays whatever a grader pays for, so each environment whose grader reads model output keeps a
table of the answers an adversarial policy would try (`tests/test_hacks.py` in its folder), each with
the reward it must get (0 unless it truly solves the task) and a part of the reason it must give, plus
a few honest answers that must still be paid. The tests run every row through the environment's real
`/verify`; `scripts/hack_table.py` prints the tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from . import final_response


@dataclass(frozen=True)
class Hack:
    """One row of a hack suite.

    `answer` is the final assistant message's text, or the response's whole output (a list of items)
    when the hack is in its shape (an answer in a tool call, an answer before a tool call). `reason` is a
    part of the reason the verdict must carry ("" for a row that is paid); " | " separates parts
    any one of which will do (a reason that depends on the machine's speed).
    """

    name: str
    answer: str | list[dict[str, Any]]
    reward: float
    reason: str = ""


def reason_matches(hack: Hack, reason: str | None) -> bool:
    """Whether a verdict's reason is one the row allows."""
    return any(part in (reason or "") for part in hack.reason.split(" | "))


def check_verdict(body: dict[str, Any], hack: Hack) -> None:
    """Assert a `/verify` answer pays the row what it must, and names an allowed reason for a 0."""
    assert abs(body["reward"] - hack.reward) < 1e-9, body
    if hack.reward == 0.0:
        assert reason_matches(hack, body.get("reason")), body


def hack_response(hack: Hack) -> dict[str, Any]:
    """The `response` of a `/verify` body for the row."""
    if isinstance(hack.answer, str):
        return final_response(hack.answer)
    response = final_response("")
    response["output"] = list(hack.answer)
    return response


def http_verifier(http: Any) -> Callable[[dict[str, Any], Hack], dict[str, Any]]:
    """`(row, hack) -> the /verify answer` of the environment that `http` (an httpx.Client at its URL) serves."""

    def verify(row: dict[str, Any], hack: Hack) -> dict[str, Any]:
        answer = http.post("/verify", json={**row, "response": hack_response(hack)})
        assert answer.status_code == 200, answer.text
        return answer.json()

    return verify


def message_item(text: str) -> dict[str, Any]:
    """An assistant message item saying `text`."""
    return final_response(text)["output"][0]


def tool_call_item(name: str, arguments: str, call_id: str = "call_1") -> dict[str, Any]:
    """A function_call item."""
    return {"type": "function_call", "id": f"fc_{call_id}", "call_id": call_id, "name": name,
            "arguments": arguments, "status": "completed"}


def tool_output_item(output: str, call_id: str = "call_1") -> dict[str, Any]:
    """A function_call_output item answering `call_id`."""
    return {"type": "function_call_output", "call_id": call_id, "output": output}


def markdown_table(grader: str, rows: list[tuple[Hack, float, str]]) -> str:
    """The table of one grader: hack, reward it must get, reward it got, the reason given."""
    lines = [f"### {grader}", "", "| hack | must get | got | reason |", "|---|---|---|---|"]
    for hack, reward, reason in rows:
        cell = reason.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {hack.name} | {hack.reward:g} | {reward:g} | {cell} |")
    return "\n".join(lines)
