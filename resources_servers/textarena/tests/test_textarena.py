"""textarena: real TextArena games over real HTTP, with scripted and model opponents.

The opponent model is a tiny rollgym ModelServer written here (scripted replies, or an HTTP error),
served over HTTP like any model server of a stack; the agent test runs the real simple_agent against
the scripted OpenAI-compatible backend.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.exceptions import HTTPException

pytest.importorskip("textarena")

from agents.simple_agent.app import SimpleAgent, SimpleAgentConfig  # noqa: E402
from models.chat_completions.app import ChatCompletionsConfig, ChatCompletionsModel  # noqa: E402
from resources_servers.textarena.app import (  # noqa: E402
    DEFAULT_ALLOWED_ENV_IDS,
    TextArenaConfig,
    TextArenaServer,
)
from resources_servers.textarena.rows import task_row  # noqa: E402
from rollgym import ModelServer, ResponsesCreateParams, ServerAddress, build_response  # noqa: E402
from rollgym.envkit.folder import env_folder  # noqa: E402
from rollgym.schema import RunResponse  # noqa: E402
from rollgym.server import ServerStartError  # noqa: E402
from rollgym.testing import final_response, free_port, scripted_backend, serve_in_thread  # noqa: E402

ENV = env_folder(__file__)
ROWS = ENV.rows()
GUESS, TICTACTOE, HANOI, NIM, TICTACTOE_VS_MODEL = ROWS
# GuessTheNumber-v0 with seed 0 hides 13; TicTacToe-v0 with seed 0: the random opponent lets [0] [1] [2] win.
INVALID = "attempted an invalid move"


class ScriptedOpponent(ModelServer):
    """An opponent model that answers with scripted moves in order (the last one repeats), or an HTTP error."""

    def __init__(self, *moves: str, fail_status: int | None = None) -> None:
        super().__init__(name="opponent")
        self.moves = deque(moves or ["[0]"])
        self.fail_status = fail_status
        self.requests: list[dict[str, Any]] = []

    async def responses(self, params: ResponsesCreateParams, payload: dict[str, Any]) -> dict[str, Any]:
        self.requests.append(payload)
        if self.fail_status is not None:
            raise HTTPException(self.fail_status, detail="the opponent's backend is down")
        text = self.moves.popleft() if len(self.moves) > 1 else self.moves[0]
        item = {"type": "message", "id": "msg_opp", "role": "assistant", "status": "completed",
                "content": [{"type": "output_text", "text": text, "annotations": []}]}
        return build_response(payload, [item], model="opponent")


def make_env(opponent_url: str | None = None, **config: Any) -> TextArenaServer:
    config.setdefault("client_max_retries", 0)
    registry = {}
    if opponent_url is not None:
        config.setdefault("opponent_model_server", {"name": "opponent"})
        registry["opponent"] = ServerAddress(url=opponent_url, role="models")
    return TextArenaServer(TextArenaConfig(**config), name="textarena", registry=registry)


@contextmanager
def env_client(opponent: ModelServer | str | None = None, **config: Any) -> Iterator[httpx.Client]:
    with ExitStack() as stack:
        url = opponent if isinstance(opponent, str) or opponent is None else stack.enter_context(serve_in_thread(opponent))
        env_url = stack.enter_context(serve_in_thread(make_env(url, **config)))
        yield stack.enter_context(httpx.Client(base_url=env_url, timeout=30.0))


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with env_client(ScriptedOpponent("[0]")) as client:
        yield client


def seed(http: httpx.Client, row: dict[str, Any], **change: Any) -> None:
    reply = http.post("/seed_session", json={**row, **change})
    assert reply.status_code == 200, reply.text


def move(http: httpx.Client, action: str) -> str:
    reply = http.post("/move", json={"action": action})
    assert reply.status_code == 200, reply.text
    assert reply.headers["content-type"].startswith("text/plain")
    return reply.text


def verify(http: httpx.Client, row: dict[str, Any]) -> dict[str, Any]:
    reply = http.post("/verify", json={**row, "response": final_response("done")})
    assert reply.status_code == 200, reply.text
    return reply.json()


# --- single-player ----------------------------------------------------------------------------------


def test_guessing_the_number_wins(http: httpx.Client) -> None:
    seed(http, GUESS)
    assert move(http, "[10]") == "[GAME] The target number is higher."
    assert move(http, "I think [15]") == "[GAME] The target number is lower."
    last = move(http, "[13]")
    assert last == ("The game is over (Congratulations! You guessed the correct number.): you won. Reward: 1. "
                    "Give your final answer.")
    assert move(http, "[14]").startswith("The game has already ended after 3 of your moves")
    result = verify(http, GUESS)
    assert result["reward"] == 1.0 and result["outcome"] == "win" and result["game_over"] is True
    assert result["reward_components"] == {"win": 1.0, "invalid_moves": 0.0, "game_reward": 1.0}
    assert result["model_moves"] == 3 and result["invalid_moves"] == 0 and result["opponent"] is None


def test_single_player_partial_credit_is_the_games_own(http: httpx.Client) -> None:
    seed(http, HANOI)
    assert "A: [3, 2, 1]" in HANOI["responses_create_params"]["input"][1]["content"]
    out = move(http, "[A C]")
    assert "You moved disk 1 from A to C." in out and "C: [1]" in out
    move(http, "[A C]")  # a larger disk onto a smaller one: the game's warning
    out = move(http, "[B A]")  # empty tower, second invalid move in a row: the game ends
    assert "The game is over" in out
    result = verify(http, HANOI)
    assert result["invalid_moves"] == 2 and result["outcome"] == "loss" and result["reward"] == 0.0
    assert result["reward_components"]["invalid_moves"] == 2.0


# --- two-player with the scripted opponent -------------------------------------------------------------


def test_tictactoe_win_against_the_random_opponent(http: httpx.Client) -> None:
    seed(http, TICTACTOE)
    first = move(http, "[0]")
    assert first.startswith("[GAME] Player 0 placed their symbol (O) in cell 0.")
    assert "[Player 1] [" in first  # the opponent's move, as TextArena shows it
    move(http, "[1]")
    assert move(http, "[2]").endswith("you won. Reward: 1. Give your final answer.")
    result = verify(http, TICTACTOE)
    assert result["reward"] == 1.0 and result["game_rewards"] == {"0": 1.0, "1": -1.0}
    assert result["opponent_moves"] == 2 and result["opponent_invalid_moves"] == 0


def test_invalid_moves_follow_the_games_error_allowance(http: httpx.Client) -> None:
    seed(http, TICTACTOE)
    warned = move(http, "the center please")
    assert INVALID in warned and "The game is over" not in warned
    move(http, "[4]")                       # a valid move resets the allowance
    assert INVALID in move(http, "[4]")     # occupied: warned again
    out = move(http, "[42]")                # a second invalid move in a row loses
    assert "you lost" in out
    result = verify(http, TICTACTOE)
    assert result["reward"] == 0.0 and result["outcome"] == "loss" and result["invalid_moves"] == 3
    assert result["reward_components"] == {"win": 0.0, "invalid_moves": 3.0, "game_reward": -1.0}


def test_move_limit_stops_the_game_unfinished(http: httpx.Client) -> None:
    seed(http, NIM, max_turns=1)
    assert move(http, "[0 1]").endswith("The move limit of 1 moves is reached: the game stops here unfinished "
                                        "(reward 0). Give your final answer.")
    assert move(http, "[0 1]").startswith("The game has already ended")
    result = verify(http, NIM)
    assert result["reward"] == 0.0 and result["outcome"] == "truncated" and "game_reward" not in result["reward_components"]


def test_no_move_is_an_unfinished_game_worth_zero(http: httpx.Client) -> None:
    seed(http, GUESS)
    result = verify(http, GUESS)
    assert result["reward"] == 0.0 and result["outcome"] == "unfinished" and result["game_over"] is False


def test_seeded_games_replay_whatever_other_sessions_do() -> None:
    """2048 draws its new tiles from the process-wide random stream: two sessions of one seed, played
    interleaved with a third game, still see the same game."""
    row = task_row("2048-v0-ultra-easy", seed=5)
    with env_client() as a, httpx.Client(base_url=str(a.base_url), timeout=30) as b, \
            httpx.Client(base_url=str(a.base_url), timeout=30) as other:
        seed(a, row)
        seed(other, row, seed=6)
        seed(b, row)
        runs: dict[str, list[str]] = {"a": [], "b": []}
        for action in ["[up]", "[left]", "[down]", "[right]", "[up]"]:
            runs["a"].append(move(a, action))
            move(other, action)
            runs["b"].append(move(b, action))
    assert runs["a"] == runs["b"]


# --- two-player with a model opponent -------------------------------------------------------------------


def test_model_opponent_plays_through_its_server() -> None:
    opponent = ScriptedOpponent("Let me take the corner: [8]", "[6]", "[2]")
    with env_client(opponent) as client:
        seed(client, TICTACTOE_VS_MODEL)
        out = move(client, "[4]")
        assert "[Player 1] Let me take the corner: [8]" in out and "cell 8" in out
        move(client, "[0]")   # the opponent plays [6], then [2] against 0-1-2
        move(client, "[1]")
        assert "you won" in move(client, "[7]")
        result = verify(client, TICTACTOE_VS_MODEL)
    assert result["reward"] == 1.0 and result["opponent"] == "model" and result["opponent_moves"] == 3
    first, *_ = opponent.requests
    assert first["model"] == "opponent"  # the base model, named: a hot-loaded adapter never plays the opponent
    history = first["input"][1]["content"]
    assert history.startswith("[GAME] You are Player 1 in Tic Tac Toe.") and "placed their symbol (O) in cell 4" in history


@pytest.mark.parametrize("status", [500, 503])
def test_a_failing_opponent_model_is_502_never_a_reward(status: int) -> None:
    with env_client(ScriptedOpponent(fail_status=status)) as client:
        seed(client, TICTACTOE_VS_MODEL)
        reply = client.post("/move", json={"action": "[4]"})
    assert reply.status_code == 502, reply.text
    assert f"opponent model server 'opponent' answered HTTP {status}" in reply.json()["error"]["message"]


def test_an_unreachable_opponent_model_is_502() -> None:
    with env_client(f"http://127.0.0.1:{free_port()}") as client:
        seed(client, TICTACTOE_VS_MODEL)
        reply = client.post("/move", json={"action": "[4]"})
    assert reply.status_code == 502 and "unavailable" in reply.json()["error"]["message"]


# --- bad input and failures -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"env_id": "Nope-v0"}, "env_id"),
        ({"env_id": "Wordle-v0"}, "env_id"),                    # registered, not allowed (needs nltk downloads)
        ({"env_kwargs": {"bogus": 1}}, "env_kwargs"),
        ({"max_turns": 0}, "max_turns"),
        ({"max_turns": 301}, "max_turns"),
        ({"seed": -1}, "seed"),
        ({"opponent": None}, "opponent"),                      # a two-player game needs one
        ({"opponent": "a friend"}, "opponent"),
        ({"env_id": "GuessTheNumber-v0"}, "opponent"),         # a single-player game has none
        ({"env_id": "KuhnPoker-v0"}, "opponent"),              # no scripted policy for it
    ],
)
def test_bad_rows_are_422_naming_the_field(http: httpx.Client, change: dict[str, Any], field: str) -> None:
    reply = http.post("/seed_session", json={**TICTACTOE, **change})
    assert reply.status_code == 422, reply.text
    assert reply.json()["error"]["field"] == field


def test_model_opponent_without_a_configured_server_is_422() -> None:
    with env_client() as client:
        reply = client.post("/seed_session", json=TICTACTOE_VS_MODEL)
    assert reply.status_code == 422 and reply.json()["error"]["field"] == "opponent"


@pytest.mark.parametrize(("body", "field"), [({}, "action"), ({"action": 4}, "action"), ({"action": "[4]", "x": 1}, "x")])
def test_malformed_move_is_422(http: httpx.Client, body: dict[str, Any], field: str) -> None:
    seed(http, TICTACTOE)
    reply = http.post("/move", json=body)
    assert reply.status_code == 422 and reply.json()["error"]["field"] == field
    assert verify(http, TICTACTOE)["model_moves"] == 0  # the game never saw it


def test_a_game_that_crashes_is_500_with_its_cause() -> None:
    """Countdown-v0 (left out of the allow-list for this) records an invalid move's reason as its reward."""
    row = task_row("Countdown-v0", seed=0)
    with env_client(allowed_env_ids=None) as client:
        seed(client, row)
        move(client, "no idea")
        reply = client.post("/move", json={"action": "still no idea"})
        assert reply.status_code == 500
        assert "GameCrashed: Countdown-v0 ended with rewards that are not numbers" in reply.json()["error"]["message"]


def test_unseeded_session_is_an_env_failure() -> None:
    with env_client() as client:
        reply = client.post("/move", json={"action": "[4]"})
    assert reply.status_code == 500 and "SessionNotSeeded" in reply.json()["error"]["message"]


# --- rows, config, a rollout through the agent ----------------------------------------------------------


def test_example_rows_are_what_the_row_builder_writes(http: httpx.Client) -> None:
    tools = http.get("/tools").json()
    assert [t["name"] for t in tools] == ["move"]
    for row in ROWS:
        assert row["responses_create_params"]["tools"] == tools
        assert row == task_row(row["env_id"], row["seed"], row["opponent"], row["max_turns"])
    with pytest.raises(ValueError, match="env_id: unknown env_id"):
        task_row("Nope-v0")


def test_default_allow_list_games_all_start() -> None:
    with env_client(ScriptedOpponent("[0]")) as client:
        for env_id in DEFAULT_ALLOWED_ENV_IDS:
            two = env_id in {"TicTacToe-v0", "ConnectFour-v0", "Nim-v0", "Nim-v0-medium"}
            single = client.post("/seed_session", json={**GUESS, "env_id": env_id})
            if single.status_code == 422:  # a two-player game
                opponent = "random" if two else "model"
                seed(client, GUESS, env_id=env_id, opponent=opponent)


def test_needs_the_memory_store(tmp_path: Path) -> None:
    with pytest.raises(ServerStartError, match="session_store: memory"):
        TextArenaServer(TextArenaConfig(session_store="sqlite", session_db=str(tmp_path / "s.db")), name="t")


def test_config_builds() -> None:
    server = ENV.build("textarena")
    assert isinstance(server, TextArenaServer) and server.config.allowed_env_ids == DEFAULT_ALLOWED_ENV_IDS
    assert server.config.opponent_model_server.name == "policy_model"
    agent = ENV.build("textarena_agent")
    assert agent.config.resources_server.name == "textarena" and agent.config.max_steps == 48


def test_rollout_through_the_agent_records_the_unfinished_game() -> None:
    """The scripted policy answers in text without moving: an ok rollout with reward 0, not a failure."""
    with ExitStack() as stack:
        backend = stack.enter_context(scripted_backend())
        policy = ChatCompletionsModel(ChatCompletionsConfig(base_url=backend, model="scripted"), name="policy_model")
        policy_url = stack.enter_context(serve_in_thread(policy))
        env_url = stack.enter_context(serve_in_thread(make_env()))
        agent = SimpleAgent(
            SimpleAgentConfig(model_server={"name": "policy_model"}, resources_server={"name": "textarena"}, max_steps=4),
            name="agent", registry={"policy_model": ServerAddress(url=policy_url, role="models"),
                                    "textarena": ServerAddress(url=env_url, role="resources_servers")},
        )
        agent_url = stack.enter_context(serve_in_thread(agent))
        reply = httpx.post(f"{agent_url}/run", json={**GUESS, "rollout_id": "r1"}, timeout=30)
    assert reply.status_code == 200, reply.text
    result = reply.json()
    RunResponse.model_validate(result)
    assert result["status"] == "ok" and result["reward"] == 0.0 and result["outcome"] == "unfinished"
