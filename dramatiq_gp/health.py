"""Whether a worker process is alive and ready, judged in the process and kept where a probe can read it.

Two states, as an orchestrator's two probes ask them:

* **alive**: its worker and consumer threads run, and no task has run past its
  time limit by more than :data:`WEDGED_AFTER_S` (Dramatiq's ``TimeLimit`` raises in
  the thread at the limit; a thread still busy well after that is stuck where an
  exception cannot reach it, and only a restart frees it). Redis being down does
  not make a process dead: a restart would not bring it back.
* **ready**: booted, Redis/Valkey, the broker and the database answer, every
  health check of the application passes, and it is not draining: readiness goes
  false the moment the stop signal arrives.

Each worker process runs its checks on a thread of its own every
``WORKER_HEALTH_INTERVAL`` (a check that hangs is reported as hanging, and never
blocks a probe), and writes its report to ``<dir>/<pid>.json``, in the directory of
its ``dramatiq -p N`` group (:mod:`dramatiq_gp.groupdir`: private to the user, one per
group and namespace). ``dramatiq-gp health`` (an exec probe) reads the directories of
every group of the namespace on the machine (or of the one it is given), and the
``/livez`` and ``/readyz`` routes (``WORKER_HEALTH_PORT``, served by one process of
the group) read their group's, so they answer for every process of the group and
need no network. A report older than :data:`STALE_INTERVALS` intervals means
its process has stopped reporting: it counts as not alive. Each process also
records its report in Redis (``<ns>:gp:health``), for the exporter and the dashboard.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

import redis

from . import groupdir, keys
from .endpoint import Endpoint, Response

logger = logging.getLogger(__name__)

#: A health check: healthy when it returns anything but ``False`` without raising (the seed's ``HealthCheckFunc``).
HealthCheck = Callable[[], object]

#: How long past its time limit a task may still run before its thread counts as wedged.
WEDGED_AFTER_S = 10.0
#: A report this many intervals old means its process stopped reporting (frozen, or its health thread died).
STALE_INTERVALS = 3
#: How long a stop waits for a health check still running (one that hangs is left behind).
STOP_WAIT_S = 1.0
#: How much of a failing check's error a report keeps.
ERROR_CHARS = 200


#: What a directory of health reports is called in :mod:`dramatiq_gp.groupdir`.
KIND = "health"


@dataclass
class Report:
    """One worker process's health, as it writes it."""

    pid: int
    host: str
    alive: bool
    ready: bool
    #: Why it is not alive or not ready, one line each (``booting``, ``draining``, ``redis: Error 111 ...``).
    failing: list[str]
    at_ms: int
    interval_ms: int

    def stale(self, now_ms: int) -> bool:
        return _stale(self.at_ms, self.interval_ms, now_ms)


def _stale(at_ms: float, interval_ms: float, now_ms: int) -> bool:
    """Whether a report made at ``at_ms`` by a process reporting every ``interval_ms`` says it stopped reporting."""
    return now_ms - at_ms > STALE_INTERVALS * interval_ms


@dataclass
class Verdict:
    """What a probe answers for every worker process of the container."""

    alive: bool
    ready: bool
    reports: list[Report] = field(default_factory=list)
    #: Why not, one line per process that is not alive (or, for readiness, not ready).
    why: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "alive": self.alive,
            "ready": self.ready,
            "why": self.why,
            "processes": [asdict(r) for r in self.reports],
        }


def read(directories: Iterable[Path], now_ms: int | None = None, *, where: str = "") -> Verdict:
    """The health of the live worker processes reporting in ``directories``; no process reporting is neither,
    and says it looked ``where`` (by default, the directories)."""
    now_ms = now_ms if now_ms is not None else int(time.time() * 1000)
    directories = list(directories)
    reports = []
    for path in sorted(p for directory in directories for p in directory.glob("*.json")):
        if not path.stem.isdigit() or not groupdir.alive(int(path.stem)):
            continue  # its process is gone (the dramatiq parent ends the group when a child dies)
        try:
            reports.append(Report(**json.loads(groupdir.read(path))))
        except (OSError, ValueError, TypeError):
            continue  # being replaced right now
    if not reports:
        where = where or ", ".join(map(str, directories)) or "no directory"
        return Verdict(False, False, [], [f"no worker process has reported in {where}"])
    dead, unready = [], []
    for report in reports:
        if report.stale(now_ms):
            dead.append(f"pid {report.pid}: no report for {(now_ms - report.at_ms) / 1000:.0f} s")
        elif not report.alive:
            dead.append(f"pid {report.pid}: {'; '.join(report.failing)}")
        elif not report.ready:
            unready.append(f"pid {report.pid}: {'; '.join(report.failing)}")
    return Verdict(not dead, not dead and not unready, reports, dead + unready)


@dataclass
class Recorded:
    """A worker process's health as another process reads it from Redis (the exporter, the dashboard)."""

    alive: bool
    ready: bool
    failing: list[str]
    host: str | None
    pid: int | None


def recorded(raw: bytes | str, now_ms: int, interval_ms: float) -> Recorded:
    """The record ``raw`` of ``<ns>:gp:health``, judged now: one older than :data:`STALE_INTERVALS` of the
    interval its process reports at (``interval_ms`` if it does not say) is a process that stopped judging
    itself, neither alive nor ready; one that cannot be read is neither either."""
    try:
        record = json.loads(raw)
    except ValueError:
        record = None
    if not isinstance(record, dict):
        return Recorded(False, False, ["unreadable health record"], None, None)
    at, every = record.get("at_ms"), record.get("interval_ms")
    every = every if _number(every) else interval_ms
    host, pid = record.get("host"), record.get("pid")
    failing = record.get("failing")
    failing = [str(reason) for reason in failing] if isinstance(failing, list) else []
    if not _number(at) or _stale(at, every, now_ms):
        return Recorded(False, False, ["no report for a while"], host, pid)
    return Recorded(record.get("alive") is True, record.get("ready") is True, failing, host, pid)


def _number(value: object) -> TypeGuard[float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def routes(directory: Path) -> dict[str, Callable[[], Response]]:
    """``/livez`` and ``/readyz``: 200 when every process of the group is alive (ready), else 503; JSON."""

    def answer(state: str) -> Callable[[], Response]:
        def route() -> Response:
            verdict = read([directory])
            ok = verdict.alive if state == "alive" else verdict.ready
            return 200 if ok else 503, "application/json", json.dumps(verdict.as_dict()).encode()

        return route

    return {"/livez": answer("alive"), "/readyz": answer("ready")}


class Monitor:
    """Judges this worker process's health every ``interval_s`` and reports it (file, Redis, endpoint).

    Parameters:
        namespace: whose group directory and Redis hash the report goes to.
        interval_s: ``WORKER_HEALTH_INTERVAL``.
        checks: named checks, run in order every interval on one thread: the kit's (Redis,
            the broker, the database) and the application's.
        client: where the report is also recorded (``<ns>:gp:health``), under ``broker_id``.
        port: serve ``/livez`` and ``/readyz`` there (``WORKER_HEALTH_PORT``), on ``host``.
    """

    def __init__(
        self,
        *,
        namespace: str,
        interval_s: float,
        checks: Iterable[tuple[str, HealthCheck]] = (),
        client: redis.Redis | None = None,
        broker_id: str = "",
        port: int | None = None,
        host: str = "0.0.0.0",
    ) -> None:
        self.namespace, self.interval_s = namespace, interval_s
        self.liveness: Callable[[], list[str]] = list
        self.checks = list(checks)
        self.client, self.broker_id = client, broker_id
        self.port, self.host = port, host
        #: This process's group's directory of reports, made (or checked) by :meth:`booting`.
        self.directory = groupdir.root() / groupdir.name(KIND, namespace, groupdir.group())
        self.path = self.directory / f"{os.getpid()}.json"
        self._endpoint: Endpoint | None = None
        self._made = False  # the directory is made and checked: this process may remove its file there
        self._booted = False
        self._draining = False
        self._failing: list[str] = []
        self._round_started: float | None = None
        self._running: str = ""
        self._unrecorded = False
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def booting(self) -> None:
        """Report alive and not yet ready, so a liveness probe passes while the process boots.

        Raises:
            UnsafeDirectory: the group's directory, or the user's one holding it, is not the user's alone.
        """
        self.directory = groupdir.group_dir(KIND, self.namespace)
        self._made = True
        groupdir.forget_dead_groups(KIND)
        groupdir.forget_the_dead(self.directory)
        self._write(self._report())
        if self.port:
            self._endpoint = Endpoint("health", self.host, self.port, routes(self.directory))
            self._endpoint.start()

    def start(self, liveness: Callable[[], list[str]]) -> None:
        """The process has booted: check and report every interval from now on.

        ``liveness`` returns why the process is not alive (stuck threads), nothing when it is.
        """
        self.liveness = liveness
        self._booted = True
        # Two threads: a check that hangs must not stop the reports that say it hangs.
        for target, name in (
            (self._check_every_interval, "gp-health-checks"),
            (self._report_every_interval, "gp-health"),
        ):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def draining(self) -> None:
        """Not ready from now on: reported at once (a probe reads the file), and in Redis on the next round."""
        self._draining = True
        self._write(self._report())

    def stop(self) -> None:
        """The process is about to exit: stop reporting and take its report away."""
        self._stop.set()
        # The last round ends first: a record written after the HDEL below would outlive the process, and a
        # database check still holding a connection when the closers dispose of the engine leaks it.
        for thread in self._threads:
            thread.join(STOP_WAIT_S)
        if self._endpoint is not None:
            self._endpoint.close()
        if self._made:
            self.path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # not empty: another process of the group still reports there
                self.directory.rmdir()
        if self.client is not None:
            try:
                self.client.hdel(keys.health(self.namespace), self.broker_id)
            except redis.RedisError as exc:
                logger.warning("could not remove this worker's health record from Redis: %s", exc)

    def _report(self) -> Report:
        dead = self.liveness() if self._booted and not self._draining else []
        failing = list(dead)
        if not self._booted:
            failing.append("booting")
        elif self._draining:
            failing.append("draining")
        else:
            failing.extend(self._failing)
            started = self._round_started
            if started is not None and time.monotonic() - started > 2 * self.interval_s:
                failing.append(f"health check {self._running} running for {time.monotonic() - started:.0f} s")
        return Report(
            pid=os.getpid(),
            host=socket.gethostname(),
            alive=not dead,
            ready=not failing,
            failing=failing,
            at_ms=int(time.time() * 1000),
            interval_ms=int(self.interval_s * 1000),
        )

    def _write(self, report: Report) -> None:
        with self._lock:  # the drain's write and the thread's must not interleave on the temporary file
            try:
                # Again each time: the last process of a group to stop removes it, as another may be starting.
                groupdir.private(self.directory)
                groupdir.write(self.path, json.dumps(asdict(report)).encode())
            except OSError as exc:
                logger.warning("could not write this worker's health report %s: %s", self.path, exc)

    def _report_every_interval(self) -> None:
        while True:
            try:
                self._write(self._report())
            except Exception:
                logger.exception("could not judge this worker's health")
            if self._stop.wait(self.interval_s):
                return

    def _check_every_interval(self) -> None:
        while True:
            started = time.monotonic()
            self._round_started = started
            failing = []
            for name, check in self.checks:
                self._running = name
                try:
                    healthy = check() is not False
                    error = "" if healthy else "failed"
                except Exception as exc:  # a check's failure is its verdict, reported, not raised
                    error = " ".join(str(exc).split())[:ERROR_CHARS] or type(exc).__name__
                if error:
                    failing.append(f"{name}: {error}")
            self._failing, self._round_started = failing, None
            self._record()
            if self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - started))):
                return

    def _record(self) -> None:
        if self.client is None:
            return
        report = self._report()
        try:
            self.client.hset(keys.health(self.namespace), self.broker_id, json.dumps(asdict(report)))
        except redis.RedisError as exc:
            # Once per outage: the report a probe reads says "redis: ..." every round.
            if not self._unrecorded:
                logger.warning("could not record this worker's health in Redis: %s", exc)
            self._unrecorded = True
        else:
            self._unrecorded = False
