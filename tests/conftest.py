"""Fixtures: real Redis (and PostgreSQL) for the whole session, a fresh key namespace per test.

The servers come from :mod:`devtools.services`: the configured or local ones if
they answer, embedded ones otherwise. Tests never skip for lack of one. The
RabbitMQ half of a test run on both brokers (the ``broker`` fixture) needs a
RabbitMQ at ``RABBITMQ_URL``, and is skipped in one line without one. Unset, it is
the local one, on a vhost of this run's own (made here, deleted at the end), so
two runs side by side never share a queue; where no vhost can be made (rabbitmqctl
cannot be run), the default one.
"""

from __future__ import annotations

import gc
import os
import sys
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import dramatiq
import pika
import pytest
import redis
import sqlalchemy as sa
from dramatiq.brokers.redis import RedisBroker
from dramatiq.common import dq_name, xq_name

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from telemetry_worker import Worker  # noqa: E402

from servers import delete_rabbitmq_vhost, own_rabbitmq_vhost  # noqa: E402

#: The vhost this run made for itself (before ``helpers`` reads ``RABBITMQ_URL``), deleted in pytest_unconfigure.
OWN_VHOST = None if "RABBITMQ_URL" in os.environ else own_rabbitmq_vhost()
if OWN_VHOST is not None:
    os.environ["RABBITMQ_URL"] = f"amqp://guest:guest@127.0.0.1:5672/{OWN_VHOST}"

import dramatiq_gp as gp  # noqa: E402
from collector import Collector, start_collector  # noqa: E402
from devtools.services import services  # noqa: E402
from dramatiq_gp import keys  # noqa: E402
from helpers import KIT_PREFIXES, RABBITMQ_URL, close_broker, own_database, rabbitmq_unreachable, wait_for  # noqa: E402

# The browser tests' fixtures (``browser``, ``page``), in a module of their own.
pytest_plugins = ["browser"]


def pytest_report_header() -> str:
    return f"RabbitMQ: {'vhost ' + OWN_VHOST + ' of this run' if OWN_VHOST else 'RABBITMQ_URL or the default vhost'}"


def pytest_unconfigure() -> None:
    if OWN_VHOST is not None:
        delete_rabbitmq_vhost(OWN_VHOST)


@pytest.fixture(autouse=True)
def _collect_garbage_after_each_test() -> Iterator[None]:
    """Collect after each test, so an object it left open (a connection, a socket) fails that test.

    Otherwise the ResourceWarning comes whenever the collector happens to run,
    in whatever test runs then.
    """
    yield
    gc.collect()


@pytest.fixture(scope="session")
def service_env() -> Iterator[dict[str, str]]:
    with services() as env:
        # Kit tests read REDIS_URL; a test opts in to the outbox by setting DB_URL itself.
        os.environ["REDIS_URL"] = env["REDIS_URL"]
        yield env


@pytest.fixture(scope="session")
def redis_url(service_env: dict[str, str]) -> str:
    return service_env["REDIS_URL"]


@pytest.fixture(scope="session")
def database_url(service_env: dict[str, str]) -> Iterator[str]:
    """A database of this test session's own on the PostgreSQL server, dropped at the end."""
    with own_database(service_env["DB_URL"]) as url:
        yield url


@pytest.fixture
def engine(database_url: str) -> Iterator[sa.Engine]:
    """An engine on the session database with an empty outbox table."""
    engine = sa.create_engine(database_url)
    gp.outbox.migrate(engine)
    with engine.begin() as conn:
        conn.execute(sa.text(f"TRUNCATE {gp.outbox.TABLE_NAME}"))
    yield engine
    engine.dispose()


@pytest.fixture
def rdb(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()


@pytest.fixture
def namespace(rdb: redis.Redis) -> Iterator[str]:
    """A key prefix of this test's own, deleted afterwards."""
    ns = f"gpt-{uuid.uuid4().hex[:10]}"
    yield ns
    keys = list(rdb.scan_iter(f"{ns}:*", count=1000))
    if keys:
        rdb.delete(*keys)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, redis_url: str) -> pytest.MonkeyPatch:
    """An environment with no kit variables but REDIS_URL."""
    for name in list(os.environ):
        if name.startswith(KIT_PREFIXES):
            monkeypatch.delenv(name)
    monkeypatch.setenv("REDIS_URL", redis_url)
    return monkeypatch


#: The queues the tests that run on both brokers use. RabbitMQ has no key namespace: a run
#: that died before its clean-up may have left messages in them, so they are deleted first.
SHARED_QUEUES = ("default", "other", "two", "qa", "qb", "jobs", "plain")


def _delete_rabbitmq_queues(queues: Iterable[str]) -> None:
    """Delete each of ``queues`` with its delay and dead-letter queues (a missing one is no error)."""
    connection = pika.BlockingConnection(pika.URLParameters(RABBITMQ_URL))
    try:
        channel = connection.channel()
        for queue in queues:
            for name in (queue, dq_name(queue), xq_name(queue)):
                channel.queue_delete(name)
    finally:
        connection.close()


@pytest.fixture(params=["redis", "rabbitmq"])
def broker(
    request: pytest.FixtureRequest, clean_env: pytest.MonkeyPatch, namespace: str, rdb: redis.Redis
) -> Iterator[str]:
    """Run the test on each broker: the Kits ``make_kit`` builds hold their queues on Redis, or on RabbitMQ.

    Opt in with ``pytest.mark.usefixtures("broker")`` on the test or the module (which
    sets it up before ``make_kit`` and ``start_worker``, so it cleans up after them). On
    RabbitMQ (``BROKER_URL``; Redis keeps the coordination state) the test is skipped
    in one line without one, and the queues it declared (recorded in Redis) are
    deleted afterwards. Yields the broker's name.
    """
    if request.param == "redis":
        yield "redis"
        return
    reason = rabbitmq_unreachable(RABBITMQ_URL)
    if reason is not None:
        pytest.skip(reason)
    _delete_rabbitmq_queues(SHARED_QUEUES)
    clean_env.setenv("BROKER_URL", RABBITMQ_URL)
    yield "rabbitmq"
    _delete_rabbitmq_queues(rdb.smembers(keys.declared_queues(namespace)))


MakeKit = Callable[..., gp.Kit]


@pytest.fixture
def make_kit(clean_env: pytest.MonkeyPatch, namespace: str) -> Iterator[MakeKit]:
    """Build Kits on this test's namespace, with a fresh registry and ``env`` applied."""
    kits: list[gp.Kit] = []

    def make(register: gp.RegisterFunc | None = None, env: dict[str, str] | None = None, **kwargs: Any) -> gp.Kit:
        for name, value in (env or {}).items():
            clean_env.setenv(name, value)
        kwargs.setdefault("registry", gp.Registry())
        kwargs.setdefault("broker_options", {"namespace": namespace})
        kit = gp.Kit(register, **kwargs)
        kits.append(kit)
        return kit

    yield make
    for kit in kits:
        kit.broker.close()  # RabbitMQ's connections (a dispatch opens one in this thread)
        kit.broker.client.close()
        if kit.engine is not None:
            kit.engine.dispose()


@pytest.fixture
def start_worker() -> Iterator[Callable[..., dramatiq.Worker]]:
    """Start a programmatic Dramatiq worker the way the CLI does (process_boot first)."""
    with ExitStack() as stack:

        def start(kit: gp.Kit, threads: int = 4, **kwargs: Any) -> dramatiq.Worker:
            kit.broker.emit_after("process_boot")
            worker = dramatiq.Worker(kit.broker, worker_threads=threads, worker_timeout=100, **kwargs)
            worker.start()
            stack.callback(worker.stop, 10_000)
            return worker

        yield start


# -- real telemetry_app workers and a stand-in collector (tests/telemetry_worker.py) ---------------------


@pytest.fixture
def collector() -> Iterator[Collector]:
    collector, server = start_collector()
    yield collector
    server.shutdown()
    server.server_close()


@pytest.fixture
def worker_env(clean_env: pytest.MonkeyPatch, redis_url: str, namespace: str) -> dict[str, str]:
    return {
        "REDIS_URL": redis_url,
        "VALKEY_NAMESPACE": namespace,
        "WORKER_MIN_BACKOFF": "10ms",
        "WORKER_MAX_BACKOFF": "50ms",
    }


@pytest.fixture
def run_worker(tmp_path: Path, worker_env: dict[str, str]) -> Iterator[Any]:
    workers: list[Worker] = []

    def run(env: dict[str, str], *args: str, processes: int = 1) -> Worker:
        worker = Worker(tmp_path, {**worker_env, **env}, *args, processes=processes)
        workers.append(worker)
        wait_for(lambda: "consumers started" in worker.log or worker.process.poll() is not None, timeout=30)
        assert worker.process.poll() is None, worker.log
        return worker

    yield run
    for worker in workers:
        worker.kill()


@pytest.fixture
def producer(redis_url: str, namespace: str) -> Iterator[RedisBroker]:
    """A plain Dramatiq broker on the worker's namespace, to send the app's actors messages."""
    broker = RedisBroker(url=redis_url, namespace=namespace)
    yield broker
    close_broker(broker)
