"""What the dashboard's pages show, read from Redis (and PostgreSQL for the outbox).

Every read is bounded by the number of queues, workers and entries, or by the
page asked for, never by how many messages there are: the queues come from the
set the consumers record (``<ns>:gp:queues``), each queue's counts are O(1)
commands (``LLEN``, ``HLEN``, ``ZCARD``) sent in one pipeline, and nothing scans
the keyspace. An overview is four round trips, a page of dead letters three.
"""

from __future__ import annotations

import reprlib
from dataclasses import dataclass
from typing import Any

import redis

from .. import keys
from ..brokers.kinds import view_for
from ..brokers.view import FILTERED, DeadLetter, QueueView
from ..health import recorded
from ..records import json_object, moment, text, unreadable
from ..scheduler.dynamic import Schedules
from ..scheduler.status import paused_by, scheduler_status
from ..scheduler.targets import Target, published
from ..settings import Settings
from ..status import LIVE_MS, outbox_status

#: Minutes of throughput the overview shows.
MINUTES = 15
#: Dead letters and failures per page.
PAGE = 50


#: What a worker process records (see ``KitBroker.register_consumer``): the type of each field.
WORKER_FIELDS = {"host": str, "pid": int, "started_ms": int, "queues": list, "weights": dict}


def _worker(broker_id: Any, beat_ms: int, record: Any) -> dict[str, Any]:
    """A worker process as the overview shows it: a record, or a field, of another shape (written by hand, by
    another version) is marked in its place."""
    worker = {
        "id": text(broker_id),
        "beat_ms": beat_ms,
        "host": None,
        "pid": None,
        "started_ms": None,
        "queues": [],
        "weights": None,
        "strict": False,
    }
    recorded = json_object(record) if record is not None else {}
    if isinstance(recorded, str):
        return {**worker, "host": recorded}
    for field, kind in WORKER_FIELDS.items():
        value = recorded.get(field)
        if value is not None:
            # bool is an int to isinstance, not to a reader of pids
            readable = isinstance(value, kind) and not isinstance(value, bool)
            worker[field] = value if readable else unreadable(f"{field}={reprlib.repr(value)}")
    worker["strict"] = bool(recorded.get("strict"))
    return worker


def _count(value: Any) -> int | None:
    try:
        return int(value)
    except ValueError:
        return None


@dataclass
class Reader:
    """The reads behind each page, for one deployment's settings."""

    settings: Settings
    client: redis.Redis
    engine: Any = None  #: the outbox's database; None when ``DB_*`` is not set
    #: The queues, wherever the settings put them; default the view :func:`~dramatiq_gp.brokers.kinds.view_for` picks.
    queue_view: QueueView = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.queue_view is None:
            self.queue_view = view_for(self.settings, self.client)

    @property
    def namespace(self) -> str:
        return self.settings.redis.namespace

    @property
    def scheduler_keys(self) -> keys.SchedulerKeys:
        return keys.SchedulerKeys(self.settings.scheduler.namespace or self.namespace)

    @property
    def pii(self) -> bool:
        return self.settings.sentry.send_default_pii

    @property
    def schedules(self) -> Schedules:
        """The entries stored at run time, in the scheduler's namespace; with no code here, their targets are
        checked against those the workers publish as schedulable."""
        return Schedules(self.client, self.scheduler_keys.namespace, timezone=self.settings.scheduler.timezone)

    def targets(self) -> list[Target]:
        """What the workers publish as schedulable, by kind and name: what the form may store."""
        return sorted(published(self.client, self.scheduler_keys).values(), key=lambda t: (t.kind, t.name))

    def queues(self) -> list[dict[str, Any]]:
        """Per queue the workers recorded: ready, in flight, delayed and dead (on RabbitMQ, consumers too)."""
        return self.queue_view.counts()

    def throughput(self, now_ms: int) -> dict[str, Any]:
        """Messages settled per minute over the last :data:`MINUTES`: per queue, and in all."""
        minutes = list(range(now_ms // 60_000 - MINUTES + 1, now_ms // 60_000 + 1))
        with self.client.pipeline(transaction=False) as pipe:
            for minute in minutes:
                pipe.hgetall(keys.throughput(self.namespace, minute))
            counted = pipe.execute()
        per_queue: dict[str, dict[str, int]] = {}
        total = []
        for counts in counted:
            row = {"done": 0, "retried": 0, "dead": 0}
            for field, n in counts.items():
                queue, _, kind = text(field).rpartition(":")
                settled = _count(n)
                # Only what workers count is drawn: a field of another kind, or a count that is no whole number
                # (written by hand, by another version), is passed over.
                if kind not in row or settled is None:
                    continue
                row[kind] += settled
                per_queue.setdefault(queue, {"done": 0, "retried": 0, "dead": 0})[kind] += settled
            total.append(row)
        peak = max([1, *(row["done"] + row["retried"] + row["dead"] for row in total)])
        return {"minutes": [m * 60_000 for m in minutes], "total": total, "per_queue": per_queue, "peak": peak}

    def workers(self, now_ms: int) -> list[dict[str, Any]]:
        """The worker processes with a heartbeat in the last :data:`~dramatiq_gp.status.LIVE_MS`, with what they
        recorded and their health (:func:`~dramatiq_gp.health.recorded`)."""
        with self.client.pipeline(transaction=False) as pipe:
            pipe.zrangebyscore(keys.heartbeats(self.namespace), now_ms - LIVE_MS, "+inf", withscores=True)
            pipe.hgetall(keys.workers(self.namespace))
            pipe.hgetall(keys.health(self.namespace))
            beats, records, healths = pipe.execute()
        interval_ms = self.settings.worker.health_interval.total_seconds() * 1000
        workers = []
        for broker_id, beat in beats:
            worker = _worker(broker_id, int(beat), records.get(broker_id))
            health = healths.get(broker_id)
            # None: a process of a version that records no health
            worker["health"] = recorded(health, now_ms, interval_ms) if health is not None else None
            workers.append(worker)
        return sorted(workers, key=lambda w: (str(w["host"]), w["pid"] if isinstance(w["pid"], int) else 0))

    def overview(self, now_ms: int) -> dict[str, Any]:
        workers = self.workers(now_ms)
        weights: dict[str, Any] = {}
        for worker in workers:
            for queue, weight in (worker["weights"] if isinstance(worker["weights"], dict) else {}).items():
                weights.setdefault(queue, {"weight": weight, "strict": worker["strict"]})
        return {
            "queues": self.queues(),
            "weights": weights,
            "throughput": self.throughput(now_ms),
            "workers": workers,
        }

    def scheduler(self) -> dict[str, Any]:
        return scheduler_status(self.client, self.scheduler_keys)

    def stored(self, prefix: str, after: str | None, limit: int = PAGE) -> dict[str, Any]:
        """One page of the stored entries whose name starts with ``prefix``, by name, after the name ``after``;
        how many are stored in all, and whether there is a next page. Three round trips however many there are;
        a payload or arguments as ``[Filtered]`` unless PII display is on, as a dead letter's."""
        schedules = self.schedules
        page = schedules.list(prefix, limit=limit + 1, after=after)
        more, page = len(page) > limit, page[:limit]
        with self.client.pipeline(transaction=False) as pipe:
            pipe.hlen(self.scheduler_keys.dynamic)
            if page:
                pipe.hmget(self.scheduler_keys.paused, [e.name for e in page])
            total, *pauses = pipe.execute()
        paused = pauses[0] if pauses else []
        entries = [
            {
                "name": e.name,
                "trigger": e.trigger,
                "zone": e.zone,
                "kind": e.kind,
                "target": e.target,
                "data": e.data if self.pii else FILTERED,
                "queue": e.queue,
                "next_fire": e.next_fire.isoformat() if e.next_fire else None,
                "paused": paused_by(p) if p is not None else None,
            }
            for e, p in zip(page, paused, strict=True)
        ]
        return {"entries": entries, "total": total, "more": more}

    def outbox(self, limit: int = PAGE) -> dict[str, Any] | None:
        """The backlog, the oldest pending event's age (the relays' lag) and the events set aside."""
        if self.engine is None:
            return None
        from ..outbox import failed_events

        status = outbox_status(self.engine)
        with self.engine.connect() as conn:
            status["failed"] = failed_events(conn, limit=limit)
        return status

    def dead_letters(self, queue: str, offset: int, limit: int = PAGE) -> tuple[int, list[DeadLetter]]:
        letters = self.queue_view.dead_letters(queue, offset=offset, limit=limit, pii=self.pii)
        return self.queue_view.dead_count(queue), letters

    def dead_letter(self, queue: str, id: str) -> DeadLetter | None:
        return self.queue_view.dead_letter(queue, id, pii=self.pii)

    def failures(self, limit: int = 100) -> list[dict[str, Any]]:
        return [_failure(item) for item in self.client.lrange(keys.failures(self.namespace), 0, limit - 1)]


def _failure(record: bytes | str) -> dict[str, Any]:
    """A failed attempt as the page shows it: a record that is not a JSON object shows its mark as its error, a
    time that is none as its time."""
    failure = json_object(record)
    if isinstance(failure, str):
        return {"error": failure}
    return {**failure, "at_ms": moment(failure.get("at_ms"), "at_ms")}
