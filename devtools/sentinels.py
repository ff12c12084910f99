"""A Redis primary, its replicas and three Sentinels, as real ``redis-server`` processes on loopback ports.

For the failover tests (``tests/test_sentinel.py``): the system's ``redis-server`` (Sentinel mode is
``redis-server <conf> --sentinel``), short failure detection so a failover takes
seconds, every process's files and log in one directory, and every process
killed by :meth:`SentinelGroup.stop` whatever state the test left them in.

The replicas reach the primary through a :class:`LagProxy`, which can hold back what
the primary sends them: on loopback replication is all but instant, and a kill -9
alone almost never catches a write the replicas lack. Held, then cut with the
primary, the stream shows what a failover does when the replicas are behind.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import redis

from devtools.services import server_port

MASTER = "mymaster"
T = TypeVar("T")


def redis_server() -> str | None:
    """The system's ``redis-server``, or None."""
    return shutil.which("redis-server")


class LagProxy:
    """The primary's address as everyone sees it: a TCP proxy that can hold back the replication stream.

    The Sentinels monitor it, the replicas replicate through it and clients connect
    through it, so the replicas name the same primary address as the Sentinels (a
    replica naming another one is put right by a Sentinel within its failover
    timeout). A connection that sends ``PSYNC`` is a replica's: :meth:`hold` drops
    what the primary sends on those from then on (the replicas stay connected,
    their acknowledgements stop advancing), and :meth:`cut` closes everything, as
    the death of the primary does.
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = server_port()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._held = threading.Event()
        self._cut = threading.Event()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="lag-proxy", daemon=True).start()

    def hold(self) -> None:
        self._held.set()

    def cut(self) -> None:
        self._cut.set()
        with self._lock:
            for sock in [self._listener, *self._sockets]:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                with contextlib.suppress(OSError):
                    sock.close()

    def _accept(self) -> None:
        while not self._cut.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.target_port), timeout=1)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets += [client, server]
            replication = threading.Event()
            threading.Thread(target=self._up, args=(client, server, replication), daemon=True).start()
            threading.Thread(target=self._down, args=(server, client, replication), daemon=True).start()

    def _up(self, client: socket.socket, server: socket.socket, replication: threading.Event) -> None:
        with contextlib.suppress(OSError):
            while data := client.recv(65536):
                if b"PSYNC" in data.upper():
                    replication.set()
                server.sendall(data)
        self._close(client, server)

    def _down(self, server: socket.socket, client: socket.socket, replication: threading.Event) -> None:
        with contextlib.suppress(OSError):
            while data := server.recv(65536):
                if not (replication.is_set() and self._held.is_set()):
                    client.sendall(data)
        self._close(client, server)

    @staticmethod
    def _close(*sockets: socket.socket) -> None:
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


class SentinelGroup:
    """A primary with ``replicas`` replicas, watched by ``sentinels`` Sentinels (quorum: a majority).

    Parameters:
        directory: where each process's config, data and log go.
        down_after_ms: how long a primary is silent before a Sentinel calls it down.
        failover_timeout_ms: Sentinel's ``failover-timeout`` (also how soon a failed failover is tried again).
    """

    def __init__(
        self,
        directory: Path,
        *,
        replicas: int = 2,
        sentinels: int = 3,
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 5000,
    ) -> None:
        program = redis_server()
        assert program is not None, "no redis-server on PATH"
        self.program, self.directory = program, directory
        self.down_after_ms, self.failover_timeout_ms = down_after_ms, failover_timeout_ms
        self.data_ports = [server_port() for _ in range(1 + replicas)]
        self.sentinel_ports = [server_port() for _ in range(sentinels)]
        self.processes: dict[int, subprocess.Popen[bytes]] = {}
        self.proxy: LagProxy | None = None
        directory.mkdir(parents=True, exist_ok=True)

    @property
    def primary_port(self) -> int:
        """The first primary's own port (the Sentinels and the replicas know it by :attr:`proxy`'s)."""
        return self.data_ports[0]

    @property
    def sentinels_env(self) -> str:
        """``VALKEY_SENTINELS`` for this group."""
        return ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)

    def start(self) -> None:
        primary, *replicas = self.data_ports
        self._data_server(primary)
        self.proxy = LagProxy(primary)
        for port in replicas:
            self._data_server(port, "--replicaof", "127.0.0.1", str(self.proxy.port))
        self._until(lambda: self.connected_replicas(primary) == len(replicas), "the replicas to sync")
        for port in self.sentinel_ports:
            self._sentinel(port, self.proxy.port)
        # Each Sentinel must know its peers (a quorum) and the replicas (the ones to promote).
        self._until(
            lambda: all(self._sentinel_sees_all(port) for port in self.sentinel_ports),
            "the Sentinels to discover each other and the replicas",
        )

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.cut()
        for process in self.processes.values():
            with contextlib.suppress(ProcessLookupError):
                process.kill()
        for process in self.processes.values():
            process.wait(10)
        self.processes.clear()

    def kill(self, port: int) -> None:
        """``kill -9`` the server on ``port`` (the proxy's: the first primary, and the proxy is cut)."""
        if self.proxy is not None and port == self.proxy.port:
            port = self.primary_port
            self.processes[port].send_signal(signal.SIGKILL)
            self.proxy.cut()
        else:
            self.processes[port].send_signal(signal.SIGKILL)
        self.processes[port].wait(10)

    def primary(self) -> int:
        """The port of the primary, as the first Sentinel that answers names it."""
        for port in self.sentinel_ports:
            with contextlib.suppress(redis.RedisError), self._client(port) as sentinel:
                _host, primary = sentinel.sentinel_get_master_addr_by_name(MASTER)
                return int(primary)
        raise AssertionError("no Sentinel answers")

    def wait_for_failover(self, old: int, timeout: float = 30) -> int:
        """The new primary's port, once every Sentinel names one other than ``old`` and it accepts writes."""

        def done() -> int | None:
            named = set()
            for port in self.sentinel_ports:
                with self._client(port) as sentinel:
                    named.add(int(sentinel.sentinel_get_master_addr_by_name(MASTER)[1]))
            if len(named) != 1 or old in named:
                return None
            (new,) = named
            with self._client(new) as client:
                return new if client.info("replication")["role"] == "master" else None

        return self._until(done, "the failover", timeout)

    def connected_replicas(self, port: int) -> int:
        with self._client(port) as client:
            return int(client.info("replication")["connected_slaves"])

    def _sentinel_sees_all(self, port: int) -> bool:
        with self._client(port) as sentinel:
            state = sentinel.sentinel_master(MASTER)
        return (
            int(state["num-other-sentinels"]) == len(self.sentinel_ports) - 1
            and int(state["num-slaves"]) == len(self.data_ports) - 1
        )

    def _data_server(self, port: int, *extra: str) -> None:
        directory = self.directory / f"redis-{port}"
        directory.mkdir(exist_ok=True)
        command = [
            self.program,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(directory),
            "--save",
            "",
            "--appendonly",
            "no",
            # The first sync goes at once, not after the default 5 s for other replicas to join it.
            "--repl-diskless-sync-delay",
            "0",
            *extra,
        ]
        self._spawn(port, command, directory)
        self._until(lambda: self._ping(port), f"redis-server on {port}")

    def _sentinel(self, port: int, primary: int) -> None:
        directory = self.directory / f"sentinel-{port}"
        directory.mkdir(exist_ok=True)
        conf = directory / "sentinel.conf"  # Sentinel rewrites it with what it learns
        quorum = len(self.sentinel_ports) // 2 + 1
        conf.write_text(
            f"port {port}\nbind 127.0.0.1\ndir {directory}\n"
            f"sentinel monitor {MASTER} 127.0.0.1 {primary} {quorum}\n"
            f"sentinel down-after-milliseconds {MASTER} {self.down_after_ms}\n"
            f"sentinel failover-timeout {MASTER} {self.failover_timeout_ms}\n"
            f"sentinel parallel-syncs {MASTER} 2\n"
        )
        self._spawn(port, [self.program, str(conf), "--sentinel"], directory)
        self._until(lambda: self._ping(port), f"Sentinel on {port}")

    def _spawn(self, port: int, command: list[str], directory: Path) -> None:
        with open(directory / "log", "ab") as log:
            self.processes[port] = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def _client(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, socket_timeout=1, socket_connect_timeout=1, decode_responses=True)

    def _ping(self, port: int) -> bool:
        try:
            with self._client(port) as client:
                return bool(client.ping())
        except redis.ConnectionError:
            return False

    def _until(self, check: Callable[[], T | None], what: str, timeout: float = 20) -> T:
        deadline = time.monotonic() + timeout
        while True:
            try:
                found = check()
            except redis.RedisError:
                found = None
            if found:
                return found
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout}s waiting for {what}")
            time.sleep(0.05)
