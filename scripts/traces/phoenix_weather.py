"""The traces proof on the weather task: an unchanged openai-SDK agent traced into Phoenix, feedback
attached afterwards, then `rollgym train scripts/train/traces_phoenix.yaml` trains on those traces.

    make phoenix                                                    # once: Phoenix's own venv
    .venv-phoenix/bin/phoenix serve &                               # http://127.0.0.1:6006
    rollgym run resources_servers/weather/configs/weather.yaml --registry-file runs/stack.json &
    python scripts/traces/phoenix_weather.py agent --model-url http://127.0.0.1:PORT --samples 4
    python scripts/traces/phoenix_weather.py feedback               # a thumbs score on each answer
    rollgym train scripts/train/traces_phoenix.yaml

`agent` is what a team already runs: plain `openai` chat completions with a get_weather tool, instrumented
by OpenInference's `OpenAIInstrumentor` and nothing else (each model call is one trace in Phoenix).
`feedback` plays the users: it reads the project's traces back from Phoenix and attaches a `thumbs` score
(1: the answer states the city's condition and temperature, 0: it does not) to each final answer.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from resources_servers.weather.app import WEATHER, weather_report, weather_reward  # noqa: E402

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather for a city.",
                                         "parameters": {"type": "object", "required": ["city"],
                                                        "properties": {"city": {"type": "string"}}}}}


def run_agent(args: argparse.Namespace) -> None:
    import openai
    from openinference.instrumentation.openai import OpenAIInstrumentor
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    client = openai.OpenAI(base_url=f"{args.model_url.rstrip('/')}/v1", api_key="unused")
    model = client.models.list().data[0].id
    provider = TracerProvider(resource=Resource.create({"openinference.project.name": args.project}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=f"{args.phoenix_url}/v1/traces")))
    OpenAIInstrumentor().instrument(tracer_provider=provider)
    rows = [json.loads(line) for line in Path(args.tasks).read_text().splitlines()][: args.limit]
    for n, row in enumerate(rows):
        messages = [{"role": m["role"], "content": m["content"]} for m in row["responses_create_params"]["input"]]
        for _ in range(args.samples):
            first = client.chat.completions.create(
                model=model, messages=messages, tools=[TOOL], max_tokens=48, temperature=args.temperature,
                tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0].message
            calls = first.tool_calls or []
            if not calls:
                continue
            city = json.loads(calls[0].function.arguments or "{}").get("city", "")
            convo = messages + [first.model_dump(exclude_none=True),
                                {"role": "tool", "tool_call_id": calls[0].id, "content": weather_report(str(city))}]
            answer = client.chat.completions.create(model=model, messages=convo, tools=[TOOL], max_tokens=48,
                                                    temperature=args.temperature).choices[0].message.content
            print(f"[{n + 1}/{len(rows)}] {row['city']}: {answer!r}", flush=True)
    provider.shutdown()


def give_feedback(args: argparse.Namespace) -> None:
    from rollgym.traces import phoenix
    from rollgym.traces.sources import read_traces

    scored = good = 0
    for trace in read_traces(f"trace://phoenix/{args.project}?url={args.phoenix_url}"):
        messages = trace.messages()
        if not any(m.get("role") == "tool" for m in messages) or trace.reward("thumbs") is not None:
            continue  # only final answers are rated, once
        question = next((str(m.get("content")) for m in messages if m.get("role") == "user"), "")
        entry = next((e for e in WEATHER.values() if e["city"].lower() in question.lower()), None)
        if entry is None:
            continue
        score = weather_reward(str(trace.final_answer or ""), [entry["condition"], str(entry["temperature_c"])])
        phoenix.annotate(trace.episode.id, "thumbs", score, label="up" if score else "down", url=args.phoenix_url)
        scored, good = scored + 1, good + int(score)
    print(f"feedback: {good} of {scored} answers thumbs up")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=["agent", "feedback"])
    parser.add_argument("--phoenix-url", default="http://127.0.0.1:6006")
    parser.add_argument("--project", default="weather-agent")
    parser.add_argument("--model-url", help="agent: the model server (any OpenAI-compatible one)")
    parser.add_argument("--tasks", default=str(REPO / "resources_servers/weather/data/train.jsonl"))
    parser.add_argument("--limit", type=int, default=16)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=1.0)
    args = parser.parse_args()
    args.phoenix_url = args.phoenix_url.rstrip("/")
    if args.step == "agent":
        if not args.model_url:
            parser.error("agent needs --model-url")
        run_agent(args)
    else:
        give_feedback(args)


if __name__ == "__main__":
    main()
