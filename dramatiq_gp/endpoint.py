"""A small HTTP endpoint that one process of a ``dramatiq -p N`` group serves for all of them.

Every worker process starts one on the same port; the first to bind it serves, the
others retry every few seconds and take over within that if it goes away. What it
answers must therefore not depend on which process serves: the Prometheus
snapshots and the health reports are files every process of the group writes to
one directory, and a route reads them all.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def forget_the_dead(directory: Path) -> None:
    """Remove the files ``<pid>.json`` of processes that are gone: a group's earlier run left them."""
    for path in directory.glob("*.json"):
        if path.stem.isdigit() and not alive(int(path.stem)):
            path.unlink(missing_ok=True)


#: A route's answer: the status code, the content type and the body.
Response = tuple[int, str, bytes]


def handler(routes: Mapping[str, Callable[[], Response]]) -> type[BaseHTTPRequestHandler]:
    """A request handler answering a GET of each path of ``routes`` with its function's response, anything else 404."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
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


class Endpoint:
    """Serves ``routes`` (path → a function answering it) on ``host:port`` in whichever process binds first."""

    def __init__(
        self, name: str, host: str, port: int, routes: Mapping[str, Callable[[], Response]], *, retry_s: float = 5.0
    ) -> None:
        self.name, self.host, self.port, self.routes, self.retry_s = name, host, port, routes, retry_s
        self._server: ThreadingHTTPServer | None = None
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
                self._server = ThreadingHTTPServer((self.host, self.port), handler(routes))
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    logger.error("%s: cannot serve on %s:%d: %s", self.name, self.host, self.port, exc)
                    return
                self._stop.wait(self.retry_s)  # another process serves; take over if it goes
                continue
            logger.info("%s: serving %s on http://%s:%d", self.name, " ".join(sorted(routes)), self.host, self.port)
            self._server.serve_forever(poll_interval=0.5)
            return
