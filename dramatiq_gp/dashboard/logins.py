"""How many wrong logins the dashboard checks: a token bucket per client and one for all.

A failed login takes a token from its client's bucket and from the overall one.
While either is empty a request with credentials is answered 429 without them
being checked: were the right password let through, the 429s would tell a
guesser which of his guesses was right. A client that logged in is proven
for :attr:`LoginLimits.proven_s`: the overall bucket no longer holds it up, so
guesses from many addresses do not lock out an operator who is already in
(its own bucket still does: its failures are failures). Memory is bounded:
a client's bucket exists only while it is refilling, and there are at most
:data:`MAX_CLIENTS` of them and :data:`MAX_PROVEN` proven clients.
"""

from __future__ import annotations

import ipaddress
import time
from collections.abc import Callable
from dataclasses import dataclass

#: Client buckets kept at most; the oldest is dropped first (it gets a full bucket again, the overall one still holds).
MAX_CLIENTS = 10_000
#: Proven clients kept at most; the one that logged in least recently is dropped first.
MAX_PROVEN = 1_000


@dataclass(frozen=True)
class LoginLimits:
    """The wrong logins checked: ``burst`` at once, then ``per_minute``, per client and overall."""

    client_burst: int = 10
    client_per_minute: float = 10.0
    overall_burst: int = 30
    overall_per_minute: float = 30.0
    #: How long a client that logged in skips the overall bucket.
    proven_s: float = 86_400.0


class _Bucket:
    __slots__ = ("at", "tokens")

    def __init__(self, tokens: float, at: float) -> None:
        self.tokens, self.at = tokens, at

    def refill(self, now: float, burst: int, per_s: float) -> float:
        self.tokens = min(float(burst), self.tokens + (now - self.at) * per_s)
        self.at = now
        return self.tokens


def client_key(host: str) -> str:
    """Whose bucket a client address uses: its own, or its /64 for IPv6 (one host often has the whole /64)."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.ip_network(f"{address}/64", strict=False))
    return str(address)


class LoginThrottle:
    """The buckets of :class:`LoginLimits`; one per process (an event loop: no lock, nothing awaits inside)."""

    def __init__(self, limits: LoginLimits | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits or LoginLimits()
        self._clock = clock
        self._overall = _Bucket(float(self.limits.overall_burst), clock())
        self._clients: dict[str, _Bucket] = {}
        self._proven: dict[str, float] = {}  # client -> when it logged in, oldest first

    def wait_s(self, client: str) -> tuple[float, str]:
        """0 and "" when a login from ``client`` may be checked now; else how long until it may, and which limit."""
        now, limits = self._clock(), self.limits
        bucket = self._clients.get(client)
        if bucket is not None and bucket.refill(now, limits.client_burst, limits.client_per_minute / 60) < 1:
            return (1 - bucket.tokens) * 60 / limits.client_per_minute, "per-client"
        if self._is_proven(client, now):
            return 0.0, ""
        overall = self._overall.refill(now, limits.overall_burst, limits.overall_per_minute / 60)
        if overall < 1:
            return (1 - overall) * 60 / limits.overall_per_minute, "overall"
        return 0.0, ""

    def failed(self, client: str) -> None:
        """Take a token from ``client``'s bucket and the overall one (:meth:`wait_s` said there were some)."""
        now, limits = self._clock(), self.limits
        bucket = self._clients.pop(client, None)  # re-inserted last: the dict stays oldest first
        if bucket is None:
            if len(self._clients) >= MAX_CLIENTS:
                self._forget_refilled(now)
            bucket = _Bucket(float(limits.client_burst), now)
        bucket.refill(now, limits.client_burst, limits.client_per_minute / 60)
        bucket.tokens -= 1
        self._clients[client] = bucket
        self._overall.refill(now, limits.overall_burst, limits.overall_per_minute / 60)
        self._overall.tokens = max(0.0, self._overall.tokens - 1)

    def succeeded(self, client: str) -> None:
        """``client`` logged in: proven for :attr:`LoginLimits.proven_s`."""
        self._proven.pop(client, None)
        if len(self._proven) >= MAX_PROVEN:
            del self._proven[next(iter(self._proven))]
        self._proven[client] = self._clock()

    @property
    def clients(self) -> int:
        """How many client buckets are kept (those refilling)."""
        return len(self._clients)

    def _is_proven(self, client: str, now: float) -> bool:
        at = self._proven.get(client)
        if at is None:
            return False
        if now - at < self.limits.proven_s:
            return True
        del self._proven[client]
        return False

    def _forget_refilled(self, now: float) -> None:
        """Drop the buckets that are full again (the same as none); then the oldest, down to nine tenths."""
        limits = self.limits
        kept = [
            (client, bucket)
            for client, bucket in self._clients.items()
            if bucket.refill(now, limits.client_burst, limits.client_per_minute / 60) < limits.client_burst
        ]
        # Not one at a time: a full dict of refilling buckets would be walked again for every new client.
        self._clients = dict(kept[-(MAX_CLIENTS * 9 // 10) :] if len(kept) >= MAX_CLIENTS else kept)
