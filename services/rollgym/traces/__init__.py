"""Traces are data: learning events and OpenTelemetry spans in, training records out.

- `schema`: Episode / Step / Reward / Event, and the Trace one episode assembles to;
- `hooks`: emit(event), the episode()/node() context managers and the @tool decorator, written as spans
  (OpenInference / GenAI conventions) to a local store, OTLP/JSON files or any OTLP/HTTP endpoint;
- `sources`: `trace://local/...`, `trace://otlp/<file>`, `trace://phoenix/<project>`,
  `trace://langfuse/<project>`, `dataset://hf/<name>[:split]`, read into Traces or training records;
- `transforms`: to_sft, to_preferences, to_trajectories, and their filters;
- `langfuse`: Event <-> LangFuse trace / observation / score.

The OpenTelemetry SDK is the optional extra `traces` (pip install 'rollgym[traces]'); reading stores and
transforming needs none of it.
"""

from .schema import Episode, Event, Reward, Step, TokenRecord, Trace

_LAZY = {"configure": ".hooks", "current": ".hooks", "emit": ".hooks", "episode": ".hooks", "node": ".hooks",
         "tool": ".hooks", "Tracing": ".hooks"}


def __getattr__(name: str):  # the hooks import the OpenTelemetry SDK only when used
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(name)


__all__ = ["Episode", "Event", "Reward", "Step", "TokenRecord", "Trace", "Tracing", "configure", "current", "emit",
           "episode", "node", "tool"]
