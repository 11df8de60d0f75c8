"""gymnasium adapter: text renderings, actions, episode reward, and the server over real HTTP."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("gymnasium")

from resources_servers.gymnasium.app import (  # noqa: E402
    GymnasiumConfig,
    GymnasiumServer,
    GymTask,
    adapter_for,
    make_env,
    parse_action,
)
from rollgym.envkit.folder import env_folder  # noqa: E402
from rollgym.server import BadRequest, ServerStartError  # noqa: E402
from rollgym.testing import final_response, serve_in_thread  # noqa: E402

ENV = env_folder(__file__)
DATA = ENV.examples
ROWS = ENV.rows()
LAKE = {"responses_create_params": {"input": "Play FrozenLake."}, "env_id": "FrozenLake-v1",
        "env_kwargs": {"is_slippery": False, "map_name": "4x4"}, "seed": 0, "max_episode_steps": 20}
# The deterministic 4x4 map:  SFFF / FHFH / FFFH / HFFG
TO_GOAL = ["down", "down", "right", "right", "down", "right"]




@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with serve_in_thread(GymnasiumServer(name="gymnasium")) as url, httpx.Client(base_url=url) as client:
        yield client


def step(http: httpx.Client, action: Any) -> str:
    reply = http.post("/step", json={"action": action})
    assert reply.status_code == 200, reply.text
    assert reply.headers["content-type"].startswith("text/plain")
    return reply.text


def verify(http: httpx.Client, row: dict[str, Any]) -> dict[str, Any]:
    reply = http.post("/verify", json={**row, "response": final_response("done")})
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_correct_actions_reach_the_goal(http: httpx.Client) -> None:
    assert http.post("/seed_session", json=LAKE).status_code == 200
    outputs = [step(http, action) for action in TO_GOAL]
    assert outputs[0] == (
        "Action: down (1).\n"
        "Map (row 0 is the top; S start, F frozen, H hole, G goal, * you):\nSFFF\n*HFH\nFFFH\nHFFG\n"
        "You are at row 1, column 0 (on F).\n"
        "Step reward: 0. Total reward: 0.\n"
        "The episode continues."
    )
    assert outputs[-1].endswith("Step reward: 1. Total reward: 1.\nThe episode has ended: you reached the goal.")
    result = verify(http, LAKE)
    assert result["reward"] == 1.0
    assert result["episode_steps"] == 6 and result["terminated"] is True and result["actions"] == [1, 1, 2, 2, 1, 2]


def test_integer_actions_and_a_hole(http: httpx.Client) -> None:
    assert http.post("/seed_session", json=LAKE).status_code == 200
    step(http, 2)        # right → (0, 1)
    last = step(http, "1")  # down → (1, 1): a hole
    assert "You are at row 1, column 1 (on H)." in last
    assert last.endswith("The episode has ended: you fell into a hole.")
    after = step(http, "down")
    assert after == ("The episode has already ended after 2 steps with total reward 0; no more actions are "
                     "possible. Give your final answer.")
    result = verify(http, LAKE)
    assert result["reward"] == 0.0 and result["episode_ended"] is True and result["episode_steps"] == 2


def test_step_limit_truncates(http: httpx.Client) -> None:
    assert http.post("/seed_session", json={**LAKE, "max_episode_steps": 2}).status_code == 200
    step(http, "left")
    assert step(http, "up").endswith("The episode has ended: the step limit of 2 steps was reached.")
    assert step(http, "down").startswith("The episode has already ended after 2 steps")
    result = verify(http, LAKE)
    assert result["reward"] == 0.0 and result["truncated"] is True and result["terminated"] is False


@pytest.mark.parametrize("action", ["jump", 4, -1, "7", 1.0, True, None])
def test_invalid_action_is_422_naming_action(http: httpx.Client, action: Any) -> None:
    assert http.post("/seed_session", json=LAKE).status_code == 200
    reply = http.post("/step", json={"action": action})
    assert reply.status_code == 422, reply.text
    assert reply.json()["error"]["field"] == "action"
    if action in ("jump", 4):
        assert "left (0), down (1), right (2), up (3)" in reply.json()["error"]["message"]
    assert verify(http, LAKE)["episode_steps"] == 0  # nothing happened


def test_missing_or_extra_argument_is_422(http: httpx.Client) -> None:
    assert http.post("/step", json={}).json()["error"]["field"] == "action"
    assert http.post("/step", json={"action": 1, "speed": 2}).json()["error"]["field"] == "speed"


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"env_id": "Nope-v0"}, "env_id"),
        ({"env_id": "CartPole-v1"}, "env_id"),           # registered but not on the allow-list
        ({"env_kwargs": {"bogus": 1}}, "env_kwargs"),
        ({"max_episode_steps": 0}, "max_episode_steps"),
        ({"max_episode_steps": 5000}, "max_episode_steps"),
    ],
)
def test_bad_task_rows_are_422(http: httpx.Client, change: dict[str, Any], field: str) -> None:
    reply = http.post("/seed_session", json={**LAKE, **change})
    assert reply.status_code == 422, reply.text
    assert reply.json()["error"]["field"] == field


def test_example_rows_seed_and_match_their_prompts(http: httpx.Client) -> None:
    assert len(ROWS) == 5
    tools = http.get("/tools").json()
    assert [t["name"] for t in tools] == ["step"]
    for row in ROWS:
        assert row["responses_create_params"]["tools"] == tools
        assert http.post("/seed_session", json=row).status_code == 200
        first = step(http, 0)
        assert first.startswith("Action: ")
        assert verify(http, row)["episode_steps"] == 1
    # The prompt shows the first observation exactly as the server renders it.
    assert "*FFF\nFHFH\nFFFH\nHFFG\nYou are at row 0, column 0 (on S)." in ROWS[0]["responses_create_params"]["input"][1]["content"]


def test_slippery_lake_is_reproducible_with_its_seed(http: httpx.Client) -> None:
    row = ROWS[1]
    assert row["env_kwargs"]["is_slippery"] is True
    runs = []
    for _ in range(2):
        assert http.post("/seed_session", json=row).status_code == 200
        runs.append([step(http, a) for a in ["right", "right", "down"]])
    assert runs[0] == runs[1]


def test_other_known_environments_render_text() -> None:
    taxi = make_env(GymTask.model_validate({"responses_create_params": {"input": "x"}, "env_id": "Taxi-v4"}), None, 100)
    obs, _ = taxi.reset(seed=0)
    text = adapter_for(taxi).render(taxi, obs)
    assert text.startswith("+---------+") and "The taxi is at row" in text and "\x1b" not in text
    assert parse_action(taxi, "pickup") == 4
    jack = make_env(GymTask.model_validate({"responses_create_params": {"input": "x"}, "env_id": "Blackjack-v1"}), None, 100)
    obs, _ = jack.reset(seed=0)
    assert adapter_for(jack).render(jack, obs).startswith("Your hand totals ")
    with pytest.raises(BadRequest):
        parse_action(jack, 2)


def test_unseeded_session_is_an_env_failure() -> None:
    with serve_in_thread(GymnasiumServer(name="gymnasium")) as url, httpx.Client(base_url=url) as client:
        reply = client.post("/step", json={"action": 1})
        assert reply.status_code == 500 and "SessionNotSeeded" in reply.json()["error"]["message"]


def test_needs_the_memory_store(tmp_path: Path) -> None:
    with pytest.raises(ServerStartError, match="session_store: memory"):
        GymnasiumServer(GymnasiumConfig(session_store="sqlite", session_db=str(tmp_path / "s.db")), name="g")


def test_config_builds() -> None:
    server = ENV.build("gymnasium")
    assert isinstance(server, GymnasiumServer) and "FrozenLake-v1" in server.config.allowed_env_ids
    assert ENV.build("gymnasium_agent").config.resources_server.name == "gymnasium"
