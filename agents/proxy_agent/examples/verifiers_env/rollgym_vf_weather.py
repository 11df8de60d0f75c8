"""A tool: the model looks the weather up with `get_weather` (a verifiers Toolset, served over MCP
per rollout) and is rewarded for reporting it."""

from collections.abc import Iterator

import verifiers.v1 as vf

WEATHER = {"Paris": "sunny, 22 C", "Oslo": "snow, -3 C", "Lima": "cloudy, 18 C", "Tokyo": "rainy, 16 C"}


class WeatherToolset(vf.Toolset[vf.ToolsetConfig, vf.State]):
    TOOL_PREFIX = None  # the tool is `get_weather`, not `weather_toolset_get_weather`

    @vf.tool
    async def get_weather(self, city: str) -> str:
        """Get the current weather for a city."""
        return f"{city}: {WEATHER.get(city, 'unknown')}"


class WeatherData(vf.TaskData):
    city: str


class WeatherTask(vf.Task[WeatherData, vf.State, vf.TaskConfig]):
    @classmethod
    def toolsets(cls, config: vf.TaskConfig) -> list[vf.Toolset]:
        return [WeatherToolset(vf.ToolsetConfig())]

    @vf.reward
    async def reports_weather(self, task: WeatherData, trace: vf.Trace) -> float:
        return float(WEATHER[task.city] in trace.last_reply)

    @vf.reward(weight=0.0)
    async def used_tool(self, task: WeatherData, trace: vf.Trace) -> float:
        return float(bool(trace.tool_messages))


class WeatherTaskset(vf.Taskset[WeatherTask, vf.TasksetConfig]):
    def load(self) -> Iterator[WeatherTask]:
        for city in WEATHER:
            yield WeatherTask(WeatherData(prompt=f"What is the weather in {city}?", city=city), self.config.task)


__all__ = ["WeatherTaskset"]

if __name__ == "__main__":  # verifiers serves a Toolset by running its module
    WeatherToolset.run()
