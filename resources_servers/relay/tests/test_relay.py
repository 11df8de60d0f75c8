"""relay: each role's reward, and the server over real HTTP: /verify answers `rewards` per role beside `reward`."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from resources_servers.relay.app import RelayServer, code_of, relay_rewards
from rollgym.testing import final_response, serve_in_thread

DATA = Path(__file__).resolve().parents[1] / "data" / "example.jsonl"


def test_every_city_has_a_code() -> None:
    assert code_of(" Paris. ") == "4817"
    assert code_of("Atlantis") == code_of("atlantis") and len(code_of("Atlantis")) == 4


@pytest.mark.parametrize(("lookups", "answer", "rewards"), [
    (["Paris"], "4817", {"caller": 1.0, "answerer": 1.0}),
    (["paris."], "4817.", {"caller": 1.0, "answerer": 1.0}),
    (["The code for Paris"], f"The code is {code_of('The code for Paris')}", {"caller": 0.5, "answerer": 0.5}),
    (["Comparison"], "4817", {"caller": 0.0, "answerer": 0.0}),  # a word containing the city is not the city
    (["London"], "2290", {"caller": 0.0, "answerer": 1.0}),  # the wrong city, its code relayed right: roles apart
    ([], "4817", {"caller": 0.0, "answerer": 0.0}),
    # Sprays a policy could learn for half credit: every city in one lookup, every number in one answer.
    (["Paris London Tokyo Cairo"], "x", {"caller": 0.0, "answerer": 0.0}),
    (["Paris"], "4817 2290 7051 3364", {"caller": 1.0, "answerer": 0.0}),
    (["Paris"], "Code 48170", {"caller": 1.0, "answerer": 0.0}),
    (["please look up the code of the city that is called Paris now"], "4817", {"caller": 0.0, "answerer": 0.0}),
])
def test_each_role_is_rewarded_for_its_own_part(lookups: list[str], answer: str, rewards: dict[str, float]) -> None:
    assert relay_rewards("Paris", lookups, answer) == rewards


def test_verify_answers_rewards_per_role_over_http() -> None:
    rows = [json.loads(line) for line in DATA.read_text().splitlines()]
    assert len(rows) == 5
    with serve_in_thread(RelayServer(name="relay")) as url, httpx.Client(base_url=url) as http:
        assert [t["name"] for t in http.get("/tools").json()] == ["lookup"]
        for row in rows:
            assert http.post("/seed_session", json=row).status_code == 200
            code = http.post("/lookup", json={"city": row["city"]}).text
            good = http.post("/verify", json={**row, "response": final_response(code)}).json()
            assert good["rewards"] == {"caller": 1.0, "answerer": 1.0} and good["reward"] == 1.0
            half = http.post("/verify", json={**row, "response": final_response("no idea")}).json()
            assert half["rewards"] == {"caller": 1.0, "answerer": 0.0} and half["reward"] == 0.5
        assert http.post("/lookup", json={"town": "Paris"}).status_code == 422
