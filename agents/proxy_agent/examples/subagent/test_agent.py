"""examples/subagent/agent.py, unchanged, through the proxy on the embedded model: several segments, each
labelled by its conversation and by why it began, every model call's tokens in exactly one of them."""

from __future__ import annotations

from collections import Counter

import pytest

from agents.proxy_agent.examples.test_segment_agents import sampled_runs
from rollgym.sequences import token_record

pytestmark = pytest.mark.slow


def test_the_agent_runs_unchanged_through_the_proxy(run_example) -> None:
    result = run_example("subagent", "Paris")
    assert result["status"] in ("ok", "truncated"), result.get("error")
    assert isinstance(result["reward"], float)
    labels = [(s["conversation"], s["segment_reason"]) for s in result["sequences"]]
    assert labels[:2] == [(0, None), (1, "new_conversation")], (labels, result["agent_answer"])
    calls = [r for r in (token_record(item) for item in result["response"]["output"]) if r is not None]
    trained = [run for s in result["sequences"] for run in sampled_runs(s["completion_ids"], s["completion_mask"])]
    assert Counter(trained) == Counter(tuple(call.generation) for call in calls if call.generation)
