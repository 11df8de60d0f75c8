"""The token view's segments over real HTTP: each segment after the first says why it began, from the label
an agent recorded (the proxy's `conversation` / `segment_reason`) and from where its tokens stop extending
the segment above (the reading `rollgym check-tokens` gives, with the tokens around that point)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from rollgym.sequences import SEGMENT_REASONS
from rollgym.testing import serve_in_thread
from rollgym.view.app import ViewServer
from rollgym.view.runs import Catalog

from .test_index import rollout, write


def segment(prompt: list[int], completion: list[int], mask: list[int], **labels: Any) -> dict[str, Any]:
    return {"prompt_ids": prompt, "completion_ids": completion, "completion_mask": mask,
            "completion_logprobs": [-0.5 if m else 0.0 for m in mask], **labels}


# A compacted conversation: its history is rewritten after token 3 of the first segment's prompt; a
# sub-agent: another conversation from token 0; a retry: a prompt that stops inside the tokens above.
MAIN = segment([1, 2, 3, 4, 5], [10, 11, 60, 61, 12, 13], [1, 1, 0, 0, 1, 1], conversation=0, segment_reason=None)
SUB = segment([7, 8, 9], [20, 21], [1, 1], conversation=1, segment_reason="new_conversation")
COMPACTED = segment([1, 2, 3, 90, 91], [30], [1], conversation=0, segment_reason="history_rewritten")


def test_the_token_view_says_where_each_segment_begins_and_why(tmp_path: Path) -> None:
    path = tmp_path / "rollouts.jsonl"
    unlabelled = [{k: v for k, v in s.items() if k not in ("conversation", "segment_reason")} for s in (MAIN, COMPACTED)]
    retry = segment([1, 2, 3], [40], [1])
    write(path, [rollout(0, sequences=[MAIN, SUB, COMPACTED], prefix_ok=True),
                 rollout(1, sequences=[*unlabelled, retry], prefix_ok=False),
                 rollout(2, sequences=[MAIN], prefix_ok=True)])
    with serve_in_thread(ViewServer(Catalog([path]))) as url, httpx.Client(base_url=url, timeout=30) as client:
        views = [client.get(f"/api/runs/r0/rollouts/{line}").json()["tokens"]["sequences"] for line in range(3)]
        page = client.get("/static/app.js").text

    first, sub, compacted = (view["start"] for view in views[0])
    assert first == {"index": 0, "conversation": 0, "reason": None, "reason_text": None}
    assert (sub["index"], sub["conversation"], sub["reason"]) == (1, 1, "new_conversation")
    assert sub["reason_text"] == SEGMENT_REASONS["new_conversation"]
    # The sub-agent's prompt differs from the main conversation's first token on.
    assert sub["tokens"].startswith("the history before the previous answer changed after 0 of its 9 tokens")
    assert sub["divergence"] == {"index": 0, "above": "| #1 #2 #3 #4 #5 #10 …", "this": "| #7 #8 #9"}
    assert (compacted["conversation"], compacted["reason"]) == (0, "history_rewritten")
    assert compacted["divergence"]["index"] == 0  # compared with the segment shown above it: the sub-agent's

    # Without labels (an agent that records none), the tokens alone say why: the history was rewritten
    # after 3 of the 9 tokens before the last answer, then a prompt went back to an earlier point.
    rewritten, retried = (view["start"] for view in views[1][1:])
    assert rewritten["reason"] is None and rewritten["conversation"] is None
    assert rewritten["tokens"].startswith("the history before the previous answer changed after 3 of its 9 tokens")
    assert rewritten["divergence"] == {"index": 3, "above": "#1 #2 #3 | #4 #5 #10 #11 #60 #61 …",
                                       "this": "#1 #2 #3 | #90 #91"}
    assert retried["tokens"].startswith("the prompt stops inside the previous tokens")
    # One segment: nothing to explain.
    assert views[2][0]["start"] == {"index": 0, "conversation": 0, "reason": None, "reason_text": None}
    assert "segmentStart" in page and "reason_text" in page  # the page renders them
