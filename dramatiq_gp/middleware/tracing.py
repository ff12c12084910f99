"""Tracing: a PRODUCER span for every message sent, a CONSUMER span for every message processed.

A message carries two W3C contexts in its options: ``gp_trace``, the span that
sent this copy of it (rewritten at each send, retries included), and
``gp_trace_origin``, the creation context, written once and never replaced. The
process span is a child of the first and links to the second, so a request,
the outbox row it wrote, the relay, the fan-out and each listener are one trace,
and a retry stays in it, linked to where the message began.

Every send goes through ``before_enqueue``/``after_enqueue`` (Dramatiq's own
``enqueue``, the kit's batches, delayed copies and scheduler firings alike). A
send that fails before ``after_enqueue`` is reported through ``after_send_failed``
by :class:`dramatiq_gp.RedisBroker`, and by :class:`dramatiq_gp.RabbitmqBroker` for
its batches and delayed copies, so their span is ended with the error. A failed
send no such hook reports (a single ``enqueue`` on RabbitMQ is Dramatiq's own; any
send on another broker) leaves its span unended; nothing else is missing.

``messaging.system`` is ``rabbitmq`` on a RabbitMQ broker (the kit's or
Dramatiq's), ``redis`` on a Redis one, and another broker's class name without
``Broker`` (``stub`` for Dramatiq's ``StubBroker``).

Spans follow the messaging semantic conventions, with one deviation: the task
type names the span (``send <task type>``, ``process <task type>``) rather than
the queue, because most applications send everything to ``default``; the queue
is ``messaging.destination.name``.

A span's attributes are the SDK's costliest part of it: ``Tracer.start_span``
validates each one again (``BoundedAttributes``), a third of a span's CPU. When the
sampler is one of the SDK's own that decide without reading attributes
(``ALWAYS_ON``/``ALWAYS_OFF``, ``TraceIdRatioBased``, ``ParentBased`` over those, read
through its ``_root``, ``_remote_parent_sampled``, ``_remote_parent_not_sampled``,
``_local_parent_sampled`` and ``_local_parent_not_sampled``), and when the span
processors are the SDK's own, whose ``on_start`` reads nothing (``BatchSpanProcessor``,
``SimpleSpanProcessor``, as the SDK ``Tracer``'s ``span_processor`` holds them in
its ``_span_processors``), the span is started without them and they are written
into the SDK span's ``_attributes._dict`` when they are all strings and ints
(a message's id and attempt come from its JSON) and its limits (``maxlen``,
``max_value_len``) would keep them all unchanged; otherwise through
``set_attributes``. Any other sampler, or tracer, gets them at ``start_span`` as
usual. The real tracer behind the global provider's ``ProxyTracer`` is read through
its ``_tracer``. docs/internals.md lists these; tests/test_tracing.py pins them.
"""

from __future__ import annotations

import threading
from typing import Any

from dramatiq import Broker, Message, Middleware, Retry
from dramatiq.broker import MessageProxy
from dramatiq.common import q_name
from opentelemetry import context, propagate, trace
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk.trace import ConcurrentMultiSpanProcessor, SpanProcessor, SynchronousMultiSpanProcessor
from opentelemetry.sdk.trace import Span as SdkSpan
from opentelemetry.sdk.trace import Tracer as SdkTracer
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.sampling import (
    ParentBased,
    ParentBasedTraceIdRatio,
    Sampler,
    StaticSampler,
    TraceIdRatioBased,
)
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from ..errortext import stack_without_messages
from ..tracecontext import DELIVERY, ORIGIN

_STATE = "_gp_span"
#: The parent of a message that carries no context: none (a ``Context`` cannot be changed, so one serves all).
_NEW_TRACE = context.Context()
_CREATED = {"messaging.operation.type": "create"}
#: The most (broker, actor, queue, operation) shapes kept; more are rebuilt for each span.
MAX_SHAPES = 1_024


#: The SDK's samplers whose decision never reads a span's attributes (subclasses may: not these).
_BLIND_SAMPLERS = (StaticSampler, TraceIdRatioBased)
_PARENT_BASED = (ParentBased, ParentBasedTraceIdRatio)
#: The values written without validation: those the SDK would keep as they are, whatever its limits but length.
_PLAIN_TYPES = frozenset({str, int})


def attribute_blind(sampler: Sampler) -> bool:
    """Whether ``sampler`` decides without reading the attributes a span starts with (see the module docstring)."""
    if type(sampler) in _PARENT_BASED:
        delegates = (
            sampler._root,  # type: ignore[attr-defined]
            sampler._remote_parent_sampled,  # type: ignore[attr-defined]
            sampler._remote_parent_not_sampled,  # type: ignore[attr-defined]
            sampler._local_parent_sampled,  # type: ignore[attr-defined]
            sampler._local_parent_not_sampled,  # type: ignore[attr-defined]
        )
        return all(attribute_blind(delegate) for delegate in delegates)
    return type(sampler) in _BLIND_SAMPLERS


#: ``on_start`` of the SDK's own processors: none reads the span it is given.
_BLIND_ON_START = (SpanProcessor.on_start, BatchSpanProcessor.on_start, SimpleSpanProcessor.on_start)
_MULTI_PROCESSORS = (SynchronousMultiSpanProcessor, ConcurrentMultiSpanProcessor)


def blind_on_start(processor: SpanProcessor) -> bool:
    """Whether ``processor`` (the provider's, which holds the others in ``_span_processors``) reads no starting span."""
    if type(processor) in _MULTI_PROCESSORS:
        return all(blind_on_start(one) for one in processor._span_processors)  # type: ignore[attr-defined]
    return type(processor).on_start in _BLIND_ON_START


def error_type(exc: BaseException) -> str:
    """The fully qualified exception class, as ``error.type`` wants it."""
    cls = type(exc)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def record_error(span: trace.Span, exception: BaseException, *, send_default_pii: bool) -> None:
    """``span.record_exception``, ``error.type`` and an ERROR status; without the message unless ``send_default_pii``.

    The message may be anyone's data: without PII sending, the ``exception``
    event has its type and frames (:func:`~dramatiq_gp.errortext.stack_without_messages`)
    and the status the type alone, as the OTLP log records do.
    """
    span.set_attribute("error.type", error_type(exception))
    if send_default_pii:
        span.record_exception(exception)
        span.set_status(Status(StatusCode.ERROR, f"{type(exception).__name__}: {exception}"))
        return
    stack = stack_without_messages(exception)
    attributes = {"exception.type": error_type(exception), "exception.stacktrace": stack, "exception.escaped": "False"}
    span.add_event("exception", attributes)
    span.set_status(Status(StatusCode.ERROR, type(exception).__name__))


class Tracing(Middleware):
    """Producer and consumer spans, with the trace context carried in message options.

    Hooks: ``before_enqueue``, ``after_enqueue``, ``before_process_message``,
    ``after_process_message``, ``after_skip_message``, and the broker's
    ``after_send_failed``. Works on any broker (see the module docstring for which
    failed sends only the kit's brokers report).

    Parameters:
        tracer_provider: where the spans go; ``None`` means the global provider.
        send_default_pii: a failure's exception message goes with its span (:func:`record_error`).
    """

    def __init__(self, tracer_provider: trace.TracerProvider | None = None, *, send_default_pii: bool = False) -> None:
        self.tracer = trace.get_tracer("dramatiq_gp", tracer_provider=tracer_provider)
        self.send_default_pii = send_default_pii
        # The tracer spans come from (the global provider's, once there is one), its span processors,
        # and whether neither its sampler nor they read a span's attributes when it starts.
        self._resolved: tuple[trace.Tracer | None, object, bool] = (None, None, False)
        # Open send spans by message id. A send may end on another thread than the one
        # that began it (the broker writes a retry copy with a batch of acks), and one
        # id may be in flight more than once (its spans then end in either order).
        self._sending: dict[str, list[trace.Span]] = {}
        self._sending_lock = threading.Lock()
        # What every span of one operation on one actor and queue shares: its name and most attributes.
        self._shapes: dict[tuple[type[Broker], str, str, str], tuple[str, dict[str, Any]]] = {}

    def _shape(
        self, broker: Broker, message: Message[Any] | MessageProxy, operation: str
    ) -> tuple[str, dict[str, Any]]:
        """The span's name and its attributes but the message's own, built once per actor, queue and operation."""
        key = (type(broker), message.actor_name, message.queue_name, operation)
        shape = self._shapes.get(key)
        if shape is None:
            shape = f"{operation} {message.actor_name}", _attributes(broker, message, operation)
            # Task types come from the messages (unknown ones too): bounded, so they cannot grow it without end.
            if len(self._shapes) < MAX_SHAPES:
                self._shapes[key] = shape
        return shape

    def _start_span(
        self,
        name: str,
        parent: context.Context | None,
        kind: SpanKind,
        attributes: dict[str, Any],
        links: tuple[Link, ...] = (),
    ) -> trace.Span:
        """``Tracer.start_span``, with the attributes written without their validation when that changes nothing."""
        tracer = self.tracer
        if isinstance(tracer, trace.ProxyTracer):
            tracer = tracer._tracer
        # A processor added to the provider later replaces the tuple: then it is looked at again.
        processors = getattr(getattr(tracer, "span_processor", None), "_span_processors", None)
        resolved, seen, blind = self._resolved
        if tracer is not resolved or processors is not seen:
            blind = (
                isinstance(tracer, SdkTracer)
                and attribute_blind(tracer.sampler)
                and blind_on_start(tracer.span_processor)
            )
            self._resolved = (tracer, processors, blind)
        if not blind or not _PLAIN_TYPES.issuperset(map(type, attributes.values())):
            return tracer.start_span(name, context=parent, kind=kind, links=links, attributes=attributes)
        span = tracer.start_span(name, context=parent, kind=kind, links=links)
        bounded = span._attributes if isinstance(span, SdkSpan) else None
        if (
            isinstance(bounded, BoundedAttributes)
            and bounded.max_value_len is None
            and (bounded.maxlen is None or len(bounded._dict) + len(attributes) <= bounded.maxlen)
        ):
            bounded._dict.update(attributes)
            return span
        if span.is_recording():
            span.set_attributes(attributes)
        return span

    # -- producer ----------------------------------------------------------------------

    def before_enqueue(self, broker: Broker, message: Message[Any], delay: int | None) -> None:
        options = message.options
        parent = None  # the active span, when there is one
        if not trace.get_current_span().get_span_context().is_valid:
            # Sent from no span (the relay; a delayed message moved to its queue when
            # due): continue from the message's last send, or from its creation
            # context, e.g. the request that wrote an outbox row.
            sent = options.get(DELIVERY) or options.get(ORIGIN)
            parent = propagate.extract(sent) if sent else None
        name, shared = self._shape(broker, message, "send")
        attributes = {**shared, "messaging.message.id": message.message_id}
        if delay:
            attributes["dramatiq_gp.delay_ms"] = delay
        span = self._start_span(name, parent, SpanKind.PRODUCER, attributes)
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(span, parent))
        if carrier:
            options[DELIVERY] = carrier
            options.setdefault(ORIGIN, carrier)
        with self._sending_lock:
            self._sending.setdefault(message.message_id, []).append(span)

    def after_enqueue(self, broker: Broker, message: Message[Any], delay: int | None) -> None:
        span = self._sent(message)
        if span is not None:
            span.end()

    def after_send_failed(self, broker: Broker, message: Message[Any], error: BaseException | None) -> None:
        """End the span of a send that never reached ``after_enqueue``."""
        span = self._sent(message)
        if span is None:
            return
        if error is not None:
            record_error(span, error, send_default_pii=self.send_default_pii)
        else:
            span.set_attribute("dramatiq_gp.sent", False)
        span.end()

    def _sent(self, message: Message[Any]) -> trace.Span | None:
        with self._sending_lock:
            spans = self._sending.get(message.message_id)
            if not spans:
                return None
            span = spans.pop()
            if not spans:
                del self._sending[message.message_id]
            return span

    # -- consumer ----------------------------------------------------------------------

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        options = message.options
        delivery, origin = options.get(DELIVERY), options.get(ORIGIN)
        # A message without a context starts a trace of its own, whatever the thread ran before.
        parent = propagate.extract(delivery or origin) if (delivery or origin) else _NEW_TRACE
        links: tuple[Link, ...] = ()
        if origin and delivery and origin != delivery:
            created = trace.get_current_span(propagate.extract(origin)).get_span_context()
            if created.is_valid:
                links = (Link(created, _CREATED),)
        name, shared = self._shape(broker, message, "process")
        attributes = {
            **shared,
            "messaging.message.id": message.message_id,
            "dramatiq_gp.attempt": options.get("retries", 0) + 1,
        }
        span = self._start_span(name, parent, SpanKind.CONSUMER, attributes, links)
        token = context.attach(trace.set_span_in_context(span, parent))
        setattr(message, _STATE, (span, token))

    def after_process_message(
        self, broker: Broker, message: MessageProxy, *, result: Any = None, exception: BaseException | None = None
    ) -> None:
        state = getattr(message, _STATE, None)
        if state is None:
            return
        span, token = state
        delattr(message, _STATE)
        try:
            if exception is not None:
                span.set_attribute("dramatiq_gp.will_retry", not message.failed)
                if isinstance(exception, Retry):
                    span.add_event("retry requested")
                else:
                    record_error(span, exception, send_default_pii=self.send_default_pii)
            span.end()
        finally:
            context.detach(token)

    def after_skip_message(self, broker: Broker, message: MessageProxy) -> None:
        state = getattr(message, _STATE, None)
        if state is None:
            return
        span, token = state
        delattr(message, _STATE)
        try:
            span.set_attribute("dramatiq_gp.skipped", True)
            span.end()
        finally:
            context.detach(token)


def messaging_system(broker: Broker) -> str:
    """``broker``'s ``messaging.system``, as the messaging semantic conventions name it."""
    # By the Dramatiq module its class comes from, not by importing it: ``dramatiq.brokers.rabbitmq`` needs pika.
    for cls in type(broker).__mro__:
        if cls.__module__ in ("dramatiq.brokers.redis", "dramatiq.brokers.rabbitmq"):
            return cls.__module__.rpartition(".")[2]
    return type(broker).__name__.removesuffix("Broker").lower()


def _attributes(broker: Broker, message: Message[Any] | MessageProxy, operation: str) -> dict[str, Any]:
    return {
        "messaging.system": messaging_system(broker),
        "messaging.operation.type": operation,
        "messaging.operation.name": operation,
        "messaging.destination.name": q_name(message.queue_name),
        "dramatiq_gp.task_type": message.actor_name,
    }
