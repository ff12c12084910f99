"""The dashboard's login limits, over real concurrent HTTP from several loopback addresses (127.0.0.x).

A 401 is a guess that was checked (and wrong); a 429 one that was refused unchecked.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from devtools.asgi import serving
from dramatiq_gp.dashboard import Credentials, create_app
from dramatiq_gp.dashboard import logins as logins_module
from dramatiq_gp.dashboard.access import RequireCredentials
from dramatiq_gp.dashboard.logins import LoginLimits, LoginThrottle, client_key

TOKEN = "t0ken-of-twenty-chars"
PASSWORD = "a-long-enough-password"


@dataclass
class Answer:
    status: int
    headers: dict[str, str]


async def _get(base: str, source: str, authorization: str) -> Answer:
    """GET / from ``source`` (a loopback address) with ``authorization``, on a connection of its own."""
    port = urlsplit(base).port
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    request = f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: {authorization}\r\nConnection: close\r\n\r\n"
    writer.write(request.encode())
    head = (await reader.read()).decode("latin-1").partition("\r\n\r\n")[0].split("\r\n")
    writer.close()
    headers = dict(line.lower().split(": ", 1) for line in head[1:])
    return Answer(int(head[0].split()[1]), headers)


def _all_at_once(base: str, requests: list[tuple[str, str]]) -> list[Answer]:
    async def run() -> list[Answer]:
        return await asyncio.gather(*(_get(base, source, authorization) for source, authorization in requests))

    return asyncio.run(run())


def _statuses(answers: list[Answer]) -> list[int]:
    return sorted(answer.status for answer in answers)


def test_parallel_wrong_guesses_from_one_client_are_checked_only_up_to_its_burst(clean_env, namespace):
    # 150 parallel connections once made 269 checked guesses a second: the delay was per request.
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    limits = LoginLimits()  # the dashboard's own
    with serving(create_app(credentials=Credentials(token=TOKEN))) as base:
        started = time.monotonic()
        answers = _all_at_once(base, [("127.0.0.2", "Bearer " + "x" * 20)] * 150)
        elapsed = time.monotonic() - started
        checked = [a for a in answers if a.status == 401]
        refused = [a for a in answers if a.status == 429]
        assert len(checked) + len(refused) == 150
        # The burst, and at most what refilled while they came in (one every 6 s).
        assert limits.client_burst <= len(checked) <= limits.client_burst + elapsed * limits.client_per_minute / 60
        assert all(int(a.headers["retry-after"]) >= 1 for a in refused)
        # Another client's right token is let through: its own bucket is full, and the overall one is not empty.
        assert _statuses(_all_at_once(base, [("127.0.0.3", f"Bearer {TOKEN}")])) == [200]


def _limited_app(limits: LoginLimits) -> Starlette:
    async def page(request: Request) -> PlainTextResponse:
        return PlainTextResponse("in")

    credentials = Credentials("alice", PASSWORD)
    return Starlette(
        routes=[Route("/", page)], middleware=[Middleware(RequireCredentials, credentials=credentials, limits=limits)]
    )


def _basic(password: str) -> str:
    return "Basic " + base64.b64encode(f"alice:{password}".encode()).decode()


def test_guesses_from_many_addresses_stop_at_the_overall_limit_but_do_not_lock_out_a_client_already_in(caplog):
    # Nothing refills during the test: what is checked is exactly what the limits allow.
    never = 1e-6
    limits = LoginLimits(client_burst=3, client_per_minute=never, overall_burst=5, overall_per_minute=never)
    right, wrong = _basic(PASSWORD), _basic("guess")
    with serving(_limited_app(limits)) as base, caplog.at_level(logging.WARNING, logger="dramatiq_gp.dashboard"):
        assert _statuses(_all_at_once(base, [("127.0.0.1", right)])) == [200]  # an operator logs in
        guessers = [f"127.0.0.{n}" for n in range(2, 6)]
        answers = _all_at_once(base, [(source, wrong) for source in guessers for _ in range(6)])
        assert _statuses(answers) == [401] * 5 + [429] * 19  # the overall burst, out of 4 addresses' 12
        # Past the limit a right password is refused too: a 200 among the 429s would tell a guesser he had it.
        assert _statuses(_all_at_once(base, [("127.0.0.2", right), ("127.0.0.9", right)])) == [429, 429]
        # The operator who logged in before is still in, at once...
        assert _statuses(_all_at_once(base, [("127.0.0.1", right)])) == [200]
        # ... but his address's own failures count as anyone's: three checked, then refused, right or wrong.
        assert _statuses(_all_at_once(base, [("127.0.0.1", wrong)] * 4)) == [401] * 3 + [429]
        assert _statuses(_all_at_once(base, [("127.0.0.1", right)])) == [429]
    lines = [r.getMessage() for r in caplog.records if r.name == "dramatiq_gp.dashboard"]
    assert "dashboard: 1 failed login(s) from 127.0.0.1 in the last 60s" in lines
    (refused,) = [line for line in lines if "refused" in line]
    assert refused.startswith("dashboard: 1 login(s) refused unchecked in the last 60s: too many failed logins")


def test_the_limits_memory_is_bounded_and_ipv6_clients_share_their_64(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(logins_module, "MAX_CLIENTS", 100)
    monkeypatch.setattr(logins_module, "MAX_PROVEN", 10)
    throttle = LoginThrottle(LoginLimits(overall_burst=10**6), clock=lambda: now[0])
    for n in range(1_000):
        throttle.failed(f"10.0.{n // 256}.{n % 256}")
        throttle.succeeded(f"10.1.{n // 256}.{n % 256}")
        assert throttle.clients <= 100
    assert len(throttle._proven) == 10
    now[0] += 60  # every bucket full again: the same as none, forgotten at the next new client
    throttle.failed("10.2.0.1")
    assert throttle.clients == 1
    assert client_key("2001:db8::1") == client_key("2001:db8::ffff:1") == "2001:db8::/64"
    assert client_key("::ffff:10.0.0.7") == "10.0.0.7"
