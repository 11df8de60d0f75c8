"""Arize Phoenix as a trace store: its REST API's span export and trace annotations.

`GET /v1/projects/{project}/spans/otlpv1` pages through a project's spans in OTLP's JSON structure;
`GET /v1/projects/{project}/trace_annotations?trace_ids=...` gives the annotations (a user's thumbs, a
judge's grade) attached to them, which become rewards named by the annotation; `.../span_annotations?span_ids=`
those attached to single spans (a model call scored in the UI, a span evaluation), which a source reads with
`level=span`. `annotate()` attaches one (`POST /v1/trace_annotations` or `/v1/span_annotations`). Spans reach Phoenix over OTLP/HTTP at `{url}/v1/traces`; a span's project is
its resource attribute `openinference.project.name` (Tracing(project=...)).
"""

from __future__ import annotations

import os
from typing import Any, Iterator

import httpx

from .otlp import SpanRecord, record_of
from .schema import Reward

DEFAULT_URL = "http://127.0.0.1:6006"
PAGE = 1000
ANNOTATION_BATCH = 50  # trace ids per annotations request (they travel in the query string)


class PhoenixError(ValueError):
    """Phoenix could not be read; the message names the server and project."""


def phoenix_url(url: str | None = None) -> str:
    return (url or os.environ.get("PHOENIX_URL") or os.environ.get("PHOENIX_COLLECTOR_ENDPOINT") or DEFAULT_URL).rstrip("/")


def _get(client: httpx.Client, path: str, params: Any, where: str) -> dict[str, Any]:
    try:
        response = client.get(path, params=params)
    except httpx.HTTPError as exc:
        raise PhoenixError(f"{where}: Phoenix is not reachable: {exc}") from None
    if response.status_code == 404:
        raise PhoenixError(f"{where}: {response.text.strip() or 'not found'}")
    if response.status_code >= 400:
        raise PhoenixError(f"{where}: HTTP {response.status_code}: {response.text[:300]}")
    return response.json()


def spans(project: str, url: str | None = None, timeout_s: float = 60.0) -> list[SpanRecord]:
    """Every span of the project, page by page."""
    base = phoenix_url(url)
    where = f"trace://phoenix/{project} ({base})"
    out: list[SpanRecord] = []
    with httpx.Client(base_url=base, timeout=timeout_s) as client:
        cursor = None
        while True:
            params = {"limit": PAGE, **({"cursor": cursor} if cursor else {})}
            page = _get(client, f"/v1/projects/{project}/spans/otlpv1", params, where)
            out.extend(record_of(span) for span in page.get("data") or [])
            cursor = page.get("next_cursor")
            if not cursor:
                return out


def _chunks(items: list[str], size: int) -> Iterator[list[str]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


def trace_rewards(project: str, trace_ids: list[str], url: str | None = None,
                  timeout_s: float = 60.0) -> list[tuple[str, Reward]]:
    """(trace id, Reward) for each trace annotation with a score; a label-only annotation has none."""
    return _rewards(project, "trace", trace_ids, url, timeout_s)


def span_rewards(project: str, span_ids: list[str], url: str | None = None,
                 timeout_s: float = 60.0) -> list[tuple[str, Reward]]:
    """(span id, Reward) for each span annotation with a score (what Phoenix's UI and its span evaluations
    attach to a model call or any other span)."""
    return _rewards(project, "span", span_ids, url, timeout_s)


def _rewards(project: str, level: str, ids: list[str], url: str | None, timeout_s: float) -> list[tuple[str, Reward]]:
    base = phoenix_url(url)
    where = f"trace://phoenix/{project} ({base}) {level} annotations"
    out: list[tuple[str, Reward]] = []
    with httpx.Client(base_url=base, timeout=timeout_s) as client:
        for chunk in _chunks(sorted(set(ids)), ANNOTATION_BATCH):
            cursor = None
            while True:
                params: dict[str, Any] = {f"{level}_ids": chunk, "limit": PAGE, **({"cursor": cursor} if cursor else {})}
                page = _get(client, f"/v1/projects/{project}/{level}_annotations", params, where)
                for note in page.get("data") or []:
                    result = note.get("result") or {}
                    if result.get("score") is None:
                        continue
                    out.append((note[f"{level}_id"], Reward(
                        value=float(result["score"]), name=str(note.get("name") or "reward"),
                        source=str(note.get("annotator_kind") or "HUMAN").lower(),
                        comment=result.get("explanation") or result.get("label"))))
                cursor = page.get("next_cursor")
                if not cursor:
                    break
    return out


def annotate(trace_id: str, name: str, score: float, *, label: str | None = None, kind: str = "HUMAN",
             url: str | None = None, timeout_s: float = 30.0, span_id: str | None = None) -> None:
    """Attach a score to a trace in Phoenix (what a user's feedback button does), or with `span_id` to that
    span (a span annotation)."""
    level, target = ("span", span_id) if span_id else ("trace", trace_id)
    body = {"data": [{"name": name, "annotator_kind": kind, f"{level}_id": target,
                      "result": {"score": score, **({"label": label} if label else {})}}]}
    response = httpx.post(f"{phoenix_url(url)}/v1/{level}_annotations", params={"sync": True}, json=body,
                          timeout=timeout_s)
    if response.status_code >= 400:
        raise PhoenixError(f"annotating {level} {target}: HTTP {response.status_code}: {response.text[:300]}")


__all__ = ["DEFAULT_URL", "PhoenixError", "annotate", "phoenix_url", "span_rewards", "spans", "trace_rewards"]
