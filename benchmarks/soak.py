"""The shop under load and faults: nothing lost, nothing applied twice, every tick once.

Starts its own Redis and PostgreSQL (so it can restart them) and three replicas of
``dramatiq benchmarks.soak_worker`` (the shop plus score-keeping), each with one
worker process of eight threads (``--processes``, ``--threads``). Load threads
(``--load-threads``, two) place orders, one transaction each, on a steady schedule;
the schedule fires a job and an event ``@every 1s``. Meanwhile faults are injected in turn:
``kill -9`` of a random replica and of the scheduler leader's replica, a rolling
SIGTERM restart of every replica, a Redis restart, a PostgreSQL restart, the
leader's replica paused with SIGSTOP past the lease TTL, a poison outbox event,
and garbage pushed into a queue (bytes, JSON of the wrong shape, 100 kB, a task
type no worker knows); a listener (``audit``) fails half its attempts throughout.
With ``--broker rabbitmq`` the queues live on a 3-node RabbitMQ cluster of its own
(quorum queues; Redis keeps the coordination state); besides the rotation, six times
a run, a RabbitMQ node is killed with ``kill -9`` and started again: the node leading
the ``default`` queue and another one, in turn (``rabbitmq_kill_leader``,
``rabbitmq_kill_node``). The garbage is published to the queue there. Apart from
the rotation, too, six times a run (every sixth of it, from 45 s), a worker is
killed between an inbox commit and its ack: the next ``audit`` run to commit
SIGKILLs its own process before acking (``kill_after_commit``), and its replica is
started again.

``--rate`` is in messages per second across the queues (100 by default): the load
places ``rate / 5`` orders a second, as one order makes five messages (the
``OrderPlaced`` fan-out, ``send_confirmation``, ``record_sale``, and two ``audit``
attempts on average), or ``rate / 9`` with ``--deploys`` (the ``soak.parcel``
fan-out and its two or three listeners besides); ``messages_per_order`` reports
what a run measured. ``--orders-per-second`` sets the orders instead (what
``--rate`` meant before). The schedule adds three messages a second.

The replicas run with ``WORKER_DEDUP_RETENTION`` set by ``--dedup-retention`` (2
minutes by default, so that the done marks' window is full early in a run; ``24h``
is the kit's default), and with what let 2 cores carry the most, all of it
measured on 2 cores at 1,000 messages/s (``TUNING``, ``PROCESSES``, ``THREADS``):

* the relays poll every 50 to 200 ms instead of waking at every commit
  (``OUTBOX_NOTIFY=false``, ``OUTBOX_POLL_INTERVAL_MIN``/``_MAX``): with a relay in
  every worker process woken by each of 200 commits a second, most rounds found
  nothing, and the relays took more CPU than the listeners (a 2-minute run asked
  for 200 orders a second placed 65 with it, the machine saturated, and 192 without);
* one worker process of eight threads per replica instead of two of four: 1.2 ms of
  a worker's CPU a message instead of 1.45, and 720 messages/s against 575;
* settles gathered for 5 ms (``WORKER_SETTLE_WINDOW``); a connection pool with one
  connection for each thread and for the relay, the scheduler and the inbox pruning
  (``SOAK_POOL_SIZE``), without a ping before each use (``SOAK_POOL_PRE_PING=false``:
  after the PostgreSQL restart the first use of each pooled connection fails, and
  its task is retried); ``audit``'s own failures logged without their traceback.
  Together with the above: 900 messages/s in a 2-minute run, against 720.

When the time is up the load stops, the system settles, and the ledger is read:

* ``lost``: committed orders missing any of their three effects (mail, sale, audit);
* ``duplicate_effects``: effects applied more than once (the audit listener counts runs;
  it writes through the inbox, as the shop's ``record_sale`` does);
* ``kills_after_commit``: workers that killed themselves between an inbox commit and
  its ack, and ``inbox_duplicates_prevented``: copies the inbox skipped (its
  ``task skipped: already applied (inbox)`` lines in the replicas' logs);
* ``ticks_missed`` / ``ticks_duplicated``: seconds from the first tick of each
  entry (the ``soak.tick`` job, the ``soak.beat`` event) to the end of the load
  with no run, and ticks applied more than once (each entry records its ticks
  through the inbox);
* ``stuck_messages``: messages still ready, in flight or delayed after settling (on
  RabbitMQ: ready or unacknowledged on a queue or delay queue), and
  ``dead_letters``: messages dead-lettered other than the garbage pushed in, the
  messages for the unknown task type and the copies for retired listeners, read
  from the dead letters themselves (``dead_letter_census``: each kind);
  ``dead_letters_missing``: garbage or unknown-type messages pushed in and found
  in no dead-letter set or queue (``unknown_task_skipped``: those skipped into the
  dead-letter set after their grace, as counted for ``dramatiq-gp status``);
* ``set_aside`` against ``poison_events``; ``rss_mb_start`` (minute 2) and
  ``rss_mb_end``: the largest worker process; ``rss_mb_per_worker_start`` and
  ``rss_mb_per_worker_end``: the median and the largest of every worker process then
  (``n`` of them; a replica restarted by a fault shortly before has a young process);
* ``messages_per_s``: messages the workers started while the load ran, per second,
  across the queues (retries, ticks and copies the inbox skipped included; copies the
  idempotency claim skips never start), beside ``orders_per_s`` (and
  ``orders_per_s_target``) and ``messages_per_order``: the messages of orders
  (``OrderPlaced`` and ``soak.parcel`` fan-outs and listeners) started in the whole
  run over the orders committed. The workers note each message they start
  (``SOAK_SAMPLES_DIR``, :class:`benchmarks.soak_worker.StartSamples`);
* ``queue_wait_ms_p50`` and ``queue_wait_ms_p99``: from the time a message was due
  (its ``message_timestamp``, or its ``eta`` for a retry or a delayed one) to its
  start in a worker, over the messages due while the load ran. The faults are in it:
  a ``kill -9``'d replica's prefetched messages wait out the 60 s heartbeat timeout;
* ``commit_to_listener_ms_p50`` and ``commit_to_listener_ms_p99``: from an order's
  commit (as the load saw it return) to the start of the ``record_sale`` transaction
  that recorded its sale (``shop_sales.recorded_at``, the database's ``now()`` there);
* ``relay_lag_ms_p50`` and ``relay_lag_ms_p99``: from an outbox row's ``created_at``
  (its transaction's start) to its ``published_at`` (the relay's claim of it, just
  before it enqueues the batch), over the rows of the orders still kept
  (``OUTBOX_RETENTION``, an hour);
* ``redis_used_mb_start``, ``redis_used_mb_window_full`` and ``redis_used_mb_end``:
  the soak's Redis ``used_memory`` (INFO memory, sampled every 10 s) as the load
  started, at the first sample once the done marks' window was full
  (``redis_window_full_s``: 1.5 retentions after the load started; a mark is kept
  at most a quarter of the retention longer than the retention), and as the load
  stopped; ``redis_used_mb_slope_per_min``: its least-squares slope over the samples
  from then to the end of the load, which should be about 0 (the marks expire in
  slices of a quarter of the retention, so memory saw-tooths around its level; each
  ``garbage_message`` fault adds a dead letter of 100 kB). None when the run is too
  short for three samples after the window is full. Messages stored in Redis count
  in it too: ``redis_stored_messages_window_full`` and ``redis_stored_messages_end``
  are those in the queues, delay queues and dead-letter sets then (on Redis; 0 on
  RabbitMQ): a backlog that grows (the workers not keeping up) and, with
  ``--deploys``, the copies for retired listeners, dead-lettered and kept for
  Dramatiq's 7 days, grow it whatever the done marks do.

``--deploys`` adds rolling deploys, every minute from 30 s: each replica in turn is
stopped with SIGTERM and started again as the next version (``SOAK_VERSION``), as a
deploy does. With each order the load also commits a ``soak.parcel`` event, whose
listeners change with the version (``benchmarks.soak_tables.parcel_listeners``: each
deploy adds one and retires the one the deploy before last added), and from
version 3 on the load writes it with an added field, ``weight_g``, before any
worker of that version runs (the web application deployed first). It reports:

* ``deploys``; ``handover_ms_max``: from the SIGTERM of the scheduler leader's
  replica until a process of another replica holds the lease; ``stop_s_max``: from a
  SIGTERM to the replica's exit;
* ``listener_deliveries_missed``: for every committed ``soak.parcel`` event, each
  listener that was live when it committed (the first replica of the version that
  added it had started, and the last one having it had not stopped more than
  :data:`GONE_MARGIN_S` earlier) and has no delivery of it, nor a copy still stored;
  ``listener_deliveries_dead_lettered`` and ``listener_deliveries_held``: those whose
  copy is in the dead-letter set, or still held in a queue or delay queue at the end
  (``WORKER_UNKNOWN_TASK_GRACE``), because the last worker with their listener stopped
  first (a copy a ``kill -9``'d worker held comes back after the 60 s heartbeat
  timeout on Redis);
  ``duplicate_effects`` counts their deliveries applied twice too;
  ``retired_listener_skipped``: copies fanned out to a listener after its last
  worker stopped, held and skipped into the dead-letter set.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from benchmarks.soak_tables import parcel_listeners
from dramatiq_gp.durations import parse_duration
from dramatiq_gp.keys import SchedulerKeys

ROOT = Path(__file__).resolve().parent.parent
REPLICAS = 3
#: Worker processes and threads per replica (``--processes``, ``--threads``).
PROCESSES, THREADS = 1, 8
#: Database connections a worker process keeps beyond one per thread: the relay's, the scheduler's, the inbox pruning's.
POOL_SPARE = 4
#: Threads placing orders, each its share of the rate (``--load-threads``).
LOAD_THREADS = 2
#: ``--dedup-retention``: short, so that the done marks' window is full early in a run.
DEDUP_RETENTION = "2m"
#: How often the soak's Redis ``used_memory`` is sampled; and when, in retentions after the load
#: started, the done marks' window is taken to be full: a mark is kept at most a quarter of the
#: retention longer than the retention (:mod:`dramatiq_gp.brokers.done_marks`), and a margin.
REDIS_SAMPLE_S, WINDOW_FULL = 10.0, 1.5
#: Where messages are stored in Redis (beside each, ``.msgs``): counted with each memory sample.
STORED_QUEUES = [f"{q}{kind}" for q in ("default", "mail", "reports") for kind in ("", ".DQ", ".XQ")]
#: Messages one order makes across the queues (``messages_per_order`` measures it): the
#: ``OrderPlaced`` fan-out, ``send_confirmation``, ``record_sale`` and ``audit``, which fails half
#: its attempts (two on average); with ``--deploys`` the ``soak.parcel`` fan-out and its listeners too.
MESSAGES_PER_ORDER, MESSAGES_PER_ORDER_DEPLOYS = 5.0, 9.0
#: What the replicas run with beside the soak's own settings (see the module docstring).
TUNING = {
    "WORKER_SETTLE_WINDOW": "5ms",
    "SOAK_POOL_PRE_PING": "false",
    "OUTBOX_NOTIFY": "false",
    "OUTBOX_POLL_INTERVAL_MIN": "50ms",
    "OUTBOX_POLL_INTERVAL_MAX": "200ms",
}
LEASE_TTL_S = 3.0
#: ``--deploys``: the first deploy, and the gap between two.
DEPLOY_FIRST_S, DEPLOY_GAP_S = 30.0, 60.0
#: A listener whose last worker stopped this long before an event committed is not owed it: the
#: event's fan-out may come after (a relay's batch, a fault), when no worker can run it any more.
GONE_MARGIN_S = 15.0
#: ``--deploys``: how long a listener no worker declares stays in the fan-out.
LISTENER_RETIREMENT = "20s"


@dataclass
class Replica:
    index: int
    env: dict[str, str]
    log: Path
    processes: int = PROCESSES
    threads: int = THREADS
    process: subprocess.Popen[bytes] | None = None

    @property
    def version(self) -> int:
        return int(self.env.get("SOAK_VERSION", "0"))

    def started(self, client: Any, namespace: str) -> bool:
        """Whether every worker process has started its consumers (each records itself as it does)."""
        from dramatiq_gp.keys import workers

        pids = set(self.pids())
        recorded = {json.loads(value)["pid"] for value in client.hvals(workers(namespace))}
        return len(pids) == self.processes and pids <= recorded

    def start(self) -> None:
        command = [sys.executable, "-m", "dramatiq", "benchmarks.soak_worker"]
        command += ["-p", str(self.processes), "-t", str(self.threads)]
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                command, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def pids(self) -> list[int]:
        """The replica's worker processes."""
        if self.process is None:
            return []
        try:
            out = subprocess.run(["pgrep", "-P", str(self.process.pid)], capture_output=True, text=True).stdout
        except OSError:
            return []
        return [int(p) for p in out.split()]

    def signal_all(self, signum: int) -> None:
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):  # already gone
                os.killpg(self.process.pid, signum)

    def stop(self, timeout: float = 30) -> None:
        if self.process is None:
            return
        self.signal_all(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.signal_all(signal.SIGKILL)
            self.process.wait()

    def kill(self) -> None:
        self.signal_all(signal.SIGKILL)
        if self.process is not None:
            self.process.wait()


@dataclass
class Soak:
    minutes: float
    #: Orders per second (``--rate`` is in messages per second: ``main`` divides it by :data:`MESSAGES_PER_ORDER`).
    rate: float
    work: Path
    broker: str = "redis"
    deploys: bool = False
    #: ``WORKER_DEDUP_RETENTION`` of the replicas (``--dedup-retention``).
    dedup_retention: str = DEDUP_RETENTION
    #: Worker processes and threads per replica (``--processes``, ``--threads``).
    processes: int = PROCESSES
    threads: int = THREADS
    #: Threads placing orders, each its share of the rate (``--load-threads``).
    load_threads: int = LOAD_THREADS
    faults: Counter[str] = field(default_factory=Counter)
    committed: list[int] = field(default_factory=list)
    #: ``--deploys``: when each order committed, the version the load writes ``soak.parcel`` for,
    #: when each listener went live and when its last worker stopped, hand-overs and stops.
    committed_at: dict[int, float] = field(default_factory=dict)
    web_version: int = 0
    live_from: dict[str, float] = field(default_factory=dict)
    gone_at: dict[str, float] = field(default_factory=dict)
    #: (when, what) of every fault and deploy, to tell why a delivery was missed.
    timeline: list[tuple[float, str]] = field(default_factory=list)
    handovers_ms: list[float] = field(default_factory=list)
    stops_s: list[float] = field(default_factory=list)
    poison: int = 0
    garbage: int = 0
    unknown: int = 0
    kills_after_commit: int = 0
    rss_start: float = 0.0
    rss_workers_start: list[float] = field(default_factory=list)
    #: (seconds since the load started, bytes of the soak's Redis ``used_memory``, messages stored in its
    #: queues, delay queues and dead-letter sets), every :data:`REDIS_SAMPLE_S`.
    redis_memory: list[tuple[float, int, int]] = field(default_factory=list)
    stop_load: threading.Event = field(default_factory=threading.Event)
    _order_ids: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    def run(self) -> dict[str, Any]:
        from tests.servers import OwnPostgres, OwnRedis, RabbitmqCluster

        self.redis, self.postgres = OwnRedis(self.work / "redis"), OwnPostgres(self.work / "pg")
        self.rabbitmq = RabbitmqCluster(self.work / "rabbitmq") if self.broker == "rabbitmq" else None
        self.redis.start()
        self.postgres.start()
        try:
            if self.rabbitmq is not None:
                self.rabbitmq.start()
            return self._run()
        finally:
            for replica in getattr(self, "replicas", []):
                replica.kill()
            if self.rabbitmq is not None:
                self.rabbitmq.stop()
            self.redis.stop()
            self.postgres.stop()

    def _run(self) -> dict[str, Any]:
        import sqlalchemy as sa

        from benchmarks import soak_tables
        from examples.shop.db import metadata

        self.namespace = f"soak-{uuid.uuid4().hex[:6]}"
        self.samples_dir = self.work / "samples"
        self.samples_dir.mkdir(exist_ok=True)
        db_url = self.postgres.url
        self.engine = sa.create_engine(db_url, pool_pre_ping=True)
        metadata.create_all(self.engine)
        soak_tables.metadata.create_all(self.engine)
        # The default catch-up policy: every takeover here is within the misfire threshold.
        env = {
            **os.environ,
            "REDIS_URL": self.redis.url,
            "DB_URL": db_url,
            "VALKEY_NAMESPACE": self.namespace,
            "SCHEDULER_LEASE_TTL": f"{LEASE_TTL_S}s",
            "WORKER_MIN_BACKOFF": "200ms",
            "WORKER_MAX_BACKOFF": "2s",
            "WORKER_SHUTDOWN_TIMEOUT": "10s",
            "WORKER_UNKNOWN_TASK_GRACE": "10s",
            "OUTBOX_MAX_ATTEMPTS": "3",
            "WORKER_DEDUP_RETENTION": self.dedup_retention,
            **TUNING,
            "SOAK_VERSION": "0",
            "SOAK_SAMPLES_DIR": str(self.samples_dir),
            "SOAK_POOL_SIZE": str(self.threads + POOL_SPARE),
            "LOG_LEVEL": "WARN",
            "PYTHONPATH": str(ROOT),
        }
        if self.deploys:
            # A copy for a new listener that an old worker fetches during a deploy is held until a new
            # worker takes it: for longer than a whole deploy lasts.
            env.update(WORKER_UNKNOWN_TASK_GRACE="60s", WORKER_LISTENER_RETIREMENT=LISTENER_RETIREMENT)
        if self.rabbitmq is not None:
            env["BROKER_URL"] = ";".join(self.rabbitmq.urls)
        from dramatiq_gp.outbox.write import set_notify

        set_notify(env["OUTBOX_NOTIFY"] == "true")  # the load's dispatches, as the replicas' relays expect
        self.replicas = [
            Replica(i, env, self.work / f"replica-{i}.log", self.processes, self.threads) for i in range(REPLICAS)
        ]
        for replica in self.replicas:
            replica.start()
        time.sleep(5)
        self.live_from = dict.fromkeys(parcel_listeners(0), 0.0)
        self.load_started_at = time.time()
        loads = [
            threading.Thread(target=self._load, args=(self.rate / self.load_threads,), daemon=True)
            for _ in range(self.load_threads)
        ]
        for load in loads:
            load.start()
        sampler = threading.Thread(target=self._sample_redis_memory, daemon=True)
        sampler.start()
        started = time.monotonic()
        end = started + self.minutes * 60
        fault_gap = max(5.0, self.minutes * 60 / 40)
        kinds = [
            "kill_replica",
            "kill_leader",
            "pause_leader",
            "redis_restart",
            "postgres_restart",
            "rolling_restart",
            "poison_event",
            "garbage_message",
        ]
        next_fault, rotation = started + fault_gap, 0
        # Not in the rotation: aimed at the gap between an inbox commit and its ack, at least 4 times a run.
        commit_kill_gap = max(10.0, self.minutes * 60 / 6)
        next_commit_kill = started + min(45.0, commit_kill_gap / 2)
        # Nor these, six times a run on RabbitMQ: kill -9 of the node leading `default`, then of another, in turn.
        node_kill_gap = max(20.0, self.minutes * 60 / 6)
        next_node_kill = started + node_kill_gap / 2 if self.rabbitmq is not None else float("inf")
        next_deploy = started + DEPLOY_FIRST_S if self.deploys else float("inf")
        while time.monotonic() < end:
            if not self.rss_start and time.monotonic() - started >= min(120, self.minutes * 60 / 3):
                self.rss_workers_start = self._rss_workers()
                self.rss_start = max(self.rss_workers_start, default=0.0)
            if time.monotonic() >= next_node_kill:
                kind = ("rabbitmq_kill_leader", "rabbitmq_kill_node")[
                    sum(self.faults[k] for k in ("rabbitmq_kill_leader", "rabbitmq_kill_node")) % 2
                ]
                self._inject(kind)
                self.faults[kind] += 1
                print(f"[{time.monotonic() - started:6.0f}s] fault {kind}", flush=True)
                self.timeline.append((time.time(), kind))
                next_node_kill += node_kill_gap  # on the clock: a node takes a while to start again
            elif time.monotonic() >= next_deploy:
                self._deploy()
                print(f"[{time.monotonic() - started:6.0f}s] deployed version {self.web_version}", flush=True)
                self.timeline.append((time.time(), f"deployed version {self.web_version}"))
                next_deploy += DEPLOY_GAP_S
            elif time.monotonic() >= next_fault:
                kind = kinds[rotation % len(kinds)]
                rotation += 1
                self._inject(kind)
                self.faults[kind] += 1
                print(f"[{time.monotonic() - started:6.0f}s] fault {kind}", flush=True)
                self.timeline.append((time.time(), kind))
                next_fault = time.monotonic() + fault_gap
            elif time.monotonic() >= next_commit_kill:
                killed = self._kill_after_commit()
                self.faults["kill_after_commit"] += 1
                print(f"[{time.monotonic() - started:6.0f}s] fault kill_after_commit: {killed}", flush=True)
                self.timeline.append((time.time(), "kill_after_commit"))
                next_commit_kill = time.monotonic() + commit_kill_gap
            time.sleep(0.2)
        self.stop_load.set()
        for load in loads:
            load.join()
        self.load_stopped_at = datetime.now(UTC)
        load_seconds = time.time() - self.load_started_at
        sampler.join()
        rss_workers_end = self._rss_workers()
        self._settle()
        result = self._ledger()
        result.update(
            broker=self.broker,
            minutes=self.minutes,
            faults_injected=sum(self.faults.values()),
            faults=dict(self.faults),
            rss_mb_start=round(self.rss_start, 1),
            rss_mb_end=round(max(rss_workers_end, default=0.0), 1),
            rss_mb_per_worker_start=_spread(self.rss_workers_start),
            rss_mb_per_worker_end=_spread(rss_workers_end),
            events_per_s=round(len(self.committed) / (self.minutes * 60), 1),
            orders_per_s_target=round(self.rate, 1),
            orders_per_s=round(len(self.committed) / load_seconds, 1),
            dedup_retention=self.dedup_retention,
            worker_processes=REPLICAS * self.processes,
            worker_threads=self.threads,
        )
        result.update(self._timing_figures(load_seconds))
        result.update(self._redis_memory_figures())
        if self.deploys:
            figures = self._deploy_figures()
            result.update(figures)
            result["duplicate_effects"] += figures["listener_duplicate_effects"]
        for replica in self.replicas:
            replica.stop()
        self.engine.dispose()
        return result

    # -- load and faults -------------------------------------------------------------

    def _deploy(self) -> None:
        """Roll out the next version: each replica in turn stopped with SIGTERM, started as the new one.

        The load writes the new version's events from the start (the web application
        first). A listener the version adds is live once the first new replica has
        started; one it drops is gone once the last replica that had it has stopped.
        """
        import redis

        self.web_version = version = self.web_version + 1
        client = redis.Redis.from_url(self.redis.url)
        try:
            for replica in self.replicas:
                leader = self._leader_replica()
                old_pids = set(replica.pids())
                stopping = time.time()
                replica.signal_all(signal.SIGTERM)
                if leader is replica:
                    self._time_handover(client, stopping, old_pids)
                replica.stop()
                self.stops_s.append(time.time() - stopping)
                still = {
                    name
                    for other in self.replicas
                    if other.process is not None and other.process.poll() is None
                    for name in parcel_listeners(other.version)
                }
                for name in set(parcel_listeners(replica.version)) - still:
                    self.gone_at.setdefault(name, time.time())
                replica.env = {**replica.env, "SOAK_VERSION": str(version)}
                replica.start()
                deadline = time.monotonic() + 60
                while not replica.started(client, self.namespace) and time.monotonic() < deadline:
                    time.sleep(0.05)
                for name in parcel_listeners(version):
                    self.live_from.setdefault(name, time.time())
            self.faults["deploy"] += 1
        finally:
            client.close()

    def _time_handover(self, client: Any, stopping: float, old_pids: set[int]) -> None:
        """Wait for a process outside ``old_pids`` to hold the lease; record when it took it."""
        deadline = time.monotonic() + 4 * LEASE_TTL_S
        keys = SchedulerKeys(self.namespace)
        while time.monotonic() < deadline:
            try:
                info = client.hgetall(keys.leader)
            except Exception:
                info = {}
            if info and int(info[b"pid"]) not in old_pids and int(info[b"acquired_at"]) / 1000 >= stopping:
                self.handovers_ms.append(int(info[b"acquired_at"]) - stopping * 1000)
                return
            time.sleep(0.005)
        self.handovers_ms.append(float("inf"))
        # Why: the last things that happened before (a fault the SIGTERM met), and who holds the lease now.
        holder: dict[str, str] = {}
        with contextlib.suppress(Exception):
            holder = {k.decode(): v.decode() for k, v in client.hgetall(keys.leader).items()}
        what = f"no hand-over within {4 * LEASE_TTL_S} s of the SIGTERM (old pids {sorted(old_pids)}); lease {holder}"
        self.timeline.append((time.time(), what))
        print(what, flush=True)

    def _deploy_figures(self) -> dict[str, Any]:
        """What ``--deploys`` adds to the result (see the module docstring)."""
        import sqlalchemy as sa

        from benchmarks.soak_tables import deliveries

        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(deliveries.c.listener, deliveries.c.order_id, deliveries.c.runs)).all()
        delivered: dict[str, set[int]] = {}
        for listener, order_id, _runs in rows:
            delivered.setdefault(listener, set()).add(order_id)
        parked = self._parked_parcel_deliveries()
        missed: dict[str, int] = {}
        set_aside = held = 0
        detail = []
        for name, live_from in self.live_from.items():
            gone = self.gone_at.get(name, float("inf"))
            owed = {order for order, at in self.committed_at.items() if live_from <= at < gone - GONE_MARGIN_S}
            undelivered = owed - delivered.get(name, set())
            # Held, then skipped with the reason, once no worker had the listener any more: not lost.
            kept = {order: parked[(name, order)] for order in undelivered if (name, order) in parked}
            set_aside += sum(where == "dead" for where in kept.values())
            held += sum(where == "held" for where in kept.values())
            missing = sorted(undelivered - kept.keys())
            missed[name] = len(missing)
            for order in missing[:5]:
                at = self.committed_at[order]
                published = self._published_at(order)
                detail.append(
                    {
                        "listener": name,
                        "order": order,
                        "s_after_live": round(at - live_from, 1),
                        "s_before_gone": round(gone - at, 1) if gone != float("inf") else None,
                        # Fanned out later than the retirement after ``gone``: the listener was no longer sent to.
                        "s_published_after_commit": round(published - at, 1) if published is not None else None,
                        "between": [what for when, what in self.timeline if at - 5 <= when <= min(gone, at + 120)],
                    }
                )
        return {
            "deploys": self.faults["deploy"],
            "versions": self.web_version,
            "handover_ms_max": round(max(self.handovers_ms), 1) if self.handovers_ms else None,
            "handovers": len(self.handovers_ms),
            "stop_s_max": round(max(self.stops_s), 2) if self.stops_s else None,
            "listener_deliveries_missed": sum(missed.values()),
            "listener_deliveries_missed_by_listener": missed,
            "listener_deliveries_missed_detail": detail,
            "listener_deliveries_dead_lettered": set_aside,
            "listener_deliveries_held": held,
            "listener_deliveries": len(rows),
            "listener_duplicate_effects": sum(runs - 1 for _, _, runs in rows),
        }

    def _published_at(self, order: int) -> float | None:
        """When the relay fanned out the ``soak.parcel`` event of ``order`` (epoch seconds), if it is still kept."""
        import sqlalchemy as sa

        query = sa.text(
            "SELECT extract(epoch FROM published_at) FROM outbox_events "
            "WHERE event = 'soak.parcel' AND (payload::jsonb ->> 'order_id')::bigint = :order"
        )
        with self.engine.connect() as conn:
            found = conn.execute(query, {"order": order}).scalar()
        return None if found is None else float(found)

    def _parked_parcel_deliveries(self) -> dict[tuple[str, int], str]:
        """(listener, order) of every ``soak.parcel`` listener message still stored at the end: ``"dead"`` in a
        dead-letter set or queue, ``"held"`` in a queue or delay queue (held for a task type no worker has)."""
        found: dict[tuple[str, int], str] = {}

        def note(data: bytes, where: str) -> None:
            try:
                message = json.loads(data)
            except (ValueError, RecursionError):  # the soak's own garbage, set aside as it came
                return
            prefix = "listener:soak.parcel:"
            if isinstance(message, dict) and str(message.get("actor_name", "")).startswith(prefix):
                key = (message["actor_name"][len(prefix) :], message["args"][0]["data"]["order_id"])
                found[key] = "dead" if where == "dead" or found.get(key) == "dead" else "held"

        if self.rabbitmq is None:
            import redis

            client = redis.Redis.from_url(self.redis.url)
            try:
                for key in client.scan_iter(f"{self.namespace}:*.msgs"):
                    where = "dead" if key.endswith(b".XQ.msgs") else "held"
                    for data in client.hvals(key):
                        note(data, where)
            finally:
                client.close()
            return found
        import pika

        connection = pika.BlockingConnection([pika.URLParameters(url) for url in self.rabbitmq.urls])
        try:
            channel = connection.channel()
            for queue, where in (("default.XQ", "dead"), ("default.DQ", "held"), ("default", "held")):
                while True:  # read without acking: closing the channel puts every one back
                    method, _properties, body = channel.basic_get(queue)
                    if method is None:
                        break
                    note(body, where)
        finally:
            connection.close()
        return found

    def _kill_after_commit(self, timeout: float = 30) -> str:
        """Arm the worker-side kill (see :mod:`benchmarks.soak_worker`), restart the replica that died."""
        import redis

        client = redis.Redis.from_url(self.redis.url)
        key = f"{self.namespace}:soak:kill_after_commit"
        logged = {replica.index: replica.log.stat().st_size for replica in self.replicas}
        try:
            client.set(key, "1")
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                dead = next((r for r in self.replicas if r.process is not None and r.process.poll() is not None), None)
                if dead is not None:
                    with open(dead.log, "rb") as log:
                        log.seek(logged[dead.index])
                        killed = b"exited unexpectedly (code -9)" in log.read()
                    dead.start()
                    if not killed:
                        return f"replica {dead.index} exited for another reason; restarted"
                    self.kills_after_commit += 1
                    return f"replica {dead.index} killed itself after an inbox commit, restarted"
                time.sleep(0.1)
            client.delete(key)
            return "no audit run committed in time; disarmed"
        except redis.RedisError as exc:
            return f"could not arm it: {exc}"
        finally:
            client.close()

    def _load(self, rate: float) -> None:
        """Place orders at ``rate`` a second, one transaction each, until the load stops.

        On a schedule, not a sleep after each order: a slow commit is made up for by
        the next ones, unless the load fell more than a second behind (PostgreSQL away):
        then the schedule starts again from now, as a web application's requests would
        have failed meanwhile, not waited.
        """
        from sqlalchemy.orm import Session

        from dramatiq_gp.outbox.table import OUTBOX_EVENTS
        from examples.shop.place_orders import place_order

        gap = 1 / rate
        due = time.monotonic() + random.random() * gap  # the load threads out of step
        while not self.stop_load.is_set():
            now = time.monotonic()
            if due > now:
                time.sleep(due - now)
            elif now - due > 1:
                due = now
            due += gap
            order_id = next(self._order_ids)
            try:
                with Session(self.engine) as session, session.begin():
                    place_order(session, order_id, f"c{order_id}@example.com", 1000 + order_id % 500)
                    if self.deploys:
                        # As the web application writes it: with the added field once that version is out.
                        parcel = {"order_id": order_id, **({"weight_g": 250} if self.web_version >= 3 else {})}
                        session.execute(
                            OUTBOX_EVENTS.insert().values(id=uuid.uuid4(), event="soak.parcel", payload=parcel)
                        )
                self.committed_at[order_id] = time.time()
                self.committed.append(order_id)
            except Exception:  # PostgreSQL restarting: this order was not committed (its id stays unused)
                time.sleep(0.2)

    def _leader_replica(self) -> Replica | None:
        import redis

        client = redis.Redis.from_url(self.redis.url)
        try:
            pid = client.hget(SchedulerKeys(self.namespace).leader, "pid")
        except redis.RedisError:
            return None
        finally:
            client.close()
        return next((r for r in self.replicas if pid and int(pid) in r.pids()), None)

    def _inject(self, kind: str) -> None:
        if kind in ("kill_replica", "kill_leader"):
            replica = (self._leader_replica() if kind == "kill_leader" else None) or random.choice(self.replicas)
            replica.kill()
            time.sleep(1)
            replica.start()
        elif kind == "pause_leader":
            replica = self._leader_replica() or random.choice(self.replicas)
            replica.signal_all(signal.SIGSTOP)
            time.sleep(LEASE_TTL_S + 2)
            replica.signal_all(signal.SIGCONT)
        elif kind == "rolling_restart":
            for replica in self.replicas:
                replica.stop()
                replica.start()
                time.sleep(2)
        elif kind == "redis_restart":
            self.redis.restart(down_for=2)
        elif kind == "postgres_restart":
            self.postgres.restart(down_for=2)
        elif kind == "poison_event":
            from dramatiq_gp.outbox.table import OUTBOX_EVENTS

            with self.engine.begin() as conn:
                conn.execute(OUTBOX_EVENTS.insert().values(id=uuid.uuid4(), event="soak.no_such_event", payload={}))
            self.poison += 1
        elif kind in ("rabbitmq_kill_leader", "rabbitmq_kill_node"):
            self._kill_rabbitmq_node(leader=kind == "rabbitmq_kill_leader")
        elif kind == "garbage_message" and self.rabbitmq is not None:
            self._publish_garbage()
        elif kind == "garbage_message":
            import dramatiq
            import redis

            client = redis.Redis.from_url(self.redis.url)
            for data in (b"\x00\xff garbage", b'{"queue_name": "default"}', b'{"x": ' + b"1" * 100_000 + b"}"):
                key = f"garbage-{uuid.uuid4().hex}"
                client.hset(f"{self.namespace}:default.msgs", key, data)
                client.rpush(f"{self.namespace}:default", key)
                self.garbage += 1
            # A well-formed message no worker has an actor for: held for the grace period, then dead-lettered.
            key = f"unknown-{uuid.uuid4().hex}"
            unknown = dramatiq.Message(
                queue_name="default",
                actor_name="soak.no_such_actor",
                args=(),
                kwargs={},
                options={"redis_message_id": key},
            )
            client.hset(f"{self.namespace}:default.msgs", key, unknown.encode())
            client.rpush(f"{self.namespace}:default", key)
            self.unknown += 1
            client.close()

    def _kill_rabbitmq_node(self, leader: bool) -> None:
        """kill -9 a node (the one leading ``default``, or another), start it again: it rejoins."""
        assert self.rabbitmq is not None
        nodes = range(len(self.rabbitmq.nodes))
        try:
            leading = self.rabbitmq.index(self.rabbitmq.leader("default"))
        except (LookupError, RuntimeError, ValueError):  # mid-election: any node will do
            leading = random.choice(nodes)
        victim = leading if leader else random.choice([i for i in nodes if i != leading])
        self.rabbitmq.kill(victim)
        time.sleep(2)
        self.rabbitmq.start(victim)

    def _publish_garbage(self) -> None:
        """What ``garbage_message`` pushes into Redis, published to ``default`` on RabbitMQ instead."""
        import dramatiq
        import pika

        assert self.rabbitmq is not None
        connection = pika.BlockingConnection([pika.URLParameters(url) for url in self.rabbitmq.urls])
        try:
            channel = connection.channel()
            channel.confirm_delivery()
            unknown = dramatiq.Message(
                queue_name="default", actor_name="soak.no_such_actor", args=(), kwargs={}, options={}
            )
            for data in (b"\x00\xff garbage", b'{"queue_name": "default"}', b'{"x": ' + b"1" * 100_000 + b"}"):
                channel.basic_publish("", "default", data, pika.BasicProperties(delivery_mode=2))
                self.garbage += 1
            channel.basic_publish("", "default", unknown.encode(), pika.BasicProperties(delivery_mode=2))
            self.unknown += 1
        finally:
            connection.close()

    def _rss_workers(self) -> list[float]:
        """The resident memory of every worker process, in MB."""
        found = []
        for replica in self.replicas:
            for pid in replica.pids():
                try:
                    with open(f"/proc/{pid}/status") as status:
                        found += [int(line.split()[1]) / 1024 for line in status if line.startswith("VmRSS:")]
                except OSError:
                    continue
        return found

    def _sample_redis_memory(self) -> None:
        """Note the soak's Redis ``used_memory`` now, every :data:`REDIS_SAMPLE_S` and as the load stops."""
        import redis

        client = redis.Redis.from_url(self.redis.url, socket_timeout=2, socket_connect_timeout=2)
        try:
            while True:
                stopped = self.stop_load.is_set()  # then this sample is the last, as the load stopped
                try:
                    used = int(client.info("memory")["used_memory"])
                    with client.pipeline(transaction=False) as pipe:
                        for queue in STORED_QUEUES:
                            pipe.hlen(f"{self.namespace}:{queue}.msgs")
                        stored = sum(pipe.execute())
                except (redis.RedisError, OSError):  # restarting: no sample this time
                    pass
                else:
                    self.redis_memory.append((time.time() - self.load_started_at, used, stored))
                if stopped:
                    break
                self.stop_load.wait(REDIS_SAMPLE_S)
        finally:
            client.close()

    # -- the end -------------------------------------------------------------------

    def _timing_figures(self, load_seconds: float) -> dict[str, Any]:
        """Messages per second and per order, and how long they waited (see the module docstring)."""
        import sqlalchemy as sa

        from examples.shop.db import sales

        start_ms = self.load_started_at * 1000
        end_ms = start_ms + load_seconds * 1000
        started = for_orders = 0
        waits: list[int] = []
        for path in self.samples_dir.glob("*.txt"):
            with open(path) as lines:
                for line in lines:
                    try:
                        at_text, waited_text, actor = line.split(" ", 2)
                        at, waited = int(at_text), int(waited_text)
                    except ValueError:  # the last line of a process killed as it wrote it
                        continue
                    started += start_ms <= at <= end_ms
                    for_orders += "shop.order_placed" in actor or "soak.parcel" in actor
                    if start_ms <= at - waited <= end_ms:  # due while the load ran, whenever it started
                        waits.append(waited)
        relay_lag = sa.text(
            "SELECT percentile_cont(ARRAY[0.5, 0.99]) WITHIN GROUP "
            "(ORDER BY 1000 * extract(epoch FROM published_at - created_at)) "
            "FROM outbox_events WHERE published_at IS NOT NULL AND event IN ('shop.order_placed', 'soak.parcel')"
        )
        with self.engine.connect() as conn:
            lag = conn.execute(relay_lag).scalar() or [None, None]
            recorded = conn.execute(sa.select(sales.c.order_id, sa.extract("epoch", sales.c.recorded_at))).all()
        to_listener = [
            1000 * (float(at) - self.committed_at[order]) for order, at in recorded if order in self.committed_at
        ]
        return {
            "messages_per_s": round(started / load_seconds, 1),
            "messages_per_order": round(for_orders / len(self.committed), 2) if self.committed else None,
            "queue_wait_ms_p50": _percentile(waits, 50),
            "queue_wait_ms_p99": _percentile(waits, 99),
            "commit_to_listener_ms_p50": _percentile(to_listener, 50),
            "commit_to_listener_ms_p99": _percentile(to_listener, 99),
            "relay_lag_ms_p50": None if lag[0] is None else round(lag[0], 1),
            "relay_lag_ms_p99": None if lag[1] is None else round(lag[1], 1),
        }

    def _redis_memory_figures(self) -> dict[str, Any]:
        """Redis ``used_memory`` as the load started and stopped, and its slope once the done marks' window was full."""
        mb = 1024 * 1024
        full_s = WINDOW_FULL * parse_duration(self.dedup_retention).total_seconds()
        after = [(t, used / mb) for t, used, _ in self.redis_memory if t >= full_s]
        stored = {t: n for t, _, n in self.redis_memory}
        slope = None
        if len(after) >= 3:
            mean_t = sum(t for t, _ in after) / len(after)
            mean_mb = sum(m for _, m in after) / len(after)
            spread = sum((t - mean_t) ** 2 for t, _ in after)
            slope = 60 * sum((t - mean_t) * (m - mean_mb) for t, m in after) / spread
        return {
            "redis_used_mb_start": round(self.redis_memory[0][1] / mb, 1) if self.redis_memory else None,
            "redis_used_mb_window_full": round(after[0][1], 1) if after else None,
            "redis_used_mb_end": round(self.redis_memory[-1][1] / mb, 1) if self.redis_memory else None,
            "redis_used_mb_slope_per_min": None if slope is None else round(slope, 3),
            "redis_stored_messages_window_full": stored[after[0][0]] if after else None,
            "redis_stored_messages_end": self.redis_memory[-1][2] if self.redis_memory else None,
            "redis_window_full_s": round(full_s),
        }

    def _queues(self) -> list[dict[str, Any]]:
        """Per queue: messages ready, in flight, delayed and dead (as ``dramatiq-gp status`` has them).

        On RabbitMQ, from ``rabbitmqctl``: ``in_flight`` is what is unacknowledged on
        the queue and ``delayed`` what is ready or unacknowledged on its delay queue
        (a delayed message waits unacknowledged in a worker). A quorum queue's figures
        there are refreshed every 5 s (the statistics interval), not at once.
        """
        if self.rabbitmq is None:
            import redis

            from dramatiq_gp.brokers.redis_view import RedisQueueView

            client = redis.Redis.from_url(self.redis.url)
            try:
                view = RedisQueueView(client, self.namespace)
                return view.counts(view.names(thorough=True))
            finally:
                client.close()
        rows = {row["name"]: row for row in self.rabbitmq.queues("messages_ready", "messages_unacknowledged")}

        def count(name: str, column: str) -> int:
            return int(rows.get(name, {}).get(column) or 0)

        return [
            {
                "name": name,
                "ready": count(name, "messages_ready"),
                "in_flight": count(name, "messages_unacknowledged"),
                "delayed": count(f"{name}.DQ", "messages_ready") + count(f"{name}.DQ", "messages_unacknowledged"),
                "dead": count(f"{name}.XQ", "messages_ready") + count(f"{name}.XQ", "messages_unacknowledged"),
            }
            for name in rows
            if not name.endswith((".DQ", ".XQ"))
        ]

    def _counts(self) -> tuple[int, int]:
        """Outbox rows pending, and messages ready, in flight or delayed."""
        from dramatiq_gp.status import outbox_status

        messages = sum(q["ready"] + q["in_flight"] + q["delayed"] for q in self._queues())
        return outbox_status(self.engine)["pending"], messages

    def _lingering(self, looks: int = 5) -> tuple[int, int]:
        """:meth:`_counts`, looked at again while it finds messages: a stuck one stays.

        The scheduler's entries keep firing every second, and a worker acks a finished
        message up to ``WORKER_SETTLE_WINDOW`` later: one look can catch a tick in flight.
        On RabbitMQ the looks span more than one refresh of its figures.
        """
        pending, messages = self._counts()
        for _ in range(looks - 1):
            if not messages:
                break
            time.sleep(0.5 if self.rabbitmq is None else 2)
            pending, messages = self._counts()
        return pending, messages

    def _settle(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                pending, messages = self._counts()
            except Exception:
                pending, messages = -1, -1
            if pending == 0 and messages == 0:
                return
            time.sleep(1)

    def _ledger(self) -> dict[str, Any]:
        import sqlalchemy as sa

        from benchmarks.soak_tables import audit, ticks
        from examples.shop.db import sales, sent_emails

        committed = set(self.committed)
        with self.engine.connect() as conn:
            mailed = {
                int(k.rsplit(":", 1)[1])
                for (k,) in conn.execute(
                    sa.select(sent_emails.c.dedup_key).where(sent_emails.c.dedup_key.like("order-confirmation:%"))
                )
            }
            sold = set(conn.execute(sa.select(sales.c.order_id)).scalars())
            audit_runs = conn.execute(sa.select(audit.c.order_id, audit.c.runs)).all()
            tick_runs: dict[str, dict[datetime, int]] = {}
            for entry, tick, runs in conn.execute(sa.select(ticks.c.entry, ticks.c.tick, ticks.c.runs)):
                tick_runs.setdefault(entry, {})[tick] = runs
            set_aside = conn.execute(
                sa.text("SELECT count(*) FROM outbox_events WHERE failed_at IS NOT NULL")
            ).scalar_one()
        audited = {order_id for order_id, _ in audit_runs}
        lost = len(committed - mailed) + len(committed - sold) + len(committed - audited)
        # One envelope per order, so a second row for an order would be a duplicate too.
        duplicates = sum(runs - 1 for _, runs in audit_runs) + len(audit_runs) - len(audited)
        missed = {entry: self._ticks_missed(runs) for entry, runs in tick_runs.items()}
        missed.update({entry: -1 for entry in ("soak.tick", "soak.beat") if entry not in tick_runs})
        pending, messages = self._lingering()
        lost_orders = sorted(committed - (mailed & sold & audited))
        diagnosis = self._diagnose(lost_orders[:5]) if lost_orders else []
        import redis

        from dramatiq_gp.status import skipped_status

        queues = self._queues()
        client = redis.Redis.from_url(self.redis.url)
        stuck = [q for q in queues if q["ready"] + q["in_flight"] + q["delayed"]]
        all_skipped = skipped_status(client, self.namespace)
        skipped = all_skipped.get("soak.no_such_actor", 0)
        retired = sum(n for task_type, n in all_skipped.items() if task_type.startswith("listener:soak.parcel:"))
        # Dead letters other than those pushed in on purpose and the copies for retired listeners:
        # messages that failed every retry. Read from the dead letters themselves: the counters
        # can be off (a skip counted twice when its ack was lost, a Redis restart).
        census = self._dead_letter_census([q["name"] for q in queues])
        dead_letters = census["other"]
        if stuck and self.rabbitmq is None:  # where the stuck ones are: whose unacked sets, do those workers beat
            now = time.time() * 1000
            beats = {
                k.decode(): now - v
                for k, v in client.zrange(f"{self.namespace}:__heartbeats__", 0, -1, withscores=True)
            }
            for key in client.scan_iter(f"{self.namespace}:__acks__.*"):
                worker_id = key.decode().split("__acks__.")[1].split(".")[0]
                stuck.append(
                    {
                        "acks": key.decode().split("__acks__.")[1],
                        "size": client.scard(key),
                        "heartbeat_age_ms": beats.get(worker_id),
                    }
                )
            stuck.append({"dq_list": client.llen(f"{self.namespace}:default.DQ")})
        client.close()
        return {
            "orders": len(committed),
            "lost": lost,
            "lost_by_effect": {
                "mail": len(committed - mailed),
                "sale": len(committed - sold),
                "audit": len(committed - audited),
            },
            "stuck_by_queue": stuck,
            "lost_orders": diagnosis,
            "duplicate_effects": duplicates,
            "kills_after_commit": self.kills_after_commit,
            "inbox_duplicates_prevented": sum(
                replica.log.read_text(errors="replace").count("task skipped: already applied (inbox)")
                for replica in self.replicas
                if replica.log.exists()
            ),
            "ticks": {entry: len(runs) for entry, runs in tick_runs.items()},
            "ticks_missed": sum(abs(n) for n in missed.values()),
            "ticks_missed_by_entry": missed,
            "ticks_duplicated": sum(1 for runs in tick_runs.values() for n in runs.values() if n > 1),
            "stuck_messages": messages,
            "dead_letters": dead_letters,
            "outbox_pending": pending,
            "poison_events": self.poison,
            "set_aside": int(set_aside),
            "garbage_messages": self.garbage,
            "unknown_task_messages": self.unknown,
            "unknown_task_skipped": skipped,
            "retired_listener_skipped": retired,
            "dead_letter_census": dict(census),
            # Pushed in on purpose, and not found among the dead letters: lost on the way there.
            "dead_letters_missing": max(0, self.garbage - census["garbage"])
            + max(0, self.unknown - census["unknown_task"]),
        }

    def _dead_letter_census(self, queues: list[str]) -> Counter[str]:
        """The dead letters of ``queues`` by kind: ``garbage`` (not a message), ``unknown_task``
        (``soak.no_such_actor``), ``retired_listener`` (a ``soak.parcel`` listener's), ``other``."""
        census: Counter[str] = Counter()

        def note(data: bytes) -> None:
            try:
                message = json.loads(data)
            except (ValueError, RecursionError):
                message = None
            if not isinstance(message, dict) or not isinstance(message.get("actor_name"), str):
                census["garbage"] += 1
            elif message["actor_name"] == "soak.no_such_actor":
                census["unknown_task"] += 1
            elif message["actor_name"].startswith("listener:soak.parcel:"):
                census["retired_listener"] += 1
            else:
                census["other"] += 1

        if self.rabbitmq is None:
            import redis

            client = redis.Redis.from_url(self.redis.url)
            try:
                for queue in queues:
                    for data in client.hvals(f"{self.namespace}:{queue}.XQ.msgs"):
                        note(data)
            finally:
                client.close()
            return census
        import pika

        connection = pika.BlockingConnection([pika.URLParameters(url) for url in self.rabbitmq.urls])
        try:
            channel = connection.channel()
            for queue in queues:
                while True:  # read without acking: closing the channel puts every one back
                    method, _properties, body = channel.basic_get(f"{queue}.XQ")
                    if method is None:
                        break
                    note(body)
        finally:
            connection.close()
        return census

    def _ticks_missed(self, runs: dict[datetime, int]) -> int:
        """Seconds with no run between an entry's first tick and the end of the load."""
        first = min(runs)
        # The schedule runs on while the system settles, so a tick before the load
        # stopped that never ran is missing even if it is the last one.
        last = max(max(runs), self.load_stopped_at.replace(microsecond=0) - timedelta(seconds=5))
        expected = int((last - first) / timedelta(seconds=1)) + 1
        return expected - sum(1 for tick in runs if tick <= last)

    def _diagnose(self, order_ids: list[int]) -> list[dict[str, Any]]:
        """What became of the events of lost orders: their outbox rows and their messages' traces in Redis."""
        import redis
        import sqlalchemy as sa

        from dramatiq_gp.brokers.done_marks import is_done
        from dramatiq_gp.names import fan_out_id
        from dramatiq_gp.outbox.table import OUTBOX_EVENTS

        client = redis.Redis.from_url(self.redis.url)
        dead = {}
        for key in client.scan_iter(f"{self.namespace}:*.XQ.msgs"):
            for value in client.hvals(key):  # bytes: the garbage pushed in is not UTF-8
                dead[value[:300].decode(errors="replace")] = key.decode()
        found = []
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(OUTBOX_EVENTS)).mappings().all()
        for order_id in order_ids:
            row = next((r for r in rows if r["payload"].get("order_id") == order_id), None)
            entry: dict[str, Any] = {"order_id": order_id, "row": None}
            if row is not None:
                event_id = str(row["id"])
                entry["row"] = {
                    "id": event_id,
                    "published_at": str(row["published_at"]),
                    "failed_at": str(row["failed_at"]),
                    "attempts": row["attempts"],
                }
                ids = {"fan_out": event_id} | {
                    name: fan_out_id(event_id, f"listener:shop.order_placed:{name}")
                    for name in ("send_confirmation", "record_sale", "audit")
                }
                # Through the kit's own look-up: whatever the layout of the marks, a copy of a marked id is skipped.
                entry["done_marks"] = {k: is_done(client, self.namespace, v) for k, v in ids.items()}
                entry["dead_letters"] = [key for value, key in dead.items() if event_id in value]
            found.append(entry)
        client.close()
        return found


def _percentile(values: list[float] | list[int], percent: float) -> float | None:
    """The nearest-rank ``percent``-th percentile of ``values``; None if there are none."""
    if not values:
        return None
    ordered = sorted(values)
    return round(float(ordered[max(0, math.ceil(percent / 100 * len(ordered)) - 1)]), 1)


def _spread(values: list[float]) -> dict[str, Any]:
    """The median and the largest of ``values``, and how many there are."""
    if not values:
        return {"median": None, "max": None, "n": 0}
    return {"median": round(statistics.median(values), 1), "max": round(max(values), 1), "n": len(values)}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks soak", description=__doc__)
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument(
        "--rate",
        type=float,
        default=100,
        help="messages per second across the queues (default 100); the load places "
        f"rate / {MESSAGES_PER_ORDER:g} orders a second ({MESSAGES_PER_ORDER_DEPLOYS:g} with --deploys)",
    )
    parser.add_argument(
        "--orders-per-second", type=float, help="place this many orders a second instead (what --rate used to be)"
    )
    parser.add_argument(
        "--dedup-retention",
        default=DEDUP_RETENTION,
        help=f"WORKER_DEDUP_RETENTION of the replicas (default {DEDUP_RETENTION}; the kit's default is 24h)",
    )
    parser.add_argument("--processes", type=int, default=PROCESSES, help="worker processes per replica")
    parser.add_argument("--threads", type=int, default=THREADS, help="worker threads per process")
    parser.add_argument("--load-threads", type=int, default=LOAD_THREADS, help="threads placing orders")
    parser.add_argument(
        "--broker",
        choices=["redis", "rabbitmq"],
        default="redis",
        help="where the queues live: rabbitmq starts a 3-node cluster of its own",
    )
    parser.add_argument("--keep", type=Path, help="keep the replicas' logs and the servers' files in this directory")
    parser.add_argument(
        "--deploys", action="store_true", help="a rolling deploy every minute, adding and retiring listeners"
    )
    args = parser.parse_args(argv)
    try:
        parse_duration(args.dedup_retention)
    except ValueError as exc:
        parser.error(f"--dedup-retention: {exc}")
    per_order = MESSAGES_PER_ORDER_DEPLOYS if args.deploys else MESSAGES_PER_ORDER
    orders = args.orders_per_second or args.rate / per_order
    options = {
        "broker": args.broker,
        "deploys": args.deploys,
        "dedup_retention": args.dedup_retention,
        "processes": args.processes,
        "threads": args.threads,
        "load_threads": args.load_threads,
    }
    if args.keep:
        from devtools.services import PG_USER, postgres_can_reach

        args.keep.mkdir(parents=True, exist_ok=True)
        if not postgres_can_reach(args.keep):
            # Its PostgreSQL files would go to a directory of their own, removed at the end.
            print(
                f"--keep {args.keep}: user {PG_USER}, who runs PostgreSQL for root, cannot reach it; "
                "keep under a directory it can, e.g. /tmp/soak",
                file=sys.stderr,
            )
            return 2
        result = Soak(args.minutes, orders, args.keep, **options).run()
    else:
        with tempfile.TemporaryDirectory(prefix="gp-soak-") as work:
            os.chmod(work, 0o755)  # the RabbitMQ nodes run as their own user
            result = Soak(args.minutes, orders, Path(work), **options).run()
    print(", ".join(f"{k} {v}" for k, v in result.items() if k != "faults"))
    if args.json:
        print(json.dumps(result))
    return 0
