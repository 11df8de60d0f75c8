"""examples/langgraph_react/agent.py, unchanged, through the proxy on the embedded model."""

from __future__ import annotations

import pytest

from agents.proxy_agent.examples.conftest import check_token_exact

pytestmark = pytest.mark.slow


def test_the_agent_runs_unchanged_through_the_proxy(run_example, embedded_registry) -> None:
    result = run_example("langgraph_react", "Paris")
    check_token_exact(result, embedded_registry["policy_model"].url)
