"""reverse_text: the LCS reward, and the server over real HTTP."""

from __future__ import annotations

import json
import random
from pathlib import Path

import httpx
import pytest

from resources_servers.reverse_text.app import ReverseTextServer, lcs_length, reverse_reward
from rollgym.testing import final_response, serve_in_thread

DATA = Path(__file__).resolve().parents[1] / "data"


def lcs_reference(a: str, b: str) -> int:
    table = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
    for i, x in enumerate(a):
        for j, y in enumerate(b):
            table[i + 1][j + 1] = table[i][j] + 1 if x == y else max(table[i][j + 1], table[i + 1][j])
    return table[-1][-1]


def test_bit_parallel_lcs_matches_dynamic_programming() -> None:
    rng = random.Random(0)
    for _ in range(300):
        a = "".join(rng.choice("abcd ") for _ in range(rng.randint(0, 40)))
        b = "".join(rng.choice("abcd ") for _ in range(rng.randint(0, 40)))
        assert lcs_length(a, b) == lcs_reference(a, b), (a, b)


@pytest.mark.parametrize(
    ("answer", "reward"),
    [
        ("dlrow olleh", 1.0),
        ("  `dlrow olleh`\n", 1.0),     # quotes and whitespace are not held against the model
        ("dlrow olle", 10 / 11),         # one character missing
        ("dlrow olleh!!", 11 / 13),      # padding costs
        ("hello world", 0.0),            # the text copied back, not reversed: nothing (it shares 5 of 11)
        ("<think>reverse it</think>dlrow olleh", 1.0),  # reasoning is not the answer, nor held against it
        ("", 0.0),
    ],
)
def test_reward(answer: str, reward: float) -> None:
    assert reverse_reward(answer, "hello world") == pytest.approx(reward)




def test_server_verifies_example_rows() -> None:
    rows = [json.loads(line) for line in (DATA / "example.jsonl").read_text().splitlines()]
    assert len(rows) == 5
    with serve_in_thread(ReverseTextServer(name="reverse_text")) as url, httpx.Client(base_url=url) as http:
        for row in rows:
            assert http.post("/seed_session", json=row).status_code == 200
            good = http.post("/verify", json={**row, "response": final_response(row["text"][::-1])}).json()
            assert good["reward"] == 1.0 and good["exact"] is True
            assert good["expected_answer"] == row["text"][::-1]
            bad = http.post("/verify", json={**row, "response": final_response(row["text"])}).json()
            assert bad["reward"] < 1.0 and bad["exact"] is False
        missing = http.post("/seed_session", json={"responses_create_params": {"input": "x"}})
        assert missing.status_code == 422 and missing.json()["error"]["field"] == "text"


def test_training_data_is_well_formed() -> None:
    rows = [json.loads(line) for line in (DATA / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 200
    for row in rows:
        assert row["responses_create_params"]["input"][-1]["content"] == f"Reverse this text: {row['text']}"
