"""``dramatiq-gp exporter``: the deployment's queues, outbox, scheduler and workers as Prometheus metrics.

The worker processes export what each of them does (:mod:`dramatiq_gp.prometheus`);
what the deployment holds (messages waiting in each queue, the outbox's backlog,
whether a scheduler leads) is the same whoever reads it, so one exporter reads it
for all, and a sum over its series counts each message once. KEDA, an HPA or an
alert rule read these names; they differ from the workers' own on purpose.

Each scrape reads afresh what the dashboard reads, through the same seams (the
broker kind's :class:`~dramatiq_gp.brokers.view.QueueView`,
:func:`~dramatiq_gp.scheduler.status.scheduler_status`,
:func:`~dramatiq_gp.status.outbox_status`), bounded by the number of queues,
workers and entries, never by the messages: no keyspace scan. The queues are the
names the workers recorded in ``<ns>:gp:queues``, which anyone who may write to
Redis can add to: a name off the queue-name grammar is left out, and a scrape reads
at most :data:`MAX_QUEUES` of them (``dramatiq_gp_exporter_queues_left_out`` counts
what it left). It needs none of the
dashboard's web packages. A source that cannot be read (Redis/Valkey, RabbitMQ, PostgreSQL)
is ``dramatiq_gp_exporter_source_up 0`` and its series are left out; the others
still serve. Only two things are remembered between scrapes, as no single read
tells them: since when no scheduler has held the lease, and since when a RabbitMQ
queue no worker has yet received from has had messages ready.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any, cast

import redis
import sqlalchemy as sa

from . import keys
from .brokers.kinds import view_for
from .brokers.view import is_queue_name
from .endpoint import Response
from .health import recorded
from .prometheus import exposition
from .records import text
from .scheduler.status import scheduler_status
from .settings import Settings
from .status import LIVE_MS, outbox_status

logger = logging.getLogger(__name__)

#: The most queues one scrape reads and counts: ``<ns>:gp:queues`` is a set anyone who may write to Redis can fill.
MAX_QUEUES = 1000
#: The most worker processes one scrape reads the health of (their heartbeats, too, are anyone's to write).
MAX_WORKERS = 1000

#: Every metric the exporter serves: name → (Prometheus type, help). Alert rules and dashboards use these names.
METRICS: dict[str, tuple[str, str]] = {
    "dramatiq_gp_queue_messages": (
        "gauge",
        "Messages in a queue, by state: ready, delayed, in_flight, dead.",
    ),
    "dramatiq_gp_queue_oldest_ready_age_seconds": (
        "gauge",
        "Age of the oldest ready message in a queue, since it became due (0 when none is ready).",
    ),
    "dramatiq_gp_outbox_pending_events": ("gauge", "Outbox rows due and not yet relayed."),
    "dramatiq_gp_outbox_lag_seconds": ("gauge", "How long the oldest pending outbox row has been due (0 when none)."),
    "dramatiq_gp_outbox_scheduled_events": ("gauge", "Delayed outbox rows not yet due."),
    "dramatiq_gp_outbox_set_aside_events": ("gauge", "Outbox rows set aside after failing to relay."),
    "dramatiq_gp_scheduler_leader_present": ("gauge", "1 when a scheduler holds the leader lease, else 0."),
    "dramatiq_gp_scheduler_leaderless_seconds": (
        "gauge",
        "How long no scheduler has held the lease, as far as this exporter has seen (0 while one does).",
    ),
    "dramatiq_gp_scheduler_lease_ttl_seconds": ("gauge", "The scheduler's lease time to live (SCHEDULER_LEASE_TTL)."),
    "dramatiq_gp_scheduler_stored_entries": ("gauge", "Schedule entries stored at run time (kit.schedules)."),
    "dramatiq_gp_scheduler_stored_overdue_seconds": (
        "gauge",
        "How long past its tick the earliest stored entry still waits to be fired (0 when none is due).",
    ),
    "dramatiq_gp_schedule_last_fire_timestamp_seconds": ("gauge", "When a schedule entry last fired (Unix time)."),
    "dramatiq_gp_schedule_paused": ("gauge", "1 when a schedule entry is paused, else 0."),
    "dramatiq_gp_worker_alive": ("gauge", "1 when a worker process reports itself alive, else 0."),
    "dramatiq_gp_worker_ready": ("gauge", "1 when a worker process reports itself ready, else 0."),
    "dramatiq_gp_exporter_queues_left_out": (
        "gauge",
        f"Names in <ns>:gp:queues not served: not queue names, or past the {MAX_QUEUES} one scrape reads.",
    ),
    "dramatiq_gp_exporter_source_up": (
        "gauge",
        "1 when the exporter could read a source (redis, rabbitmq, postgresql), else 0.",
    ),
}

#: A queue's states, as ``state`` labels, in :meth:`~dramatiq_gp.brokers.view.QueueView.counts`' keys.
STATES = ("ready", "delayed", "in_flight", "dead")

Labels = tuple[tuple[str, str], ...]
#: Metric name → label pairs → value.
Samples = dict[str, dict[Labels, float]]


class Exporter:
    """The metrics of one deployment's settings, read afresh on each :meth:`scrape`."""

    def __init__(self, settings: Settings, client: redis.Redis, engine: Any = None) -> None:
        self.settings, self.client, self.engine = settings, client, engine
        self.namespace = settings.redis.namespace
        self.queue_view = view_for(settings, client)
        self.scheduler_keys = keys.SchedulerKeys(settings.scheduler.namespace or self.namespace)
        self.system = "redis" if settings.rabbitmq.url is None else "rabbitmq"
        #: One scrape at a time: they share what is remembered below, and a scrape every few seconds never queues.
        self._lock = threading.Lock()
        #: RabbitMQ queue → when (ms) this exporter first saw it with messages ready and no worker's record.
        self._ready_seen: dict[str, int] = {}
        #: When (monotonic) this exporter first saw no leader, None while one leads.
        self._leaderless_since: float | None = None
        #: How many recorded names the last scrape left out, to log only a change.
        self._left_out = 0

    def scrape(self) -> Response:
        """The answer to ``GET /metrics``."""
        return 200, "text/plain; version=0.0.4; charset=utf-8", self.render().encode()

    def render(self) -> str:
        with self._lock:
            samples = self.collect(int(time.time() * 1000))
        families = {name: {"kind": kind, "help": help} for name, (kind, help) in METRICS.items() if name in samples}
        return exposition(families, samples)

    def collect(self, now_ms: int) -> Samples:
        """Metric name → label pairs → value; the series of a source that could not be read are left out."""
        samples: Samples = {}
        tried, down = ["redis"], self._read(samples, lambda into: self._redis(into, now_ms))
        if not down:
            # Both kinds name their queues in Redis/Valkey (``<ns>:gp:queues``): nothing to ask RabbitMQ without it.
            tried.append(self.system)
            down |= self._read(samples, lambda into: self._queues(into, now_ms))
        if self.engine is not None:
            tried.append("postgresql")
            down |= self._read(samples, self._outbox)
        for source in dict.fromkeys(tried):
            _gauge(samples, "dramatiq_gp_exporter_source_up", (("source", source),), int(source not in down))
        ttl = self.settings.scheduler.lease_ttl.total_seconds()
        _gauge(samples, "dramatiq_gp_scheduler_lease_ttl_seconds", (), ttl)
        return samples

    def _read(self, samples: Samples, read: Callable[[Samples], None]) -> set[str]:
        """Add what ``read`` finds to ``samples`` if it all succeeds; else the source that failed it, as a set."""
        into: Samples = {}
        try:
            read(into)
        except redis.RedisError:  # first: the RabbitMQ view reads Redis/Valkey too
            return {"redis"}
        except self.queue_view.unreachable:
            return {self.system}
        except sa.exc.SQLAlchemyError:
            return {"postgresql"}
        for name, values in into.items():
            samples.setdefault(name, {}).update(values)
        return set()

    def _redis(self, into: Samples, now_ms: int) -> None:
        """The scheduler and the workers' health, from Redis/Valkey."""
        scheduler = scheduler_status(self.client, self.scheduler_keys)
        if scheduler["leader"] is not None:
            self._leaderless_since = None
        elif self._leaderless_since is None:
            self._leaderless_since = time.monotonic()
        since = self._leaderless_since
        # A deployment without a schedule elects no leader (an empty schedule starts no election): no
        # leader is no fault there, and a series saying "leaderless" would only page someone.
        stored = scheduler["stored"]
        if scheduler["entries"] or stored["count"]:
            _gauge(into, "dramatiq_gp_scheduler_leader_present", (), int(since is None))
            leaderless = 0 if since is None else round(time.monotonic() - since, 3)
            _gauge(into, "dramatiq_gp_scheduler_leaderless_seconds", (), leaderless)
        if stored["count"]:
            # Stored entries are many (one per customer): their count and how far behind the earliest is, not a
            # series each.
            _gauge(into, "dramatiq_gp_scheduler_stored_entries", (), stored["count"])
            due_ms = stored["next_ms"][0] if stored["next_ms"] else now_ms
            _gauge(into, "dramatiq_gp_scheduler_stored_overdue_seconds", (), max(0, now_ms - due_ms) / 1000)
        for entry in scheduler["entries"]:
            labels = (("entry", entry["name"]),)
            _gauge(into, "dramatiq_gp_schedule_paused", labels, int(entry["paused"] is not None))
            fired = _timestamp(entry["last_fired"])
            if fired is not None:
                _gauge(into, "dramatiq_gp_schedule_last_fire_timestamp_seconds", labels, fired)
        self._workers(into, now_ms)

    def _workers(self, into: Samples, now_ms: int) -> None:
        """Each worker process with a heartbeat in the last :data:`~dramatiq_gp.status.LIVE_MS` (as the dashboard
        lists them) and a health record, judged by :func:`~dramatiq_gp.health.recorded` (a stale one is 0 for
        both). A process that stopped cleanly took its record away, and is not listed. At most
        :data:`MAX_WORKERS`, the most recent first."""
        heartbeats = keys.heartbeats(self.namespace)
        newest = self.client.zrevrangebyscore(heartbeats, "+inf", now_ms - LIVE_MS, start=0, num=MAX_WORKERS)
        live = cast(list[bytes], newest)
        records = self.client.hmget(keys.health(self.namespace), live) if live else []
        interval_ms = self.settings.worker.health_interval.total_seconds() * 1000
        for broker_id, raw in zip(live, records, strict=True):
            if raw is None:
                continue  # a process of a version that does not record its health
            health = recorded(raw, now_ms, interval_ms)
            worker = (("host", str(health.host)), ("pid", str(health.pid)), ("worker", text(broker_id)))
            _gauge(into, "dramatiq_gp_worker_alive", worker, int(health.alive))
            _gauge(into, "dramatiq_gp_worker_ready", worker, int(health.ready))

    def _queues(self, into: Samples, now_ms: int) -> None:
        """Each queue's counts by state, and the age of its oldest ready message.

        A count that cannot be known now (RabbitMQ, after an unconfirmed send) is left
        out. On RabbitMQ the age is an estimate
        (:meth:`~dramatiq_gp.brokers.rabbitmq_view.RabbitmqQueueView.ready_since`); before any
        worker received from a queue, it counts from when this exporter first saw the
        queue with messages ready.
        """
        view = self.queue_view
        counts = view.counts(self._queue_names(into))
        waiting = [row["name"] for row in counts if row["ready"]]
        since = view.ready_since(waiting) if waiting else {}
        for row in counts:
            queue = (("messaging_destination_name", row["name"]), ("messaging_system", self.system))
            for state in STATES:
                if row[state] is not None:
                    _gauge(into, "dramatiq_gp_queue_messages", (*queue, ("state", state)), row[state])
            if row["ready"] is None:
                continue
            ready_ms = since.get(row["name"])
            if row["ready"] and ready_ms is None:
                ready_ms = self._ready_seen.setdefault(row["name"], now_ms)
            else:
                self._ready_seen.pop(row["name"], None)
            age = max(now_ms - ready_ms, 0) / 1000 if row["ready"] and ready_ms is not None else 0
            _gauge(into, "dramatiq_gp_queue_oldest_ready_age_seconds", queue, age)
        for gone in self._ready_seen.keys() - {row["name"] for row in counts}:
            del self._ready_seen[gone]

    def _queue_names(self, into: Samples) -> list[str]:
        """The queues to count: at most :data:`MAX_QUEUES` of the names recorded, those of the queue-name grammar
        (:func:`~dramatiq_gp.brokers.view.is_queue_name`: no delay or dead-letter queue; none of Dramatiq's own)."""
        key = keys.declared_queues(self.namespace)
        recorded = self.client.scard(key)
        members = self.client.smembers(key) if recorded <= MAX_QUEUES else self.client.sscan_iter(key, count=100)
        names = sorted(
            name
            for name in (text(member) for member in itertools.islice(members, MAX_QUEUES))
            if is_queue_name(name) and not name.startswith("__")
        )
        left_out = recorded - len(names)
        _gauge(into, "dramatiq_gp_exporter_queues_left_out", (), left_out)
        changed, self._left_out = left_out != self._left_out, left_out
        if left_out and changed:
            logger.warning(
                "exporter: %d of the %d names in %s left out (not queue names, or past the %d a scrape reads)",
                left_out,
                recorded,
                key,
                MAX_QUEUES,
            )
        return names

    def _outbox(self, into: Samples) -> None:
        status = outbox_status(self.engine)
        _gauge(into, "dramatiq_gp_outbox_pending_events", (), status["pending"])
        _gauge(into, "dramatiq_gp_outbox_lag_seconds", (), status["oldest_pending_age_s"] or 0)
        _gauge(into, "dramatiq_gp_outbox_scheduled_events", (), status["scheduled"])
        _gauge(into, "dramatiq_gp_outbox_set_aside_events", (), status["set_aside"])


def _gauge(into: Samples, name: str, labels: Labels, value: float) -> None:
    into.setdefault(name, {})[tuple(sorted(labels))] = value


def _timestamp(fired: Any) -> float | None:
    """An entry's last fire (an ISO time in its zone) as Unix time; None when it never fired or is marked."""
    try:
        return datetime.fromisoformat(fired).timestamp() if isinstance(fired, str) else None
    except ValueError:
        return None
