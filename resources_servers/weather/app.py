"""Weather: a one-tool environment. The model looks up a city's weather and reports it.

Reward 1.0 when the final assistant message states every expected fact (e.g. "sunny", "22"),
else 0.0.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rollgym import ResourcesServer, RunRequest, Verdict, tool
from rollgym.text import final_message_text

# A small fixed world so rewards are deterministic.
WEATHER: dict[str, dict[str, Any]] = {
    "paris": {"city": "Paris", "condition": "sunny", "temperature_c": 22},
    "london": {"city": "London", "condition": "rainy", "temperature_c": 14},
    "tokyo": {"city": "Tokyo", "condition": "cloudy", "temperature_c": 18},
    "cairo": {"city": "Cairo", "condition": "hot and dry", "temperature_c": 35},
    "oslo": {"city": "Oslo", "condition": "snowy", "temperature_c": -3},
    "lima": {"city": "Lima", "condition": "foggy", "temperature_c": 17},
    "sydney": {"city": "Sydney", "condition": "windy", "temperature_c": 20},
    "toronto": {"city": "Toronto", "condition": "stormy", "temperature_c": 11},
}


class WeatherTask(RunRequest):
    city: str = Field(description="the city the user asks about")
    expected: list[str] = Field(min_length=1, description="facts the final answer must state, case-insensitive")


class GetWeatherArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    city: str = Field(min_length=1, description="City name, e.g. Paris")


def weather_report(city: str) -> str:
    """The tool's answer for a city."""
    entry = WEATHER.get(city.strip().lower())
    if entry is None:
        return f"No weather data for {city.strip()}. Known cities: {', '.join(e['city'] for e in WEATHER.values())}."
    return f"{entry['city']}: {entry['condition']}, {entry['temperature_c']} C"


def weather_reward(answer: str, expected: list[str]) -> float:
    """1.0 when the answer contains every expected fact (case-insensitive), else 0.0."""
    text = answer.lower()
    return 1.0 if all(fact.lower() in text for fact in expected) else 0.0


class WeatherServer(ResourcesServer):
    task_model = WeatherTask

    async def seed(self, task: WeatherTask, state: dict[str, Any]) -> None:
        state["lookups"] = []

    @tool
    async def get_weather(self, args: GetWeatherArgs, state: dict[str, Any]) -> str:
        """Get the current weather for a city."""
        state.setdefault("lookups", []).append(args.city)
        return weather_report(args.city)

    async def verify(self, request: WeatherTask, state: dict[str, Any]) -> Verdict:
        answer = final_message_text(request.response.output)
        return Verdict(
            reward=weather_reward(answer, request.expected),
            details={"looked_up": list(state.get("lookups", []))},
        )
