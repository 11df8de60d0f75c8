"""weather: the tool, the reward, and the server over real HTTP."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from resources_servers.weather.app import WeatherServer, weather_report, weather_reward
from rollgym.testing import final_response, serve_in_thread

DATA = Path(__file__).resolve().parents[1] / "data" / "example.jsonl"


def test_weather_report() -> None:
    assert weather_report("paris ") == "Paris: sunny, 22 C"
    assert weather_report("Atlantis").startswith("No weather data for Atlantis. Known cities: Paris, London")


@pytest.mark.parametrize(
    ("answer", "expected", "reward"),
    [
        ("It is Sunny and 22 C in Paris.", ["sunny", "22"], 1.0),
        ("It is sunny in Paris.", ["sunny", "22"], 0.0),
        ("", ["sunny"], 0.0),
    ],
)
def test_weather_reward(answer: str, expected: list[str], reward: float) -> None:
    assert weather_reward(answer, expected) == reward




def test_server_end_to_end_over_http() -> None:
    rows = [json.loads(line) for line in DATA.read_text().splitlines()]
    assert len(rows) == 5
    with serve_in_thread(WeatherServer(name="weather")) as url, httpx.Client(base_url=url) as http:
        tools = http.get("/tools").json()
        assert [t["name"] for t in tools] == ["get_weather"]
        assert tools[0]["parameters"]["required"] == ["city"]
        for row in rows:
            assert http.post("/seed_session", json=row).status_code == 200
            report = http.post("/get_weather", json={"city": row["city"]})
            assert report.headers["content-type"].startswith("text/plain")
            good = http.post("/verify", json={**row, "response": final_response(report.text)}).json()
            assert good["reward"] == 1.0 and good["looked_up"] == [row["city"]]
            bad = http.post("/verify", json={**row, "response": final_response("I do not know.")}).json()
            assert bad["reward"] == 0.0
        bad_args = http.post("/get_weather", json={"city": 5})
        assert bad_args.status_code == 422 and bad_args.json()["error"]["field"] == "city"
        extra = http.post("/get_weather", json={"city": "Paris", "units": "F"})
        assert extra.status_code == 422 and extra.json()["error"]["field"] == "units"
        no_city = http.post("/seed_session", json={"responses_create_params": {"input": "hi"}, "expected": ["x"]})
        assert no_city.status_code == 422 and no_city.json()["error"]["field"] == "city"
