"""What the kit costs per message, against bare Dramatiq in the same run.

Three variants, each in a fresh worker process (one process, 8 threads, the same
Redis), run alternately for several rounds; every variant logs at INFO to a file:

* ``bare``: a no-op plain actor on Dramatiq's ``RedisBroker`` with its default middleware;
* ``kit``: the same actor through the kit's full middleware stack (task logs included);
* ``listener``: a no-op listener reached through ``dispatch`` (fan-out ids and
  idempotent execution included);
* ``traced``: ``kit`` with telemetry on: each message's producer and consumer
  spans go through a batch span processor to an exporter that discards them,
  and Sentry is initialised with its DSN at a local endpoint (per-message
  isolation scopes; nothing fails, so nothing is sent).

Messages are enqueued before the worker starts; the clock runs from worker start
until the last message is acked. Reported: the median rate per variant, the
ratios to bare, the worker process's CPU time per message (the kit can outrun
bare Dramatiq while spending more CPU: its consumer refetches as soon as a
worker thread frees a slot, where Dramatiq's waits out a backoff), and each
variant's resident memory after the run.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from typing import Any

import dramatiq
import redis
from dramatiq import Message
from dramatiq.brokers.redis import RedisBroker
from dramatiq.common import current_millis

VARIANTS = ("bare", "kit", "listener", "traced")
QUEUE = "bench"


def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


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


def fill(broker: RedisBroker, messages: list[Message[Any]]) -> None:
    """Put ``messages`` on their queue in pipelined chunks (not timed; bare Dramatiq has no batch API)."""
    dispatch = broker.scripts["dispatch"]
    for start in range(0, len(messages), 1000):
        with broker.client.pipeline(transaction=False) as pipe:
            for message in messages[start : start + 1000]:
                redis_id = str(uuid.uuid4())
                data = message.copy(options={"redis_message_id": redis_id}).encode()
                args = ["enqueue", current_millis(), message.queue_name, broker.broker_id, broker.heartbeat_timeout,
                        broker.dead_message_ttl, 0, 1000, redis_id, data]  # fmt: skip
                dispatch(keys=[broker.namespace], args=args, client=pipe)
            pipe.execute()


def run_variant(variant: str, messages: int, threads: int, redis_url: str) -> dict[str, float]:
    """Run one variant in this process and measure it; ``bare`` never imports dramatiq_gp."""
    log_fd, log_path = tempfile.mkstemp(prefix=f"gp-bench-{variant}-", suffix=".log")
    os.close(log_fd)
    logging.basicConfig(level=logging.INFO, filename=log_path, force=True)
    namespace = f"gpbench-{uuid.uuid4().hex[:8]}"
    os.environ["REDIS_URL"] = redis_url
    broker: Any
    if variant == "bare":
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

    if variant == "listener":

        @gp.event("benchmarks.overhead.tick")
        @dataclass(frozen=True)
        class Tick:
            n: int

        kit.registry.listen(Tick, lambda event: None, name="noop", queue=QUEUE)
        batch = [m for n in range(messages) for m in kit.registry.fan_out(Tick(n), str(uuid.uuid4()))]
    else:
        actor = dramatiq.actor(noop, broker=broker, queue_name=QUEUE, actor_name="noop")
        batch = [actor.message(n) for n in range(messages)]
    fill(broker, batch)

    watcher = redis.Redis.from_url(redis_url)
    broker.emit_after("process_boot")
    worker = dramatiq.Worker(broker, worker_threads=threads)
    started, cpu_started = time.perf_counter(), time.process_time()
    worker.start()
    while watcher.hlen(f"{namespace}:{QUEUE}.msgs"):
        time.sleep(0.005)
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    rss = _rss_mb()
    worker.stop()
    for key in watcher.scan_iter(f"{namespace}:*", count=1000):
        watcher.delete(key)
    os.unlink(log_path)
    return {"msgs_per_s": messages / elapsed, "cpu_us_per_msg": cpu / messages * 1e6, "rss_mb": rss}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks overhead", description=__doc__)
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")

    if args.variant:  # a child: run one variant, report on stdout
        print(json.dumps(run_variant(args.variant, args.messages, args.threads, redis_url)))
        return 0

    results: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    for round_ in range(1, args.rounds + 1):
        for variant in VARIANTS:
            out = subprocess.run(
                [sys.executable, "-m", "benchmarks", "overhead", "--variant", variant,
                 "--messages", str(args.messages), "--threads", str(args.threads)],
                check=True, capture_output=True, text=True, env={**os.environ, "REDIS_URL": redis_url},
            )  # fmt: skip
            result = json.loads(out.stdout.strip().splitlines()[-1])
            results[variant].append(result)
            rate, cpu, rss = result["msgs_per_s"], result["cpu_us_per_msg"], result["rss_mb"]
            print(f"round {round_} {variant:>8}: {rate:8.0f} msg/s, {cpu:5.0f} µs CPU/msg, {rss:6.1f} MB", flush=True)

    def median(variant: str, key: str) -> float:
        return statistics.median(r[key] for r in results[variant])

    summary = {
        "bare_msgs_per_s": round(median("bare", "msgs_per_s")),
        "kit_msgs_per_s": round(median("kit", "msgs_per_s")),
        "ratio": round(median("kit", "msgs_per_s") / median("bare", "msgs_per_s"), 3),
        "listener_msgs_per_s": round(median("listener", "msgs_per_s")),
        "listener_ratio": round(median("listener", "msgs_per_s") / median("bare", "msgs_per_s"), 3),
        "kit_traced_msgs_per_s": round(median("traced", "msgs_per_s")),
        "traced_ratio": round(median("traced", "msgs_per_s") / median("bare", "msgs_per_s"), 3),
        **{f"{v}_cpu_us_per_msg": round(median(v, "cpu_us_per_msg")) for v in VARIANTS},
        "bare_rss_mb": round(median("bare", "rss_mb"), 1),
        "kit_rss_mb": round(median("kit", "rss_mb"), 1),
        "messages": args.messages,
        "rounds": args.rounds,
        "threads": args.threads,
    }
    print(
        f"kit/bare {summary['ratio']:.3f}, listener/bare {summary['listener_ratio']:.3f}, "
        f"traced/bare {summary['traced_ratio']:.3f}, "
        f"RSS kit-bare {summary['kit_rss_mb'] - summary['bare_rss_mb']:+.1f} MB"
    )
    if args.json:
        print(json.dumps(summary))
    return 0
