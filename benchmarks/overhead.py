"""What the kit costs per message in CPU, against bare Dramatiq at its best, in the same run.

Each variant runs a no-op task in a fresh worker process (8 threads, the same
Redis) pinned to one core (``os.sched_setaffinity``), with nothing else in that
process: the driver (this process, pinned to the other cores) fills nothing, times
nothing in the worker, and watches the queue drain from outside. Variants:

* ``bare``: a plain actor on Dramatiq's ``RedisBroker`` with its default middleware;
* ``kit``: the same actor through the kit's full middleware stack, its INFO task
  log written to a file (as the docs recommend; never a terminal);
* ``kit_quiet``: ``kit`` with ``LOG_LEVEL=WARN`` (no per-task lines);
* ``listener``: a no-op listener reached through a fan-out (envelope ids and
  idempotent execution included);
* ``db_listener``: a listener that inserts one row into PostgreSQL in a
  transaction of its own (``engine.begin()``);
* ``inbox``: the same row written through the inbox (``inbox=engine``): one more
  ``INSERT`` in the same transaction, the Redis claim still on (the default);
* ``inbox_noclaim``: ``inbox`` with the Redis claim off (``idempotent=False``),
  which the inbox makes redundant; ``db_listener`` and the inbox variants count
  their rows at the end (one per message, or the run fails). Their CPU is the
  worker's only, as for every variant: PostgreSQL's own work is not in it;
* ``sync_io`` and ``async_io``: a listener waiting 50 ms on I/O, a plain function
  in ``time.sleep`` against an ``async def`` one in ``asyncio.sleep``, at
  ``--threads`` and again at each of ``--io-threads`` (default 64) worker threads,
  with ``--io-messages`` (default 40) messages per thread. Their figure is msg/s
  (and RSS), not CPU: Dramatiq's worker thread waits for its coroutine
  (``async_to_sync``), so the async form runs as many at once as there are threads;
* ``traced``: ``kit`` with telemetry on: each message's producer and consumer
  spans go through a batch span processor to an exporter that discards them,
  and Sentry is initialised with its DSN at a local endpoint (per-message
  isolation scopes; nothing fails, so nothing is sent);
* ``default``: the kit as a user deploys it, through the real ``dramatiq`` command
  (``dramatiq -p 1 -t <threads> benchmarks.overhead_app --log-file F``, the
  command and its worker process pinned to the workers' core) at its defaults
  (``gp.Kit()``: the INFO task log, the kit's own prefetch, not the sweep's). Its
  CPU is the command's parent's, plus its worker process's, plus Redis's
  (``INFO cpu``, over the same window; reported apart as
  ``default_{parent,workers,redis}_us_per_msg``). After the command has stopped
  on SIGTERM, its log file must hold a ``task done`` line for every message;
* ``bare_default``: stock Dramatiq (``RedisBroker``) through the command the same
  way, at bare's best prefetch; run whenever ``default`` is. ``default_cpu_ratio``
  is ``default`` over it (on Redis only: both are left out with ``--broker rabbitmq``);
* with ``--peers`` (or named in ``--variants``): ``celery_threads`` (Celery's
  threads pool, acks late), ``arq`` (``max_jobs`` = threads), ``rq`` (its
  ``SimpleWorker``: no fork, one job at a time) and ``huey`` (``RedisHuey``, a
  consumer of ``threads`` worker threads), each on the same Redis, each installed
  into a throwaway virtualenv of its own (``--peers-venv``) only when asked for.
  Each logs its per-task INFO lines to a file, like ``kit``, and keeps no result.
  rq runs ``--rq-messages`` (default 2,000) per round: one job at a time, it
  moves about a hundred a second.

With ``--broker rabbitmq`` (and ``--rabbitmq-url``) each Dramatiq variant's queue
is on RabbitMQ: ``bare`` is Dramatiq's ``RabbitmqBroker`` with its defaults (a
classic queue, no publisher confirms), the others the kit's (quorum queues,
confirms; Redis keeps only the kit's claims). The queue, named after the run, is
filled unconfirmed before the worker starts and deleted after it. AMQP counts
only the messages waiting on a queue, not those a worker has prefetched, so there
the window runs on the ready count: the prefetched ones are a steady buffer of at
most the prefetch, beside the thousands counted.

Every variant uses the same prefetch (messages a worker process holds ahead of
its threads; ``dramatiq_queue_prefetch``). Bare Dramatiq's consumer sleeps through
a growing backoff whenever its prefetched messages are all outstanding, so a small
prefetch caps it; the benchmark first sweeps bare over ``--sweep`` (pinned, short
runs, alternating) and runs everything at the prefetch where bare moved the most
messages per second, printing the sweep so that raising it further can be seen not
to help bare. ``--prefetch N`` skips the sweep.

Messages are enqueued before the worker starts. The driver polls the queue's
outstanding count (Redis, every 5 ms) and reads the worker's CPU time (user + system
of every thread, ``/proc/<pid>/stat``) when the first 10% have been processed and
again when 10% are left: start-up and the drain are outside the window. Redis's own
CPU (``INFO cpu``: ``used_cpu_user`` + ``used_cpu_sys``) is read at the same two
moments, since a system that moves work into Redis would look cheap otherwise; it
counts everything that Redis served meanwhile, so give the benchmark a Redis of its
own (``REDIS_URL``) on a machine shared with others. The driver's polling alone
costs Redis a little (``redis_idle_cpu_us_per_s``, measured before the rounds):
nothing beside thousands of messages a second, a share of a slow system's figure.
Reported per variant, median over the alternating rounds: CPU µs per message of the
worker (the primary figure, lower is better), of Redis, and their total
(``<variant>_redis_cpu_us_per_msg``, ``<variant>_total_cpu_us_per_msg``), messages
per second, the share of its core the worker used, and its resident memory. Each CPU
ratio (``cpu_ratio``...) is the median of the rounds' ratios, each round's variant
over the bare run of the same round; beside it, ``<ratio>_of_medians`` is the
variant's median over bare's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

import redis

from benchmarks.outbox_common import DEFAULT_RABBITMQ_URL, delete_rabbitmq_queues, scratch_database
from benchmarks.overhead_worker import (
    CLI_VARIANTS,
    DB_VARIANTS,
    DRAMATIQ_VARIANTS,
    IO_VARIANTS,
    PEERS,
    outstanding_keys,
    queue_name,
)
from devtools.services import services

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = DRAMATIQ_VARIANTS + CLI_VARIANTS
SWEEP = "16,64,128,256,512"
#: The measurement window: from this share of the messages processed until this share is left.
WARMUP = TAIL = 0.1
POLL_S = 0.005


@dataclass(frozen=True)
class Run:
    msgs_per_s: float
    cpu_us_per_msg: float
    core_busy: float  # CPU seconds per wall second in the window; 1.0 = the whole core
    rss_mb: float
    #: CPU spent in garbage collection per message, over the whole run (reported by a Dramatiq worker; else None).
    gc_us_per_msg: float | None = None
    #: Redis's CPU per message over the same window (the whole server's: anything else it served is in it).
    redis_cpu_us_per_msg: float | None = None
    #: The variants run through the ``dramatiq`` command: ``cpu_us_per_msg`` is the sum of these three.
    parent_us_per_msg: float | None = None
    workers_us_per_msg: float | None = None
    redis_us_per_msg: float | None = None


def _cpu_seconds(pid: int) -> float:
    """User + system time of every thread of ``pid``, in seconds (clock ticks: 10 ms resolution)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _redis_cpu_seconds(client: redis.Redis) -> float:
    """User + system time of the Redis server, in seconds (``INFO cpu``; getrusage, microseconds)."""
    cpu = client.info("cpu")
    return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


def _redis_idle_cpu_us_per_s(redis_url: str, seconds: float = 2.0) -> float:
    """Redis's CPU per second with no worker, the driver polling as in a run: what a slow system's figure carries."""
    client = redis.Redis.from_url(redis_url)
    key = f"gpbench-idle-{uuid.uuid4().hex[:8]}"
    try:
        start, cpu = time.perf_counter(), _redis_cpu_seconds(client)
        while time.perf_counter() - start < seconds:
            with client.pipeline(transaction=False) as pipe:
                pipe.llen(key).llen(key).zcard(key)
                pipe.execute()
            time.sleep(POLL_S)
        return (_redis_cpu_seconds(client) - cpu) / (time.perf_counter() - start) * 1e6
    finally:
        client.close()


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _tail(err: IO[bytes]) -> str:
    err.seek(0)
    return err.read().decode(errors="replace")[-3000:]


def run_one(
    variant: str,
    *,
    messages: int,
    threads: int,
    prefetch: int,
    core: int,
    redis_url: str,
    python: str,
    db_url: str | None = None,
    rabbitmq_url: str | None = None,
) -> Run:
    """Run ``variant`` once in a pinned worker process and measure it from here."""
    namespace = f"gpbench-{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(redis_url)
    keys = outstanding_keys(variant, namespace)
    ready_on_rabbitmq = _ReadyOnRabbitmq(rabbitmq_url, queue_name(namespace, True)) if rabbitmq_url else None

    def outstanding() -> int:
        if ready_on_rabbitmq is not None:
            return ready_on_rabbitmq()
        with client.pipeline(transaction=False) as pipe:
            for command, key in keys:
                getattr(pipe, command)(key)
            return sum(pipe.execute())

    command = [
        python,
        "-m",
        "benchmarks.overhead_worker",
        "--variant",
        variant,
        "--messages",
        str(messages),
        "--threads",
        str(threads),
        "--prefetch",
        str(prefetch),
        "--core",
        str(core),
        "--namespace",
        namespace,
        "--redis-url",
        redis_url,
    ]
    if variant in DB_VARIANTS:
        assert db_url is not None
        command += ["--db-url", db_url]
    if rabbitmq_url is not None:
        command += ["--rabbitmq-url", rabbitmq_url]
    timeout = 60 + messages / 100
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(command, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
        assert proc.stdin is not None and proc.stdout is not None
        try:
            readable, _, _ = select.select([proc.stdout], [], [], timeout)
            if not readable or proc.stdout.readline().strip() != "ready":
                raise RuntimeError(f"{variant}: the worker did not get ready:\n{_tail(err)}")
            deadline = time.monotonic() + timeout
            start_at, stop_at = messages - int(messages * WARMUP), int(messages * TAIL)
            first: tuple[float, int, float, float] | None = None
            while True:
                left = outstanding()
                now = time.perf_counter()
                if first is None and left <= start_at:
                    first = (now, left, _cpu_seconds(proc.pid), _redis_cpu_seconds(client))
                if first is not None and left <= stop_at:
                    last = (now, left, _cpu_seconds(proc.pid), _redis_cpu_seconds(client))
                    rss = _rss_mb(proc.pid)
                    break
                if proc.poll() is not None:
                    raise RuntimeError(f"{variant}: the worker exited ({proc.returncode}):\n{_tail(err)}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{variant}: {left} of {messages} messages left after {timeout:.0f} s")
                time.sleep(POLL_S)
            while left := outstanding():  # let it finish before stopping it
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{variant}: {left} of {messages} messages left after {timeout:.0f} s")
                time.sleep(POLL_S)
        finally:
            if variant in PEERS:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.stdin.write("stop\n")
                proc.stdin.close()
            except BrokenPipeError:
                pass
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            said = proc.stdout.read().splitlines()  # after "ready": the time the worker spent collecting garbage
            gc_s = next((float(line.split()[1]) for line in said if line.startswith("gc ")), None)
            if proc.returncode and variant not in PEERS:
                raise RuntimeError(f"{variant}: the worker failed ({proc.returncode}):\n{_tail(err)}")
            for pattern in (f"{namespace}*", f"_kombu.binding*{namespace}*"):  # kombu's bindings of the queue
                for key in client.scan_iter(pattern, count=1000):
                    client.delete(key)
            deadlines = "_kombu.binding_deadlines"
            stale = [m for m in client.zrange(deadlines, 0, -1) if namespace.encode() in m]
            if stale:
                client.zrem(deadlines, *stale)
            client.close()
            if ready_on_rabbitmq is not None:
                ready_on_rabbitmq.close()
                delete_rabbitmq_queues(ready_on_rabbitmq.url, ready_on_rabbitmq.queue)
    done, wall, cpu = first[1] - last[1], last[0] - first[0], last[2] - first[2]
    gc_us = gc_s / messages * 1e6 if gc_s is not None else None
    return Run(
        msgs_per_s=done / wall,
        cpu_us_per_msg=cpu / done * 1e6,
        core_busy=cpu / wall,
        rss_mb=rss,
        gc_us_per_msg=gc_us,
        redis_cpu_us_per_msg=(last[3] - first[3]) / done * 1e6,
    )


def _descendants(pid: int) -> list[int]:
    """``pid``'s children, their children and so on (``/proc/<pid>/task/<tid>/children``)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        with contextlib.suppress(OSError), os.scandir(f"/proc/{parent}/task") as tasks:
            for task in tasks:
                with contextlib.suppress(OSError), open(f"{task.path}/children") as children:
                    todo += [int(child) for child in children.read().split()]
        if parent != pid:
            found.append(parent)
    return found


def run_cli(variant: str, *, messages: int, threads: int, prefetch: int, core: int, redis_url: str, **_: Any) -> Run:
    """Run ``variant`` as a user deploys it: ``dramatiq -p 1 -t <threads> benchmarks.overhead_app --log-file F``.

    The messages are put on the queue first (``python -m benchmarks.overhead_app``);
    the command (its parent and its worker process) is pinned to ``core``. Its CPU
    is the parent's plus every worker process's, plus Redis's (``INFO cpu``: the
    server is shared, so anything else using it at the time counts too). ``default``
    runs at the kit's own prefetch, ``bare_default`` at ``prefetch``; ``default`` also
    checks that its log file has a ``task done`` line for every message after the
    command exited on SIGTERM.
    """
    namespace = f"gpbench-{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(redis_url)
    keys = outstanding_keys(variant, namespace)

    def outstanding() -> int:
        with client.pipeline(transaction=False) as pipe:
            for command, key in keys:
                getattr(pipe, command)(key)
            return sum(pipe.execute())

    env = {**os.environ, "GPBENCH_VARIANT": variant, "VALKEY_NAMESPACE": namespace, "REDIS_URL": redis_url}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    for name in ("LOG_LEVEL", "LOG_FORMAT", "SENTRY_DSN", "dramatiq_queue_prefetch"):
        env.pop(name, None)  # the defaults
    if variant == "bare_default":
        env["dramatiq_queue_prefetch"] = str(prefetch)
    timeout = 60 + messages / 100
    with tempfile.TemporaryDirectory(prefix="gp-bench-cli-") as tmp:
        log_path = Path(tmp) / "dramatiq.log"
        fill = subprocess.run(
            [sys.executable, "-m", "benchmarks.overhead_app", str(messages)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if fill.returncode:
            raise RuntimeError(f"{variant}: filling the queue failed:\n{fill.stderr[-3000:]}")
        command = [
            sys.executable,
            "-m",
            "dramatiq",
            "-p",
            "1",
            "-t",
            str(threads),
            "benchmarks.overhead_app",
            "--log-file",
            str(log_path),
        ]
        with tempfile.TemporaryFile() as err:
            proc = subprocess.Popen(
                command,
                cwd=ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=err,
                stderr=err,
                preexec_fn=lambda: os.sched_setaffinity(0, {core}),
            )
            try:
                deadline = time.monotonic() + timeout
                start_at, stop_at = messages - int(messages * WARMUP), int(messages * TAIL)
                first: tuple[float, int, float, float, float] | None = None

                def sample(left: int) -> tuple[float, int, float, float, float]:
                    workers = sum(_cpu_seconds(pid) for pid in _descendants(proc.pid))
                    return time.perf_counter(), left, _cpu_seconds(proc.pid), workers, _redis_cpu_seconds(client)

                while True:
                    left = outstanding()
                    if first is None and left <= start_at:
                        first = sample(left)
                    if first is not None and left <= stop_at:
                        last = sample(left)
                        rss = sum(_rss_mb(pid) for pid in [proc.pid, *_descendants(proc.pid)])
                        break
                    if proc.poll() is not None:
                        raise RuntimeError(f"{variant}: dramatiq exited ({proc.returncode}):\n{_tail(err)}")
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{variant}: {left} of {messages} messages left after {timeout:.0f} s")
                    time.sleep(POLL_S)
                while left := outstanding():
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{variant}: {left} of {messages} messages left after {timeout:.0f} s")
                    time.sleep(POLL_S)
            finally:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                for key in client.scan_iter(f"{namespace}*", count=1000):
                    client.delete(key)
            if proc.returncode:
                raise RuntimeError(f"{variant}: dramatiq failed ({proc.returncode}):\n{_tail(err)}")
        if variant == "default":
            with open(log_path, encoding="utf-8") as log:
                logged = sum(" task done " in line for line in log)
            if logged != messages:
                raise RuntimeError(f"{variant}: {logged} 'task done' lines in the log for {messages} messages")
    client.close()
    done, wall = first[1] - last[1], last[0] - first[0]
    parent, workers, redis_cpu = (last[i] - first[i] for i in (2, 3, 4))
    cpu = parent + workers + redis_cpu
    return Run(
        msgs_per_s=done / wall,
        cpu_us_per_msg=cpu / done * 1e6,
        core_busy=(parent + workers) / wall,
        rss_mb=rss,
        parent_us_per_msg=parent / done * 1e6,
        workers_us_per_msg=workers / done * 1e6,
        redis_us_per_msg=redis_cpu / done * 1e6,
    )


class _ReadyOnRabbitmq:
    """Counts the messages ready on ``queue`` (a passive declare, once the worker has declared it)."""

    def __init__(self, url: str, queue: str) -> None:
        self.url, self.queue = url, queue
        self.connection: Any = None

    def __call__(self) -> int:
        import pika

        if self.connection is None:
            self.connection = pika.BlockingConnection(pika.URLParameters(self.url))
            self.channel = self.connection.channel()
        return int(self.channel.queue_declare(self.queue, passive=True).method.message_count)

    def close(self) -> None:
        if self.connection is not None and self.connection.is_open:
            self.connection.close()


def _line(label: str, run: Run) -> str:
    return (
        f"{label}: {run.cpu_us_per_msg:5.0f} µs CPU/msg"
        + (f" (+{run.redis_cpu_us_per_msg:4.0f} Redis)" if run.redis_cpu_us_per_msg is not None else "")
        + f", {run.msgs_per_s:6.0f} msg/s, "
        f"core {run.core_busy:4.2f} busy, {run.rss_mb:5.1f} MB"
        + (f", {run.gc_us_per_msg:4.1f} µs GC/msg" if run.gc_us_per_msg is not None else "")
        + (
            f" (parent {run.parent_us_per_msg:.0f} + workers {run.workers_us_per_msg:.0f}"
            f" + Redis {run.redis_us_per_msg:.0f})"
            if run.parent_us_per_msg is not None
            else ""
        )
    )


def _median(runs: list[Run]) -> Run:
    def median(field: str) -> Any:
        values = [getattr(r, field) for r in runs if getattr(r, field) is not None]
        return statistics.median(values) if values else None

    return Run(**{field: median(field) for field in asdict(runs[0])})


#: What each peer's throwaway virtualenv gets (one each: arq wants redis<6, the newest Celery's kombu more).
PEER_PACKAGES = {"celery_threads": ("celery[redis]",), "arq": ("arq",), "rq": ("rq",), "huey": ("huey", "redis")}
PEER_MODULES = {"celery_threads": "celery", "arq": "arq", "rq": "rq", "huey": "huey"}


def peer_python(root: Path, peer: str) -> str:
    """The Python of ``peer``'s throwaway virtualenv under ``root``, installed on first use."""
    venv = root / peer
    python = venv / "bin" / "python"
    if not python.exists():
        print(f"peers: creating {venv}", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    module = PEER_MODULES[peer]
    if subprocess.run([str(python), "-c", f"import {module}, redis"], capture_output=True).returncode:
        print(f"peers: installing {' '.join(PEER_PACKAGES[peer])} into {venv}", flush=True)
        pip = [str(python), "-m", "pip", "install", "--quiet", *PEER_PACKAGES[peer]]
        installed = subprocess.run(pip, capture_output=True, text=True)
        if installed.returncode:
            sys.exit(f"peers: {' '.join(pip)} failed:\n{installed.stdout}{installed.stderr}")
    version = subprocess.run(
        [str(python), "-c", f"import {module}; print({module}.__version__)"], capture_output=True, text=True, check=True
    )
    print(f"peers: {module} {version.stdout.strip()}", flush=True)
    return str(python)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks overhead", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--prefetch", type=int, help="run every variant at this prefetch; skips the sweep")
    parser.add_argument("--sweep", default=SWEEP, help="bare's prefetch values to try (default %(default)s)")
    parser.add_argument("--sweep-messages", type=int, default=10_000)
    parser.add_argument("--sweep-rounds", type=int, default=2)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated (default: all)")
    parser.add_argument("--io-threads", default="64", help="the I/O variants' other thread counts")
    parser.add_argument("--io-messages", type=int, default=40, help="the I/O variants' messages per worker thread")
    parser.add_argument("--peers", action="store_true", help="also run Celery (threads), arq, rq and Huey")
    parser.add_argument("--peers-venv", type=Path, default=Path(tempfile.gettempdir()) / "dramatiq-gp-bench-peers")
    parser.add_argument(
        "--rq-messages", type=int, default=2_000, help="rq's messages per round (one job at a time: about 100 a second)"
    )
    parser.add_argument("--core", type=int, help="the core the workers run on (default: the last one available)")
    parser.add_argument("--broker", choices=["redis", "rabbitmq"], default="redis", help="where the queue lives")
    parser.add_argument("--rabbitmq-url", default=os.environ.get("RABBITMQ_URL", DEFAULT_RABBITMQ_URL))
    args = parser.parse_args(argv)
    if args.broker == "rabbitmq" and args.peers:
        parser.error("--peers runs on Redis only")
    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if args.peers:
        variants += [peer for peer in PEERS if peer not in variants]
    unknown = set(variants) - set(VARIANTS) - set(PEERS)
    if unknown:
        parser.error(f"unknown variants: {', '.join(sorted(unknown))}")
    if "default" in variants and "bare_default" not in variants:
        variants.append("bare_default")  # default_cpu_ratio's other side
    if args.broker == "rabbitmq":
        variants = [v for v in variants if v not in CLI_VARIANTS]  # the command's variants are on Redis

    with contextlib.ExitStack() as stack:
        db_url = None
        if set(variants) & set(DB_VARIANTS):
            server = os.environ.get("DB_URL") or stack.enter_context(services())["DB_URL"]
            db_url = stack.enter_context(scratch_database(server.replace("postgresql://", "postgresql+psycopg://", 1)))
        return _run(args, variants, redis_url, db_url)


def _run(args: argparse.Namespace, variants: list[str], redis_url: str, db_url: str | None) -> int:
    """Sweep bare's prefetch (unless given), run every variant ``--rounds`` times in turn, report the medians."""
    cores = os.sched_getaffinity(0)
    core = args.core if args.core is not None else max(cores)
    if cores - {core}:
        os.sched_setaffinity(0, cores - {core})  # the driver keeps off the workers' core
    print(f"workers pinned to core {core}; driver on {sorted(cores - {core}) or [core]}", flush=True)
    python = {v: sys.executable for v in VARIANTS}
    python.update({peer: peer_python(args.peers_venv, peer) for peer in PEERS if peer in variants})
    rabbitmq_url = args.rabbitmq_url if args.broker == "rabbitmq" else None
    common = {
        "threads": args.threads,
        "core": core,
        "redis_url": redis_url,
        "db_url": db_url,
        "rabbitmq_url": rabbitmq_url,
    }

    summary: dict[str, object] = {}
    if args.prefetch is None:
        values = [int(v) for v in args.sweep.split(",")]
        sweep: dict[int, list[Run]] = {v: [] for v in values}
        for round_ in range(1, args.sweep_rounds + 1):
            for value in values:
                run = run_one("bare", messages=args.sweep_messages, prefetch=value, python=python["bare"], **common)
                sweep[value].append(run)
                print(_line(f"sweep {round_} bare prefetch {value:>4}", run), flush=True)
        medians = {value: _median(runs) for value, runs in sweep.items()}
        prefetch = max(values, key=lambda value: medians[value].msgs_per_s)
        print(f"bare's prefetch sweep (median of {args.sweep_rounds}, {args.sweep_messages} messages each):")
        for value, run in medians.items():
            print(_line(f"  prefetch {value:>4}{' <- chosen' if value == prefetch else '          '}", run))
        summary["bare_prefetch_sweep"] = {
            str(value): {"cpu_us_per_msg": round(run.cpu_us_per_msg), "msgs_per_s": round(run.msgs_per_s)}
            for value, run in medians.items()
        }
    else:
        prefetch = args.prefetch
    print(f"every variant at prefetch {prefetch}", flush=True)
    if args.broker == "redis":
        idle = summary["redis_idle_cpu_us_per_s"] = round(_redis_idle_cpu_us_per_s(redis_url))
        print(f"Redis with no worker, polled by the driver: {idle} µs CPU per second", flush=True)

    # (label, variant, threads, messages): the I/O variants again at each of --io-threads, labelled with it.
    plan = []
    for variant in variants:
        if variant not in IO_VARIANTS:
            plan.append((variant, variant, args.threads, args.rq_messages if variant == "rq" else args.messages))
            continue
        for n, threads in enumerate([args.threads, *(int(t) for t in args.io_threads.split(",") if t)]):
            plan.append((f"{variant}_{threads}" if n else variant, variant, threads, threads * args.io_messages))
    results: dict[str, list[Run]] = {label: [] for label, *_ in plan}
    for round_ in range(1, args.rounds + 1):
        for label, variant, threads, messages in plan:
            run = (run_cli if variant in CLI_VARIANTS else run_one)(
                variant, messages=messages, prefetch=prefetch, python=python[variant], **{**common, "threads": threads}
            )
            results[label].append(run)
            print(_line(f"round {round_} {label:>14}", run), flush=True)

    medians = {v: _median(runs) for v, runs in results.items()}
    for variant, run in medians.items():
        summary[f"{variant}_cpu_us_per_msg"] = round(run.cpu_us_per_msg)
        if run.redis_cpu_us_per_msg is not None:
            summary[f"{variant}_redis_cpu_us_per_msg"] = round(run.redis_cpu_us_per_msg)
            # The median of the rounds' own sums, not the sum of the two medians.
            totals = [
                r.cpu_us_per_msg + r.redis_cpu_us_per_msg
                for r in results[variant]
                if r.redis_cpu_us_per_msg is not None
            ]
            summary[f"{variant}_total_cpu_us_per_msg"] = round(statistics.median(totals))
        summary[f"{variant}_msgs_per_s"] = round(run.msgs_per_s)
        if run.gc_us_per_msg is not None:
            summary[f"{variant}_gc_us_per_msg"] = round(run.gc_us_per_msg, 1)
        if run.parent_us_per_msg is not None:
            for part in ("parent", "workers", "redis"):
                summary[f"{variant}_{part}_us_per_msg"] = round(getattr(run, f"{part}_us_per_msg"))
    ratios = {
        "kit": "cpu_ratio",
        "kit_quiet": "quiet_cpu_ratio",
        "listener": "listener_cpu_ratio",
        "traced": "traced_cpu_ratio",
        "default": "default_cpu_ratio",  # through the dramatiq command, over stock Dramatiq run the same way
    }
    for variant, key in ratios.items():
        base = "bare_default" if variant in CLI_VARIANTS else "bare"
        if base in medians and variant in medians:
            # Each round's variant against that round's bare, run beside it: the load of the shared machine
            # moves both, so the median of these is the steadier figure, the one targets are held to.
            pairs = zip(results[variant], results[base], strict=True)
            per_round = [run.cpu_us_per_msg / bare.cpu_us_per_msg for run, bare in pairs]
            summary[key] = round(statistics.median(per_round), 3)
            summary[f"{key}_of_medians"] = round(medians[variant].cpu_us_per_msg / medians[base].cpu_us_per_msg, 3)
    for variant, run in medians.items():
        summary[f"{variant}_rss_mb"] = round(run.rss_mb, 1)
    if "inbox" in medians:
        # What the inbox adds to a listener that writes a row anyway, and what the Redis claim adds to the inbox.
        for base, key in (
            ("db_listener", "inbox_extra_cpu_us_per_msg"),
            ("inbox_noclaim", "inbox_claim_cpu_us_per_msg"),
        ):
            if base in medians:
                summary[key] = round(medians["inbox"].cpu_us_per_msg - medians[base].cpu_us_per_msg)
    for label in medians:  # async against sync, at the same thread count
        if label.startswith("async_io") and (sync := "sync" + label.removeprefix("async")) in medians:
            summary[f"{label}_ratio"] = round(medians[label].msgs_per_s / medians[sync].msgs_per_s, 3)
    summary.update(
        broker=args.broker, bare_prefetch=prefetch, rounds=args.rounds, messages=args.messages, threads=args.threads
    )

    print("medians:")
    for variant, run in medians.items():
        print(_line(f"  {variant:>14}", run))
    print(", ".join(f"{key} {summary[key]:.3f}" for key in ratios.values() if key in summary) or "no ratios")
    if args.json:
        print(json.dumps(summary))
    return 0
