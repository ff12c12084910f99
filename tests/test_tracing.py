"""Span structure: producer and consumer spans, one trace per dispatch, retries linked, every span ended.

These run a worker in the test process with the kit's ``tracer_provider`` pointed
at an in-memory exporter; the multi-process path (exporters started after the
fork, flushed at shutdown) is in test_telemetry_cli.py.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import dramatiq
import pytest
from dramatiq import Message
from dramatiq.broker import MessageProxy
from dramatiq.brokers.stub import StubBroker
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    Decision,
    ParentBased,
    ParentBasedTraceIdRatio,
    Sampler,
    SamplingResult,
    TraceIdRatioBased,
)
from opentelemetry.trace import SpanKind, StatusCode

import dramatiq_gp as gp
from dramatiq_gp.middleware.tracing import MAX_SHAPES, attribute_blind, blind_on_start, messaging_system
from helpers import wait_for


@gp.event("test.tracing.signed_up")
@dataclass(frozen=True)
class SignedUp:
    user_id: int


@pytest.fixture
def spans() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def _finished(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [span for span in exporter.get_finished_spans() if span.name == name]


def _parent(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def test_a_dispatch_inside_a_request_span_is_one_trace_down_to_each_listener(make_kit, start_worker, spans):
    provider, exporter = spans
    kit = make_kit(
        lambda registry, schedule: (
            registry.listen(SignedUp, lambda e: None, name="welcome_mail", queue="mail"),
            registry.listen(SignedUp, lambda e: None, name="crm"),
        ),
        tracer_provider=provider,
    )
    with provider.get_tracer("test").start_as_current_span("POST /signup") as request:
        kit.dispatch(SignedUp(1))
    start_worker(kit)
    wait_for(lambda: len([s for s in exporter.get_finished_spans() if s.name.startswith("process")]) == 2)

    trace_id = request.get_span_context().trace_id
    for listener, queue in (("welcome_mail", "mail"), ("crm", "default")):
        (send,) = _finished(exporter, f"send listener:test.tracing.signed_up:{listener}")
        (process,) = _finished(exporter, f"process listener:test.tracing.signed_up:{listener}")
        assert send.kind is SpanKind.PRODUCER and process.kind is SpanKind.CONSUMER
        assert send.context.trace_id == process.context.trace_id == trace_id
        assert _parent(send) == request.get_span_context().span_id
        assert _parent(process) == send.context.span_id
        assert process.attributes["messaging.system"] == "redis"
        assert process.attributes["messaging.operation.type"] == "process"
        assert process.attributes["messaging.destination.name"] == queue
        assert process.attributes["messaging.message.id"] == send.attributes["messaging.message.id"]
        assert process.attributes["dramatiq_gp.attempt"] == 1
        assert process.status.status_code is StatusCode.UNSET


def test_a_retry_stays_in_the_trace_and_links_to_where_the_message_was_created(make_kit, start_worker, spans):
    provider, exporter = spans
    calls = Counter[str]()

    def flaky(event: SignedUp) -> None:
        calls["flaky"] += 1
        if calls["flaky"] == 1:
            raise ConnectionError("smtp down")

    kit = make_kit(
        lambda registry, schedule: registry.listen(SignedUp, flaky, name="flaky", min_backoff=10, max_backoff=20),
        tracer_provider=provider,
    )
    with provider.get_tracer("test").start_as_current_span("POST /signup") as request:
        kit.dispatch(SignedUp(2))
    start_worker(kit)
    wait_for(lambda: len(_finished(exporter, "process listener:test.tracing.signed_up:flaky")) == 2)

    first, second = sorted(
        _finished(exporter, "process listener:test.tracing.signed_up:flaky"), key=lambda s: s.start_time
    )
    sends = sorted(_finished(exporter, "send listener:test.tracing.signed_up:flaky"), key=lambda s: s.start_time)
    assert len(sends) == 3
    created, retried, moved = sends
    assert {s.context.trace_id for s in (first, second, *sends)} == {request.get_span_context().trace_id}
    # The retry is sent from inside the failed attempt's span to the delay queue, moved
    # to its queue when due, and the second attempt links to the first send.
    assert _parent(retried) == first.context.span_id and retried.attributes["dramatiq_gp.delay_ms"] > 0
    assert _parent(moved) == retried.context.span_id
    assert _parent(second) == moved.context.span_id
    assert [link.context.span_id for link in second.links] == [created.context.span_id]
    assert first.status.status_code is StatusCode.ERROR
    assert first.attributes["error.type"] == "ConnectionError" and first.attributes["dramatiq_gp.will_retry"] is True
    assert [event.name for event in first.events] == ["exception"]
    assert (first.attributes["dramatiq_gp.attempt"], second.attributes["dramatiq_gp.attempt"]) == (1, 2)
    assert second.status.status_code is StatusCode.UNSET


def test_a_skipped_duplicate_and_a_timed_out_task_still_end_their_spans(make_kit, start_worker, spans):
    provider, exporter = spans
    kit = make_kit(tracer_provider=provider)
    done = threading.Event()

    @dramatiq.actor(broker=kit.broker, actor_name="once", idempotent=True)
    def once() -> None:
        done.set()

    @dramatiq.actor(broker=kit.broker, actor_name="too_slow", time_limit=200, max_retries=0)
    def too_slow() -> None:
        for _ in range(100):
            time.sleep(0.05)

    message = once.message()
    kit.broker.enqueue(message)
    start_worker(kit)
    wait_for(done.is_set)
    kit.broker.enqueue(message)  # the same message id again: a duplicate
    too_slow.send()
    wait_for(lambda: len(_finished(exporter, "process once")) == 2 and _finished(exporter, "process too_slow"))

    ran, skipped = sorted(_finished(exporter, "process once"), key=lambda s: s.start_time)
    assert "dramatiq_gp.skipped" not in ran.attributes
    assert skipped.attributes["dramatiq_gp.skipped"] is True
    (slow,) = _finished(exporter, "process too_slow")
    assert slow.status.status_code is StatusCode.ERROR
    assert slow.attributes["error.type"] == "dramatiq.middleware.time_limit.TimeLimitExceeded"
    assert slow.attributes["dramatiq_gp.will_retry"] is False


@pytest.mark.usefixtures("broker")
def test_each_scheduler_firing_starts_a_trace_named_after_its_entry(make_kit, start_worker, spans):
    provider, exporter = spans
    ran = threading.Event()
    kit = make_kit(
        lambda registry, schedule: schedule.job("nightly_report", "@every 1s", ran.set),
        env={"SCHEDULER_LEASE_TTL": "1500ms"},
        tracer_provider=provider,
    )
    start_worker(kit)
    wait_for(ran.is_set, timeout=10)
    wait_for(lambda: _finished(exporter, "process job:nightly_report"))
    kit.scheduler.stop()

    (process, *_) = _finished(exporter, "process job:nightly_report")
    roots = {s.context.span_id: s for s in _finished(exporter, "schedule nightly_report")}
    sends = {s.context.span_id: s for s in _finished(exporter, "send job:nightly_report")}
    send = sends[_parent(process)]
    root = roots[_parent(send)]
    assert root.parent is None and root.attributes["dramatiq_gp.schedule.entry"] == "nightly_report"
    assert root.attributes["dramatiq_gp.schedule.outcome"] == "fired"
    assert root.context.trace_id == send.context.trace_id == process.context.trace_id
    assert len({s.context.trace_id for s in roots.values()}) == len(roots)  # a new trace per firing


@pytest.mark.usefixtures("broker")
def test_a_stored_entry_s_firing_starts_its_trace_too(make_kit, start_worker, spans):
    provider, exporter = spans
    ran = threading.Event()
    kit = make_kit(env={"SCHEDULER_LEASE_TTL": "1500ms", "SCHEDULER_DYNAMIC": "true"}, tracer_provider=provider)
    report = gp.schedulable(dramatiq.actor(lambda customer: ran.set(), actor_name="customer_report", broker=kit.broker))
    kit.schedules.add("report.customer-7", "@every 1s", report, args=[7])
    start_worker(kit)
    wait_for(ran.is_set, timeout=10)
    wait_for(lambda: _finished(exporter, "process customer_report"))
    kit.scheduler.stop()

    (process, *_) = _finished(exporter, "process customer_report")
    roots = {s.context.span_id: s for s in _finished(exporter, "schedule report.customer-7")}
    send = {s.context.span_id: s for s in _finished(exporter, "send customer_report")}[_parent(process)]
    root = roots[_parent(send)]
    assert root.parent is None and root.attributes["dramatiq_gp.schedule.outcome"] == "fired"
    assert root.context.trace_id == send.context.trace_id == process.context.trace_id


def test_a_send_that_fails_ends_its_span_with_the_error(make_kit, spans, clean_env):
    provider, exporter = spans
    kit = make_kit(env={"REDIS_URL": "redis://127.0.0.1:1/0"}, tracer_provider=provider)
    messages: list[Message[Any]] = [
        Message(queue_name="default", actor_name="nobody", args=(), kwargs={}, options={}) for _ in range(2)
    ]
    with pytest.raises(Exception, match=r"Connection refused|Error 111"):
        kit.broker.enqueue_many(messages)
    with pytest.raises(Exception, match=r"Connection refused|Error 111"):
        kit.broker.enqueue(messages[0])
    failed = _finished(exporter, "send nobody")
    assert len(failed) == 3
    assert all(span.status.status_code is StatusCode.ERROR and "error.type" in span.attributes for span in failed)


@pytest.mark.usefixtures("broker")
def test_spans_name_the_broker_the_queues_are_on_as_the_messaging_system(broker, make_kit, start_worker, spans):
    provider, exporter = spans
    kit = make_kit(tracer_provider=provider)
    done = threading.Event()

    @dramatiq.actor(broker=kit.broker, actor_name="plain_task")
    def plain_task() -> None:
        done.set()

    plain_task.send()
    start_worker(kit)
    wait_for(done.is_set)
    wait_for(lambda: _finished(exporter, "process plain_task"))

    (send,) = _finished(exporter, "send plain_task")
    (process,) = _finished(exporter, "process plain_task")
    assert send.attributes["messaging.system"] == process.attributes["messaging.system"] == broker


def test_another_broker_is_named_after_its_class():
    assert messaging_system(StubBroker()) == "stub"


def test_span_names_and_shared_attributes_are_kept_per_actor_queue_and_operation_up_to_a_bound(spans):
    provider, exporter = spans
    tracing = gp.Tracing(provider)
    broker = StubBroker(middleware=[tracing])

    def send(actor_name: str, delay: int | None = None) -> Message[Any]:
        message = Message(queue_name="default", actor_name=actor_name, args=(), kwargs={}, options={})
        tracing.before_enqueue(broker, message, delay)
        tracing.after_enqueue(broker, message, delay)
        return message

    many = MAX_SHAPES + 10
    for n in range(many):  # task types come from the messages: unknown ones must not grow the cache without end
        send(f"task_{n}")
    assert len(tracing._shapes) == MAX_SHAPES
    delayed = send("task_0", 250)  # from the cache
    past_the_bound = send(f"task_{many - 1}")  # built for this span alone
    for message, actor_name in ((delayed, "task_0"), (past_the_bound, f"task_{many - 1}")):
        sent = _finished(exporter, f"send {actor_name}")
        (span,) = [s for s in sent if s.attributes["messaging.message.id"] == message.message_id]
        assert dict(span.attributes) == {
            "messaging.system": "stub",
            "messaging.operation.type": "send",
            "messaging.operation.name": "send",
            "messaging.destination.name": "default",
            "messaging.message.id": message.message_id,
            "dramatiq_gp.task_type": actor_name,
            **({"dramatiq_gp.delay_ms": 250} if message is delayed else {}),
        }
    assert "dramatiq_gp.delay_ms" not in _finished(exporter, "send task_0")[0].attributes  # the cached shape kept none


class _ReadsAttributes(Sampler):
    """Samples what a rule on the starting attributes says: the kind of sampler that must see them."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None, links=None, trace_state=None):  # type: ignore[no-untyped-def]
        self.seen.append(dict(attributes or {}))
        return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes)

    def get_description(self) -> str:
        return "reads attributes"


def test_only_the_sdk_s_own_samplers_that_ignore_attributes_count_as_blind():
    """Pins the SDK internals the unvalidated attributes rely on: ``ParentBased``'s five delegates."""
    assert attribute_blind(TracerProvider().sampler)  # ParentBased(ALWAYS_ON), the default
    blind = (ALWAYS_ON, ALWAYS_OFF, TraceIdRatioBased(0.5), ParentBasedTraceIdRatio(0.5), ParentBased(ALWAYS_OFF))
    for sampler in blind:
        assert attribute_blind(sampler), sampler
    reads = _ReadsAttributes()
    assert not attribute_blind(reads)
    assert not attribute_blind(ParentBased(reads))
    for delegate in ("remote_parent_sampled", "remote_parent_not_sampled", "local_parent_sampled"):
        assert not attribute_blind(ParentBased(ALWAYS_ON, **{delegate: reads})), delegate  # type: ignore[arg-type]
    assert not attribute_blind(ParentBased(ALWAYS_ON, local_parent_not_sampled=reads))

    class Subclass(TraceIdRatioBased):  # may read them in its own should_sample
        pass

    assert not attribute_blind(Subclass(0.5))


@pytest.mark.parametrize(
    "limits",
    [None, SpanLimits(max_span_attribute_length=4), SpanLimits(max_span_attributes=3)],
    ids=["default", "value-length", "attribute-count"],
)
@pytest.mark.parametrize("sampler", ["default", "reads-attributes"])
def test_a_span_s_attributes_are_what_start_span_would_have_set_whatever_the_limits_and_sampler(limits, sampler):
    """Written into the SDK span's ``_attributes._dict`` or passed to ``start_span``: the same exported span."""
    reads = _ReadsAttributes()
    exporter = InMemorySpanExporter()
    provider = TracerProvider(span_limits=limits, **({"sampler": reads} if sampler == "reads-attributes" else {}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing = gp.Tracing(provider)
    broker = StubBroker(middleware=[tracing])
    ids = ["a-message", 7]  # a message id from JSON may be anything: an int is validated as before
    for message_id in ids:
        message = Message(queue_name="q", actor_name="work", args=(), kwargs={}, options={}, message_id=message_id)  # type: ignore[arg-type]
        proxy = MessageProxy(message)
        tracing.before_process_message(broker, proxy)
        tracing.after_process_message(broker, proxy, result=None)
    assert tracing._resolved[2] is (sampler == "default")  # the path without validation was taken, or not
    processed = exporter.get_finished_spans()
    expected = {
        "messaging.system": "stub",
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.destination.name": "q",
        "dramatiq_gp.task_type": "work",
    }
    reference = provider.get_tracer("reference")
    for span, message_id in zip(processed, ids, strict=True):
        attributes = {**expected, "messaging.message.id": message_id, "dramatiq_gp.attempt": 1}
        same = reference.start_span("process work", attributes=attributes)
        same.end()
        assert dict(span.attributes) == dict(exporter.get_finished_spans()[-1].attributes)
        assert span.dropped_attributes == exporter.get_finished_spans()[-1].dropped_attributes
    first = {**expected, "messaging.message.id": "a-message", "dramatiq_gp.attempt": 1}
    if limits is None:
        assert dict(processed[0].attributes) == first
    if sampler == "reads-attributes":  # the sampler saw every attribute, as it does without the kit
        assert reads.seen[0] == first


def test_the_global_provider_s_tracer_is_read_through_the_proxy_tracer():
    """Pins ``ProxyTracer._tracer``: the real SDK tracer once a global provider is set (a process of its own)."""
    code = """
from opentelemetry import trace
from opentelemetry.sdk.trace import Tracer, TracerProvider
import dramatiq_gp as gp
tracing = gp.Tracing()
assert isinstance(tracing.tracer, trace.ProxyTracer)
assert not isinstance(tracing.tracer._tracer, Tracer)
trace.set_tracer_provider(TracerProvider())
assert isinstance(tracing.tracer._tracer, Tracer), tracing.tracer._tracer
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "ok", done.stderr


class _ReadsAtStart(SpanProcessor):
    """Copies what a span starts with: the kind of processor that must see its attributes then."""

    def __init__(self) -> None:
        self.started: list[dict[str, Any]] = []

    def on_start(self, span, parent_context=None):  # type: ignore[no-untyped-def]
        self.started.append(dict(span.attributes))


def test_a_processor_that_reads_a_span_as_it_starts_sees_its_attributes_even_when_added_later():
    """Pins the SDK internals: the provider's processors in ``Tracer.span_processor._span_processors``."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    assert blind_on_start(provider.get_tracer("x").span_processor)  # type: ignore[attr-defined]
    tracing = gp.Tracing(provider)
    broker = StubBroker(middleware=[tracing])

    def process() -> None:
        proxy = MessageProxy(Message(queue_name="q", actor_name="work", args=(), kwargs={}, options={}))
        tracing.before_process_message(broker, proxy)
        tracing.after_process_message(broker, proxy, result=None)

    process()
    assert tracing._resolved[2] is True
    reads = _ReadsAtStart()
    provider.add_span_processor(reads)
    assert not blind_on_start(provider.get_tracer("x").span_processor)  # type: ignore[attr-defined]
    process()
    assert tracing._resolved[2] is False
    assert reads.started[0]["dramatiq_gp.task_type"] == "work"
    assert reads.started[0]["dramatiq_gp.attempt"] == 1
