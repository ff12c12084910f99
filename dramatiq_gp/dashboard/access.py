"""Who may use the dashboard, and proof that an action came from its own page.

* **Credentials.** With ``DASHBOARD_USER``/``DASHBOARD_PASSWORD`` (HTTP Basic)
  or ``DASHBOARD_TOKEN`` (``Authorization: Bearer``), every request must carry
  them. ``dramatiq-gp dashboard`` refuses to listen anywhere but loopback
  without them (:func:`loopback`).
* **CSRF.** An action is a POST whose form carries the token of the
  ``gp_csrf`` cookie (a double-submit token: a page of another site can send
  the cookie but cannot read it). The cookie is ``SameSite=Strict`` too. And a
  POST a browser sends from a page of another origin (``Origin``,
  ``Sec-Fetch-Site``) gets 403 before any of that (:class:`SameOrigin`): cookies
  are not isolated by port, so a page on another port of the same host can set
  the cookie it then submits.
* **Who.** Each action is logged with the user (or ``token``, or ``anonymous``
  on a loopback dashboard without credentials) and the client's address.
* **Hosts.** With an allowed-hosts list (the command's default: the address it
  listens on and ``localhost``), a request naming another ``Host`` gets 400: a
  page whose name an attacker rebinds to 127.0.0.1 cannot reach it.
* **Headers.** Every response forbids framing, caching and content sniffing,
  and sends no referrer off the site.
* **Guessing.** Wrong credentials are slowed down, limited per client and
  overall (:mod:`~dramatiq_gp.dashboard.logins`: past the limit, 429 unchecked)
  and logged, once per client per minute.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import ipaddress
import logging
import math
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from ..settings import MIN_TOKEN_LENGTH
from ..telemetry import printable
from .logins import LoginLimits, LoginThrottle, client_key

logger = logging.getLogger("dramatiq_gp.dashboard")

CSRF_COOKIE = "gp_csrf"
#: Its name over TLS at the root: the browser then refuses it from a sibling subdomain or over plain HTTP.
SECURE_CSRF_COOKIE = "__Host-gp_csrf"
CSRF_FIELD = "csrf"
#: Where :class:`Credentials` put the authenticated name in the ASGI scope.
WHO = "gp.who"


def loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Credentials:
    """What a request must carry; with neither, every request passes (as ``anonymous``).

    Fails closed: an empty or blank secret, a user without a password (or the
    reverse) and a token shorter than :data:`MIN_TOKEN_LENGTH` are refused when
    built, rather than read as "no credentials".
    """

    user: str | None = None
    password: str | None = None
    token: str | None = None

    def __post_init__(self) -> None:
        for name, value in (("user", self.user), ("password", self.password), ("token", self.token)):
            if value is not None and not value.strip():
                raise ValueError(f"the dashboard's {name} is empty: give a real one, or none")
        if (self.user is None) != (self.password is None):
            raise ValueError("the dashboard's user and password go together: give both or neither")
        if self.token is not None and len(self.token.strip()) < MIN_TOKEN_LENGTH:
            raise ValueError(f"the dashboard's token is shorter than {MIN_TOKEN_LENGTH} characters")

    @property
    def required(self) -> bool:
        return self.user is not None or self.token is not None

    def check(self, authorization: str) -> str | None:
        """The name the ``Authorization`` header authenticates, or None."""
        scheme, _, value = authorization.partition(" ")
        if scheme.lower() == "bearer" and self.token is not None:
            return "token" if hmac.compare_digest(value.strip().encode(), self.token.encode()) else None
        if scheme.lower() == "basic" and self.user is not None and self.password is not None:
            try:
                user, _, password = base64.b64decode(value.strip(), validate=True).decode().partition(":")
            except (ValueError, UnicodeDecodeError):  # binascii.Error, and a value that is not even ASCII
                return None
            same_user = hmac.compare_digest(user.encode(), self.user.encode())
            same_password = hmac.compare_digest(password.encode(), self.password.encode())
            return user if same_user and same_password else None
        return None


#: How long a wrong password or token waits for its 401: a sequential guesser gets two tries a second.
FAILED_LOGIN_DELAY_S = 0.5
#: Failed and refused logins are logged once per client (refused: once overall) per this many seconds, with counts.
FAILED_LOGIN_LOG_S = 60.0


class RequireCredentials:
    """ASGI middleware: a request without the credentials gets 401 and goes no further.

    A request whose credentials are wrong (not merely missing: a browser's first
    request carries none) waits :data:`FAILED_LOGIN_DELAY_S` for its 401, and
    takes a token from its client's bucket and the overall one
    (:class:`~dramatiq_gp.dashboard.logins.LoginThrottle`): while either is
    empty, a request with credentials gets 429 and a ``Retry-After`` at once,
    unchecked. A right one is never slowed. Failures are logged once per client
    address per :data:`FAILED_LOGIN_LOG_S`, refusals once per that for all.
    """

    def __init__(self, app: ASGIApp, credentials: Credentials, limits: LoginLimits | None = None) -> None:
        self.app = app
        self.credentials = credentials
        self.throttle = LoginThrottle(limits)
        self._failures: dict[str, tuple[float, int]] = {}  # client -> (logged at, failed since)
        self._refused: tuple[float, int] = (-FAILED_LOGIN_LOG_S, 0)  # (logged at, refused since)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.credentials.required:
            authorization = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            client = client_key(scope["client"][0]) if scope.get("client") else "unknown"
            # Nothing awaits from the bucket's look to its token taken: parallel guesses cannot all pass the look.
            wait_s, limit = self.throttle.wait_s(client) if authorization else (0.0, "")
            if wait_s:
                self._refuse(client, limit)
                retry = str(max(1, math.ceil(wait_s)))
                response = PlainTextResponse(f"too many failed logins: try again in {retry}s", 429)
                response.headers["Retry-After"] = retry
                await response(scope, receive, send)
                return
            found = self.credentials.check(authorization)
            if found is None:
                if authorization:
                    self.throttle.failed(client)
                    self._failed(client)
                    await asyncio.sleep(FAILED_LOGIN_DELAY_S)
                challenge = {"WWW-Authenticate": 'Basic realm="dramatiq-gp"'} if self.credentials.user else {}
                await PlainTextResponse("credentials required", 401, headers=challenge)(scope, receive, send)
                return
            self.throttle.succeeded(client)
            scope[WHO] = found
        await self.app(scope, receive, send)

    def _failed(self, client: str) -> None:
        now = time.monotonic()
        logged_at, count = self._failures.get(client, (now - FAILED_LOGIN_LOG_S, 0))
        count += 1
        if now - logged_at >= FAILED_LOGIN_LOG_S:
            logger.warning("dashboard: %d failed login(s) from %s in the last %ds", count, client, FAILED_LOGIN_LOG_S)
            logged_at, count = now, 0
        self._failures[client] = (logged_at, count)
        if len(self._failures) > 10_000:  # many clients: forget the quiet ones rather than grow for ever
            self._failures = {c: v for c, v in self._failures.items() if now - v[0] < FAILED_LOGIN_LOG_S}

    def _refuse(self, client: str, limit: str) -> None:
        now = time.monotonic()
        logged_at, count = self._refused
        count += 1
        if now - logged_at >= FAILED_LOGIN_LOG_S:
            logger.warning(
                "dashboard: %d login(s) refused unchecked in the last %ds: too many failed logins "
                "(the last from %s, over the %s limit)",
                count,
                FAILED_LOGIN_LOG_S,
                client,
                limit,
            )
            logged_at, count = now, 0
        self._refused = (logged_at, count)


class AllowedHosts:
    """ASGI middleware: a request whose ``Host`` is not one of ``hosts`` gets 400.

    Starlette's ``TrustedHostMiddleware`` cuts the port off at the first colon,
    which leaves ``[`` of an IPv6 address such as ``[::1]:8642``; this one reads
    the brackets. ``*`` allows any host; ``*.example.com`` any subdomain.
    """

    def __init__(self, app: ASGIApp, hosts: Sequence[str]) -> None:
        self.app = app
        self.hosts = [_bare_host(h) for h in hosts]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or "*" in self.hosts:
            await self.app(scope, receive, send)
            return
        host = _bare_host(dict(scope["headers"]).get(b"host", b"").decode("latin-1"))
        if not any(host == h or (h.startswith("*.") and host.endswith(h[1:])) for h in self.hosts):
            await PlainTextResponse("this Host is not allowed (DASHBOARD_ALLOWED_HOSTS)", 400)(scope, receive, send)
            return
        await self.app(scope, receive, send)


#: The methods that change nothing: every other one must come from the dashboard's own origin.
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


class SameOrigin:
    """ASGI middleware: a request that may change something, sent by a page of another origin, gets 403.

    Browsers say where a request comes from. ``Sec-Fetch-Site`` must be
    ``same-origin`` (or ``none``: typed by the user); ``same-site`` is refused,
    since a page on another port of the same host is same-site. ``Origin`` must
    name the host and port the request was sent to (its ``Host``). A request with
    neither header is not a browser's (curl, a script): it still needs its CSRF
    token and credentials. Each refusal is logged on ``dramatiq_gp.dashboard``.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in SAFE_METHODS:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        site = headers.get(b"sec-fetch-site", b"").decode("latin-1")
        origin = headers.get(b"origin", b"").decode("latin-1")
        host = headers.get(b"host", b"").decode("latin-1")
        if (site and site not in ("same-origin", "none")) or (origin and not _same_host(origin, host)):
            client = scope["client"][0] if scope.get("client") else "unknown"
            logger.warning(
                "dashboard: %s %s from %s refused: sent by a page of another origin (Origin %r, Sec-Fetch-Site %r)",
                scope["method"],
                printable(scope["path"][:200]),
                client,
                origin[:200],
                site[:40],
            )
            await PlainTextResponse("refused: this request comes from a page of another origin", 403)(
                scope, receive, send
            )
            return
        await self.app(scope, receive, send)


def _same_host(origin: str, host: str) -> bool:
    """Whether ``origin`` (``scheme://host[:port]``) names ``host`` (a ``Host`` header): the same name and the same
    port as written (a default port left out on both sides)."""
    scheme, sep, rest = origin.partition("://")
    if not sep or not scheme or "/" in rest:  # "null" (a sandboxed or file page), or no origin at all
        return False
    return _host_port(rest) == _host_port(host)


def _host_port(host: str) -> tuple[str, str]:
    host = host.strip().lower()
    if host.startswith("["):
        name, _, rest = host[1:].partition("]")
        return name, rest.removeprefix(":")
    name, _, port = host.rpartition(":") if host.count(":") == 1 else (host, "", "")
    return name, port


def _bare_host(host: str) -> str:
    """``host`` without its port and IPv6 brackets, lower-cased."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    if host.count(":") == 1:
        return host.partition(":")[0]
    return host


#: On every response: no framing (clickjacking), no caching of pages that show queues and payloads, no
#: sniffing a text response into a script, no dashboard URL sent to another site.
SECURITY_HEADERS = [
    (b"x-frame-options", b"DENY"),
    (b"content-security-policy", b"frame-ancestors 'none'"),
    (b"cache-control", b"no-store"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),
]


class SecurityHeaders:
    """ASGI middleware: adds :data:`SECURITY_HEADERS` to every response (an existing one of a name is replaced)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        names = {name for name, _ in SECURITY_HEADERS}

        async def send_with_headers(message: Any) -> None:
            if message["type"] == "http.response.start":
                kept = [(k, v) for k, v in message.get("headers", []) if k.lower() not in names]
                message = {**message, "headers": kept + SECURITY_HEADERS}
            await send(message)

        await self.app(scope, receive, send_with_headers)


def who(request: Request) -> str:
    """``<name> (dashboard, <client address>)``, for the line an action logs."""
    name = request.scope.get(WHO)
    if name is None:  # no credentials of its own: the application it is mounted in may have authenticated
        user: Any = request.scope.get("user")
        name = str(user.display_name) if getattr(user, "is_authenticated", False) else "anonymous"
    client = request.client.host if request.client else "unknown"
    return f"{name} (dashboard, {client})"


def _csrf_cookie(request: Request) -> tuple[str, str, bool]:
    """The CSRF cookie's name, path and whether it is ``Secure``: ``__Host-`` over TLS at the root."""
    path = request.scope.get("root_path") or "/"
    secure = request.url.scheme == "https"
    return (SECURE_CSRF_COOKIE if secure and path == "/" else CSRF_COOKIE), path, secure


def csrf_token(request: Request) -> str:
    """The request's CSRF token: its cookie's, or a new one that :func:`keep_csrf` sets."""
    token = request.cookies.get(_csrf_cookie(request)[0])
    if not token:
        token = request.state.new_csrf = secrets.token_urlsafe(32)
    return token


def keep_csrf(request: Request, response: Response) -> Response:
    new = getattr(request.state, "new_csrf", None)
    if new:
        name, path, secure = _csrf_cookie(request)
        response.set_cookie(name, new, path=path, httponly=True, samesite="strict", secure=secure)
    return response


def csrf_ok(request: Request, submitted: object) -> bool:
    cookie = request.cookies.get(_csrf_cookie(request)[0])
    if not cookie or not isinstance(submitted, str):
        return False
    return hmac.compare_digest(cookie.encode(), submitted.encode())
