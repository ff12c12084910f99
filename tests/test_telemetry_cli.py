"""Telemetry in real ``dramatiq`` worker processes, exporting to a local stand-in collector and Sentry.

Exporters start in each forked worker process and must be flushed before it
exits (Dramatiq's children leave through ``os._exit``, skipping ``atexit``), so
these run the real CLI.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import sqlalchemy as sa
from opentelemetry.sdk.trace import TracerProvider
from telemetry_worker import ROOT, Worker, free_port, send

import dramatiq_gp as gp
from apps.app_events import OrderPlaced, SignedUp
from dramatiq_gp.middleware.lifecycle import DUPLICATE_SIGNAL_S
from helpers import wait_for

PRODUCER, CONSUMER = 4, 5  # OTLP span kinds


def test_an_outbox_dispatch_is_one_trace_through_the_relay_to_both_listeners_and_json_logs_carry_it(
    run_worker, collector, engine, database_url
):
    worker = run_worker(
        {
            "DB_URL": database_url,
            "OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint,
            "OTEL_BSP_SCHEDULE_DELAY": "100",
            "OTEL_SERVICE_NAME": "gp-test-worker",
            "LOG_FORMAT": "json",
        },
        "--skip-logging",
    )
    tracer = TracerProvider().get_tracer("test-web-app")
    with tracer.start_as_current_span("POST /orders") as request, engine.begin() as conn:
        gp.dispatch(conn, OrderPlaced(41))
    wait_for(lambda: len(collector.spans_named("process listener:")) == 2, timeout=20)
    assert worker.stop() == 0

    spans = {span.span_id: span for span in collector.spans}
    trace_id = format(request.get_span_context().trace_id, "032x")
    request_id = format(request.get_span_context().span_id, "016x")
    (relay_send,) = collector.spans_named("send event:test.telemetry.order_placed")
    assert relay_send.kind == PRODUCER and relay_send.parent_id == request_id
    (fan_out,) = collector.spans_named("process event:test.telemetry.order_placed")
    assert fan_out.kind == CONSUMER and fan_out.parent_id == relay_send.span_id
    listeners = collector.spans_named("process listener:")
    for process in listeners:
        send_span = spans[process.parent_id]
        assert send_span.kind == PRODUCER and send_span.parent_id == fan_out.span_id
        assert process.kind == CONSUMER and process.trace_id == trace_id
    assert {p.attributes["messaging.destination.name"] for p in listeners} == {"default", "stock"}

    # Every line the worker wrote is one JSON object; the listeners' lines carry their span.
    records = [json.loads(line) for line in worker.log.splitlines() if line.strip()]
    by_message = {r["message"]: r for r in records}
    mail_span = next(p for p in listeners if p.name.endswith(":mail"))
    assert by_message["mailing order 41"]["trace_id"] == trace_id
    assert by_message["mailing order 41"]["span_id"] == mail_span.span_id
    done = [r for r in records if r["message"].startswith("task done") and r["task_type"].endswith(":mail")]
    assert done and done[0]["trace_id"] == trace_id and done[0]["attempt"] == 1 and "duration_ms" in done[0]
    assert any(r["logger"].startswith("dramatiq.") for r in records)  # Dramatiq's own lines too


def test_a_task_finished_just_before_sigterm_is_exported_with_the_default_batch_delay(run_worker, collector, producer):
    worker = run_worker({"OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint})  # batch delay: the default 5 s
    message_id = send(producer, "quick", 1)
    wait_for(lambda: "task done task_type=quick" in worker.log)
    time.sleep(0.1)
    started = time.monotonic()
    assert worker.stop() == 0
    assert time.monotonic() - started < 10
    assert [s.message_id for s in collector.spans_named("process quick")] == [message_id]


def test_a_second_sigterm_still_flushes_what_finished(run_worker, collector, producer):
    worker = run_worker({"OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint})
    message_id = send(producer, "quick", 2)
    wait_for(lambda: "task done task_type=quick" in worker.log)
    send(producer, "sleepy", 60)
    wait_for(lambda: "task started task_type=sleepy" in worker.log)
    worker.process.send_signal(signal.SIGTERM)
    wait_for(lambda: "shutdown: draining in-flight tasks" in worker.log)
    time.sleep(DUPLICATE_SIGNAL_S)  # sooner, it would be taken for the same stop delivered twice
    worker.process.send_signal(signal.SIGTERM)  # impatient: kill the drain
    worker.process.wait(30)
    assert [s.message_id for s in collector.spans_named("process quick")] == [message_id]


def test_sentry_gets_one_event_per_final_failure_none_for_a_recovered_retry_and_no_leaked_breadcrumbs(
    run_worker, collector, producer, rdb, namespace
):
    worker = run_worker(
        {
            "SENTRY_DSN": collector.dsn,
            "SENTRY_ENVIRONMENT": "test",
            "GP_TEST_CRON": "1",
            "SENTRY_TRACES_SAMPLE_RATE": "1.0",
            "OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint,
            "OTEL_BSP_SCHEDULE_DELAY": "100",
        }
    )
    failing = send(producer, "always_fails", "a")
    send(producer, "fails_once", "b")
    send(producer, "expected", "c")  # the actor throws it: an expected outcome, not reported
    for n in range(30):
        send(producer, "quick", n)
    wait_for(lambda: worker.log.count("task done task_type=quick") == 30)
    wait_for(lambda: "task done task_type=fails_once" in worker.log)
    wait_for(lambda: worker.log.count("task failed task_type=always_fails") == 3)
    wait_for(lambda: "task failed task_type=expected" in worker.log)
    wait_for(lambda: {"in_progress", "ok"} <= {c["status"] for c in collector.items("check_in")}, timeout=15)
    assert worker.stop() == 0

    (event,) = collector.items("event")
    assert event["environment"] == "test"
    assert event["exception"]["values"][-1]["type"] == "ValueError"
    assert event["exception"]["values"][-1]["mechanism"] == {"type": "dramatiq", "handled": False}
    tags = event["tags"]
    assert (tags["task_type"], tags["queue"], tags["message_id"], str(tags["attempt"])) == (
        "always_fails",
        "default",
        failing,
        "3",
    )
    (process,) = [s for s in collector.spans_named("process always_fails") if s.attributes["dramatiq_gp.attempt"] == 3]
    assert tags["trace_id"] == process.trace_id
    crumbs = [c for c in event.get("breadcrumbs", {}).get("values", [])]
    # This attempt's own, nothing from earlier attempts or the quick tasks running beside it.
    assert [c["message"] for c in crumbs if c.get("category") == "test"] == ["always_fails a"]
    assert not any("quick" in str(c.get("message")) or "fails_once" in str(c.get("message")) for c in crumbs)
    assert event["contexts"]["dramatiq"]["args"] == "[Filtered]"

    # Each message is a Sentry transaction in the same trace as its OpenTelemetry span.
    spans_by_message = {s.message_id: s for s in collector.spans_named("process quick")}
    transactions = [t for t in collector.items("transaction") if t["transaction"] == "quick"]
    assert len(transactions) == 30
    for transaction in transactions:
        message_id = transaction["tags"]["message_id"]
        assert transaction["contexts"]["trace"]["trace_id"] == spans_by_message[message_id].trace_id

    check_ins = [c for c in collector.items("check_in") if c["monitor_slug"] == "heartbeat"]
    first = check_ins[0]
    assert first["status"] == "in_progress"
    assert first["monitor_config"]["schedule"] == {"type": "interval", "unit": "minute", "value": 1}
    closing = [c for c in check_ins if c["check_in_id"] == first["check_in_id"] and c["status"] == "ok"]
    assert len(closing) == 1 and closing[0]["duration"] >= 0


EMAIL = "ada.lovelace@example.com"


@pytest.mark.parametrize("pii", [False, True], ids=["pii-off", "pii-on"])
def test_event_data_reaches_sentry_and_the_logs_only_when_pii_sending_is_on(
    run_worker, collector, engine, database_url, pii
):
    worker = run_worker(
        {
            "SENTRY_DSN": collector.dsn,
            "SENTRY_TRACES_SAMPLE_RATE": "1.0",
            "LOG_LEVEL": "DEBUG",
            "SENTRY_SEND_DEFAULT_PII": str(pii).lower(),
            "DB_URL": database_url,
            "OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint,
            "OTEL_BSP_SCHEDULE_DELAY": "100",
        }
    )
    with engine.begin() as conn:
        gp.dispatch(conn, SignedUp(EMAIL))
    wait_for(
        lambda: "task_type=listener:test.telemetry.signed_up:welcome" in worker.log and "will_retry=False" in worker.log
    )
    wait_for(lambda: len(collector.spans_named("process listener:test.telemetry.signed_up:welcome")) == 2)
    assert worker.stop() == 0

    (event,) = collector.items("event")
    assert event["exception"]["values"][-1]["value"] == "the welcome mail bounced"
    frames = event["exception"]["values"][-1]["stacktrace"]["frames"]
    assert any(frame["function"] == "welcome" for frame in frames)
    assert collector.items("transaction")  # spans were sent too, and are searched below
    everything = json.dumps(collector.envelopes) + repr(collector.spans)
    if pii:
        assert event["contexts"]["dramatiq"]["args"][0]["data"] == {"email": EMAIL}
        (welcome,) = [frame for frame in frames if frame["function"] == "welcome"]
        assert EMAIL in json.dumps(welcome["vars"])
    else:
        # Not in the arguments, nor in any frame's local variables, breadcrumb, tag, context or span.
        assert event["contexts"]["dramatiq"]["args"] == "[Filtered]"
        assert all("vars" not in frame for frame in frames)
        assert EMAIL not in everything
        # Nor in the worker's log, DEBUG lines included (Dramatiq's own print whole messages).
        assert EMAIL not in worker.log
        assert "Received message listener:test.telemetry.signed_up:welcome/" in worker.log


def test_sentry_crons_false_sends_no_check_ins(run_worker, collector):
    worker = run_worker(
        {"SENTRY_DSN": collector.dsn, "SENTRY_TRACES_SAMPLE_RATE": "1.0", "SENTRY_CRONS": "false", "GP_TEST_CRON": "1"}
    )
    wait_for(lambda: worker.log.count("task done task_type=job:heartbeat") >= 2, timeout=15)
    assert worker.stop() == 0
    assert [t for t in collector.items("transaction") if t["transaction"] == "job:heartbeat"]  # Sentry was on
    assert collector.items("check_in") == []


@pytest.mark.parametrize("pii", [False, True], ids=["pii-off", "pii-on"])
def test_a_reported_final_failure_frees_its_exception_at_once(collector, redis_url, namespace, pii):
    """Dramatiq's own test_exception_from_actor_doesnt_leak, with the kit and Sentry on."""
    env = {
        **os.environ,
        "SENTRY_DSN": collector.dsn,
        "REDIS_URL": redis_url,
        "VALKEY_NAMESPACE": namespace,
        "SENTRY_SEND_DEFAULT_PII": str(pii).lower(),
    }
    run = subprocess.run(
        [sys.executable, "-m", "tests.apps.exception_leak"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == {"raised": 2, "alive": 0, "events": 1}


def test_the_exit_flush_prints_no_traceback_when_the_log_stream_is_already_closed(tmp_path, redis_url, namespace):
    # The stand-in Sentry accepts connections and never answers, so the flush gives up and says so, at exit.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        script = f"""
import logging, sentry_sdk
stream = open({str(tmp_path / "log.txt")!r}, "w")
logging.getLogger().addHandler(logging.StreamHandler(stream))
import dramatiq_gp as gp
kit = gp.Kit(registry=gp.Registry())
kit.broker.emit_after("process_boot")
sentry_sdk.capture_message("one event to flush")
stream.close()  # as pytest closes its capture streams before the exit hooks run
"""
        env = {
            **os.environ,
            "REDIS_URL": redis_url,
            "VALKEY_NAMESPACE": namespace,
            "SENTRY_DSN": f"http://key@127.0.0.1:{silent.getsockname()[1]}/1",
        }
        run = subprocess.run(
            [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
        )
    assert run.returncode == 0
    assert "Traceback" not in run.stderr and "Logging error" not in run.stderr, run.stderr


def test_the_prometheus_endpoint_adds_up_every_worker_process(run_worker, producer, tmp_path, engine, database_url):
    port = free_port()
    worker = run_worker(
        {
            "OTEL_METRICS_EXPORTER": "prometheus",
            "OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1",
            "OTEL_EXPORTER_PROMETHEUS_PORT": str(port),
            "OTEL_METRIC_EXPORT_INTERVAL": "300",
            "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "metrics"),
            "DB_URL": database_url,
            "GP_TEST_CRON": "1",
        },
        processes=2,
    )
    with engine.begin() as conn:
        for n in range(3):
            gp.dispatch(conn, OrderPlaced(n))
    for n in range(40):
        send(producer, "quick", n)
    for n in range(5):
        send(producer, "low", n, queue="low")
    send(producer, "always_fails", "p")

    def scrape() -> str:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
                return str(response.read().decode())
        except OSError:
            return ""

    def counters() -> dict[str, float]:
        return {
            line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in scrape().splitlines()
            if line.startswith("dramatiq_gp_messages_total{")
        }

    done_default = 'dramatiq_gp_messages_total{outcome="done",queue="default",task_type="quick"}'
    done_low = 'dramatiq_gp_messages_total{outcome="done",queue="low",task_type="low"}'
    failed = 'dramatiq_gp_messages_total{outcome="failed",queue="default",task_type="always_fails"}'
    retried = 'dramatiq_gp_messages_total{outcome="retried",queue="default",task_type="always_fails"}'
    wait_for(lambda: counters().get(done_default) == 40 and counters().get(failed) == 1, timeout=20)
    seen = counters()
    assert (seen[done_low], seen[retried]) == (5, 2)
    # Both processes write a snapshot; the second may have booted after the first did all the work (a loaded
    # machine), and writes its first one an interval after its telemetry starts.
    wait_for(lambda: len(set((tmp_path / "metrics").glob("*.json"))) == 2, timeout=10)
    text = scrape()
    assert 'messaging_process_duration_seconds_count{messaging_destination_name="low",task_type="low"} 5' in text
    assert "dramatiq_gp_queue_wait_seconds_bucket" in text
    wait_for(lambda: _value(scrape(), "dramatiq_gp_outbox_published_total") == 3)
    wait_for(lambda: _value(scrape(), 'dramatiq_gp_scheduler_ticks_total{entry="heartbeat",outcome="fired"}') >= 2)
    text = scrape()
    leaders = [line for line in text.splitlines() if line.startswith("dramatiq_gp_scheduler_leader{")]
    assert sorted(line.rsplit(" ", 1)[1] for line in leaders) == ["0", "1"]  # one gauge per process, one leads
    assert 'dramatiq_gp_outbox_backlog{pid="' in text
    assert worker.stop() == 0


def _value(text: str, prefix: str) -> float:
    """The sum of the samples whose line starts with ``prefix``."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


def test_telemetry_that_cannot_be_reached_neither_stops_nor_stalls_the_work(run_worker, producer):
    closed = f"http://127.0.0.1:{free_port()}"
    worker = run_worker(
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": closed,
            "OTEL_BSP_SCHEDULE_DELAY": "100",
            "SENTRY_DSN": f"http://key@{closed[7:]}/1",
            "OTEL_METRICS_EXPORTER": "otlp",
            "OTEL_METRIC_EXPORT_INTERVAL": "200",
        }
    )
    send(producer, "always_fails", "x")
    for n in range(200):
        send(producer, "quick", n)
    wait_for(lambda: worker.log.count("task done task_type=quick") == 200, timeout=20)
    wait_for(lambda: worker.log.count("task failed task_type=always_fails") == 3)
    started = time.monotonic()
    assert worker.stop() == 0
    assert time.monotonic() - started < 15  # the flush is bounded
    assert "telemetry flush gave up after 5000 ms" in worker.log


def test_a_bad_exporter_name_fails_at_start_up_naming_the_variable(worker_env, tmp_path):
    worker = Worker(tmp_path, {**worker_env, "OTEL_TRACES_EXPORTER": "jaegr"})
    assert worker.process.wait(30) != 0
    worker.kill()
    assert "OTEL_TRACES_EXPORTER='jaegr': unknown exporter; installed: console, none, otlp" in worker.log


def test_the_outbox_backlog_gauge_reads_pending_rows(engine, database_url, clean_env):
    with engine.begin() as conn:
        for n in range(3):
            gp.dispatch(conn, OrderPlaced(n))
        conn.execute(sa.text("UPDATE outbox_events SET created_at = now() - interval '90 seconds'"))
    clean_env.setenv("DB_URL", database_url)
    clean_env.setenv("OUTBOX_RELAY", "true")
    kit = gp.Kit(registry=gp.Registry())
    try:
        assert kit.relay is not None
        count, age = kit.relay.backlog()
    finally:
        # The kit's own engine (from DB_URL); a worker's closers would dispose it.
        assert kit.engine is not None
        kit.engine.dispose()
        kit.broker.client.close()
    assert count == 3 and 89 < age < 120
