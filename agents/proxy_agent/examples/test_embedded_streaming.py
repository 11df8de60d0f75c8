"""The embedded model server streams as the OpenAI SDK parses it (same model as the examples' tests)."""

from __future__ import annotations

import pytest
from openai import OpenAI

pytestmark = pytest.mark.slow


def test_the_embedded_model_streams_both_routes(embedded_registry) -> None:
    with OpenAI(base_url=embedded_registry["policy_model"].url + "/v1", api_key="unused", max_retries=0) as client:
        with client.responses.stream(model="smol", input="Say hi.", max_output_tokens=8) as stream:
            events = list(stream)
        chunks = list(client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Say hi."}],
                                                     max_tokens=8, stream=True))
    # Cut at max_output_tokens, a response ends with response.incomplete, as OpenAI's does.
    last = events[-1]
    assert last.type in ("response.completed", "response.incomplete")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas and last.response.output_text == deltas
    assert len(last.response.output[-1].model_extra["generation_token_ids"]) <= 8
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
