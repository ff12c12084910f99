"""Who listens, across processes: the listeners every live worker has declared, which every fan-out reaches.

A rolling deploy runs old and new workers side by side. A listener the new
version adds is known to the new workers only, yet an old worker may be the one
that fans an event out. So the fan-out does not go to the fanning process's
registry alone, but to the union of what the live workers have declared:

* **Declared.** Each worker process writes its listeners (task type, event,
  listener name, queue, actor options) to Redis/Valkey before its consumers start
  (``declare.lua``), and again every :data:`HEARTBEAT_DIVISOR`-th of
  ``WORKER_LISTENER_RETIREMENT`` (30 s at most), so they stay fresh.
* **Retired.** A listener no worker has declared for ``WORKER_LISTENER_RETIREMENT``
  (10 minutes by default) is retired by the next declaration of any worker: the
  version goes up, and fan-outs stop sending it the events committed after its
  retirement. A listener whose workers all stopped for less than that (a restart,
  a crash) keeps receiving: its messages wait in its queue.
* **Owed what it was live for.** An event committed while a listener was live
  reaches it even when it is fanned out after the retirement (a fan-out retried,
  or held by a killed worker until its heartbeat lapsed): the outbox's envelope
  says when the event was written (``at``), and a retired listener is kept, with
  the time it was retired, for :data:`RETIRED_KEPT`. Its message then waits in its
  queue, or, where workers without it consume that queue, is held and then set
  aside in the dead-letter set, where ``dramatiq-gp dlq requeue`` finds it.
* **Read through a cache.** A fanning process keeps the set and its version, and
  looks at the version (one ``GET``) at most every :data:`REFRESH_S`, before a
  fan-out that needs it: a fan-out never uses a set read longer ago than that. A
  worker whose declaration changed the set lets :data:`REFRESH_S` pass before it
  calls itself started, so every event committed after its start reaches its
  listeners, whichever process fans it out.

A message for a listener whose actor the consuming worker does not have is held
and then skipped, as any unknown task type (``WORKER_UNKNOWN_TASK_GRACE``).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

import redis

from . import keys
from .lua import scripts
from .records import text

if TYPE_CHECKING:
    from .events import EventType


class Listener(Protocol):
    """What a worker declares of a listener (:class:`dramatiq_gp.registry.Listener` is one)."""

    @property
    def event(self) -> EventType: ...
    @property
    def name(self) -> str: ...
    @property
    def queue(self) -> str: ...
    @property
    def priority(self) -> int: ...
    @property
    def options(self) -> Mapping[str, Any]: ...
    @property
    def actor_name(self) -> str: ...


logger = logging.getLogger(__name__)

_SCRIPTS = scripts(__file__)

#: A fan-out never uses a listener set whose version was read longer ago than this.
REFRESH_S = 0.25
#: Declarations are refreshed this many times per retirement period (at most every 30 s).
HEARTBEAT_DIVISOR, HEARTBEAT_MAX_S = 4, 30.0
#: How long a retired listener is kept for the events committed before its retirement: as long as
#: Dramatiq retries a message (its longest backoff) and keeps a dead letter.
RETIRED_KEPT = timedelta(days=7)


def spec(listener: Listener) -> str:
    """What a worker declares of ``listener``: enough to send it messages, and to show it."""
    return json.dumps(
        {
            "event": listener.event.name,
            "name": listener.name,
            "queue": listener.queue,
            "priority": listener.priority,
            "options": _jsonable(listener.options),
        },
        sort_keys=True,
    )


class Subscriptions:
    """The declared listeners of one namespace, per event: ``(task type, queue)`` pairs.

    Parameters:
        client: the coordination Redis/Valkey.
        namespace: the prefix of the kit's keys.
    """

    def __init__(self, client: redis.Redis, namespace: str) -> None:
        self.client = client
        self.keys = (
            keys.listeners(namespace),
            keys.listeners_seen(namespace),
            keys.listeners_version(namespace),
            keys.listeners_retired(namespace),
        )
        self._declare = client.register_script(_SCRIPTS["declare"])
        self._lock = threading.Lock()
        self._version: int | None = None
        self._by_event: dict[str, tuple[tuple[str, str], ...]] = {}
        #: Per event, the retired listeners: ``(task type, queue, ms retired)``.
        self._retired: dict[str, tuple[tuple[str, str, int], ...]] = {}
        self._fresh_until = 0.0
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    def of(self, event: str, written_ms: int | None = None) -> tuple[tuple[str, str], ...]:
        """The ``(task type, queue)`` of every live listener of ``event``, read at most :data:`REFRESH_S` ago,
        and of every listener retired after ``written_ms`` (when the event was written, if known).

        Raises:
            redis.RedisError: the version could not be read (the fan-out fails, and is retried).
        """
        if time.monotonic() >= self._fresh_until:
            self._refresh()
        live = self._by_event.get(event, ())
        retired = self._retired.get(event)
        if not retired or written_ms is None:
            return live
        return live + tuple((task_type, queue) for task_type, queue, at in retired if at > written_ms)

    def _refresh(self) -> None:
        with self._lock:
            sent = time.monotonic()
            if sent < self._fresh_until:
                return  # another thread read it meanwhile
            specs_key, _, version_key, retired_key = self.keys
            version = int(self.client.get(version_key) or 0)
            if version != self._version:
                with self.client.pipeline(transaction=True) as pipe:
                    pipe.get(version_key)
                    pipe.hgetall(specs_key)
                    pipe.hgetall(retired_key)
                    raw_version, specs, retired = pipe.execute()
                version = int(raw_version or 0)
                by_event: dict[str, list[tuple[str, str]]] = {}
                for task_type, data in specs.items():
                    declared = json.loads(data)
                    by_event.setdefault(declared["event"], []).append((text(task_type), declared["queue"]))
                retired_by_event: dict[str, list[tuple[str, str, int]]] = {}
                for task_type, data in retired.items():
                    at, _, spec_json = text(data).partition(" ")
                    declared = json.loads(spec_json)
                    retired_by_event.setdefault(declared["event"], []).append(
                        (text(task_type), declared["queue"], int(at))
                    )
                self._by_event = {event: tuple(sorted(pairs)) for event, pairs in by_event.items()}
                self._retired = {event: tuple(sorted(found)) for event, found in retired_by_event.items()}
                self._version = version
            self._fresh_until = sent + REFRESH_S

    def declare(self, listeners: Iterable[Listener], retirement: timedelta) -> bool:
        """Write ``listeners`` as this process's; whether that changed the set (a new listener, or a new spec)."""
        changed = self._write(listeners, retirement)
        self._fresh_until = 0.0  # the next fan-out reads the set again
        return changed

    def _write(self, listeners: Iterable[Listener], retirement: timedelta) -> bool:
        now = int(time.time() * 1000)
        retire_before, forget_before = (now - int(after.total_seconds() * 1000) for after in (retirement, RETIRED_KEPT))
        args: list[Any] = [now, retire_before, forget_before]
        for listener in listeners:
            args += [listener.actor_name, spec(listener)]
        _version, changed = self._declare(keys=list(self.keys), args=args)
        return bool(changed)

    def keep_declaring(self, listeners: Callable[[], Iterable[Listener]], retirement: timedelta) -> None:
        """Declare ``listeners()`` again every :data:`HEARTBEAT_DIVISOR`-th of ``retirement``, on a thread."""
        every = min(HEARTBEAT_MAX_S, retirement.total_seconds() / HEARTBEAT_DIVISOR)
        self._stop.clear()

        def beat() -> None:
            warned = False
            while not self._stop.wait(every):
                try:
                    self._write(listeners(), retirement)
                    warned = False
                except redis.RedisError as exc:
                    if not warned:
                        logger.warning("could not declare this worker's listeners in Redis, retrying: %s", exc)
                        warned = True

        self._heartbeat = threading.Thread(target=beat, name="gp-listeners", daemon=True)
        self._heartbeat.start()

    def stop(self) -> None:
        """Stop declaring; what was declared stays until it is retired (a restart keeps receiving)."""
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join(1)

    def wait_until_everyone_sees(self, since: float) -> None:
        """Sleep until every fanning process reads the set again after ``since`` (a monotonic time)."""
        time.sleep(max(0.0, since + REFRESH_S - time.monotonic()))


def _jsonable(options: Any) -> Any:
    return json.loads(json.dumps(options, default=lambda value: getattr(value, "__name__", repr(value))))
