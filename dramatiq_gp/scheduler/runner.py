"""The schedule runner: fires the schedule's ticks while this process holds the lease.

The leader only enqueues (``job:<name>`` or ``schedule:<event>``); any worker runs
what it enqueued, under the usual queues and retries.

Firing a tick is one Lua call that, atomically,

1. checks the lease still holds this leader's ``<epoch>/<token>`` (an old leader
   waking from a pause finds another value and fires nothing);
2. claims the tick (``SET NX`` on ``<ns>:scheduler:tick:<entry>:<ms>``) and checks
   it is after the entry's last fired tick;
3. pushes the message onto its queue, under an id derived from the tick, and
   records the tick as the entry's last fired.

So no tick is enqueued twice, and none is claimed without being enqueued. A new
leader reads the last fired tick of each entry and fires the ticks missed during
the takeover under ``SCHEDULER_CATCHUP``: ``none``, ``latest`` (default: the most
recent one within ``SCHEDULER_CATCHUP_GRACE``) or ``all`` (every one within the
grace, up to ``SCHEDULER_CATCHUP_MAX``). It keeps nothing in memory across
leaderships; the timer is a plain loop that sleeps until the next tick.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from datetime import UTC, datetime
from typing import Any

import redis
from dramatiq import Actor, Message
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.metrics import Observation

from .. import keys
from ..brokers.redis import RedisBroker
from ..lua import scripts
from ..metrics import instruments, observe
from ..names import tick_message_id
from ..registry import Registry, idempotent_option, send_all
from ..settings import SchedulerSettings
from ..status import scheduler_status
from .lease import Lease
from .schedule import Entry, Schedule

_SCRIPTS = scripts(__file__)


#: A tick's claim key outlives the catch-up grace by this much (older ticks never fire).
TICK_KEY_MARGIN_MS = 60_000
#: The timer never sleeps longer than this, so it notices leadership changes and stops.
MAX_SLEEP_S = 0.25


def _ms(instant: datetime) -> int:
    return round(instant.timestamp() * 1000)


class Runner:
    """Contends for the lease and, while leading, fires the schedule.

    Parameters:
        schedule: the entries.
        broker: where firings are enqueued (the kit's broker).
        registry: the listeners scheduled events fan out to.
        settings: ``SCHEDULER_*``.
        namespace: the scheduler's key prefix.
        tracer_provider: where each firing's root span goes; ``None`` means the global provider.
    """

    name = "schedule runner"

    def __init__(
        self,
        *,
        schedule: Schedule,
        broker: RedisBroker,
        registry: Registry,
        settings: SchedulerSettings,
        namespace: str,
        tracer_provider: trace.TracerProvider | None = None,
    ) -> None:
        self.logger = logging.getLogger(f"{__name__}.{type(self).__name__}")
        self.schedule, self.broker, self.registry, self.settings = schedule, broker, registry, settings
        self.keys = keys.SchedulerKeys(namespace)
        self.covered_key = self.keys.last_fired
        self.lease = Lease(broker.client, self.keys, settings.lease_ttl.total_seconds(), self._leadership_changed)
        self._fire_script = broker.client.register_script(_SCRIPTS["fire"])
        self._tick_ttl_ms = int(settings.catchup_grace.total_seconds() * 1000) + TICK_KEY_MARGIN_MS
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._next: dict[str, datetime] = {}
        self.tracer = trace.get_tracer("dramatiq_gp", tracer_provider=tracer_provider)
        self._declare_actors()
        observe("dramatiq_gp.scheduler.leader", "1", "1 in the process that holds the scheduler lease, else 0",
                lambda: [Observation(1 if self.lease.is_held() else 0, {"namespace": namespace})])  # fmt: skip

    # -- lifecycle -----------------------------------------------------------------

    def start(self) -> None:
        self._stop.clear()
        # Published for ``dramatiq-gp status``, which reads Redis, not the application.
        self.broker.client.hset(
            self.keys.entries,
            mapping={entry.name: f"{entry.spec.text}|{entry.zone.key}" for entry in self.schedule},
        )
        self.lease.start()
        self._thread = threading.Thread(target=self._run, name="gp-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop firing and release the lease at once."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(5)
        self.lease.stop()

    def status(self) -> dict[str, Any]:
        """What ``dramatiq-gp status`` shows of this scheduler, and whether this process leads."""
        return {**scheduler_status(self.broker.client, self.keys), "this_process_leads": self.lease.is_held()}

    # -- actors --------------------------------------------------------------------

    def _declare_actors(self) -> None:
        broker, idempotent = self.broker, idempotent_option(self.broker)
        for entry in self.schedule:
            broker.declare_queue(entry.queue)
            if entry.actor_name in broker.actors:
                continue
            if entry.handler is not None:
                Actor(
                    _job_fn(entry),
                    broker=broker,
                    actor_name=entry.actor_name,
                    queue_name=entry.queue,
                    priority=0,
                    options={**idempotent, **entry.options},
                )
            else:
                Actor(_fan_out_fn(self.registry, broker), broker=broker, actor_name=entry.actor_name,
                      queue_name=entry.queue, priority=0, options=idempotent)  # fmt: skip

    # -- the timer -----------------------------------------------------------------

    def _leadership_changed(self, leading: bool) -> None:
        self._wake.set()

    def _run(self) -> None:
        leading_epoch = None
        while not self._stop.is_set():
            self._wake.clear()
            try:
                if not self.lease.is_held():
                    leading_epoch = None
                    self._wake.wait(MAX_SLEEP_S)
                    continue
                if leading_epoch != self.lease.epoch:
                    self._take_over()
                    leading_epoch = self.lease.epoch
                self._fire_due()
            except redis.RedisError as exc:
                self.logger.warning("schedule runner: Redis error, retrying: %s", exc)
                leading_epoch = None  # look at the last fired ticks again
                self._stop.wait(1)

    def _fire_due(self) -> None:
        now = datetime.now(UTC)
        due = sorted((tick, name) for name, tick in self._next.items() if tick <= now)
        entries = {entry.name: entry for entry in self.schedule}
        for tick, name in due:
            if not self._fire(entries[name], tick):
                return
            self._next[name] = entries[name].next_after(tick)
        if not due:
            sleep = (min(self._next.values()) - datetime.now(UTC)).total_seconds()
            self._wake.wait(min(max(sleep, 0.0), MAX_SLEEP_S))

    def _take_over(self) -> None:
        """Pick up where the last leader stopped, firing missed ticks under the catch-up policy."""
        now = datetime.now(UTC)
        last = {_text(k): int(v) for k, v in self.broker.client.hgetall(self.covered_key).items()}
        policy, grace = self.settings.catchup, self.settings.catchup_grace
        self._next = {}
        for entry in self.schedule:
            if entry.name not in last:
                # A new entry starts now; recording that keeps the next leader from
                # treating the time before it as missed.
                self.broker.client.hsetnx(self.covered_key, entry.name, _ms(now))
                self._next[entry.name] = entry.next_after(now)
                continue
            since = max(datetime.fromtimestamp(last[entry.name] / 1000, UTC), now - grace)
            missed, skipped = [], 0
            tick = entry.next_after(since)
            while tick <= now:
                missed.append(tick)
                if len(missed) > self.settings.catchup_max:
                    missed.pop(0)
                    skipped += 1
                tick = entry.next_after(tick)
            chosen = {"none": [], "latest": missed[-1:], "all": missed}[policy]
            skipped += len(missed) - len(chosen)
            if skipped:
                self.logger.warning(
                    "schedule runner: %s: %d missed tick(s) not fired (SCHEDULER_CATCHUP=%s)",
                    entry.name,
                    skipped,
                    policy,
                )
            for tick in chosen:
                if not self._fire(entry, tick, catching_up=True):
                    return
            self._next[entry.name] = entry.next_after(now)

    def _fire(self, entry: Entry, tick: datetime, *, catching_up: bool = False) -> bool:
        """Enqueue ``entry``'s ``tick``; False when this process turns out not to lead."""
        if not self.lease.is_held() or self.lease.value is None:
            return False
        # Each firing starts a trace of its own, named after the entry.
        with self.tracer.start_as_current_span(
            f"schedule {entry.name}", context=Context(),
            attributes={"dramatiq_gp.schedule.entry": entry.name, "dramatiq_gp.schedule.tick": tick.isoformat(),
                        "dramatiq_gp.schedule.catch_up": catching_up},
        ) as span:  # fmt: skip
            result = self._enqueue_tick(entry, tick)
            outcome = {1: "fired", 0: "deduplicated"}.get(result, "lease lost")
            span.set_attribute("dramatiq_gp.schedule.outcome", outcome)
        if result == -1:
            self.logger.warning("schedule runner: %s not fired: this process no longer holds the lease", entry.name)
            # Until the next renewal (up to a third of the TTL away) the timer would try again at once, in a loop.
            self.lease.lose("a firing found it taken or gone")
            return False
        if outcome == "fired" and catching_up:
            outcome = "caught_up"
        instruments().scheduler_ticks.add(1, {"entry": entry.name, "outcome": outcome})
        if result == 1:
            lateness_ms = (datetime.now(UTC) - tick).total_seconds() * 1000
            self.logger.info(
                "schedule runner: fired %s scheduled_at=%s lateness_ms=%.0f%s",
                entry.name, tick.astimezone(entry.zone).isoformat(), lateness_ms, " (catch-up)" if catching_up else "",
            )  # fmt: skip
        return True

    def _enqueue_tick(self, entry: Entry, tick: datetime) -> int:
        """1: enqueued; 0: this tick was fired already; -1: the lease is lost."""
        message = self._message(entry, tick)
        redis_id = str(uuid.uuid4())
        message = message.copy(options={"redis_message_id": redis_id})
        self.broker.emit_before("enqueue", message, None)
        ns, queue = self.broker.namespace, entry.queue
        assert self.lease.value is not None
        try:
            result = int(self._fire_script(
                keys=[self.lease.key, self.keys.tick(entry.name, _ms(tick)), self.covered_key,
                      keys.queue(ns, queue), keys.messages(ns, queue)],
                args=[self.lease.value, self._tick_ttl_ms, entry.name, _ms(tick), redis_id, message.encode()],
            ))  # fmt: skip
        except BaseException as exc:
            self.broker.send_failed(message, exc)
            raise
        if result == 1:
            self.broker.emit_after("enqueue", message, None)
        else:
            self.broker.send_failed(message, None)
        return result

    def _message(self, entry: Entry, tick: datetime) -> Message[Any]:
        message_id = tick_message_id(entry.name, tick)
        firing: dict[str, Any] = {"entry": entry.name, "scheduled_at": tick.astimezone(entry.zone).isoformat()}
        if entry.event is not None:
            firing.update(id=message_id, event=entry.event.name, data=entry.payload)
        return Message(
            queue_name=entry.queue,
            actor_name=entry.actor_name,
            args=(firing,),
            kwargs={},
            options=dict(entry.options),
            message_id=message_id,
            message_timestamp=int(time.time() * 1000),
        )


def _fan_out_fn(registry: Registry, broker: RedisBroker) -> Any:
    def fan_out(firing: dict[str, Any]) -> None:
        # The firing's own message id is the envelope id: every firing is a new
        # dispatch, and a retry of one firing fans out to the same message ids.
        send_all(broker, registry.messages_for(firing))

    return fan_out


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _job_fn(entry: Entry) -> Any:
    handler, takes_time = entry.handler, entry.takes_time
    assert handler is not None

    def run(firing: dict[str, Any]) -> None:
        if takes_time:
            handler(datetime.fromisoformat(firing["scheduled_at"]))
        else:
            handler()

    run.__module__ = getattr(handler, "__module__", None) or __name__
    run.__name__ = run.__qualname__ = entry.name
    return run
