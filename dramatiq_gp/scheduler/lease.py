"""The leader lease: one holder at a time among the worker processes, on one Redis key.

States and moves, run on the lease's own thread every third of the TTL:

* **contending**: ``SET <ns>:scheduler:lease <epoch>/<token> NX PX <ttl>``; on success
  the process leads, with a fresh epoch (a fencing token: ``INCR`` on every
  acquisition) written beside the holder's host and pid. Besides the poll, a
  contender is woken by the release of the lease (below), so a graceful hand-over
  takes a round trip or two, not a third of the TTL; the poll is what finds a
  crashed leader's lease run out;
* **leading**: a Lua compare-and-renew extends the lease only if it still holds our
  value. The local deadline is measured on the monotonic clock from *before* the
  renewal was sent, minus a margin for clock drift; the holder stops leading the
  moment the deadline passes without a confirmed renewal (Redis unreachable, a GC
  or ``SIGSTOP`` pause) or Redis reports another value. It then contends again;
  it never exits.
* **released**: at shutdown a compare-and-delete frees the key at once and, in the
  same Lua call, publishes on ``<ns>:scheduler:released``, which every process
  listens to on a connection of its own (a thread that only waits on its socket).

The lease only says who should fire. What makes a tick fire once is the tick claim
in :mod:`dramatiq_gp.scheduler.runner`, which checks the lease value in the same
Lua call that enqueues.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable

import redis

from ..keys import SchedulerKeys
from ..lua import scripts

_SCRIPTS = scripts(__file__)

#: Part of the TTL, and a fixed amount, not trusted to clock drift between us and Redis.
DRIFT_FACTOR, DRIFT_MIN_S = 0.01, 0.005
#: How long the listener for releases waits on its socket before it looks whether to stop.
LISTEN_SLICE_S = 0.1


class Lease:
    """This process's side of the leader election.

    Parameters:
        client: the Redis client.
        keys: the scheduler namespace's keys.
        ttl_s: the lease TTL.
        on_change: called (from the lease thread) with True on acquisition and
            False on loss or release.
    """

    def __init__(
        self, client: redis.Redis, keys: SchedulerKeys, ttl_s: float, on_change: Callable[[bool], None]
    ) -> None:
        self.logger = logging.getLogger(f"{__name__}.{type(self).__name__}")
        self.client = client
        self.key, self.info_key, self.epoch_key, self.released = keys.lease, keys.leader, keys.epoch, keys.released
        self.ttl_s = ttl_s
        self.on_change = on_change
        self.identity = (socket.gethostname(), os.getpid())
        self._acquire = client.register_script(_SCRIPTS["acquire"])
        self._renew = client.register_script(_SCRIPTS["renew"])
        self._release = client.register_script(_SCRIPTS["release"])
        self._lock = threading.Lock()
        self._stop = threading.Event()
        #: Set by a release elsewhere (or by stop): contend now rather than at the next poll.
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._listener: threading.Thread | None = None
        self.value: str | None = None  # "<epoch>/<token>" while held
        self.epoch = 0
        self._deadline = 0.0
        self._warned = False

    def is_held(self) -> bool:
        """Whether we lead now: held, and the last confirmed renewal has not run out."""
        return self.value is not None and time.monotonic() < self._deadline

    def start(self) -> None:
        self._stop.clear()
        self._listener = threading.Thread(target=self._listen, name="gp-scheduler-released", daemon=True)
        self._listener.start()
        self._thread = threading.Thread(target=self._run, name="gp-scheduler-lease", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop contending and release the lease at once if we hold it."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(self.ttl_s)
        with self._lock:
            value, self.value = self.value, None
        if value is not None:
            try:
                self._release(keys=[self.key, self.info_key, self.released], args=[value])
                self.logger.info("schedule runner: leadership released (epoch %d)", self.epoch)
            except redis.RedisError as exc:
                self.logger.warning("schedule runner: could not release the lease (it expires by itself): %s", exc)
            self.on_change(False)
        if self._listener is not None:
            self._listener.join(2 * LISTEN_SLICE_S)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            if self.value is None:
                self._contend()
            else:
                self._renew_once()
            self._wake.wait(self.ttl_s / 3)

    def _listen(self) -> None:
        """Wake the contending thread whenever a leader releases the lease (on a connection of its own)."""
        pubsub = self.client.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call,unused-ignore]  # typed since redis 8.2
        try:
            while not self._stop.is_set():
                try:
                    if not pubsub.subscribed:
                        pubsub.subscribe(self.released)
                    if pubsub.get_message(timeout=LISTEN_SLICE_S) is not None and self.value is None:
                        self._wake.set()
                except redis.RedisError:
                    # The contending thread reports Redis out of reach; its poll goes on meanwhile.
                    pubsub.reset()
                    self._stop.wait(1)
        finally:
            pubsub.close()

    def _contend(self) -> None:
        token, sent = uuid.uuid4().hex, time.monotonic()
        try:
            epoch = self._acquire(
                keys=[self.key, self.epoch_key, self.info_key],
                args=[token, int(self.ttl_s * 1000), *self.identity, int(time.time() * 1000)],
            )
        except redis.RedisError as exc:
            self._warn(exc)
            return
        self._warned = False
        if not epoch:
            return
        with self._lock:
            self.value, self.epoch = f"{epoch}/{token}", int(epoch)
            self._deadline = sent + self._valid_for()
        self.logger.info("schedule runner: leadership acquired (epoch %d, %s pid %d)", epoch, *self.identity)
        self.on_change(True)

    def _renew_once(self) -> None:
        value, sent = self.value, time.monotonic()
        if value is None:
            return
        try:
            renewed = self._renew(keys=[self.key, self.info_key], args=[value, int(self.ttl_s * 1000)])
        except redis.RedisError as exc:
            self._warn(exc)
            if time.monotonic() >= self._deadline:
                self.lose("the lease ran out without a confirmed renewal")
            return
        self._warned = False
        if renewed:
            self._deadline = sent + self._valid_for()
        else:
            self.lose("another process holds the lease")

    def lose(self, why: str) -> None:
        """Stop leading now: the lease was found taken or gone (by a renewal, or by a firing)."""
        with self._lock:
            if self.value is None:
                return
            self.value = None
        self.logger.warning("schedule runner: leadership lost (epoch %d): %s", self.epoch, why)
        self.on_change(False)

    def _valid_for(self) -> float:
        return self.ttl_s - self.ttl_s * DRIFT_FACTOR - DRIFT_MIN_S

    def _warn(self, exc: Exception) -> None:
        if not self._warned:
            self.logger.warning("schedule runner: cannot reach Redis for the lease, retrying: %s", exc)
            self._warned = True
