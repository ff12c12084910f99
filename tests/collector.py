"""A local stand-in for an OpenTelemetry collector and a Sentry server, speaking their real protocols.

Workers export to it as they would in production: OTLP/HTTP protobuf on
``/v1/traces``, ``/v1/metrics`` and ``/v1/logs``, Sentry envelopes on ``/api/<project>/envelope/``.
"""

from __future__ import annotations

import gzip
import json
import threading
import zlib
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


@dataclass
class Span:
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    kind: int
    attributes: dict[str, Any]
    links: list[tuple[str, str]]
    status: int
    events: list[str]
    #: The status's description, and each event's attributes (an ``exception`` event's type, message, stack trace).
    status_message: str = ""
    event_attributes: list[dict[str, Any]] = field(default_factory=list)

    @property
    def message_id(self) -> str | None:
        return self.attributes.get("messaging.message.id")


@dataclass
class Log:
    body: Any
    severity: str
    trace_id: str  # "" outside a span
    span_id: str
    attributes: dict[str, Any]
    resource: dict[str, Any]


@dataclass
class Collector:
    spans: list[Span] = field(default_factory=list)
    logs: list[Log] = field(default_factory=list)
    log_requests: int = 0
    envelopes: list[list[tuple[dict[str, Any], Any]]] = field(default_factory=list)
    metric_requests: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    port: int = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def dsn(self) -> str:
        return f"http://public@127.0.0.1:{self.port}/1"

    def items(self, kind: str) -> list[Any]:
        """Payloads of every envelope item of type ``kind`` (``event``, ``check_in``, ``transaction``)."""
        with self.lock:
            return [
                payload for envelope in self.envelopes for header, payload in envelope if header.get("type") == kind
            ]

    def spans_named(self, prefix: str) -> list[Span]:
        with self.lock:
            return [span for span in self.spans if span.name.startswith(prefix)]

    def logs_starting(self, prefix: str) -> list[Log]:
        with self.lock:
            return [log for log in self.logs if isinstance(log.body, str) and log.body.startswith(prefix)]

    def receive(self, path: str, body: bytes) -> None:
        if path == "/v1/traces":
            request = ExportTraceServiceRequest.FromString(body)
            spans = [
                _span(span)
                for resource in request.resource_spans
                for scope in resource.scope_spans
                for span in scope.spans
            ]
            with self.lock:
                self.spans.extend(spans)
        elif path == "/v1/logs":
            logs = ExportLogsServiceRequest.FromString(body)
            records = [
                _log(record, {a.key: _value(a.value) for a in resource.resource.attributes})
                for resource in logs.resource_logs
                for scope in resource.scope_logs
                for record in scope.log_records
            ]
            with self.lock:
                self.log_requests += 1
                self.logs.extend(records)
        elif path == "/v1/metrics":
            with self.lock:
                self.metric_requests += 1
        elif path.startswith("/api/") and path.rstrip("/").endswith("/envelope"):
            envelope = _envelope(body)
            with self.lock:
                self.envelopes.append(envelope)
        else:
            raise ValueError(f"unexpected path {path}")


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None


def _span(span: Any) -> Span:
    return Span(
        trace_id=span.trace_id.hex(),
        span_id=span.span_id.hex(),
        parent_id=span.parent_span_id.hex(),
        name=span.name,
        kind=span.kind,
        attributes={a.key: _value(a.value) for a in span.attributes},
        links=[(link.trace_id.hex(), link.span_id.hex()) for link in span.links],
        status=span.status.code,
        events=[event.name for event in span.events],
        status_message=span.status.message,
        event_attributes=[{a.key: _value(a.value) for a in event.attributes} for event in span.events],
    )


def _log(record: Any, resource: dict[str, Any]) -> Log:
    return Log(
        body=_value(record.body),
        severity=record.severity_text,
        trace_id=record.trace_id.hex(),
        span_id=record.span_id.hex(),
        attributes={a.key: _value(a.value) for a in record.attributes},
        resource=resource,
    )


def _envelope(body: bytes) -> list[tuple[dict[str, Any], Any]]:
    lines = body.split(b"\n")
    items = []
    i = 1  # line 0 is the envelope header
    while i < len(lines):
        if not lines[i].strip():
            i += 1
            continue
        header = json.loads(lines[i])
        length = header.get("length")
        if length is not None:
            rest = b"\n".join(lines[i + 1 :])
            payload, remainder = rest[:length], rest[length + 1 :]
            lines = [b"", *remainder.split(b"\n")]
            i = 1
        else:
            payload = lines[i + 1]
            i += 2
        items.append((header, json.loads(payload) if payload.strip() else None))
    return items


def start_collector() -> tuple[Collector, ThreadingHTTPServer]:
    collector = Collector()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            encoding = self.headers.get("Content-Encoding", "")
            if encoding == "gzip":
                body = gzip.decompress(body)
            elif encoding == "deflate":
                body = zlib.decompress(body)
            elif encoding:
                self.send_error(415, f"cannot read {encoding}")
                return
            collector.receive(self.path, body)
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    collector.port = server.server_address[1]
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
    return collector, server
