"""OTLP logs from real ``dramatiq`` worker processes, received by a local OTLP/HTTP collector.

``LOG_EXPORTER=otlp`` starts the exporter in each worker process after the fork
and flushes it at shutdown, so these run the real CLI, as test_telemetry_cli.py does.
"""

from __future__ import annotations

import json
import time

import pytest
from telemetry_worker import free_port, send

import dramatiq_gp as gp
from apps.app_events import SignedUp
from helpers import wait_for

#: No batch leaves before shutdown unless the flush sends it.
NEVER_MS = "600000"


def test_task_records_carry_the_trace_and_span_of_the_task_and_reach_the_collector_by_shutdown(
    run_worker, collector, producer
):
    worker = run_worker(
        {
            "LOG_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint,
            "OTEL_SERVICE_NAME": "gp-logs-worker",
            # Only the last flush sends spans and log records: whatever arrives, it sent.
            "OTEL_BSP_SCHEDULE_DELAY": NEVER_MS,
            "OTEL_BLRP_SCHEDULE_DELAY": NEVER_MS,
        }
    )
    message_id = send(producer, "quick", 7)
    wait_for(lambda: "task done task_type=quick" in worker.log)
    assert "telemetry exports traces to otlp; metrics to otlp; logs to otlp" in worker.log
    assert collector.log_requests == 0
    assert worker.stop() == 0

    (span,) = [s for s in collector.spans_named("process quick") if s.message_id == message_id]
    started = collector.logs_starting(f"task started task_type=quick task_id={message_id}")
    done = collector.logs_starting(f"task done task_type=quick task_id={message_id}")
    app = collector.logs_starting("quick 7")  # the actor's own line, through the root logger
    for (record,) in (started, done, app):
        assert (record.trace_id, record.span_id) == (span.trace_id, span.span_id)
        assert record.resource["service.name"] == "gp-logs-worker"
    (done_record,) = done
    assert done_record.severity == "INFO"
    assert done_record.attributes["task_type"] == "quick" and done_record.attributes["task_id"] == message_id
    assert done_record.attributes["attempt"] == 1 and done_record.attributes["duration_ms"] >= 0
    # The ids are the record's own fields, not repeated as attributes.
    assert "trace_id" not in done_record.attributes and "span_id" not in done_record.attributes
    # Outside a task, a start-up line: no trace.
    (ready,) = collector.logs_starting("start-up: consumers started")
    assert ready.trace_id == ""


def test_a_failing_task_sends_its_error_records_with_their_trace_id(run_worker, collector, producer):
    worker = run_worker(
        {
            "OTEL_LOGS_EXPORTER": "otlp",  # the OpenTelemetry variable works as well as LOG_EXPORTER
            "OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint,
            "OTEL_BSP_SCHEDULE_DELAY": "100",
            "OTEL_BLRP_SCHEDULE_DELAY": "100",
        }
    )
    message_id = send(producer, "always_fails", "boom")
    wait_for(lambda: len(collector.logs_starting(f"task failed task_type=always_fails task_id={message_id}")) == 3)
    wait_for(lambda: len(collector.spans_named("process always_fails")) == 3)
    assert worker.stop() == 0

    spans = {span.span_id: span for span in collector.spans_named("process always_fails")}
    failures = collector.logs_starting(f"task failed task_type=always_fails task_id={message_id}")
    assert [f.attributes["attempt"] for f in sorted(failures, key=lambda f: f.attributes["attempt"])] == [1, 2, 3]
    for failure in failures:
        assert failure.severity == "ERROR"
        assert spans[failure.span_id].trace_id == failure.trace_id != ""
        assert failure.attributes["error"] == "ValueError"  # not its message: PII sending is off
        assert failure.attributes["exception.type"] == "ValueError"
        assert "raise ValueError" in failure.attributes["exception.stacktrace"]
    assert [f.attributes["will_retry"] for f in failures].count(False) == 1


def test_with_logs_off_no_log_request_arrives(run_worker, collector, producer):
    worker = run_worker(
        {
            "OTEL_LOGS_EXPORTER": "otlp",
            "LOG_EXPORTER": "none",  # the kit's variable wins
            "OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint,
            "OTEL_BSP_SCHEDULE_DELAY": "100",
        }
    )
    message_id = send(producer, "quick", 1)
    wait_for(lambda: "task done task_type=quick" in worker.log)
    assert worker.stop() == 0
    assert [s.message_id for s in collector.spans_named("process quick")] == [message_id]  # the collector was used
    assert collector.log_requests == 0
    assert "logs to" not in worker.log


def test_an_unreachable_collector_neither_stalls_the_work_nor_hears_of_records_after_its_shutdown(run_worker, producer):
    closed = f"http://127.0.0.1:{free_port()}"
    worker = run_worker(
        {
            "LOG_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_LOGS_ENDPOINT": closed,
            "OTEL_EXPORTER_OTLP_LOGS_TIMEOUT": "1",
            "OTEL_BLRP_SCHEDULE_DELAY": "50",
        }
    )
    for n in range(200):
        send(producer, "quick", n)
    wait_for(lambda: worker.log.count("task done task_type=quick") == 200, timeout=20)
    wait_for(lambda: "Failed to export logs batch" in worker.log)  # said in the worker's own log
    started = time.monotonic()
    assert worker.stop() == 0
    assert time.monotonic() - started < 15  # the flush is bounded
    # Dramatiq's last lines come after the flush: they are not handed to the exporter it shut
    # down, which would drop each and say so in one more line.
    assert "Worker has been shut down" in worker.log
    assert "Shutdown called, ignoring" not in worker.log


def test_the_sdks_own_lines_stay_out_of_the_otlp_logs(run_worker, collector, producer):
    # Spans to a closed port: their exporter logs each failure, and the logs go to a working collector.
    worker = run_worker(
        {
            "LOG_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_LOGS_ENDPOINT": f"{collector.endpoint}/v1/logs",
            "OTEL_BLRP_SCHEDULE_DELAY": "50",
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{free_port()}",
            "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "1",
            "OTEL_BSP_SCHEDULE_DELAY": "50",
        }
    )
    send(producer, "quick", 3)
    wait_for(lambda: "Failed to export spans batch" in worker.log)
    assert worker.stop() == 0
    assert collector.logs_starting("task done task_type=quick")  # the kit's lines went
    # One exporter's failures sent over another, or over itself (one more record per failed batch), help no one.
    assert [log.body for log in collector.logs if "Failed to export" in str(log.body)] == []


EMAIL = "grace.hopper@example.com"
CARD = "4111 1111 1111 1111"


@pytest.mark.parametrize("pii", [False, True], ids=["pii-off", "pii-on"])
def test_message_arguments_and_exception_messages_go_over_otlp_only_when_pii_sending_is_on(
    run_worker, collector, engine, database_url, producer, pii
):
    worker = run_worker(
        {
            "LOG_EXPORTER": "otlp",
            "LOG_LEVEL": "DEBUG",  # Dramatiq's DEBUG lines print whole messages
            "SENTRY_SEND_DEFAULT_PII": str(pii).lower(),
            "DB_URL": database_url,
            "OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint,
            "OTEL_BLRP_SCHEDULE_DELAY": "100",
        }
    )
    with engine.begin() as conn:
        gp.dispatch(conn, SignedUp(EMAIL))
    message_id = send(producer, "declined", CARD)
    wait_for(
        lambda: (
            "task_type=listener:test.telemetry.signed_up:welcome" in worker.log
            and f"task failed task_type=declined task_id={message_id}" in worker.log
            and worker.log.count("will_retry=False") == 2
        )
    )
    assert worker.stop() == 0

    received = collector.logs_starting("Received message listener:test.telemetry.signed_up:welcome")
    assert received  # Dramatiq's DEBUG line went over OTLP
    everything = json.dumps([(log.body, log.attributes) for log in collector.logs], default=str)
    assert (EMAIL in everything) is pii
    # An exception's message once went 4 times in one record (body, error, exception.message and .stacktrace).
    assert (CARD in everything) is pii
    # And twice in the task's span (its exception event, its status).
    (span,) = [s for s in collector.spans_named("process declined") if s.message_id == message_id]
    assert (CARD in json.dumps([span.status_message, span.event_attributes])) is pii
    assert span.event_attributes[0]["exception.type"] == "ValueError"
    assert CARD in worker.log  # the lines written here keep it
    (failed,) = collector.logs_starting(f"task failed task_type=declined task_id={message_id}")
    (skipped,) = collector.logs_starting("charge skipped")
    stack = failed.attributes["exception.stacktrace"]
    assert failed.attributes["exception.type"] == "ValueError"
    assert "The above exception was the direct cause" in stack and 'raise LookupError(f"no customer' in stack
    if pii:
        assert failed.attributes["error"] == f"ValueError: card {CARD} declined"
        assert failed.attributes["exception.message"] == f"card {CARD} declined"
        assert skipped.body == f"charge skipped: no customer for card {CARD}"
    else:
        # The type and the frames, as Sentry's rule: not the message.
        assert failed.body.endswith(" error=ValueError") and failed.attributes["error"] == "ValueError"
        assert "exception.message" not in failed.attributes
        assert stack.rstrip().endswith("\nValueError") and "\nLookupError\n" in stack
        assert skipped.body == "charge skipped: LookupError"


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, ()),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, ()),  # an endpoint alone ships no logs
        ({"LOG_EXPORTER": "OTLP"}, ("otlp",)),
        ({"OTEL_LOGS_EXPORTER": "otlp"}, ("otlp",)),
        ({"OTEL_LOGS_EXPORTER": "otlp", "LOG_EXPORTER": "none"}, ()),
        ({"OTEL_LOGS_EXPORTER": "console", "LOG_EXPORTER": "otlp"}, ("otlp",)),
        ({"LOG_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}, ()),
        ({"OTEL_LOGS_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}, ()),
    ],
)
def test_which_variable_turns_otlp_logs_on(clean_env, env, expected):
    for name, value in env.items():
        clean_env.setenv(name, value)
    settings = gp.Settings.from_env()
    assert settings.otel.logs(settings.log.exporter) == expected
