"""Relay: a two-role program. A caller reads the request and names the city to look up; an answerer is
handed the lookup's result and must report the code exactly. Each role has its own reward (`rewards`), so
each can be trained as a policy of its own (docs/train-policies.md).

- `caller`: 1.0 when the lookup was made for exactly the task's city (case, spaces and a final period ignored),
  0.5 when its argument names the city among a few other words ("The code for Paris") and no other city of
  the table (a list of every city is no answer), else 0.0;
- `answerer`: 1.0 when the final answer is exactly the code the lookup returned (a final period ignored), 0.5
  when it contains it among other words and no other number (a spray of numbers is no answer), else 0.0;
- `reward` (the episode's, a team's): their mean.

The half credit gives GRPO something to rank on a small model, which rarely answers with the bare word at first
(the bundled SmolLM2-135M, temperature 0.7: about 0.3 for the caller and 0.1 for the answerer).

The lookup answers every city with a code (a fixed table, and a code derived from the name otherwise), so the
answerer's task does not depend on the caller's success: the roles' rewards are their own.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rollgym import ResourcesServer, RunRequest, Verdict, tool
from rollgym.text import final_message_text

CODES = {"paris": "4817", "london": "2290", "tokyo": "7051", "cairo": "3364", "oslo": "9128", "lima": "5573",
         "sydney": "6402", "toronto": "1839", "rome": "8246", "berlin": "3915", "madrid": "7480", "vienna": "2067"}


HALF_CREDIT_WORDS = 8  # a lookup argument longer than this is not naming a city among a few words


class RelayTask(RunRequest):
    city: str = Field(description="the city the request names")


class LookupArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    city: str = Field(description="the city whose code to look up")


def normalise(city: str) -> str:
    return " ".join(city.strip().strip(".!\"'").lower().split())


def code_of(city: str) -> str:
    """The code the lookup returns for a city: the table's, or four digits derived from the name."""
    key = normalise(city)
    return CODES.get(key) or str(1000 + int(hashlib.sha256(key.encode()).hexdigest(), 16) % 9000)


def relay_rewards(city: str, lookups: list[str], answer: str) -> dict[str, float]:
    """Each role's reward: the caller's for the city it looked up (the last lookup), the answerer's for the code."""
    if not lookups:
        return {"caller": 0.0, "answerer": 0.0}
    looked_up, code = lookups[-1], code_of(lookups[-1])
    words = normalise(looked_up)
    named = re.search(rf"\b{re.escape(normalise(city))}\b", words) is not None
    others = [other for other in CODES if other != normalise(city) and re.search(rf"\b{other}\b", words)]
    named = named and not others and len(words.split()) <= HALF_CREDIT_WORDS
    numbers = re.findall(r"\d+", answer)
    return {"caller": 1.0 if words == normalise(city) else 0.5 if named else 0.0,
            "answerer": 1.0 if answer.strip().rstrip(".") == code else 0.5 if numbers == [code] else 0.0}


class RelayServer(ResourcesServer):
    task_model = RelayTask

    async def seed(self, task: RelayTask, state: dict[str, Any]) -> None:
        state["lookups"] = []

    @tool
    async def lookup(self, args: LookupArgs, state: dict[str, Any]) -> str:
        """The access code of a city."""
        state.setdefault("lookups", []).append(args.city)
        return code_of(args.city)

    async def verify(self, request: RelayTask, state: dict[str, Any]) -> Verdict:
        lookups = list(state.get("lookups", []))
        rewards = relay_rewards(request.city, lookups, final_message_text(request.response.output))
        return Verdict(reward=sum(rewards.values()) / len(rewards), details={"rewards": rewards, "looked_up": lookups})
