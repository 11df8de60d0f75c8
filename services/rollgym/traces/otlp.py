"""OTLP/JSON: spans to the OpenTelemetry protocol's JSON encoding and back, and a file exporter.

The local store and `trace://otlp/<file>` share one format: JSON lines, each an OTLP
`ExportTraceServiceRequest` (`{"resourceSpans": [...]}`), which is what the OpenTelemetry Collector's
file exporter writes; a file holding one such document (pretty-printed) reads as well. Ids are hex as the
OTLP/JSON specification says; base64 ids (protobuf's own JSON mapping) are read too.
"""

from __future__ import annotations

import base64
import binascii
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

STATUS = {0: "UNSET", 1: "OK", 2: "ERROR", "STATUS_CODE_UNSET": "UNSET", "STATUS_CODE_OK": "OK",
          "STATUS_CODE_ERROR": "ERROR"}


@dataclass
class SpanRecord:
    """One span, whatever it was read from (OTLP JSON, the local store, Phoenix)."""

    trace_id: str
    span_id: str
    parent_id: str | None
    name: str
    start_ns: int
    end_ns: int
    status: str = "UNSET"  # UNSET | OK | ERROR
    status_message: str = ""
    attributes: dict[str, Any] = field(default_factory=dict)


def any_value(value: Any) -> dict[str, Any]:
    """A Python attribute value as an OTLP AnyValue."""
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}
    if isinstance(value, float):
        return {"doubleValue": value}
    if isinstance(value, (list, tuple)):
        return {"arrayValue": {"values": [any_value(v) for v in value]}}
    return {"stringValue": str(value)}


def from_any_value(value: dict[str, Any]) -> Any:
    """An OTLP AnyValue (camelCase, or snake_case with the unset fields null as Phoenix writes them)."""
    if not isinstance(value, dict):
        return value
    for key, field_value in value.items():
        if field_value is None:
            continue
        if key in ("stringValue", "string_value", "boolValue", "bool_value", "doubleValue", "double_value"):
            return field_value
        if key in ("intValue", "int_value"):
            return int(field_value)
        if key in ("arrayValue", "array_value"):
            return [from_any_value(v) for v in field_value.get("values") or []]
        if key in ("kvlistValue", "kvlist_value"):
            return {kv["key"]: from_any_value(kv.get("value") or {}) for kv in field_value.get("values") or []}
    return None


def attributes_of(pairs: Iterable[dict[str, Any]] | None) -> dict[str, Any]:
    return {pair["key"]: from_any_value(pair.get("value") or {}) for pair in pairs or []}


def hex_id(value: Any, size: int) -> str | None:
    """A trace (size 16) or span (size 8) id as lowercase hex, from hex or base64."""
    if not value:
        return None
    text = str(value)
    if len(text) == 2 * size and all(c in "0123456789abcdefABCDEF" for c in text):
        return text.lower()
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return text
    return raw.hex() if len(raw) == size else text


def span_json(span: Any) -> dict[str, Any]:
    """An OpenTelemetry SDK ReadableSpan as an OTLP/JSON span."""
    context = span.context
    parent = span.parent
    out: dict[str, Any] = {
        "traceId": f"{context.trace_id:032x}", "spanId": f"{context.span_id:016x}", "name": span.name,
        "kind": int(span.kind.value) + 1, "startTimeUnixNano": str(span.start_time or 0),
        "endTimeUnixNano": str(span.end_time or span.start_time or 0),
        "attributes": [{"key": k, "value": any_value(v)} for k, v in (span.attributes or {}).items()],
        "status": {"code": int(span.status.status_code.value), **(
            {"message": span.status.description} if span.status.description else {})},
    }
    if parent is not None:
        out["parentSpanId"] = f"{parent.span_id:016x}"
    if span.events:
        out["events"] = [{"name": e.name, "timeUnixNano": str(e.timestamp),
                          "attributes": [{"key": k, "value": any_value(v)} for k, v in (e.attributes or {}).items()]}
                         for e in span.events]
    return out


def export_request(spans: Sequence[Any]) -> dict[str, Any]:
    """An OTLP ExportTraceServiceRequest of SDK spans, grouped by resource and scope."""
    by_resource: dict[int, tuple[Any, dict[tuple[str, str], list[dict[str, Any]]]]] = {}
    for span in spans:
        resource, scopes = by_resource.setdefault(id(span.resource), (span.resource, {}))
        scope = span.instrumentation_scope
        key = (scope.name if scope else "", (scope.version or "") if scope else "")
        scopes.setdefault(key, []).append(span_json(span))
    return {"resourceSpans": [{
        "resource": {"attributes": [{"key": k, "value": any_value(v)} for k, v in (resource.attributes or {}).items()]},
        "scopeSpans": [{"scope": {"name": name, **({"version": version} if version else {})}, "spans": items}
                       for (name, version), items in scopes.items()]} for resource, scopes in by_resource.values()]}


def record_of(span: dict[str, Any]) -> SpanRecord:
    """An OTLP/JSON span (camelCase, or snake_case as Phoenix's otlpv1 export writes it) as a SpanRecord."""
    get = lambda camel, snake: span.get(camel, span.get(snake))  # noqa: E731
    status = span.get("status") or {}
    code = status.get("code", 0)
    return SpanRecord(
        trace_id=hex_id(get("traceId", "trace_id"), 16) or "", span_id=hex_id(get("spanId", "span_id"), 8) or "",
        parent_id=hex_id(get("parentSpanId", "parent_span_id"), 8), name=str(span.get("name", "")),
        start_ns=int(get("startTimeUnixNano", "start_time_unix_nano") or 0),
        end_ns=int(get("endTimeUnixNano", "end_time_unix_nano") or 0),
        status=STATUS.get(code, str(code)), status_message=str(status.get("message") or ""),
        attributes=attributes_of(span.get("attributes")))


def records_of(document: dict[str, Any]) -> Iterator[SpanRecord]:
    for resource in document.get("resourceSpans") or document.get("resource_spans") or []:
        for scope in resource.get("scopeSpans") or resource.get("scope_spans") or []:
            for span in scope.get("spans") or []:
                yield record_of(span)


def read_otlp_file(path: Path) -> list[SpanRecord]:
    """Every span of an OTLP/JSON file: JSON lines of export requests, or one document. ValueError names
    the file and line of what is not OTLP/JSON; a torn last line (a writer that crashed) is skipped."""
    text = path.read_text()
    try:
        whole = json.loads(text)
    except ValueError:
        whole = None
    if isinstance(whole, dict):
        return list(records_of(whole))
    lines = text.splitlines()
    records: list[SpanRecord] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            document = json.loads(line)
        except ValueError:
            if number == len(lines) and not text.endswith("\n"):
                break
            raise ValueError(f"{path}:{number}: not a JSON line of OTLP spans") from None
        if not isinstance(document, dict) or not ({"resourceSpans", "resource_spans"} & set(document)):
            raise ValueError(f"{path}:{number}: an OTLP/JSON line has resourceSpans")
        records.extend(records_of(document))
    return records


class OtlpFileExporter:
    """An OpenTelemetry SpanExporter that appends each batch to a file as one OTLP/JSON line."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[Any]) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        line = json.dumps(export_request(spans), separators=(",", ":")) + "\n"
        with self._lock, self.path.open("a") as handle:
            handle.write(line)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


__all__ = ["OtlpFileExporter", "SpanRecord", "any_value", "export_request", "read_otlp_file", "record_of",
           "records_of"]
