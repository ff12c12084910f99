"""Every Redis key the kit reads or writes, built here and nowhere else.

Dramatiq's own layout (its ``brokers/redis/dispatch.lua``), under a namespace:

* ``<ns>:<queue>``: the ids ready to fetch (a list), ``<ns>:<queue>.msgs``: id → message (a hash);
* ``<ns>:<queue>.DQ`` / ``.DQ.msgs``: the delay queue, the same way;
* ``<ns>:<queue>.XQ`` / ``.XQ.msgs``: the dead letters (a sorted set scored by the time, and a hash);
  beside them the kit's ``<ns>:<queue>.XQ.why``: why each it set aside as it came was (Redis id → reason);
* ``<ns>:__acks__.<broker id>.<queue>``: what one worker process fetched and has not settled;
* ``<ns>:__heartbeats__``: the worker processes' last beats (a sorted set).

The kit's own, under the same namespace: ``<ns>:gp:done:<message id>`` (the
idempotency claim of a message id being run; before issue 30 also its done mark,
``"done"``), ``<ns>:gp:marks:*`` (the done marks of completed ones, laid out by
:mod:`.brokers.done_marks`), ``<ns>:gp:skipped`` (messages
skipped for want of a handler, per task type), and what the dashboard reads
without scanning the keyspace: ``<ns>:gp:queues`` (the queues consumed),
``<ns>:gp:workers`` (the worker processes), ``<ns>:gp:health`` (each one's health), ``<ns>:gp:throughput:<minute>`` (the
messages settled per queue and minute), ``<ns>:gp:failures`` (the latest
failures); on RabbitMQ, ``<ns>:gp:unconfirmed`` (the queues whose sends go
unconfirmed), ``<ns>:gp:held:<broker id>`` (what a worker process holds) and
``<ns>:gp:fetched`` (when each queue's last received message became ready);
the listeners the worker processes declare, which every fan-out reaches:
``<ns>:gp:listeners``, ``<ns>:gp:listeners:seen``, ``<ns>:gp:listeners:version``
and ``<ns>:gp:listeners:retired``. The scheduler's,
under ``<scheduler namespace>:scheduler:``: see :class:`SchedulerKeys`.
"""

from __future__ import annotations

from dataclasses import dataclass

from dramatiq.common import dq_name, q_name

#: Suffix of the hash holding a queue's messages.
MESSAGES = ".msgs"


def queue(namespace: str, queue_name: str) -> str:
    return f"{namespace}:{queue_name}"


def messages(namespace: str, queue_name: str) -> str:
    return f"{namespace}:{queue_name}{MESSAGES}"


def delay_queue(namespace: str, queue_name: str) -> str:
    return f"{namespace}:{dq_name(q_name(queue_name))}"


def delay_messages(namespace: str, queue_name: str) -> str:
    return f"{delay_queue(namespace, queue_name)}{MESSAGES}"


def dead(namespace: str, queue_name: str) -> str:
    """The dead-letter set of ``queue_name`` (of its canonical queue, for a delay queue)."""
    return f"{namespace}:{q_name(queue_name)}.XQ"


def dead_messages(namespace: str, queue_name: str) -> str:
    return f"{dead(namespace, queue_name)}{MESSAGES}"


def dead_reasons(namespace: str, queue_name: str) -> str:
    """Why each message the consumer set aside as it came (malformed: no options to write it in) was,
    by Redis id; it expires with the last of them."""
    return f"{dead(namespace, queue_name)}.why"


def acks(namespace: str, broker_id: str, queue_name: str) -> str:
    return f"{namespace}:__acks__.{broker_id}.{queue_name}"


def heartbeats(namespace: str) -> str:
    return f"{namespace}:__heartbeats__"


def declared_queues(namespace: str) -> str:
    """The queues the workers consume (declared, on RabbitMQ), for ``status`` and the dashboard (a set)."""
    return f"{namespace}:gp:queues"


def workers(namespace: str) -> str:
    """Broker id → a worker process's host, pid, queues and weights, as JSON (a hash)."""
    return f"{namespace}:gp:workers"


def health(namespace: str) -> str:
    """Broker id → a worker process's health as JSON (a hash): ``alive``, ``ready``, ``failing`` (why not),
    ``at_ms`` (when it was judged), written by :mod:`.health` every ``WORKER_HEALTH_INTERVAL``."""
    return f"{namespace}:gp:health"


def throughput(namespace: str, minute: int) -> str:
    """``<queue>:done|retried|dead`` → messages settled so in that minute since the epoch (a hash, kept 2 h)."""
    return f"{namespace}:gp:throughput:{minute}"


def failures(namespace: str) -> str:
    """The latest failed attempts, newest first, as JSON (a list capped by :mod:`.middleware.failures`)."""
    return f"{namespace}:gp:failures"


def held(namespace: str, broker_id: str) -> str:
    """Queue → messages one RabbitMQ worker process holds unsettled, as of its last beat (a hash)."""
    return f"{namespace}:gp:held:{broker_id}"


def fetched(namespace: str) -> str:
    """RabbitMQ queue → when (ms) the last message a worker process received from it became ready, as of that
    process's last beat (a hash): the exporter's estimate of the oldest ready message's age."""
    return f"{namespace}:gp:fetched"


def unconfirmed(namespace: str) -> str:
    """RabbitMQ queue → when (ms) a send to it last went unconfirmed, until one is confirmed again (a hash)."""
    return f"{namespace}:gp:unconfirmed"


def listeners(namespace: str) -> str:
    """Task type → a declared listener's event, name, queue and options, as JSON (a hash)."""
    return f"{namespace}:gp:listeners"


def listeners_seen(namespace: str) -> str:
    """Task type → when a worker process last declared that listener, in ms (a sorted set)."""
    return f"{namespace}:gp:listeners:seen"


def listeners_version(namespace: str) -> str:
    """Incremented whenever a listener is declared for the first time, changed or retired (a counter)."""
    return f"{namespace}:gp:listeners:version"


def listeners_retired(namespace: str) -> str:
    """Task type → ``"<ms retired> <spec>"`` of a retired listener, kept for the events committed before (a hash)."""
    return f"{namespace}:gp:listeners:retired"


def claim_prefix(namespace: str) -> str:
    """Prefix of the claims of message ids being run (``<prefix><message id>``: the claim's token, with a lease).

    The name the kit has always used, so that during a rolling upgrade the workers of
    both versions see each other's claims, and the new ones the old done marks
    (``"done"``, kept for the old retention).
    """
    return f"{namespace}:gp:done:"


def done_marks(namespace: str) -> str:
    """Prefix of the done marks' keys (:mod:`.brokers.done_marks`)."""
    return f"{namespace}:gp:marks:"


def skipped(namespace: str) -> str:
    return f"{namespace}:gp:skipped"


#: Patterns ``dramatiq-gp status`` scans for.
def all_messages(namespace: str) -> str:
    return f"{namespace}:*{MESSAGES}"


def all_dead(namespace: str) -> str:
    return f"{namespace}:*.XQ"


ALL_SCHEDULER_ENTRIES = "*:scheduler:entries"


@dataclass(frozen=True)
class SchedulerKeys:
    """The keys of one scheduler namespace (``SCHEDULER_NAMESPACE``, by default the queues')."""

    namespace: str

    @classmethod
    def from_entries_key(cls, key: str) -> SchedulerKeys:
        """The keys of the scheduler whose ``entries`` key is ``key`` (found by scanning)."""
        return cls(key.removesuffix(":scheduler:entries"))

    @property
    def prefix(self) -> str:
        return f"{self.namespace}:scheduler"

    @property
    def lease(self) -> str:
        """``<epoch>/<token>`` of the leader, with the lease TTL."""
        return f"{self.prefix}:lease"

    @property
    def released(self) -> str:
        """The channel a leader publishes its epoch on as it releases the lease, so a contender takes it at once."""
        return f"{self.prefix}:released"

    @property
    def epoch(self) -> str:
        """The fencing counter, incremented at every acquisition."""
        return f"{self.prefix}:epoch"

    @property
    def leader(self) -> str:
        """The leader's host, pid, epoch and acquisition time (a hash)."""
        return f"{self.prefix}:leader"

    @property
    def last_fired(self) -> str:
        """Entry name → the last tick fired, in ms (a hash)."""
        return f"{self.prefix}:last_fired"

    @property
    def started(self) -> str:
        """Entry name → when a leader first covered it, in ms, for an entry not yet fired (a hash)."""
        return f"{self.prefix}:started"

    @property
    def entries(self) -> str:
        """Entry name → ``<trigger>|<zone>``, published for ``dramatiq-gp status`` (a hash)."""
        return f"{self.prefix}:entries"

    @property
    def templates(self) -> str:
        """Entry name → what a firing of it enqueues (trigger, zone, queue, actor, options; an event entry's event and
        payload), as JSON, so that ``dramatiq-gp schedule run|backfill`` and the dashboard build its messages without
        the application's code (a hash, see :mod:`.scheduler.manual`)."""
        return f"{self.prefix}:templates"

    @property
    def schedulable(self) -> str:
        """``actor:<name>``/``event:<name>`` → a target stored entries may have, as JSON: its queue and parameters,
        published by the workers whose code marks it (a hash; :mod:`.scheduler.targets`)."""
        return f"{self.prefix}:schedulable"

    @property
    def catchup(self) -> str:
        """The catch-up policy the workers run with (``SCHEDULER_CATCHUP*``), as JSON, for the dashboard."""
        return f"{self.prefix}:catchup"

    @property
    def upcoming(self) -> str:
        """Entry name → its next fire times as a JSON list, for triggers other than cron strings (a hash)."""
        return f"{self.prefix}:upcoming"

    @property
    def unpublished(self) -> str:
        """``<entry>:<tick ms>`` → a claimed tick's message not yet sent: unconfirmed by RabbitMQ, or its claim
        not yet on a replica (``SCHEDULER_CLAIM_REPLICAS``) (a hash)."""
        return f"{self.prefix}:unpublished"

    @property
    def paused(self) -> str:
        """Entry name → who paused it and when, as JSON: its ticks are passed over, not fired (a hash)."""
        return f"{self.prefix}:paused"

    @property
    def dynamic(self) -> str:
        """Entry name → a schedule entry stored at run time, as JSON (a hash; :mod:`dramatiq_gp.scheduler.dynamic`)."""
        return f"{self.prefix}:dynamic"

    @property
    def names(self) -> str:
        """Stored entry names, every one at score 0 (a sorted set): read by name and prefix with ``ZRANGEBYLEX``,
        a page at a time, where the hash could only be scanned whole."""
        return f"{self.prefix}:names"

    @property
    def due(self) -> str:
        """Stored entry name → the ms of its next tick not yet fired (a sorted set): what the leader reads."""
        return f"{self.prefix}:due"

    def tick(self, entry: str, tick_ms: int) -> str:
        """The claim of one tick of one entry."""
        return f"{self.prefix}:tick:{entry}:{tick_ms}"

    def running(self, entry: str) -> str:
        """The message id of the run of ``entry`` in progress, with a lease it renews (``overlap=`` entries)."""
        return f"{self.prefix}:running:{entry}"
