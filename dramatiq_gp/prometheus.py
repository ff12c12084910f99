"""A Prometheus ``/metrics`` endpoint for a worker with several processes.

The dramatiq CLI runs N worker processes; a scrape must see all of them, and
one process must serve it. Each process writes a snapshot of its metrics
(cumulative since it started) to ``<dir>/<pid>.json`` every export interval and
when it stops; every process tries to bind the port, the one that gets it serves,
and if it goes away another takes over within an interval. A scrape adds up
counters and histograms over all snapshots (a process that exited keeps its
counts) and shows gauges per live process, with a ``pid`` label.

The directory is ``PROMETHEUS_MULTIPROC_DIR`` when set (the user's, not writable by
others), else the group's own, per namespace and port (:mod:`dramatiq_gp.groupdir`:
private to the user, refused if not); snapshots of dead processes, and the
directories of ended groups, are removed when a process starts. What a scrape reads
back from a snapshot is checked again: a sample whose name, kind or labels are not
Prometheus's is left out, and help text and label values are escaped.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import threading
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from opentelemetry.sdk.metrics.export import (
    Gauge,
    Histogram,
    HistogramDataPoint,
    MetricExportResult,
    MetricReader,
    MetricsData,
    Sum,
)

from . import groupdir
from .endpoint import Endpoint, Response
from .errors import UnsafeDirectory

logger = logging.getLogger(__name__)

_NAME = re.compile(r"[^a-zA-Z0-9_:]")
_UNITS = {"s": "seconds", "ms": "milliseconds", "By": "bytes"}
#: Prometheus's grammar of a metric name and of a label name.
METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
KINDS = ("counter", "gauge", "histogram")
#: What a group's snapshot directory is called in :mod:`dramatiq_gp.groupdir`.
KIND = "metrics"


def snapshot_dir(namespace: str, port: int) -> Path:
    """Where this process's group meets: ``PROMETHEUS_MULTIPROC_DIR``, else the group's own directory.

    Raises:
        UnsafeDirectory: the directory is another user's, open to others (writable, for one the user chose), or a
            symbolic link.
    """
    configured = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not configured:
        directory = groupdir.group_dir(KIND, namespace, port)
        groupdir.forget_dead_groups(KIND)
        return directory
    try:
        return groupdir.private(Path(configured), others_may_read=True)
    except UnsafeDirectory as exc:
        raise UnsafeDirectory(f"PROMETHEUS_MULTIPROC_DIR: {exc}") from None


def prometheus_name(name: str, unit: str, kind: str) -> str:
    base = _NAME.sub("_", name)
    suffix = _UNITS.get(unit, "")
    if suffix and not base.endswith(suffix):
        base = f"{base}_{suffix}"
    return f"{base}_total" if kind == "counter" and not base.endswith("_total") else base


class SnapshotReader(MetricReader):
    """Writes this process's metrics to ``<directory>/<pid>.json`` every ``interval_ms`` and at shutdown."""

    def __init__(self, directory: Path, *, interval_ms: int) -> None:
        super().__init__()
        self.directory = directory
        self.path = directory / f"{os.getpid()}.json"
        self._interval = interval_ms / 1000
        self._stop = threading.Event()
        groupdir.forget_the_dead(directory)
        self._thread = threading.Thread(target=self._run, name="metrics-snapshot", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.collect()
            except Exception:
                logger.exception("could not write the metrics snapshot %s", self.path)

    def _receive_metrics(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any) -> None:
        samples = list(_samples(metrics_data))
        groupdir.write(self.path, json.dumps({"pid": os.getpid(), "samples": samples}).encode())

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self._stop.set()
        self.collect(timeout_millis=timeout_millis)

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        self.collect(timeout_millis=timeout_millis)
        return True

    @property
    def export_result(self) -> MetricExportResult:
        return MetricExportResult.SUCCESS


def _samples(data: MetricsData) -> Iterable[dict[str, Any]]:
    for resource_metrics in data.resource_metrics:
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                points = metric.data
                if isinstance(points, Sum):
                    kind = "counter" if points.is_monotonic else "gauge"
                elif isinstance(points, Gauge):
                    kind = "gauge"
                elif isinstance(points, Histogram):
                    kind = "histogram"
                else:
                    continue
                name = prometheus_name(metric.name, metric.unit or "", kind)
                for point in points.data_points:
                    sample: dict[str, Any] = {
                        "name": name,
                        "kind": kind,
                        "help": metric.description or "",
                        "labels": {_NAME.sub("_", k): str(v) for k, v in (point.attributes or {}).items()},
                    }
                    if isinstance(point, HistogramDataPoint):
                        sample.update(
                            bounds=list(point.explicit_bounds),
                            counts=list(point.bucket_counts),
                            sum=point.sum,
                            count=point.count,
                        )
                    else:
                        sample["value"] = point.value
                    yield sample


def render(directory: Path) -> str:
    """The Prometheus text exposition of every snapshot in ``directory``."""
    families: dict[str, dict[str, Any]] = {}
    values: dict[str, dict[tuple[tuple[str, str], ...], Any]] = defaultdict(dict)
    for path in sorted(directory.glob("*.json")):
        try:
            snapshot = json.loads(groupdir.read(path))
            pid = int(snapshot["pid"])
            samples = [sample for sample in snapshot["samples"] if _valid(sample)]
        except (OSError, ValueError, TypeError, KeyError):
            continue  # being replaced right now, gone, or not a snapshot
        live = groupdir.alive(pid)
        for sample in samples:
            kind = sample["kind"]
            labels = dict(sample["labels"])
            if kind == "gauge":
                if not live:
                    continue
                labels["pid"] = str(pid)
            if families.setdefault(sample["name"], {"kind": kind, "help": sample["help"]})["kind"] != kind:
                continue  # another snapshot has it of another kind
            key = tuple(sorted(labels.items()))
            seen = values[sample["name"]].get(key)
            if kind == "histogram":
                if seen is not None and len(seen["counts"]) != len(sample["counts"]):
                    continue  # other buckets than another snapshot's
                if seen is None:
                    empty = {"bounds": sample["bounds"], "counts": [0] * len(sample["counts"]), "sum": 0.0, "count": 0}
                    seen = values[sample["name"]][key] = empty
                seen["counts"] = [a + b for a, b in zip(seen["counts"], sample["counts"], strict=True)]
                seen["sum"] += sample["sum"]
                seen["count"] += sample["count"]
            else:
                values[sample["name"]][key] = (seen or 0) + sample["value"]
    return exposition(families, values)


def _valid(sample: Any) -> bool:
    """Whether ``sample``, read back from a snapshot, is one :func:`_samples` could have written."""
    if not isinstance(sample, dict):
        return False
    name, labels = sample.get("name"), sample.get("labels")
    if not (
        isinstance(name, str)
        and METRIC_NAME.fullmatch(name)
        and sample.get("kind") in KINDS
        and isinstance(sample.get("help"), str)
        and isinstance(labels, dict)
        and all(isinstance(k, str) and LABEL_NAME.fullmatch(k) and isinstance(v, str) for k, v in labels.items())
    ):
        return False
    if sample["kind"] != "histogram":
        return _numeric(sample.get("value"))
    bounds, counts = sample.get("bounds"), sample.get("counts")
    return (
        isinstance(bounds, list)
        and isinstance(counts, list)
        and len(counts) == len(bounds) + 1
        and all(map(_numeric, [*bounds, *counts, sample.get("sum"), sample.get("count")]))
    )


def _numeric(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def exposition(
    families: Mapping[str, Mapping[str, Any]], values: Mapping[str, Mapping[tuple[tuple[str, str], ...], Any]]
) -> str:
    """The Prometheus text format of ``families`` (name → ``kind`` and ``help``) and their ``values`` (name → the
    sorted label pairs → a number, or for a histogram its ``bounds``, ``counts``, ``sum`` and ``count``)."""
    lines = []
    for name in sorted(families):
        family = families[name]
        kind = family["kind"]
        if family["help"]:
            lines.append(f"# HELP {name} {_escape_help(family['help'])}")
        lines.append(f"# TYPE {name} {kind}")
        for key, value in sorted(values[name].items()):
            if kind != "histogram":
                lines.append(f"{name}{_labels(key)} {_number(value)}")
                continue
            cumulative = 0
            for bound, count in zip([*value["bounds"], math.inf], value["counts"], strict=True):
                cumulative += count
                le = "+Inf" if bound == math.inf else _number(bound)
                lines.append(f"{name}_bucket{_labels((*key, ('le', le)))} {cumulative}")
            lines.append(f"{name}_sum{_labels(key)} {_number(value['sum'])}")
            lines.append(f"{name}_count{_labels(key)} {value['count']}")
    return "\n".join(lines) + "\n"


def _labels(pairs: Iterable[tuple[str, str]]) -> str:
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in pairs)
    return f"{{{inner}}}" if inner else ""


def _escape(value: str) -> str:
    escaped = value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
    return _CONTROL.sub(_code, escaped)


def _escape_help(text: str) -> str:
    return _CONTROL.sub(_code, text.replace("\\", "\\\\").replace("\n", "\\n"))


#: Characters the text format allows raw in a label value or help text but which end a line for some readers
#: (Python's ``splitlines``, a terminal): written as ``\xHH`` (``\uHHHH``), which Prometheus reads as text.
_CONTROL = re.compile("[\x00-\x09\x0b-\x1f\x7f\x85\u2028\u2029]")


def _code(found: re.Match[str]) -> str:
    char = ord(found[0])
    return f"\\x{char:02x}" if char < 0x100 else f"\\u{char:04x}"


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def endpoint(directory: Path, host: str, port: int) -> Endpoint:
    """Serves ``/metrics`` from ``directory`` on ``host:port`` in whichever process binds first."""

    def metrics() -> Response:
        return 200, "text/plain; version=0.0.4; charset=utf-8", render(directory).encode()

    return Endpoint("metrics", host, port, {"/metrics": metrics, "/": metrics})
