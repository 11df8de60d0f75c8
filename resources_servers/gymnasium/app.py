"""gymnasium: any Gymnasium environment with a discrete action space, played turn by turn with a `step` tool.

The task row names the environment (`env_id`, `env_kwargs`), the reset `seed` and a step limit. At
seed time the server makes the environment and resets it; each `step(action)` call advances it and
answers with the new observation as text, the step reward and whether the episode ended. Reward at
`/verify`: the sum of the environment's rewards over the episode (FrozenLake: 1.0 if the goal was
reached, else 0.0).

Text: FrozenLake, CliffWalking, Taxi and Blackjack have their own renderings and action names
(FrozenLake: left, down, right, up); any other environment shows its "ansi" render when it has one,
else the observation's value, and takes integer actions.

The live environment object is kept in the session state, so this server needs the in-memory
session store (one worker process); it refuses to start with `session_store: sqlite`.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from typing import Any, Callable

import gymnasium
import numpy as np
from gymnasium.envs.registration import load_env_creator
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from rollgym import BadRequest, ResourcesServer, ResourcesServerConfig, RunRequest, Verdict, tool
from rollgym.server import ServerStartError

# Toy-text environments: cheap, text-friendly and import nothing beyond gymnasium + numpy.
DEFAULT_ALLOWED_ENV_IDS = [
    "FrozenLake-v1", "FrozenLake8x8-v1", "CliffWalking-v1", "CliffWalkingSlippery-v1", "Taxi-v4", "Blackjack-v1",
]
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


class GymnasiumConfig(ResourcesServerConfig):
    allowed_env_ids: list[str] | None = Field(
        default_factory=lambda: list(DEFAULT_ALLOWED_ENV_IDS),
        description="env ids a task row may name; null allows any registered id (a 'module:Env' id imports "
        "that module, so only allow it for trusted task files)",
    )
    max_episode_steps_limit: int = Field(default=1000, ge=1, description="the largest max_episode_steps a row may ask")


class GymTask(RunRequest):
    env_id: str = Field(min_length=1, description="a registered Gymnasium id, e.g. FrozenLake-v1")
    env_kwargs: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of gymnasium.make")
    seed: int | None = Field(default=None, description="the reset seed (episodes are reproducible with it)")
    max_episode_steps: int | None = Field(default=None, ge=1, description="step limit (default: the env's own)")


class StepArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    action: StrictInt | StrictStr = Field(
        description="the action: its number, or its name for known environments "
        "(FrozenLake: left, down, right, up; CliffWalking: up, right, down, left; "
        "Taxi: south, north, east, west, pickup, dropoff; Blackjack: stick, hit)"
    )


class SessionNotSeeded(RuntimeError):
    """A call on a session without an environment (never seeded, or expired)."""


# --- text renderings of known environments ------------------------------------------------------------


def _plain(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def render_frozen_lake(env: Any, obs: Any) -> str:
    lake = env.unwrapped
    rows = [[cell.decode() for cell in row] for row in lake.desc]
    row, col = divmod(int(obs), lake.ncol)
    under = rows[row][col]
    rows[row][col] = "*"
    grid = "\n".join("".join(r) for r in rows)
    return (f"Map (row 0 is the top; S start, F frozen, H hole, G goal, * you):\n{grid}\n"
            f"You are at row {row}, column {col} (on {under}).")


def frozen_lake_end(env: Any, obs: Any, reward: float) -> str:
    lake = env.unwrapped
    row, col = divmod(int(obs), lake.ncol)
    return "you reached the goal" if lake.desc[row][col] == b"G" else "you fell into a hole"


def render_cliff_walking(env: Any, obs: Any) -> str:
    row, col = divmod(int(obs), env.unwrapped.shape[1])
    grid = ANSI_ESCAPE.sub("", env.render() or "").rstrip()
    return (f"Grid (row 0 is the top; o free, C cliff, T target, x you):\n{grid}\n"
            f"You are at row {row}, column {col}.")


TAXI_STOPS = ["R", "G", "Y", "B"]


def render_taxi(env: Any, obs: Any) -> str:
    taxi_row, taxi_col, passenger, destination = env.unwrapped.decode(int(obs))
    grid = ANSI_ESCAPE.sub("", env.render() or "").rstrip()
    where = "in the taxi" if passenger == 4 else f"waiting at {TAXI_STOPS[passenger]}"
    return (f"{grid}\nThe taxi is at row {taxi_row}, column {taxi_col} (row 0 is the top). "
            f"The passenger is {where}; the destination is {TAXI_STOPS[destination]}.")


def render_blackjack(env: Any, obs: Any) -> str:
    player, dealer, usable_ace = (int(v) for v in obs)
    return f"Your hand totals {player}; the dealer shows {dealer}; usable ace: {'yes' if usable_ace else 'no'}."


def render_generic(env: Any, obs: Any) -> str:
    if getattr(env, "render_mode", None) == "ansi":
        text = env.render()
        if isinstance(text, str) and text.strip():
            return ANSI_ESCAPE.sub("", text).rstrip()
    return f"Observation: {_plain(obs)!r}"


@dataclass(frozen=True)
class Adapter:
    render: Callable[[Any, Any], str]
    action_names: tuple[str, ...] = ()
    end: Callable[[Any, Any, float], str] | None = None


ADAPTERS: dict[str, Adapter] = {
    "FrozenLakeEnv": Adapter(render_frozen_lake, ("left", "down", "right", "up"), frozen_lake_end),
    "CliffWalkingEnv": Adapter(render_cliff_walking, ("up", "right", "down", "left")),
    "TaxiEnv": Adapter(render_taxi, ("south", "north", "east", "west", "pickup", "dropoff")),
    "BlackjackEnv": Adapter(render_blackjack, ("stick", "hit")),
}
GENERIC = Adapter(render_generic)


def adapter_for(env: Any) -> Adapter:
    return ADAPTERS.get(type(env.unwrapped).__name__, GENERIC)


# --- making, stepping ---------------------------------------------------------------------------------


def make_env(task: GymTask, allowed: list[str] | None, step_limit: int) -> Any:
    """gymnasium.make for a task row, "ansi" rendering when the env has it; BadRequest names the bad field."""
    if allowed is not None and task.env_id not in allowed:
        raise BadRequest(f"env_id {task.env_id!r} is not allowed here (allowed: {', '.join(allowed)})", field="env_id")
    if task.max_episode_steps is not None and task.max_episode_steps > step_limit:
        raise BadRequest(f"max_episode_steps is above this server's limit of {step_limit}", field="max_episode_steps")
    try:
        spec = gymnasium.spec(task.env_id)
    except gymnasium.error.Error as exc:
        raise BadRequest(f"unknown env_id {task.env_id!r}: {exc}", field="env_id") from None
    kwargs = {k: v for k, v in task.env_kwargs.items() if k != "render_mode"}
    creator = spec.entry_point if callable(spec.entry_point) else load_env_creator(spec.entry_point)
    metadata = getattr(creator, "metadata", None)
    modes = metadata.get("render_modes", []) if isinstance(metadata, dict) else []
    if "ansi" in modes:
        kwargs["render_mode"] = "ansi"
    try:
        env = gymnasium.make(task.env_id, max_episode_steps=task.max_episode_steps, **kwargs)
    except (TypeError, ValueError, KeyError, AssertionError, gymnasium.error.Error) as exc:
        raise BadRequest(f"gymnasium.make({task.env_id!r}) failed with these env_kwargs: {exc}", field="env_kwargs") from None
    if not isinstance(env.action_space, gymnasium.spaces.Discrete):
        env.close()
        raise BadRequest(f"{task.env_id} has a {type(env.action_space).__name__} action space; "
                         "this adapter plays Discrete action spaces only", field="env_id")
    return env


def parse_action(env: Any, action: int | str) -> int:
    """The action index for an int or a name; BadRequest naming `action` when it is not valid here."""
    space = env.action_space
    start, n = int(space.start), int(space.n)
    names = adapter_for(env).action_names
    valid = ", ".join(f"{name} ({start + i})" for i, name in enumerate(names)) or f"{start} to {start + n - 1}"
    if isinstance(action, str):
        text = action.strip().lower()
        if re.fullmatch(r"[+-]?\d+", text):
            action = int(text)
        elif text in names:
            return start + names.index(text)
        else:
            raise BadRequest(f"unknown action {action!r}; valid actions: {valid}", field="action")
    if not start <= action < start + n:
        raise BadRequest(f"action {action} is out of range; valid actions: {valid}", field="action")
    return action


def describe_step(env: Any, state: dict[str, Any], label: str, obs: Any, reward: float) -> str:
    lines = [f"Action: {label}.", state["observation"], f"Step reward: {reward:g}. Total reward: {state['total_reward']:g}."]
    if state["terminated"]:
        end = adapter_for(env).end
        lines.append(f"The episode has ended: {end(env, obs, reward) if end else 'a terminal state was reached'}.")
    elif state["truncated"]:
        lines.append(f"The episode has ended: the step limit of {state['steps']} steps was reached.")
    else:
        lines.append("The episode continues.")
    return "\n".join(lines)


class GymnasiumServer(ResourcesServer):
    config_class = GymnasiumConfig
    config: GymnasiumConfig
    task_model = GymTask

    def __init__(self, config: GymnasiumConfig | None = None, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        if not self.sessions.holds_objects:
            self.sessions.close()
            raise ServerStartError(
                f"server {self.name!r}: the gymnasium adapter keeps live environment objects in the session "
                "state, so it needs session_store: memory (run it with one worker process)"
            )

    async def seed(self, task: GymTask, state: dict[str, Any]) -> None:
        old = state.get("env")
        if old is not None:
            old.close()
        env = await asyncio.to_thread(make_env, task, self.config.allowed_env_ids, self.config.max_episode_steps_limit)
        obs, _info = await asyncio.to_thread(env.reset, seed=task.seed)
        state.update(env=env, env_id=task.env_id, observation=adapter_for(env).render(env, obs), total_reward=0.0,
                     steps=0, terminated=False, truncated=False, actions=[], rewards=[])

    @tool
    async def step(self, args: StepArgs, state: dict[str, Any]) -> str:
        """Take one action in the environment; returns the new observation, the step reward and whether the episode ended."""
        env = state.get("env")
        if env is None:
            raise SessionNotSeeded("this session has no environment: /seed_session was not called or the session expired")
        if state["terminated"] or state["truncated"]:
            return (f"The episode has already ended after {state['steps']} steps with total reward "
                    f"{state['total_reward']:g}; no more actions are possible. Give your final answer.")
        action = parse_action(env, args.action)
        obs, reward, terminated, truncated, _info = await asyncio.to_thread(env.step, action)
        reward = float(reward)
        names = adapter_for(env).action_names
        index = action - int(env.action_space.start)
        label = f"{names[index]} ({action})" if index < len(names) else str(action)
        state["observation"] = adapter_for(env).render(env, obs)
        state["total_reward"] += reward
        state["steps"] += 1
        state["terminated"], state["truncated"] = bool(terminated), bool(truncated)
        state["actions"].append(action)
        state["rewards"].append(reward)
        return describe_step(env, state, label, obs, reward)

    async def verify(self, request: GymTask, state: dict[str, Any]) -> Verdict:
        if state.get("env") is None:
            raise SessionNotSeeded("this session has no environment: /seed_session was not called or the session expired")
        return Verdict(
            reward=float(state["total_reward"]),
            details={
                "episode_steps": state["steps"],
                "episode_ended": state["terminated"] or state["truncated"],
                "terminated": state["terminated"],
                "truncated": state["truncated"],
                "actions": list(state["actions"]),
            },
        )
