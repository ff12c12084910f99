"""A small HTTP endpoint that one process of a ``dramatiq -p N`` group serves for all of them.

Every worker process starts one on the same port; the first to bind it serves, the
others retry every few seconds and take over within that if it goes away. What it
answers must therefore not depend on which process serves: the Prometheus
snapshots and the health reports are files every process of the group writes to
the group's directory (:mod:`dramatiq_gp.groupdir`), and a route reads them all.

Each connection has a thread while it is open, so the server (:class:`Server`, also
the exporter's) bounds them: a connection that sends nothing for
:data:`READ_TIMEOUT_S` is cut, and at most :data:`MAX_CONNECTIONS` are open at once;
past that, the oldest one still sending its request is cut to make room, so idle
sockets cannot keep a probe or a scrape out.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

logger = logging.getLogger(__name__)

#: How long a connection may send nothing (or take nothing of its answer) before it is cut, in seconds.
READ_TIMEOUT_S = 5.0
#: Connections open at once, each with a thread: probes and scrapes come a few at a time.
MAX_CONNECTIONS = 32
#: How often, at most, a server says it is cutting connections to stay under :data:`MAX_CONNECTIONS`.
WARN_EVERY_S = 60.0

#: A route's answer: the status code, the content type and the body.
Response = tuple[int, str, bytes]


def handler(routes: Mapping[str, Callable[[], Response]], read_timeout_s: float) -> type[BaseHTTPRequestHandler]:
    """A request handler answering a GET of each path of ``routes`` with its function's response, anything else 404;
    a connection silent for ``read_timeout_s`` is closed."""

    class Handler(BaseHTTPRequestHandler):
        timeout = read_timeout_s  # set on the socket before the request is read: a read that waits longer ends it

        def do_GET(self) -> None:
            server = self.server
            if isinstance(server, Server):
                server.answering(self.request)
            route = routes.get(self.path.split("?")[0])
            if route is None:
                self.send_error(404)
                return
            status, content_type, body = route()
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # a probe or a scrape every few seconds is not worth a log line

    return Handler


class Server(ThreadingHTTPServer):
    """A thread per connection, as :class:`ThreadingHTTPServer`, with at most ``max_connections`` of them open and
    each cut after ``read_timeout_s`` of silence.

    A connection past the limit cuts the oldest one that has not yet sent its request
    (an idle socket, or a slow one), so a probe still gets in; when every open one is
    being answered, it is closed at once.
    """

    #: The kernel's queue of connections not yet accepted: socketserver's 5 drops the SYNs of a burst of them,
    #: which wait a second each to try again.
    request_queue_size = 128

    def __init__(
        self,
        name: str,
        address: tuple[str, int],
        routes: Mapping[str, Callable[[], Response]],
        *,
        read_timeout_s: float = READ_TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self.name, self.max_connections = name, max_connections
        #: Each open connection, oldest first, and whether its request has been read (it is being answered).
        self._open: dict[socket.socket, bool] = {}
        self._guard = threading.Lock()
        self._warned_at = -WARN_EVERY_S
        super().__init__(address, handler(routes, read_timeout_s))

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._guard:
            if len(self._open) >= self.max_connections and not self._make_room():
                super().shutdown_request(request)
                return
            self._open[request] = False
        super().process_request(request, client_address)

    def answering(self, request: socket.socket) -> None:
        """``request``'s request has been read: it is no longer one to cut for a newer connection."""
        with self._guard:
            if request in self._open:
                self._open[request] = True

    def shutdown_request(self, request: Any) -> None:
        with self._guard:
            self._open.pop(request, None)
        super().shutdown_request(request)

    def _make_room(self) -> bool:
        """Cut the oldest connection still sending its request; False if every one is being answered."""
        waiting = next((connection for connection, answering in self._open.items() if not answering), None)
        now = time.monotonic()
        if now - self._warned_at >= WARN_EVERY_S:
            self._warned_at = now
            logger.warning(
                "%s: %d connections open, the most served at once; %s",
                self.name,
                len(self._open),
                "cutting the oldest idle one for each new one" if waiting else "refusing new ones",
            )
        if waiting is None:
            return False
        del self._open[waiting]
        with contextlib.suppress(OSError):
            waiting.shutdown(socket.SHUT_RDWR)  # its thread's read returns at once, and it closes the socket
        return True


class Endpoint:
    """Serves ``routes`` (path → a function answering it) on ``host:port`` in whichever process binds first."""

    def __init__(
        self, name: str, host: str, port: int, routes: Mapping[str, Callable[[], Response]], *, retry_s: float = 5.0
    ) -> None:
        self.name, self.host, self.port, self.routes, self.retry_s = name, host, port, routes, retry_s
        self._server: Server | None = None
        self._stop = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._run, name=f"{self.name}-endpoint", daemon=True).start()

    def close(self) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def _run(self) -> None:
        routes = self.routes
        while not self._stop.is_set():
            try:
                self._server = Server(self.name, (self.host, self.port), routes)
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    logger.error("%s: cannot serve on %s:%d: %s", self.name, self.host, self.port, exc)
                    return
                self._stop.wait(self.retry_s)  # another process serves; take over if it goes
                continue
            logger.info("%s: serving %s on http://%s:%d", self.name, " ".join(sorted(routes)), self.host, self.port)
            self._server.serve_forever(poll_interval=0.5)
            return
