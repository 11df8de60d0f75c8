"""Task rows for the textarena environment: the game's first observation as the user prompt.

    python -m resources_servers.textarena.rows TicTacToe-v0:0:random GuessTheNumber-v0:3 --max-turns 12 > tasks.jsonl

Each argument is ENV_ID[:SEED[:OPPONENT]] (OPPONENT: random or model). The row's user message is
exactly what the server shows the model before its first move, so the prompt and the game agree; a
game where Player 1 opens cannot have a model opponent here (its opening is not known in advance).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

import orjson
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from rollgym.resources import ToolSpec
from rollgym.server import BadRequest

from .app import MOVE_DESCRIPTION, GameTask, MoveArgs, TextArenaConfig, TextArenaServer

MOVE_TOOL = ToolSpec("move", MOVE_DESCRIPTION, MoveArgs, "move").schema()
OPPONENTS = {
    "random": "a scripted opponent that plays a random legal move",
    "model": "another language model",
}


def system_prompt(env_id: str, opponent: str | None, max_turns: int | None) -> str:
    game = env_id.split("-v")[0]
    against = f" against {OPPONENTS[opponent]}" if opponent else ""
    scoring = ("Winning gives reward 1, a draw 0.5, a loss 0." if opponent else
               "Solving the game gives reward 1; some games give partial credit for progress.")
    limit = f" You have at most {max_turns} moves." if max_turns else ""
    reply = ", including your opponent's reply" if opponent else ""
    return (
        f"You are playing {game} (TextArena {env_id}) as Player 0{against}. Make each move with the move tool, "
        "passing your action exactly as the game asks for it (usually in square brackets, e.g. [4]). The tool "
        f"answers with what happened since your last move{reply}. "
        "Keep moving until the tool says the game is over, then answer with one short sentence. After an "
        f"invalid move the game warns you once; a second invalid move in a row loses the game. {scoring}{limit}"
    )


def task_row(env_id: str, seed: int | None = None, opponent: str | None = None, max_turns: int | None = None,
             env_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """A complete task row; ValueError naming the problem when the game cannot start this way."""
    row: dict[str, Any] = {"env_id": env_id, "env_kwargs": env_kwargs or {}, "seed": seed, "opponent": opponent,
                           "max_turns": max_turns}
    try:
        task = GameTask.model_validate({"responses_create_params": {"input": "-"}, **row})
    except ValidationError as exc:
        raise ValueError(str(exc.errors()[0]["msg"])) from None
    # No model server is reachable from here: a model opponent that would have to open fails below.
    server = TextArenaServer(TextArenaConfig(allowed_env_ids=None, opponent_model_server={"name": "no_model_here"},
                                             client_max_retries=0), name="textarena_rows")
    try:
        first = asyncio.run(server.first_observation(task))
    except BadRequest as exc:
        raise ValueError(f"{exc.errors[0]['field']}: {exc}") from None
    except HTTPException:
        raise ValueError(f"Player 1 opens in {env_id}: a model opponent's opening cannot be written into the prompt") from None
    finally:
        server.sessions.close()
        server.close_game_thread()
    messages = [{"role": "system", "content": system_prompt(env_id, opponent, max_turns)},
                {"role": "user", "content": f"The game starts.\n{first}"}]
    return {"responses_create_params": {"input": messages, "tools": [MOVE_TOOL]}, **row}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m resources_servers.textarena.rows", description=__doc__.splitlines()[0])
    parser.add_argument("games", nargs="+", metavar="ENV_ID[:SEED[:OPPONENT]]")
    parser.add_argument("--max-turns", type=int, default=None, help="the most moves the model may make")
    args = parser.parse_args(argv)
    for spec in args.games:
        env_id, _, rest = spec.partition(":")
        seed_text, _, opponent = rest.partition(":")
        try:
            seed = int(seed_text) if seed_text else None
            row = task_row(env_id, seed, opponent or None, args.max_turns)
        except ValueError as exc:
            print(f"{spec}: {exc}", file=sys.stderr)
            return 2
        sys.stdout.write(orjson.dumps(row).decode() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
