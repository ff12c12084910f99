"""The multi-process Prometheus exposition: snapshots of several processes add up into one scrape."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from opentelemetry.sdk.metrics import MeterProvider

from dramatiq_gp.errors import UnsafeDirectory
from dramatiq_gp.prometheus import SnapshotReader, prometheus_name, render, snapshot_dir


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


def test_the_snapshot_directory_is_the_groups_own_and_refused_unless_the_users_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    home = tmp_path / f"dramatiq-gp-{os.geteuid()}"
    home.mkdir(mode=0o700)
    ended = home / f"metrics-shop-9464-{_dead_pid()}"  # a group killed outright left it
    ended.mkdir(mode=0o700)
    (ended / "1.json").write_text("{}")
    directory = snapshot_dir("shop", 9464)
    assert directory == home / f"metrics-shop-9464-{os.getpid()}"  # a process alone is its own group
    assert not ended.exists()
    assert stat.S_IMODE(home.stat().st_mode) == stat.S_IMODE(directory.stat().st_mode) == 0o700
    home.chmod(0o755)
    with pytest.raises(UnsafeDirectory, match=r"its mode 0755 lets other users in; remove it, or set TMPDIR"):
        snapshot_dir("shop", 9464)
    chosen = tmp_path / "chosen"
    chosen.mkdir(mode=0o777)
    chosen.chmod(0o777)
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(chosen))
    with pytest.raises(UnsafeDirectory, match=r"^PROMETHEUS_MULTIPROC_DIR: refusing .*: its mode 0777 lets other"):
        snapshot_dir("shop", 9464)
    chosen.chmod(0o755)  # the user's own choice: others may read it
    assert snapshot_dir("shop", 9464) == chosen


def test_a_snapshot_is_written_through_no_symbolic_link(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    directory = tmp_path / "metrics"
    directory.mkdir()
    (directory / f"{os.getpid()}.tmp").symlink_to(victim)
    provider = MeterProvider(metric_readers=[SnapshotReader(directory, interval_ms=60_000)])
    provider.get_meter("test").create_counter("jobs").add(1)
    provider.shutdown()  # writes the final snapshot
    assert victim.read_text() == "keep me"
    assert json.loads((directory / f"{os.getpid()}.json").read_text())["pid"] == os.getpid()


def test_names_labels_and_help_read_back_from_a_snapshot_are_checked_and_escaped(tmp_path):
    good = {"kind": "counter", "labels": {"queue": 'a"b\\c\nd\re'}, "value": 1}
    samples = [
        {**good, "name": "jobs_total", "help": "Jobs\nwith a \\ in it\r"},
        {**good, "name": "evil_total 1\n# TYPE injected counter\ninjected", "help": ""},
        {**good, "name": "bad_labels_total", "help": "", "labels": {"a b": "x"}},
        {**good, "name": "bad_kind", "help": "", "kind": "summary"},
        {**good, "name": "bad_value_total", "help": "", "value": "1"},
    ]
    (tmp_path / f"{os.getpid()}.json").write_text(json.dumps({"pid": os.getpid(), "samples": samples}))
    (tmp_path / "1.json").write_text(json.dumps({"samples": "not a snapshot"}))
    assert render(tmp_path).splitlines() == [
        "# HELP jobs_total Jobs\\nwith a \\\\ in it\\x0d",
        "# TYPE jobs_total counter",
        'jobs_total{queue="a\\"b\\\\c\\nd\\x0de"} 1',
    ]
