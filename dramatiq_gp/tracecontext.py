"""The W3C trace context of the code that dispatches an event, carried with it to the listeners."""

from __future__ import annotations

from opentelemetry import propagate

#: Options carrying the W3C context of the span that sent this copy, and of the first send.
DELIVERY = "gp_trace"
ORIGIN = "gp_trace_origin"


def current_carrier() -> dict[str, str] | None:
    """``traceparent``/``tracestate`` of the active span, or ``None`` outside any trace."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier or None
