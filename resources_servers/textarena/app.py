"""textarena: TextArena games (textarena 0.7.4) played move by move with a `move` tool.

The task row names the game (`env_id`, optional `env_kwargs`), the `seed`, the `opponent` of a
two-player game and a move limit. At `/seed_session` the server makes the game with
`textarena.make(env_id)` and resets it; the model is always Player 0. Each `move(action)` call
passes the action text to the game unchanged (TextArena's own action wrappers, e.g. adding the
brackets, still apply), lets the opponent answer, and returns what Player 0 was told since its last
move, formatted as TextArena's LLMObservationWrapper formats it (`[GAME] ...`, `[Player 1] ...`).

Opponents of two-player games: `random`, a scripted seeded policy choosing a uniformly random legal
move (TicTacToe, ConnectFour, Nim), or `model`, the stack's model server named in the config
(`opponent_model_server`), asked at `/v1/responses` with its whole observation history as TextArena's
own agents are. The opponent model keeps the weights it was configured with: every request names
`opponent_model`, else the server's base model, so adapters hot-loaded for the policy never play
the opponent.

Invalid moves follow the game's rules: TextArena warns a player after an invalid move and lets them
retry (the error allowance, 1 in every game state class); the next invalid move in a row ends the
game as that player's loss. Every invalid move the game detects, the model's and the opponent's, is
counted.

Reward at `/verify`: two-player games compare the players' TextArena rewards: win 1.0, draw 0.5,
loss 0.0. Single-player games use the game's own reward (1 solved; a progress fraction in [0, 1)
for some games that end unsolved) with a loss (TextArena's -1) as 0.0. An unfinished game (the
model stopped moving, or hit `max_turns`) is 0.0. A game that raises is an environment failure
(HTTP 500 naming the game and the move); an opponent model that fails is HTTP 502 (504 on timeout);
neither is ever a reward.

TextArena's games draw from the process-wide `random` and `numpy.random`. Each session keeps its own
copy of both streams, swapped in around every call into its game on one game thread, so a seeded
game plays the same whatever other sessions do. The live game objects stay in the session state:
this server needs the in-memory session store (one worker process).
"""

from __future__ import annotations

import asyncio
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import numpy as np
import orjson
import textarena
from pydantic import BaseModel, ConfigDict, Field, StrictStr
from starlette.exceptions import HTTPException
from textarena.core import GAME_ID, ObservationType
from textarena.envs.registration import ENV_REGISTRY

from rollgym import BadRequest, ResourcesServer, ResourcesServerConfig, RunRequest, ServerCallError, ServerRef, Verdict, tool
from rollgym.server import ServerStartError
from rollgym.text import final_message_text

MODEL_PLAYER = 0
OPPONENT_PLAYER = 1

# Games that make, reset and play offline on Python 3.11 with textarena 0.7.4 alone. Left out (see the
# README): word games that call nltk.download at import (Wordle, Hangman, WordLadder, WordSearch,
# SpellingBee, LetterAuction, Codenames, DontSayIt, WordChains), games judged or hosted through
# OpenRouter (TwentyQuestions, GuessWho, Debate, ScenarioPlanning), modules with Python 3.12 f-string
# syntax (Chess, Checkers, ReverseTicTacToe, IteratedStagHunt, Klondike, UltimateTexasHoldem), games whose
# data files are not in the wheel (ScorableGames, UsedCarNegotiation), games that record an invalid move's
# reason as the reward and so end with a text reward (Countdown, Cryptarithm) and games of three or more players.
SINGLE_PLAYER_GAMES = [
    "GuessTheNumber-v0", "GuessTheNumber-v0-hardcore", "TowerOfHanoi-v0", "TowerOfHanoi-v0-medium",
    "Mastermind-v0", "FrozenLake-v0", "LightsOut-v0", "Minesweeper-v0-small", "FifteenPuzzle-v0",
    "Sudoku-v0-very-easy", "2048-v0-ultra-easy", "PegJump-v0",
    "ThreeCardMonte-v0", "Secretary-v0", "Blackjack-v0",
]
TWO_PLAYER_GAMES = [
    "TicTacToe-v0", "ConnectFour-v0", "Nim-v0", "Nim-v0-medium", "Othello-v0-tiny", "Breakthrough-v0-tiny",
    "KuhnPoker-v0", "IteratedRockPaperScissors-v0", "ColonelBlotto-v0-small", "Battleship-v0", "Chopsticks-v0",
]
DEFAULT_ALLOWED_ENV_IDS = SINGLE_PLAYER_GAMES + TWO_PLAYER_GAMES
# A game whose turn never comes back to the model within this many opponent moves is broken.
MAX_OPPONENT_MOVES_IN_A_ROW = 100
MOVE_DESCRIPTION = (
    "Make your move in the game: `action` is the text the game asks for (usually in square brackets, "
    "e.g. [4]). Returns what happened since your last move: the game's messages, the opponent's move, "
    "the new board, and whether the game is over."
)


class TextArenaConfig(ResourcesServerConfig):
    allowed_env_ids: list[str] | None = Field(
        default_factory=lambda: list(DEFAULT_ALLOWED_ENV_IDS),
        description="TextArena env ids a task row may name; null allows any registered id",
    )
    max_turns_limit: int = Field(default=300, ge=1, description="the largest max_turns a row may ask")
    opponent_model_server: ServerRef | None = Field(
        default=None, description="the model server that plays `opponent: model` (none: such rows are refused)"
    )
    opponent_model: str | None = Field(
        default=None, description="sent as `model` to the opponent server (default: its base model)"
    )
    opponent_temperature: float | None = Field(default=0.7, ge=0.0, le=2.0)
    opponent_max_output_tokens: int | None = Field(default=256, ge=1)
    opponent_timeout_s: float = Field(default=120.0, gt=0, description="deadline of one opponent move")


class GameTask(RunRequest):
    env_id: str = Field(min_length=1, description="a registered TextArena id, e.g. TicTacToe-v0")
    env_kwargs: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of textarena.make")
    seed: int | None = Field(default=None, ge=0, lt=2**32, description="the reset seed (games are reproducible with it)")
    opponent: Literal["random", "model"] | None = Field(
        default=None, description="two-player games: who plays Player 1; leave out for single-player games"
    )
    max_turns: int | None = Field(default=None, ge=1, description="the most moves the model may make (default: the game's own end)")


class MoveArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    action: StrictStr = Field(description="your move, as the game asks for it, e.g. [4]")


class SessionNotSeeded(RuntimeError):
    """A call on a session without a game (never seeded, or expired)."""


class GameCrashed(RuntimeError):
    """The TextArena game raised: an environment failure, never a move of the model."""


# --- scripted opponents: a uniformly random legal move, read from the game's own state -----------------


def tictactoe_moves(env: Any) -> list[str]:
    board = env.state.game_state["board"]
    return [f"[{r * 3 + c}]" for r in range(3) for c in range(3) if board[r][c] == ""]


def connect_four_moves(env: Any) -> list[str]:
    return [f"[col {c}]" for c in range(env.num_cols) if env.state.game_state["board"][0][c] == "."]


def nim_moves(env: Any) -> list[str]:
    piles = env.state.game_state["piles"]
    return [f"[{i} {q}]" for i, size in enumerate(piles) for q in range(1, size + 1)]


LEGAL_MOVES: dict[str, Callable[[Any], list[str]]] = {
    "TicTacToeEnv": tictactoe_moves,
    "ConnectFourEnv": connect_four_moves,
    "NimEnv": nim_moves,
}


def scripted_games() -> str:
    return ", ".join(name.removesuffix("Env") for name in LEGAL_MOVES)


# --- text ----------------------------------------------------------------------------------------------


def render_messages(messages: list[tuple[int, str, Any]], roles: dict[int, str], hide_actions_of: int | None,
                    single_player: bool) -> str:
    """TextArena messages as its LLMObservationWrapper shows them, one `[SENDER] text` per line.

    The player's own actions are left out for the model (its tool calls already hold them); in a
    single-player game every action is the player's own, whoever the game files it under."""
    lines = []
    for sender, text, kind in messages:
        if kind == ObservationType.PLAYER_ACTION and (single_player or sender == hide_actions_of):
            continue
        name = "GAME" if sender == GAME_ID else roles.get(sender, f"Player {sender}")
        lines.append(f"[{name}] {text}")
    return "\n".join(lines)


# --- one game in progress ------------------------------------------------------------------------------

# `random` and `numpy.random` are one per process: a swap must never overlap another.
_STREAMS_LOCK = threading.Lock()


def base_env(env: Any) -> Any:
    while isinstance(env, textarena.Wrapper):
        env = env.env
    return env


@dataclass
class Game:
    """A TextArena game of one session: the env, its random streams, the opponent and the counts.

    Its methods are plain synchronous calls into the game; the server runs them through `call`."""

    env_id: str
    num_players: int
    opponent: str | None
    max_turns: int | None
    py_state: Any
    np_state: Any
    opponent_rng: random.Random
    env: Any = None
    invalid_moves: dict[int, int] = field(default_factory=lambda: {0: 0, 1: 0})
    moves: list[str] = field(default_factory=list)
    opponent_moves: list[str] = field(default_factory=list)
    opponent_log: str = ""
    over: bool = False
    truncated: bool = False
    rewards: dict[int, float] | None = None
    reason: str | None = None

    @classmethod
    def for_task(cls, task: GameTask) -> "Game":
        """A game not made yet: its random streams start from the row's seed (fresh entropy without one)."""
        seed = task.seed
        return cls(task.env_id, 2 if task.opponent else 1, task.opponent, task.max_turns,
                   random.Random(seed).getstate(), np.random.RandomState(seed).get_state(),
                   random.Random(None if seed is None else seed + 1))

    def with_streams(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) with this game's random streams installed, the process's put back after."""
        with _STREAMS_LOCK:
            saved_py, saved_np = random.getstate(), np.random.get_state()
            random.setstate(self.py_state)
            np.random.set_state(self.np_state)
            try:
                return fn(*args)
            finally:
                self.py_state, self.np_state = random.getstate(), np.random.get_state()
                random.setstate(saved_py)
                np.random.set_state(saved_np)

    # --- inside the game (run through with_streams) ---------------------------------------------------
    def make(self, env_kwargs: dict[str, Any]) -> None:
        self.env = textarena.make(self.env_id, **env_kwargs)

    def reset(self, seed: int | None) -> None:
        self.env.reset(num_players=self.num_players, seed=seed)
        state = base_env(self.env).state
        original = state.set_invalid_move

        def counted(*args: Any, **kwargs: Any) -> Any:
            # Every invalid move a game detects goes through its state's set_invalid_move.
            player = state.current_player_id
            self.invalid_moves[player] = self.invalid_moves.get(player, 0) + 1
            return original(*args, **kwargs)

        state.set_invalid_move = counted
        self._settle()

    def step(self, player: int, action: str) -> None:
        (self.moves if player == MODEL_PLAYER else self.opponent_moves).append(action)
        try:
            self.env.step(action=action)
        except Exception as exc:
            raise GameCrashed(f"{self.env_id} raised {type(exc).__name__}: {exc} on Player {player}'s move "
                              f"{action[:200]!r}") from exc
        self._settle()

    def _settle(self) -> None:
        state = base_env(self.env).state
        if state.done and not self.over:
            self.over = True
            closed = self.env.close()
            rewards = closed[0] if isinstance(closed, tuple) else closed
            info = closed[1] if isinstance(closed, tuple) and len(closed) > 1 else {}
            try:
                self.rewards = {int(k): float(v) for k, v in (rewards or {}).items()}
            except (TypeError, ValueError):
                raise GameCrashed(f"{self.env_id} ended with rewards that are not numbers: {rewards!r}") from None
            mine = info.get(MODEL_PLAYER, {}) if isinstance(info, dict) else {}
            self.reason = str(mine.get("reason")) if isinstance(mine, dict) and mine.get("reason") else None

    @property
    def current_player(self) -> int:
        return int(base_env(self.env).state.current_player_id)

    def take_observation(self, player: int) -> str:
        """What `player` was told since it last looked (TextArena queues messages per player)."""
        state = base_env(self.env).state
        messages, state.observations[player] = state.observations[player], []
        if player == MODEL_PLAYER:
            return render_messages(messages, state.role_mapping, MODEL_PLAYER, self.num_players == 1)
        self.opponent_log += "\n" + render_messages(messages, state.role_mapping, None, False)
        return self.opponent_log

    def scripted_move(self) -> str:
        moves = LEGAL_MOVES[type(base_env(self.env)).__name__](base_env(self.env))
        return self.opponent_rng.choice(moves) if moves else "[0]"

    # --- the outcome ----------------------------------------------------------------------------------
    def outcome(self) -> tuple[str, float, float | None]:
        """(outcome, reward, the model's TextArena reward): see the module docstring."""
        if not self.over or not self.rewards or MODEL_PLAYER not in self.rewards:
            return ("truncated" if self.truncated else "unfinished"), 0.0, None
        mine = self.rewards[MODEL_PLAYER]
        if self.num_players == 1:
            label = "win" if mine >= 1.0 else ("partial" if mine > 0.0 else "loss")
            return label, min(max(mine, 0.0), 1.0), mine
        theirs = self.rewards.get(OPPONENT_PLAYER, 0.0)
        if mine > theirs:
            return "win", 1.0, mine
        return ("draw", 0.5, mine) if mine == theirs else ("loss", 0.0, mine)

    def end_text(self) -> str:
        label, reward, _raw = self.outcome()
        said = {"win": "you won", "loss": "you lost", "draw": "it is a draw", "partial": "you did not solve it"}
        why = f" ({self.reason})" if self.reason else ""
        return f"The game is over{why}: {said.get(label, label)}. Reward: {reward:g}. Give your final answer."


# --- the server ----------------------------------------------------------------------------------------


class TextArenaServer(ResourcesServer):
    config_class = TextArenaConfig
    config: TextArenaConfig
    task_model = GameTask

    def __init__(self, config: TextArenaConfig | None = None, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        if not self.sessions.holds_objects:
            self.sessions.close()
            raise ServerStartError(
                f"server {self.name!r}: TextArena games are live objects kept in the session state, so this "
                "server needs session_store: memory (run it with one worker process)"
            )
        # One game thread: game calls are short, and the random-stream swap is exclusive anyway.
        self._game_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="textarena")
        self._opponent_base: str | None = None

    async def shutdown(self) -> None:
        self.close_game_thread()
        await super().shutdown()

    def close_game_thread(self) -> None:
        self._game_thread.shutdown(wait=False, cancel_futures=True)

    async def call(self, game: Game, fn: Callable[..., Any], *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._game_thread, game.with_streams, fn, *args)

    # --- seeding ----------------------------------------------------------------------------------------
    def check_task(self, task: GameTask) -> None:
        allowed = self.config.allowed_env_ids
        if allowed is not None and task.env_id not in allowed:
            raise BadRequest(f"env_id {task.env_id!r} is not allowed here (allowed: {', '.join(allowed)})", field="env_id")
        if task.env_id not in ENV_REGISTRY:
            raise BadRequest(f"unknown env_id {task.env_id!r}: not a registered TextArena game", field="env_id")
        if task.max_turns is not None and task.max_turns > self.config.max_turns_limit:
            raise BadRequest(f"max_turns is above this server's limit of {self.config.max_turns_limit}", field="max_turns")
        if task.opponent == "model" and self.config.opponent_model_server is None:
            raise BadRequest("opponent 'model' needs opponent_model_server in this server's config", field="opponent")

    async def seed(self, task: GameTask, state: dict[str, Any]) -> None:
        self.check_task(task)
        game = Game.for_task(task)
        try:
            await self.call(game, game.make, task.env_kwargs)
        except TypeError as exc:
            raise BadRequest(f"textarena.make({task.env_id!r}) rejects these env_kwargs: {exc}", field="env_kwargs") from None
        except Exception as exc:
            raise GameCrashed(f"textarena.make({task.env_id!r}) failed: {type(exc).__name__}: {exc}") from exc
        if task.opponent == "random" and type(base_env(game.env)).__name__ not in LEGAL_MOVES:
            raise BadRequest(f"no scripted opponent for {task.env_id} (scripted games: {scripted_games()}); "
                             "use opponent: model", field="opponent")
        try:
            await self.call(game, game.reset, task.seed)
        except AssertionError as exc:
            # TextArena's state classes assert the number of players.
            kind = "two-player: name an opponent" if task.opponent is None else "not a two-player game: leave opponent out"
            raise BadRequest(f"{task.env_id} is {kind} ({exc})", field="opponent") from None
        except Exception as exc:
            raise GameCrashed(f"{task.env_id} failed at reset: {type(exc).__name__}: {exc}") from exc
        await self.opponent_turns(game)
        state.update(game=game, first_observation=await self.call(game, game.take_observation, MODEL_PLAYER))

    async def first_observation(self, task: GameTask) -> str:
        """What the model sees before its first move (the rows' user prompt embeds it)."""
        state: dict[str, Any] = {}
        await self.seed(task, state)
        return state["first_observation"]

    # --- playing ----------------------------------------------------------------------------------------
    @tool(description=MOVE_DESCRIPTION)
    async def move(self, args: MoveArgs, state: dict[str, Any]) -> str:
        game = self.game_of(state)
        if game.over or game.truncated:
            return f"The game has already ended after {len(game.moves)} of your moves; no more moves are possible. " \
                   "Give your final answer."
        await self.call(game, game.step, MODEL_PLAYER, args.action)
        await self.opponent_turns(game)
        text = await self.call(game, game.take_observation, MODEL_PLAYER)
        if game.over:
            return f"{text}\n{game.end_text()}".strip()
        if game.max_turns is not None and len(game.moves) >= game.max_turns:
            game.truncated = True
            return (f"{text}\nThe move limit of {game.max_turns} moves is reached: the game stops here unfinished "
                    "(reward 0). Give your final answer.").strip()
        return text

    async def opponent_turns(self, game: Game) -> None:
        """Let Player 1 move until it is the model's turn again or the game is over."""
        for _ in range(MAX_OPPONENT_MOVES_IN_A_ROW):
            if game.over or game.num_players == 1 or game.current_player == MODEL_PLAYER:
                return
            history = await self.call(game, game.take_observation, OPPONENT_PLAYER)
            if game.opponent == "random":
                action = await self.call(game, game.scripted_move)
            else:
                action = await self.ask_opponent(history)
            await self.call(game, game.step, OPPONENT_PLAYER, action)
        raise GameCrashed(f"{game.env_id}: Player 1 moved {MAX_OPPONENT_MOVES_IN_A_ROW} times in a row "
                          "without the turn coming back to Player 0")

    def game_of(self, state: dict[str, Any]) -> Game:
        game = state.get("game")
        if game is None:
            raise SessionNotSeeded("this session has no game: /seed_session was not called or the session expired")
        return game

    # --- the opponent model -------------------------------------------------------------------------------
    async def ask_opponent(self, history: str) -> str:
        """The opponent model's move for its observation history; HTTP 502/504 when it cannot answer."""
        ref = self.config.opponent_model_server
        assert ref is not None  # check_task refused `opponent: model` without one
        payload: dict[str, Any] = {"input": [
            {"role": "system", "content": "You are playing a text game. Answer with your next move in the "
                                          "format the game asks for."},
            {"role": "user", "content": history.strip()},
        ]}
        payload["model"] = self.config.opponent_model or await self._opponent_base_model(ref.name)
        if self.config.opponent_temperature is not None:
            payload["temperature"] = self.config.opponent_temperature
        if self.config.opponent_max_output_tokens is not None:
            payload["max_output_tokens"] = self.config.opponent_max_output_tokens
        try:
            reply = await self.client.post(ref.name, "/v1/responses", json=payload, timeout_s=self.config.opponent_timeout_s)
        except ServerCallError as exc:
            if exc.kind == "timeout":
                raise HTTPException(504, detail=f"opponent model {ref.name!r}: no move within "
                                                f"opponent_timeout_s={self.config.opponent_timeout_s:g} s") from None
            raise HTTPException(502, detail=f"opponent model server {ref.name!r} unavailable: {exc}") from None
        if not reply.ok:
            raise HTTPException(502, detail=f"opponent model server {ref.name!r} answered HTTP {reply.status}: "
                                            f"{reply.error_message()}")
        try:
            body = reply.json()
        except orjson.JSONDecodeError:
            raise HTTPException(502, detail=f"opponent model server {ref.name!r} answered with a body that is not JSON") from None
        output = body.get("output") if isinstance(body, dict) else None
        return final_message_text(output or [])

    async def _opponent_base_model(self, server: str) -> str:
        """The opponent server's base model (asked once): naming it keeps hot-loaded adapters out."""
        if self._opponent_base is None:
            try:
                reply = await self.client.get(server, "/v1/models", timeout_s=30)
                cards = reply.json().get("data", []) if reply.ok else []
            except ServerCallError as exc:
                raise HTTPException(502, detail=f"opponent model server {server!r} unavailable: {exc}") from None
            except (orjson.JSONDecodeError, AttributeError):
                raise HTTPException(502, detail=f"opponent model server {server!r}: its /v1/models is not a model list") from None
            bases = [c["id"] for c in cards if isinstance(c, dict) and c.get("id") and not c.get("parent")]
            if not bases:
                raise HTTPException(502, detail=f"opponent model server {server!r} lists no base model at /v1/models; "
                                                "set opponent_model")
            self._opponent_base = bases[0]
        return self._opponent_base

    # --- reward -------------------------------------------------------------------------------------------
    async def verify(self, request: GameTask, state: dict[str, Any]) -> Verdict:
        game = self.game_of(state)
        label, reward, raw = game.outcome()
        invalid = game.invalid_moves.get(MODEL_PLAYER, 0)
        components = {"win": float(label == "win"), "invalid_moves": float(invalid)}
        if raw is not None:
            components["game_reward"] = raw
        return Verdict(
            reward=reward,
            components=components,
            details={
                "env_id": game.env_id,
                "outcome": label,
                "game_over": game.over,
                "end_reason": game.reason,
                "game_rewards": {str(k): v for k, v in (game.rewards or {}).items()},
                "model_moves": len(game.moves),
                "invalid_moves": invalid,
                "opponent": game.opponent,
                "opponent_moves": len(game.opponent_moves),
                "opponent_invalid_moves": game.invalid_moves.get(OPPONENT_PLAYER, 0) if game.num_players == 2 else 0,
            },
        )
