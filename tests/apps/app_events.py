"""Events shared by the test apps and the tests that drive them."""

from __future__ import annotations

from dataclasses import dataclass

import dramatiq_gp as gp


@gp.event("test.app.slow")
@dataclass(frozen=True)
class Slow:
    seconds: float


@gp.event("test.app.numbered")
@dataclass(frozen=True)
class Numbered:
    n: int


@gp.event("test.telemetry.order_placed")
@dataclass(frozen=True)
class OrderPlaced:
    order_id: int


@gp.event("test.telemetry.signed_up")
@dataclass(frozen=True)
class SignedUp:
    email: str


@gp.event("test.deploy.order_placed")
@dataclass(frozen=True)
class Ordered:
    order_id: int
