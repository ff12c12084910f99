"""How ``dramatiq-gp dashboard`` serves the application: uvicorn, with a deadline on each request and a cap.

uvicorn closes a keep-alive connection :data:`~dramatiq_gp.endpoint.READ_TIMEOUT_S`
after a response (its ``timeout_keep_alive``), but a connection that never sends a
whole request is kept for as long as the client likes, and it caps nothing but
requests (``limit_concurrency`` counts idle sockets too, so real requests would get
503 while they pile up). :class:`DeadlineProtocol` gives each request the same
deadline as the kit's other endpoints (:mod:`dramatiq_gp.endpoint`): its headers must
arrive within :data:`~dramatiq_gp.endpoint.READ_TIMEOUT_S` of the connection, or of the
response before it. And past :data:`~dramatiq_gp.endpoint.MAX_CONNECTIONS` open at once,
a new connection cuts the oldest one that is not being answered, or is itself closed
when every one is.

It subclasses uvicorn's private ``H11Protocol`` (``docs/internals.md`` #21):
``connection_made``, ``handle_events``, ``on_response_complete``, and its ``cycle``,
``transport``, ``connections`` and ``loop`` attributes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from ..endpoint import MAX_CONNECTIONS, READ_TIMEOUT_S, WARN_EVERY_S

logger = logging.getLogger("dramatiq_gp.dashboard")

_warned_at = -WARN_EVERY_S


class DeadlineProtocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, with a deadline on each request's headers and a cap on connections."""

    _deadline: asyncio.TimerHandle | None = None
    #: The request being answered when the deadline was armed: another one started means it was met.
    _armed_for: Any = None
    _made_at = 0.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._made_at = time.monotonic()
        self._arm()
        if len(self.connections) > MAX_CONNECTIONS:
            self._make_room()

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not self._armed_for and self._deadline is not None:
            self._deadline.cancel()  # a request's headers arrived: uvicorn answers it
            self._deadline = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self._deadline is None:
            self._arm()  # the next request on this connection has the same deadline

    def connection_lost(self, exc: Exception | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._armed_for = self.cycle
        self._deadline = self.loop.call_later(READ_TIMEOUT_S, self._expire)

    def _expire(self) -> None:
        self._deadline = None
        answering = self.cycle is not None and not self.cycle.response_complete  # a pipelined one: never cut
        if self.cycle is self._armed_for and not answering and not self.transport.is_closing():
            self.transport.close()

    def _waiting(self) -> bool:
        """Whether this connection waits for a request (idle, or its headers not all in): nothing to lose."""
        return self._deadline is not None

    def _make_room(self) -> None:
        waiting = [c for c in self.connections if isinstance(c, DeadlineProtocol) and c._waiting() and c is not self]
        victim = min(waiting, key=lambda c: c._made_at) if waiting else self
        victim.transport.close()
        global _warned_at
        now = time.monotonic()
        if now - _warned_at >= WARN_EVERY_S:
            _warned_at = now
            logger.warning(
                "dashboard: more than %d connections open at once: cutting %s",
                MAX_CONNECTIONS,
                "the oldest one not sending a request" if waiting else "the new one (every other is being answered)",
            )


def serve(app: Any, *, host: str, port: int, trusted_proxies: str | None) -> None:
    """Serve ``app`` as the command does: uvicorn on ``host:port`` with :class:`DeadlineProtocol`.

    uvicorn believes ``X-Forwarded-For`` from 127.0.0.1 by default: only ``trusted_proxies`` are believed, so
    nobody on the machine can forge the audit lines' client.
    """
    import uvicorn

    uvicorn.run(
        app,
        host=host,
        port=port,
        http=DeadlineProtocol,
        timeout_keep_alive=int(READ_TIMEOUT_S),
        log_level="warning",
        proxy_headers=bool(trusted_proxies),
        forwarded_allow_ips=trusted_proxies or "",
    )
