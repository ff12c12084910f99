"""One worker of the overhead benchmark: ``python -m benchmarks.overhead_worker --variant V ...``.

Started by :mod:`benchmarks.overhead` (the driver), once per variant and round. It
pins itself to one core, puts ``--messages`` no-op messages on a fresh namespace,
prints ``ready`` on stdout, and runs a worker until the driver says stop (a line on
stdin, or stdin closed; the peers stop on SIGTERM). Nothing else runs in this
process: the driver watches the queue from its own process and reads this one's
CPU time from ``/proc``.

Only the standard library is imported at the top, so a virtualenv without Dramatiq
(the peers': Celery, arq, rq and Huey) can run this module too.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import uuid
from typing import Any

DRAMATIQ_VARIANTS = (
    "bare",
    "kit",
    "kit_quiet",
    "listener",
    "db_listener",
    "inbox",
    "inbox_noclaim",
    "traced",
    "sync_io",
    "async_io",
)
#: The listeners that wait on I/O (50 ms): ``time.sleep`` in a plain one, ``asyncio.sleep`` in an ``async def`` one.
IO_VARIANTS = ("sync_io", "async_io")
IO_WAIT_S = 0.05
#: The variants whose listener writes a row to PostgreSQL (given with ``--db-url``).
DB_VARIANTS = ("db_listener", "inbox", "inbox_noclaim")
#: The table those listeners write one row per message to.
EFFECTS = "gp_bench_effects"
PEERS = ("celery_threads", "arq", "rq", "huey")
QUEUE = "bench"
#: Run through the real ``dramatiq`` command on :mod:`benchmarks.overhead_app`, not by this module.
CLI_VARIANTS = ("default", "bare_default")


def queue_name(namespace: str, rabbitmq: bool) -> str:
    """The benchmark's queue: ``bench`` in the namespace on Redis; on RabbitMQ, which has none, named after it."""
    return f"{namespace}-{QUEUE}" if rabbitmq else QUEUE


def outstanding_keys(variant: str, namespace: str) -> list[tuple[str, str]]:
    """``(command, key)`` pairs whose sum is the messages not yet processed (queued, prefetched or running)."""
    if variant == "celery_threads":  # acks_late: a message stays in the unacked hash until its task has run
        return [("llen", f"{namespace}.{QUEUE}"), ("hlen", f"{namespace}:unacked")]
    if variant == "arq":  # a job leaves the queue's sorted set when it finishes
        return [("zcard", f"{namespace}:queue")]
    if variant == "rq":  # RQ_KEY_PREFIX = namespace: queued, moved to the intermediate list, then running (wip)
        queue = f"{namespace}:queue:{QUEUE}"
        return [("llen", queue), ("llen", f"{queue}:intermediate"), ("zcard", f"{namespace}:wip:{QUEUE}")]
    if variant == "huey":
        # Huey keeps no record of a task it has popped: the (at most ``threads``) running ones are not counted.
        return [("llen", f"huey.redis.{namespace}")]
    return [("hlen", f"{namespace}:{QUEUE}.msgs")]  # Dramatiq's (and the kit's) messages hash, acked = deleted


def _log_file(variant: str) -> str:
    fd, path = tempfile.mkstemp(prefix=f"gp-bench-{variant}-", suffix=".log")
    os.close(fd)
    return path


def _log_to_file(variant: str, **formats: str) -> str:
    """INFO to a temporary file (not a terminal), as the docs recommend for the kit's task log."""
    path = _log_file(variant)
    logging.basicConfig(level=logging.INFO, filename=path, force=True, **formats)
    return path


def _ready() -> None:
    print("ready", flush=True)


def _start_telemetry() -> None:
    """A tracer provider exporting through a batch processor to nowhere, and a local Sentry endpoint."""
    from collections.abc import Sequence
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from threading import Thread

    from opentelemetry import trace
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    class Discard(SpanExporter):
        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Discard()))
    trace.set_tracer_provider(provider)

    class Accept(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(200)
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Accept)
    Thread(target=server.serve_forever, daemon=True).start()
    os.environ["SENTRY_DSN"] = f"http://public@127.0.0.1:{server.server_address[1]}/1"


def _time_garbage_collection() -> dict[str, float]:
    """The seconds spent in garbage collection from now on, in ``["s"]`` (``gc.callbacks``)."""
    import gc
    import time

    spent = {"s": 0.0, "start": 0.0}

    def callback(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            spent["start"] = time.thread_time()
        else:
            spent["s"] += time.thread_time() - spent["start"]

    gc.callbacks.append(callback)
    return spent


def _fill(broker: Any, messages: list[Any]) -> None:
    """Put ``messages`` on their queue in pipelined chunks (not timed; bare Dramatiq has no batch API)."""
    from dramatiq.common import current_millis

    dispatch = broker.scripts["dispatch"]
    for start in range(0, len(messages), 1000):
        with broker.client.pipeline(transaction=False) as pipe:
            for message in messages[start : start + 1000]:
                redis_id = str(uuid.uuid4())
                data = message.copy(options={"redis_message_id": redis_id}).encode()
                args = [
                    "enqueue",
                    current_millis(),
                    message.queue_name,
                    broker.broker_id,
                    broker.heartbeat_timeout,
                    broker.dead_message_ttl,
                    0,
                    1000,
                    redis_id,
                    data,
                ]
                dispatch(keys=[broker.namespace], args=args, client=pipe)
            pipe.execute()


def _fill_rabbitmq(broker: Any, url: str, messages: list[Any]) -> None:
    """Declare the queue (the broker's way: quorum for the kit), publish ``messages`` unconfirmed, wait for them all."""
    import time

    import pika

    queue = messages[0].queue_name
    broker.declare_queue(queue, ensure=True)
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        channel = connection.channel()
        for message in messages:
            channel.basic_publish("", queue, message.encode(), pika.BasicProperties(delivery_mode=2))
        while channel.queue_declare(queue, passive=True).method.message_count < len(messages):
            time.sleep(0.05)
    finally:
        connection.close()


def _effects_engine(db_url: str, threads: int) -> Any:
    """An engine with a connection per worker thread, on an empty effects table and an empty inbox."""
    import sqlalchemy as sa

    import dramatiq_gp as gp

    engine = sa.create_engine(db_url, pool_size=threads)
    gp.outbox.migrate(engine)
    with engine.begin() as conn:
        conn.execute(sa.text(f"CREATE TABLE IF NOT EXISTS {EFFECTS} (n bigint NOT NULL, envelope_id text NOT NULL)"))
        conn.execute(sa.text(f"TRUNCATE {EFFECTS}, {gp.outbox.INBOX_TABLE_NAME}"))
    return engine


def run_dramatiq(
    variant: str,
    messages: int,
    threads: int,
    prefetch: int,
    namespace: str,
    redis_url: str,
    db_url: str | None,
    rabbitmq_url: str | None = None,
) -> None:
    """A Dramatiq worker (bare or the kit's) with ``prefetch`` per queue; ``bare`` never imports dramatiq_gp.

    With ``rabbitmq_url`` the queue is on RabbitMQ: Dramatiq's ``RabbitmqBroker`` for
    ``bare``, the kit's (``BROKER_URL``) for the others; Redis keeps the kit's claims.
    """
    os.environ["dramatiq_queue_prefetch"] = str(prefetch)  # noqa: SIM112 (Dramatiq's spelling, read at import)
    os.environ["REDIS_URL"] = redis_url
    if rabbitmq_url is not None:
        os.environ["BROKER_URL"] = rabbitmq_url
    queue = queue_name(namespace, rabbitmq_url is not None)
    os.environ["LOG_LEVEL"] = "WARN" if variant == "kit_quiet" else "INFO"
    if variant != "traced":
        os.environ.pop("SENTRY_DSN", None)
    log_path = _log_to_file(variant)

    import dramatiq
    from dramatiq.brokers.redis import RedisBroker

    broker: Any
    if variant == "bare" and rabbitmq_url is not None:
        from dramatiq.brokers.rabbitmq import RabbitmqBroker

        broker = RabbitmqBroker(url=rabbitmq_url)
    elif variant == "bare":
        broker = RedisBroker(url=redis_url, namespace=namespace)
    else:
        if variant == "traced":
            _start_telemetry()
        import dramatiq_gp as gp

        kit = gp.Kit(registry=gp.Registry(), broker_options={"namespace": namespace})
        broker = kit.broker
        assert kit.telemetry.tracing == kit.telemetry.sentry == (variant == "traced")

    def noop(n: int) -> None:
        pass

    if variant == "listener" or variant in DB_VARIANTS or variant in IO_VARIANTS:
        from dataclasses import dataclass

        @gp.event("benchmarks.overhead.tick")
        @dataclass(frozen=True)
        class Tick:
            n: int

        if variant == "listener":
            kit.registry.listen(Tick, lambda event: None, name="noop", queue=queue)
        elif variant == "sync_io":
            import time

            def wait_sync(event: Tick) -> None:
                time.sleep(IO_WAIT_S)

            kit.registry.listen(Tick, wait_sync, name="wait", queue=queue)
        elif variant == "async_io":
            import asyncio

            async def wait_async(event: Tick) -> None:
                await asyncio.sleep(IO_WAIT_S)

            kit.registry.listen(Tick, wait_async, name="wait", queue=queue)
        else:
            # One row per message: in a transaction of its own, or in the inbox's (with or without the Redis claim).
            import sqlalchemy as sa

            assert db_url is not None, f"{variant} needs --db-url"
            engine = _effects_engine(db_url, threads)
            insert = sa.text(f"INSERT INTO {EFFECTS} (n, envelope_id) VALUES (:n, :envelope_id)")

            def write(event: Tick, conn: sa.Connection) -> None:
                conn.execute(insert, {"n": event.n, "envelope_id": gp.current_envelope().id})

            if variant == "db_listener":

                def own_transaction(event: Tick) -> None:
                    with engine.begin() as conn:
                        write(event, conn)

                kit.registry.listen(Tick, own_transaction, name="write", queue=queue)
            else:
                claim = {"idempotent": False} if variant == "inbox_noclaim" else {}
                kit.registry.listen(Tick, write, name="write", queue=queue, inbox=engine, **claim)
        batch = [m for n in range(messages) for m in kit.registry.fan_out(Tick(n), str(uuid.uuid4()))]
    else:
        actor = dramatiq.actor(noop, broker=broker, queue_name=queue, actor_name="noop")
        batch = [actor.message(n) for n in range(messages)]
    if rabbitmq_url is not None:
        _fill_rabbitmq(broker, rabbitmq_url, batch)
    else:
        _fill(broker, batch)
    del batch  # a worker holds no such list: its objects would slow every full garbage collection, on each side

    broker.emit_after("process_boot")
    worker = dramatiq.Worker(broker, worker_threads=threads)
    worker.queue_prefetch = prefetch  # the same for every variant (the env above already says so)
    collecting = _time_garbage_collection()
    _ready()
    worker.start()
    sys.stdin.readline()  # the driver's "stop", or EOF if the driver is gone
    worker.stop()
    print(f"gc {collecting['s']:.6f}", flush=True)
    os.unlink(log_path)
    if variant in DB_VARIANTS:
        with engine.connect() as conn:
            rows = conn.execute(sa.text(f"SELECT count(*), count(DISTINCT n) FROM {EFFECTS}")).one()
        if tuple(rows) != (messages, messages):
            sys.exit(f"{variant}: {rows[0]} rows ({rows[1]} distinct) for {messages} messages")


def run_celery(messages: int, threads: int, prefetch: int, namespace: str, redis_url: str) -> None:
    """Celery's threads pool, acks late (as Dramatiq acks), ``threads`` times the multiplier = ``prefetch``."""
    from celery import Celery

    log_path = _log_to_file("celery")
    queue = f"{namespace}.{QUEUE}"
    app = Celery("bench", broker=redis_url)
    app.conf.update(
        task_acks_late=True,
        task_ignore_result=True,
        worker_prefetch_multiplier=max(1, prefetch // threads),
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
        broker_transport_options={
            "unacked_key": f"{namespace}:unacked",
            "unacked_index_key": f"{namespace}:unacked_index",
            "unacked_mutex_key": f"{namespace}:unacked_mutex",
        },
    )

    @app.task(name="noop")
    def noop(n: int) -> None:
        pass

    with app.producer_or_acquire() as producer:
        for n in range(messages):
            noop.apply_async((n,), queue=queue, producer=producer)
    _ready()
    app.worker_main(
        [
            "worker",
            "--pool=threads",
            f"--concurrency={threads}",
            "--loglevel=INFO",
            f"--logfile={log_path}",
            "-Q",
            queue,
            "--without-gossip",
            "--without-mingle",
        ]
    )
    os.unlink(log_path)


def run_arq(messages: int, threads: int, prefetch: int, namespace: str, redis_url: str) -> None:
    """arq with ``max_jobs=threads``, reading up to ``prefetch`` job ids per poll, results not kept."""
    import asyncio

    from arq import Worker, create_pool
    from arq.connections import RedisSettings
    from arq.worker import func

    log_path = _log_to_file("arq")
    queue = f"{namespace}:queue"
    settings = RedisSettings.from_dsn(redis_url)

    async def noop(ctx: dict[str, Any], n: int) -> None:
        pass

    async def fill() -> None:
        pool = await create_pool(settings, default_queue_name=queue)
        for start in range(0, messages, 200):
            await asyncio.gather(*(pool.enqueue_job("noop", n) for n in range(start, min(start + 200, messages))))
        await pool.aclose()

    asyncio.run(fill())
    _ready()
    worker = Worker(
        functions=[func(noop, name="noop")],  # type: ignore[list-item]
        redis_settings=settings,
        queue_name=queue,
        max_jobs=threads,
        queue_read_limit=prefetch,
        poll_delay=0.005,
        keep_result=0,
        handle_signals=True,
    )
    worker.run()
    os.unlink(log_path)


def peer_noop(n: int) -> None:
    """rq's task: a function it imports by name in the worker."""


def run_rq(messages: int, namespace: str, redis_url: str) -> None:
    """rq's ``SimpleWorker`` (the job runs in the worker process, no fork), one job at a time, results not kept.

    rq has no threads: ``--threads`` and ``--prefetch`` do not apply (it pops one job when it is free).
    """
    os.environ["RQ_KEY_PREFIX"] = namespace  # read at import: every rq key in the namespace, cleaned up after

    from redis import Redis
    from rq import Queue, SimpleWorker
    from rq.defaults import DEFAULT_LOGGING_DATE_FORMAT, DEFAULT_LOGGING_FORMAT

    # What ``rq worker`` prints to stdout, here to a file (no terminal: no colours).
    log_path = _log_to_file("rq", format=DEFAULT_LOGGING_FORMAT, datefmt=DEFAULT_LOGGING_DATE_FORMAT)
    connection = Redis.from_url(redis_url)
    queue = Queue(QUEUE, connection=connection)
    for start in range(0, messages, 1000):
        jobs = [
            Queue.prepare_data("benchmarks.overhead_worker.peer_noop", args=(n,), result_ttl=0)
            for n in range(start, min(start + 1000, messages))
        ]
        with connection.pipeline() as pipe:
            queue.enqueue_many(jobs, pipeline=pipe)
            pipe.execute()
    _ready()
    SimpleWorker([queue], connection=connection).work(logging_level="INFO")
    os.unlink(log_path)


def run_huey(messages: int, threads: int, namespace: str, redis_url: str) -> None:
    """Huey's ``RedisHuey`` consumer as ``huey_consumer -k thread -w THREADS -l FILE`` runs it; None is not stored."""
    from huey import RedisHuey
    from huey.consumer_options import ConsumerConfig

    log_path = _log_file("huey")
    huey = RedisHuey(namespace, url=redis_url, clean_name=False)  # the queue is the list huey.redis.<namespace>

    @huey.task(name="noop")
    def noop(n: int) -> None:
        pass

    storage = huey.storage
    for start in range(0, messages, 1000):
        tasks = [huey.serialize_task(noop.s(n)) for n in range(start, min(start + 1000, messages))]
        storage.conn.lpush(storage.queue_key, *tasks)  # what noop(n) does, one LPUSH per 1,000 instead of each
    config = ConsumerConfig(workers=threads, worker_type="thread", logfile=log_path)
    config.validate()
    config.setup_logger(logging.getLogger("huey"))  # as huey_consumer does
    consumer = huey.create_consumer(**config.values)
    _ready()
    consumer.run()
    os.unlink(log_path)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.overhead_worker", description=__doc__)
    parser.add_argument("--variant", choices=DRAMATIQ_VARIANTS + PEERS, required=True)
    parser.add_argument("--messages", type=int, required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--prefetch", type=int, required=True)
    parser.add_argument("--core", type=int, required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--db-url", help="PostgreSQL for the variants that write a row")
    parser.add_argument("--rabbitmq-url", help="the queue on this RabbitMQ (the Dramatiq variants)")
    args = parser.parse_args(argv)
    os.sched_setaffinity(0, {args.core})  # before any thread starts: every thread inherits it
    if args.variant == "celery_threads":
        run_celery(args.messages, args.threads, args.prefetch, args.namespace, args.redis_url)
    elif args.variant == "arq":
        run_arq(args.messages, args.threads, args.prefetch, args.namespace, args.redis_url)
    elif args.variant == "rq":
        run_rq(args.messages, args.namespace, args.redis_url)
    elif args.variant == "huey":
        run_huey(args.messages, args.threads, args.namespace, args.redis_url)
    else:
        run_dramatiq(
            args.variant,
            args.messages,
            args.threads,
            args.prefetch,
            args.namespace,
            args.redis_url,
            args.db_url,
            args.rabbitmq_url,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
