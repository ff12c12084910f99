"""Who may use the dashboard, and proof that an action came from its own page.

* **Credentials.** With ``DASHBOARD_USER``/``DASHBOARD_PASSWORD`` (HTTP Basic)
  or ``DASHBOARD_TOKEN`` (``Authorization: Bearer``), every request must carry
  them. ``dramatiq-gp dashboard`` refuses to listen anywhere but loopback
  without them (:func:`loopback`).
* **CSRF.** An action is a POST whose form carries the token of the
  ``gp_csrf`` cookie (a double-submit token: a page of another site can send
  the cookie but cannot read it). The cookie is ``SameSite=Strict`` too.
* **Who.** Each action is logged with the user (or ``token``, or ``anonymous``
  on a loopback dashboard without credentials) and the client's address.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import ipaddress
import secrets
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from ..settings import MIN_TOKEN_LENGTH

CSRF_COOKIE = "gp_csrf"
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
            except (binascii.Error, UnicodeDecodeError):
                return None
            same_user = hmac.compare_digest(user.encode(), self.user.encode())
            same_password = hmac.compare_digest(password.encode(), self.password.encode())
            return user if same_user and same_password else None
        return None


class RequireCredentials:
    """ASGI middleware: a request without the credentials gets 401 and goes no further."""

    def __init__(self, app: ASGIApp, credentials: Credentials) -> None:
        self.app = app
        self.credentials = credentials

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.credentials.required:
            authorization = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            found = self.credentials.check(authorization)
            if found is None:
                challenge = {"WWW-Authenticate": 'Basic realm="dramatiq-gp"'} if self.credentials.user else {}
                await PlainTextResponse("credentials required", 401, headers=challenge)(scope, receive, send)
                return
            scope[WHO] = found
        await self.app(scope, receive, send)


def who(request: Request) -> str:
    """``<name> (dashboard, <client address>)``, for the line an action logs."""
    name = request.scope.get(WHO)
    if name is None:  # no credentials of its own: the application it is mounted in may have authenticated
        user: Any = request.scope.get("user")
        name = str(user.display_name) if getattr(user, "is_authenticated", False) else "anonymous"
    client = request.client.host if request.client else "unknown"
    return f"{name} (dashboard, {client})"


def csrf_token(request: Request) -> str:
    """The request's CSRF token: its cookie's, or a new one that :func:`keep_csrf` sets."""
    token = request.cookies.get(CSRF_COOKIE)
    if not token:
        token = request.state.new_csrf = secrets.token_urlsafe(32)
    return token


def keep_csrf(request: Request, response: Response) -> Response:
    new = getattr(request.state, "new_csrf", None)
    if new:
        path = request.scope.get("root_path") or "/"
        response.set_cookie(CSRF_COOKIE, new, path=path, httponly=True, samesite="strict")
    return response


def csrf_ok(request: Request, submitted: object) -> bool:
    cookie = request.cookies.get(CSRF_COOKIE)
    if not cookie or not isinstance(submitted, str):
        return False
    return hmac.compare_digest(cookie.encode(), submitted.encode())
