"""The multi-process Prometheus exposition: snapshots of several processes add up into one scrape."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from opentelemetry.sdk.metrics import MeterProvider

from dramatiq_gp.prometheus import SnapshotReader, prometheus_name, render


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _snapshot(directory: Path, pid: int, done: int, leader: int, waits: list[int]) -> None:
    samples = [
        {
            "name": "dramatiq_gp_messages_total",
            "kind": "counter",
            "help": "Messages processed, by outcome",
            "labels": {"queue": "default", "outcome": "done"},
            "value": done,
        },
        {
            "name": "dramatiq_gp_scheduler_leader",
            "kind": "gauge",
            "help": "",
            "labels": {"namespace": "shop"},
            "value": leader,
        },
        {
            "name": "dramatiq_gp_queue_wait_seconds",
            "kind": "histogram",
            "help": "",
            "labels": {"queue": "default"},
            "bounds": [0.1, 1.0],
            "counts": waits,
            "sum": 1.5,
            "count": sum(waits),
        },
    ]
    (directory / f"{pid}.json").write_text(json.dumps({"pid": pid, "samples": samples}))


def test_counters_and_histograms_add_up_and_gauges_of_dead_processes_drop_out(tmp_path):
    live, dead = os.getpid(), _dead_pid()
    _snapshot(tmp_path, live, done=5, leader=1, waits=[1, 2, 0])
    _snapshot(tmp_path, dead, done=7, leader=1, waits=[3, 0, 1])
    text = render(tmp_path)
    assert 'dramatiq_gp_messages_total{outcome="done",queue="default"} 12' in text.splitlines()
    assert "# TYPE dramatiq_gp_messages_total counter" in text
    # The dead process no longer leads; its counts stay in the totals.
    leaders = [line for line in text.splitlines() if line.startswith("dramatiq_gp_scheduler_leader{")]
    assert leaders == [f'dramatiq_gp_scheduler_leader{{namespace="shop",pid="{live}"}} 1']
    assert 'dramatiq_gp_queue_wait_seconds_bucket{queue="default",le="0.1"} 4' in text
    assert 'dramatiq_gp_queue_wait_seconds_bucket{queue="default",le="1"} 6' in text
    assert 'dramatiq_gp_queue_wait_seconds_bucket{queue="default",le="+Inf"} 7' in text
    assert 'dramatiq_gp_queue_wait_seconds_count{queue="default"} 7' in text
    assert 'dramatiq_gp_queue_wait_seconds_sum{queue="default"} 3' in text


def test_a_process_snapshot_is_written_from_the_meter_and_stale_files_are_removed(tmp_path):
    stale = tmp_path / f"{_dead_pid()}.json"
    stale.write_text("{}")
    reader = SnapshotReader(tmp_path, interval_ms=60_000)
    assert not stale.exists()
    provider = MeterProvider(metric_readers=[reader])
    counter = provider.get_meter("test").create_counter("dramatiq_gp.messages", unit="{message}")
    counter.add(3, {"queue": "mail", "task_type": "listener:x:y", "outcome": "done"})
    provider.shutdown()  # writes the final snapshot
    text = render(tmp_path)
    assert 'dramatiq_gp_messages_total{outcome="done",queue="mail",task_type="listener:x:y"} 3' in text


def test_names_follow_prometheus_conventions():
    assert prometheus_name("messaging.process.duration", "s", "histogram") == "messaging_process_duration_seconds"
    assert prometheus_name("dramatiq_gp.messages", "{message}", "counter") == "dramatiq_gp_messages_total"
    assert prometheus_name("dramatiq_gp.outbox.backlog", "{event}", "gauge") == "dramatiq_gp_outbox_backlog"
