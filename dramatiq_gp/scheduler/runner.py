"""The schedule runner: APScheduler is the timer, the lease gates it, and each tick fires once.

In every worker process an APScheduler 3 ``BackgroundScheduler`` holds one job per
schedule entry, with the entry's trigger (:mod:`dramatiq_gp.scheduler.triggers`).
It runs only while this process holds the lease (:mod:`dramatiq_gp.scheduler.lease`):
it starts paused, resumes once a takeover has caught up, and is paused the moment
the lease is lost or runs out without a confirmed renewal. Its jobs go to
:class:`TickExecutor`, which hands the scheduled run times to the runner: every
tick knows its own time.

The leader only enqueues (``job:<name>`` or ``schedule:<event>``); any worker runs
what it enqueued, under the usual queues and retries. Firing a tick is one Lua
call (``outlet/claim.lua``, run by the broker's :mod:`~dramatiq_gp.scheduler.outlet`)
that, atomically,

1. checks the lease still holds this leader's ``<epoch>/<token>`` (an old leader
   waking from a pause finds another value and fires nothing: ``lease_lost``);
2. claims the tick (``SET NX`` on ``<ns>:scheduler:tick:<entry>:<ms>``) and checks
   it is after the entry's last fired tick (else ``deduplicated``);
3. pushes the message onto its queue, under an id derived from the tick, and
   records the tick as the entry's last fired (``fired``).

So no tick is enqueued twice, and none is claimed without being enqueued. An
entry paused (``dramatiq-gp schedule pause``, ``<ns>:scheduler:paused``) is checked
in the same call: its tick is recorded as passed over and not enqueued (``paused``),
so it stops at its next tick, and resuming it does not catch up the ticks of the pause.

When the queues are not in that Redis (RabbitMQ: the broker's ``queues_in_client``
is False), the claim cannot enqueue: the same call keeps the tick's message in
``<ns>:scheduler:unpublished`` instead, the broker publishes it and waits for the
confirm, and only then is it removed. A leader publishes what it finds there
before anything else, at every takeover and after an error reaching either, so a claimed
tick whose publish failed, or whose leader died, is published late rather than
never; published twice (the confirm came, the removal did not), its two copies
carry the tick's message id, and idempotent execution runs one. The runner does not
know which of the two it fires through: the outlet, chosen once from the broker, does.
Behind replicas (``SCHEDULER_CLAIM_REPLICAS``, 1 by default behind Sentinel) both
keep the message in ``unpublished`` and send it only once a replica acknowledged
the claim (``WAIT``), so a failover cannot lose a claim whose message may have
run; a claim not acknowledged in time ends the firing ``not_durable``, and the
takeover pass that follows sends it once a replica has it (the outlet's docstring
reasons it through).
APScheduler's own misfire handling is off (``misfire_grace_time=None``,
``coalesce=False``): while this process leads, every due tick fires, late if need
be. What a new leader fires of the ticks missed during a takeover is decided from
the entries' last fired ticks in Redis, never from APScheduler's memory. A tick less
than ``SCHEDULER_MISFIRE_THRESHOLD`` late (60 s by default, as Quartz's
``misfireThreshold``) is on time and fires: every tick of a graceful hand-over, and
of a crash's takeover within the threshold. Older ones are misfires, handled under
``SCHEDULER_CATCHUP``: ``none``, ``latest`` (default: the most recent one within
``SCHEDULER_CATCHUP_GRACE``, as APScheduler's ``coalesce``) or ``all`` (every one
within the grace, APScheduler's ``misfire_grace_time``, up to ``SCHEDULER_CATCHUP_MAX``);
then each job's next run is set to its first tick after now, so APScheduler never
replays a stale one.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from datetime import UTC, datetime
from typing import Any, cast

import redis
from apscheduler.schedulers.background import BackgroundScheduler
from dramatiq import Actor, Message
from dramatiq.errors import BrokerConnectionError
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.metrics import Observation
from opentelemetry.trace import Status, StatusCode

from .. import keys
from ..aio import is_async, require_event_loop
from ..brokers.base import KitBroker
from ..events import declared_events
from ..exactly_once import Running, run_handler, run_handler_async
from ..lua import scripts
from ..metrics import instruments, observe
from ..records import text
from ..registry import Registry, idempotent_option, send_all
from ..settings import SchedulerSettings
from ..telemetry import printable
from . import dynamic
from .dynamic import decode_raw
from .executor import TickExecutor
from .lease import Lease
from .manual import Template, tick_message
from .outlet import Tick, TickNotDurable, outlet_for
from .schedule import Entry, Schedule, ScheduleError
from .status import scheduler_status
from .targets import Checker
from .targets import publish as publish_targets
from .triggers import SpecTrigger, first_at_or_after, following, just_after, upcoming

#: Redis, or a broker whose queues are elsewhere, out of reach, or claims no replica acknowledged: try again
#: (a takeover sends what was claimed).
_UNREACHABLE = (redis.RedisError, BrokerConnectionError, TickNotDurable)


#: A tick's claim key outlives the catch-up grace by this much (older ticks never fire).
TICK_KEY_MARGIN_MS = 60_000
#: The leadership thread looks at the lease at least this often, to pause the timer when it runs out.
MAX_SLEEP_S = 0.25
#: How many next fire times of an APScheduler trigger are published for ``dramatiq-gp status``.
UPCOMING = 5
#: How many due stored entries the leader reads per round trip.
STORED_BATCH = 500
#: How long the leader uses a read of the published schedulable targets before reading it again.
TARGETS_MAX_AGE_S = 5.0

_STORED_SCRIPTS = scripts(dynamic.__file__)


def tick_claim_ttl_ms(settings: SchedulerSettings) -> int:
    """How long the leader's claim of a tick lives: past the catch-up grace, that tick never fires again."""
    return int(settings.catchup_grace.total_seconds() * 1000) + TICK_KEY_MARGIN_MS


def _ms(instant: datetime) -> int:
    return round(instant.timestamp() * 1000)


def quiet_apscheduler() -> None:
    """APScheduler's INFO lines at WARNING, unless its level was set: about seven per start in every process.

    "Adding job tentatively", "Scheduler started", "Paused/Resumed scheduler job processing"
    say nothing the kit's own lines (``schedule runner: ...``) do not, and every worker
    process, leader or not, starts a timer. ``logging.getLogger("apscheduler").setLevel(...)``
    before the Kit is built keeps the level you chose.
    """
    apscheduler = logging.getLogger("apscheduler")
    if apscheduler.level == logging.NOTSET:
        apscheduler.setLevel(logging.WARNING)


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
        broker: KitBroker,
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
        #: Where fired ticks go: pushed in the claim's Lua call, or sent after it (and after a replica has it).
        self.outlet = outlet_for(
            broker,
            self.keys,
            tick_claim_ttl_ms(settings),
            replicas=settings.claim_replicas,
            wait_ms=max(1, round(settings.claim_timeout.total_seconds() * 1000)),
        )
        self._stop = threading.Event()
        self._wake = threading.Event()
        #: The entries' last fired ticks must be read again before firing (Redis or the broker was out of reach).
        self._stale = threading.Event()
        self._thread: threading.Thread | None = None
        #: Set while this process leads and has caught up: the timer runs, and stored entries fire.
        self._firing = threading.Event()
        self._stored_thread: threading.Thread | None = None
        self._advance = broker.client.register_script(_STORED_SCRIPTS["advance"])
        self._code_names = {entry.name for entry in schedule}
        #: What stored entries may target: this process's code where it declares the target, else as published.
        self._targets = Checker(broker.client, self.keys, broker, max_age_s=TARGETS_MAX_AGE_S)
        #: Stored entries already reported as unreadable or shadowed by a code entry (once each).
        self._reported: set[str] = set()
        self._timer = BackgroundScheduler(
            timezone=UTC,
            executors={TickExecutor.ALIAS: TickExecutor()},
            # Every due tick fires while this process leads; catch-up after a takeover is the kit's.
            job_defaults={"misfire_grace_time": None, "coalesce": False, "max_instances": 1},
        )
        self.tracer = trace.get_tracer("dramatiq_gp", tracer_provider=tracer_provider)
        quiet_apscheduler()
        self._declare_actors()
        self._namespace = namespace
        observe(
            "dramatiq_gp.scheduler.leader",
            "1",
            "1 in the process that holds the scheduler lease, else 0",
            self._observe_leader,
        )

    def _observe_leader(self) -> list[Observation]:
        return [Observation(1 if self.lease.is_held() else 0, {"namespace": self._namespace})]

    # -- lifecycle -----------------------------------------------------------------

    def start(self) -> None:
        """Contend for the lease; the timer runs while this process holds it."""
        self._stop.clear()
        # Published for ``dramatiq-gp status``, which reads Redis, not the application.
        client = self.broker.client
        if self.schedule:
            client.hset(
                self.keys.entries, mapping={entry.name: f"{entry.text}|{entry.zone.key}" for entry in self.schedule}
            )
            # And what each firing enqueues, for ``dramatiq-gp schedule run|backfill`` and the dashboard's Run now.
            client.hset(
                self.keys.templates, mapping={entry.name: Template.of(entry).encode() for entry in self.schedule}
            )
        # What stored entries may target, for the dashboard and `dramatiq-gp schedule add` (no code loaded there).
        publish_targets(client, self.keys, self.broker, declared_events())
        policy = self.settings
        client.set(
            self.keys.catchup,
            json.dumps(
                {
                    "policy": policy.catchup,
                    "grace_s": policy.catchup_grace.total_seconds(),
                    "max": policy.catchup_max,
                    "misfire_threshold_s": policy.misfire_threshold.total_seconds(),
                }
            ),
        )
        for entry in self.schedule:
            self._timer.add_job(
                functools.partial(self._fire_due, entry),
                trigger=entry.trigger,
                id=entry.name,
                name=entry.name,
                executor=TickExecutor.ALIAS,
                next_run_time=None,  # paused until this process leads
            )
            self._publish_upcoming(entry, datetime.now(UTC))
        self._timer.start(paused=True)
        self.lease.start()
        self._thread = threading.Thread(target=self._run, name="gp-scheduler-leadership", daemon=True)
        self._thread.start()
        self._stored_thread = threading.Thread(target=self._run_stored, name="gp-scheduler-stored", daemon=True)
        self._stored_thread.start()

    def stop(self) -> None:
        """Stop firing and release the lease at once."""
        self._stop.set()
        self._wake.set()
        for thread in (self._thread, self._stored_thread):
            if thread is not None:
                thread.join(5)
        if self._timer.running:
            self._timer.shutdown(wait=False)
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
                if is_async(entry.handler):
                    require_event_loop(broker, f"schedule entry {entry.name!r}")
                Actor(
                    _job_fn(entry),
                    broker=broker,
                    actor_name=entry.actor_name,
                    queue_name=entry.queue,
                    priority=0,
                    options={**idempotent, **entry.options},
                )
            else:
                Actor(
                    _fan_out_fn(self.registry, broker),
                    broker=broker,
                    actor_name=entry.actor_name,
                    queue_name=entry.queue,
                    priority=0,
                    options=idempotent,
                )

    # -- leadership ----------------------------------------------------------------

    def _leadership_changed(self, leading: bool) -> None:
        self._wake.set()

    def _run(self) -> None:
        """Gate the timer: paused unless this process leads, resumed once a takeover caught up."""
        # The lease value, not its epoch: a failover can roll the epoch counter back, so one number
        # may name two acquisitions; the random token in the value tells them apart.
        leading = None
        while not self._stop.is_set():
            self._wake.clear()
            if not self.lease.is_held():
                self._pause()
                leading = None
                self._wake.wait(MAX_SLEEP_S)
                continue
            if leading == self.lease.value and not self._stale.is_set():
                self._wake.wait(MAX_SLEEP_S)
                continue
            self._pause()
            self._stale.clear()
            try:
                caught_up = self._take_over()
            except _UNREACHABLE as exc:
                _warn_retrying(self.logger, exc)
                self._stale.set()  # look at the last fired ticks again
                self._stop.wait(1)
                continue
            if caught_up and self.lease.is_held():
                leading = self.lease.value
                self._resume()

    def _pause(self) -> None:
        self._firing.clear()
        self._timer.pause()

    def _resume(self) -> None:
        self._timer.resume()
        self._firing.set()

    def _take_over(self) -> bool:
        """Pick up where the last leader stopped: publish claimed ticks left unpublished, fire missed
        ticks (all those within the misfire threshold, older ones under the catch-up policy), then
        start each job at its first tick after now. False if
        the lease was lost meanwhile."""
        self.outlet.recover()
        now = datetime.now(UTC)
        last = {text(k): int(v) for k, v in self.broker.client.hgetall(self.covered_key).items()}
        for name, started in self.broker.client.hgetall(self.keys.started).items():
            last.setdefault(text(name), int(started))
        for entry in self.schedule:
            if entry.name not in last:
                # A new entry starts now; recording that keeps the next leader from treating the
                # time before it as missed (apart from the last fired: it has not fired yet).
                self.broker.client.hsetnx(self.keys.started, entry.name, _ms(now))
                self._timer.modify_job(entry.name, next_run_time=first_at_or_after(entry.trigger, just_after(now)))
                continue
            since = datetime.fromtimestamp(last[entry.name] / 1000, UTC)
            chosen, on_time, tick = self._due_ticks(entry, just_after(since), now)
            for missed_tick in [*chosen, *on_time]:
                if not self._fire(entry, missed_tick, catching_up=True):
                    return False
            self._timer.modify_job(entry.name, next_run_time=tick)
        return True

    def _due_ticks(
        self, entry: Entry, start: datetime, now: datetime
    ) -> tuple[list[datetime], list[datetime], datetime | None]:
        """The ticks of ``entry`` from ``start`` to ``now`` to fire: the misfires the catch-up policy
        keeps, then those on time; and its first tick after ``now`` (``None`` if it fires no more)."""
        policy, grace = self.settings.catchup, self.settings.catchup_grace
        on_time_from = now - self.settings.misfire_threshold
        # Late by less than the misfire threshold (a hand-over, a crash's takeover) is on time:
        # those ticks all fire. The policy decides only of the older ones, the misfires.
        misfired: list[datetime] = []
        on_time: list[datetime] = []
        skipped = 0
        tick = first_at_or_after(entry.trigger, max(start, now - grace))
        while tick is not None and tick <= now:
            if tick >= on_time_from:
                on_time.append(tick)
            else:
                misfired.append(tick)
                if len(misfired) > self.settings.catchup_max:
                    misfired.pop(0)
                    skipped += 1
            tick = following(entry.trigger, tick)
        chosen = {"none": [], "latest": misfired[-1:], "all": misfired}[policy]
        skipped += len(misfired) - len(chosen)
        if skipped:
            self.logger.warning(
                "schedule runner: %s: %d missed tick(s) not fired (SCHEDULER_CATCHUP=%s: more than "
                "SCHEDULER_MISFIRE_THRESHOLD late)",
                printable(entry.name),
                skipped,
                policy,
            )
        return chosen, on_time, tick

    # -- firing ----------------------------------------------------------------------

    def _fire_due(self, entry: Entry, *run_times: datetime) -> None:
        """Fire ``entry``'s ticks that APScheduler found due, in order (in the timer's thread)."""
        for tick in run_times:
            try:
                if not self._fire(entry, tick):
                    self._pause()
                    return
            except _UNREACHABLE as exc:
                _warn_retrying(self.logger, exc)
                # The timer moves on; the takeover's catch-up, from the last fired ticks, does not.
                self._pause()
                self._stale.set()
                self._wake.set()
                return
        self._publish_upcoming(entry, run_times[-1])

    # -- stored entries --------------------------------------------------------------

    def _run_stored(self) -> None:
        """Fire the stored entries that fall due, while this process leads and has caught up."""
        while not self._stop.is_set():
            if not self._firing.wait(MAX_SLEEP_S):
                continue
            try:
                wait = self._fire_stored()
            except _UNREACHABLE as exc:
                _warn_retrying(self.logger, exc)
                # As for a code entry: a takeover pass sends what was claimed, then firing resumes.
                self._pause()
                self._stale.set()
                self._wake.set()
                self._stop.wait(1)
                continue
            if wait:
                self._stop.wait(wait)

    def _fire_stored(self) -> float:
        """Fire one batch of the due stored entries, and move each to its next tick; how long to wait
        before looking again (0 when more are due).

        Only the due part of the index and its head are read: the entries not due cost nothing.
        """
        client, now = self.broker.client, datetime.now(UTC)
        now_ms = _ms(now)
        due = cast(
            list[tuple[bytes, float]],
            client.zrangebyscore(self.keys.due, "-inf", now_ms, start=0, num=STORED_BATCH, withscores=True),
        )
        if not due:
            head = cast(list[tuple[bytes, float]], client.zrange(self.keys.due, 0, 0, withscores=True))
            return MAX_SLEEP_S if not head else min(MAX_SLEEP_S, max(0.001, (head[0][1] - now_ms) / 1000))
        raws = cast(list[bytes | None], client.hmget(self.keys.dynamic, [name for name, _ in due]))
        firings: list[tuple[Entry, datetime, bool]] = []
        moves: list[Any] = []
        for (raw_name, due_ms), raw in zip(due, raws, strict=True):
            name, after = text(raw_name), None
            entry = self._stored_entry(name, raw)
            if entry is not None:
                chosen, on_time, after = self._due_ticks(entry, datetime.fromtimestamp(due_ms / 1000, UTC), now)
                if self._may_fire(entry):  # else its ticks are passed over, as a paused entry's
                    firings += [(entry, tick, tick in chosen) for tick in [*chosen, *on_time]]
            moves += [name, int(due_ms), "" if after is None else _ms(after)]
        # Claimed in one round trip; moved on only once fired: a leader stopped in between leaves them due,
        # and its successor's claims find them fired already.
        if not self._fire_many(firings):
            return MAX_SLEEP_S
        self._advance(keys=[self.keys.due], args=moves)
        return 0 if len(due) == STORED_BATCH else MAX_SLEEP_S / 10

    def _stored_entry(self, name: str, raw: bytes | None) -> Entry | None:
        """The stored entry to fire, or ``None`` to drop it from the index: removed meanwhile,
        shadowed by a code entry, or unreadable (said once)."""
        if raw is None:  # removed between the two reads
            return None
        if name in self._code_names:
            self._report(name, "schedule runner: stored entry %s not fired: a code entry has its name", printable(name))
            return None
        try:
            return decode_raw(name, raw)
        except ScheduleError as exc:
            self._report(name, "schedule runner: stored entry not fired: %s", exc)
            return None

    def _may_fire(self, entry: Entry) -> bool:
        """Whether a stored entry's target is schedulable (said once per entry when it is not)."""
        try:
            self._targets.entry(entry)
        except ScheduleError as exc:
            self._report(entry.name, "schedule runner: stored entry not fired: %s", exc)
            return False
        self._reported.discard(entry.name)  # allowed again (marked since): a later refusal is said again
        return True

    def _report(self, name: str, message: str, *args: Any) -> None:
        if name not in self._reported:
            self._reported.add(name)
            self.logger.error(message, *args)

    def _publish_upcoming(self, entry: Entry, after: datetime) -> None:
        """Write where ``dramatiq-gp status`` reads an APScheduler trigger's next fires (it computes cron ones)."""
        if isinstance(entry.trigger, SpecTrigger):
            return
        times = [t.isoformat() for t in upcoming(entry.trigger, after, UPCOMING)]
        self.broker.client.hset(self.keys.upcoming, entry.name, json.dumps(times))

    def _fire(self, entry: Entry, tick: datetime, *, catching_up: bool = False) -> bool:
        """Enqueue ``entry``'s ``tick``; False when this process turns out not to lead.

        Raises:
            TickNotDurable: claimed, but no replica acknowledged the claim in time; kept, to be
                sent by the takeover pass the caller starts (see :mod:`~dramatiq_gp.scheduler.outlet`).
        """
        return self._fire_many([(entry, tick, catching_up)])

    def _fire_many(self, firings: list[tuple[Entry, datetime, bool]]) -> bool:
        """Enqueue each ``(entry, tick, catching up)``, claimed in one round trip where the outlet can;
        False when this process turns out not to lead (what was claimed before that is enqueued).

        Raises:
            TickNotDurable: as :meth:`_fire`, for any of them.
        """
        if not firings:
            return True
        lease = self.lease.value
        if lease is None or not self.lease.is_held():
            return False
        spans, ticks = [], []
        for entry, tick, catching_up in firings:
            # Each firing starts a trace of its own, named after the entry; its message is sent from it.
            span = self.tracer.start_span(
                f"schedule {entry.name}",
                context=Context(),
                attributes={
                    "dramatiq_gp.schedule.entry": entry.name,
                    "dramatiq_gp.schedule.tick": tick.isoformat(),
                    "dramatiq_gp.schedule.catch_up": catching_up,
                },
            )
            with trace.use_span(span, end_on_exit=False):
                ticks.append(self.outlet.prepare(Tick(entry.name, _ms(tick), self._message(entry, tick), lease)))
            spans.append(span)
        try:
            if self.outlet.batches:
                outcomes = self.outlet.fire_prepared(ticks)
            else:  # the outlet announces each message as it sends it: in its firing's span
                outcomes = []
                for span, prepared in zip(spans, ticks, strict=True):
                    with trace.use_span(span, end_on_exit=False):
                        outcomes.append(self.outlet.fire(prepared))
        except BaseException as exc:
            for span in spans:
                span.record_exception(exc)
                span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
                span.end()
            raise
        leading, not_durable = True, []
        for (entry, tick, catching_up), span, outcome in zip(firings, spans, outcomes, strict=True):
            # The span says "lease lost", as it did before the script named its outcomes.
            span.set_attribute("dramatiq_gp.schedule.outcome", "lease lost" if outcome == "lease_lost" else outcome)
            span.end()
            if outcome == "lease_lost":
                if leading:
                    self.logger.warning(
                        "schedule runner: %s not fired: this process no longer holds the lease", printable(entry.name)
                    )
                    # Until the next renewal (up to a third of the TTL away) the timer would try again at once.
                    self.lease.lose("a firing found it taken or gone")
                leading = False
                continue
            counted = "caught_up" if outcome == "fired" and catching_up else outcome
            instruments().scheduler_ticks.add(1, {"entry": entry.name, "outcome": counted})
            if outcome == "not_durable":
                not_durable.append(f"{printable(entry.name)} tick {tick.isoformat()}")
            elif outcome == "paused":
                self.logger.debug(
                    "schedule runner: %s is paused: tick %s not fired", printable(entry.name), tick.isoformat()
                )
            elif outcome == "fired":
                lateness_ms = (datetime.now(UTC) - tick).total_seconds() * 1000
                self.logger.info(
                    "schedule runner: fired %s scheduled_at=%s lateness_ms=%.0f%s",
                    printable(entry.name),
                    tick.astimezone(entry.zone).isoformat(),
                    lateness_ms,
                    " (catch-up)" if catching_up else "",
                )
        if not_durable:
            raise TickNotDurable(
                f"{', '.join(not_durable)} claimed, but fewer than the {self.outlet.replicas} replica(s) "
                f"of SCHEDULER_CLAIM_REPLICAS acknowledged the claim within SCHEDULER_CLAIM_TIMEOUT: kept, and sent "
                "once they have it (0 fires without waiting, and a failover may then fire a tick twice)"
            )
        return leading

    def _message(self, entry: Entry, tick: datetime) -> Message[Any]:
        return tick_message(Template.of(entry), tick)


def _warn_retrying(logger: logging.Logger, exc: BaseException) -> None:
    if isinstance(exc, TickNotDurable):
        logger.warning("schedule runner: retrying: %s", exc)
    else:
        logger.warning("schedule runner: Redis or the broker unreachable, retrying: %s", exc)


def _fan_out_fn(registry: Registry, broker: KitBroker) -> Any:
    def fan_out(firing: dict[str, Any]) -> None:
        # The firing's own message id is the envelope id: every firing is a new
        # dispatch, and a retry of one firing fans out to the same message ids.
        send_all(broker, registry.messages_for(firing))

    return fan_out


def _job_fn(entry: Entry) -> Any:
    handler, takes_time, bind, actor_name = entry.handler, entry.takes_time, entry.inbox, entry.actor_name
    assert handler is not None

    # gp.inbox() inside the job keys its transaction by this firing's message id: the tick's, or the own id
    # a run asked for by hand carries (dramatiq_gp.scheduler.manual).
    def run(firing: dict[str, Any]) -> None:
        scheduled_at = firing["scheduled_at"]
        args = (datetime.fromisoformat(scheduled_at),) if takes_time else ()
        run_handler(Running(actor_name, scheduled_at=scheduled_at, message_id=firing.get("id")), bind, handler, *args)

    async def run_async(firing: dict[str, Any]) -> None:
        # On Dramatiq's event-loop thread, in a copy of the worker thread's context (see dramatiq_gp.aio).
        scheduled_at = firing["scheduled_at"]
        args = (datetime.fromisoformat(scheduled_at),) if takes_time else ()
        running = Running(actor_name, scheduled_at=scheduled_at, message_id=firing.get("id"))
        await run_handler_async(running, bind, handler, *args)

    fn: Any = run_async if is_async(handler) else run
    fn.__module__ = getattr(handler, "__module__", None) or __name__
    fn.__name__ = fn.__qualname__ = entry.name
    return fn
