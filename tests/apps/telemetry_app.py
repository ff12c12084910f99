"""A worker app for the telemetry tests: listeners, actors that fail, and a job, each leaving a breadcrumb.

Run as ``dramatiq tests.apps.telemetry_app`` with ``REDIS_URL`` and
``VALKEY_NAMESPACE`` set (``DB_URL`` adds the outbox; ``GP_TEST_CRON=1`` adds an
``@every 1s`` job), plus the ``OTEL_*``/``SENTRY_*``/``LOG_*`` variables under test.
"""

from __future__ import annotations

import logging
import os
import time

import dramatiq
import sentry_sdk

import dramatiq_gp as gp
from tests.apps.app_events import OrderPlaced, SignedUp

logger = logging.getLogger("tests.apps.telemetry_app")


def _crumb(text: str) -> None:
    sentry_sdk.add_breadcrumb(category="test", message=text)


def mail(event: OrderPlaced) -> None:
    _crumb(f"mail {event.order_id}")
    logger.info("mailing order %s", event.order_id)


def stock(event: OrderPlaced) -> None:
    _crumb(f"stock {event.order_id}")
    logger.info("reserving stock for order %s", event.order_id)


def welcome(event: SignedUp) -> None:
    address = event.email
    _crumb(f"welcome mail for user #{len(address)}")
    raise RuntimeError("the welcome mail bounced")


def heartbeat() -> None:
    logger.info("heartbeat")


def register(registry: gp.Registry, schedule: gp.Schedule) -> None:
    registry.listen(OrderPlaced, mail, name="mail")
    registry.listen(OrderPlaced, stock, name="stock", queue="stock")
    registry.listen(SignedUp, welcome, name="welcome", max_retries=1)
    if os.environ.get("GP_TEST_CRON") == "1":
        schedule.job("heartbeat", "@every 1s", heartbeat)


kit = gp.Kit(register, registry=gp.Registry())
broker = kit.broker
attempts = kit.broker.client


@dramatiq.actor(broker=broker, queue_name="default")
def quick(n: int) -> None:
    _crumb(f"quick {n}")
    logger.info("quick %d", n)


@dramatiq.actor(broker=broker, queue_name="default", max_retries=2, min_backoff=10, max_backoff=50)
def always_fails(tag: str) -> None:
    _crumb(f"always_fails {tag}")
    raise ValueError(f"always fails: {tag}")


@dramatiq.actor(broker=broker, queue_name="default", max_retries=3, min_backoff=10, max_backoff=50)
def fails_once(tag: str) -> None:
    _crumb(f"fails_once {tag}")
    if attempts.incr(f"{broker.namespace}:test:attempts:{tag}") == 1:
        raise RuntimeError(f"first attempt of {tag} fails")


@dramatiq.actor(broker=broker, queue_name="low")
def low(n: int) -> None:
    logger.info("low %d", n)


@dramatiq.actor(broker=broker, queue_name="default")
def sleepy(seconds: float) -> None:
    time.sleep(seconds)


class Expected(Exception):
    pass


@dramatiq.actor(broker=broker, queue_name="default", throws=Expected)
def expected(tag: str) -> None:
    raise Expected(f"expected: {tag}")


@dramatiq.actor(broker=broker, queue_name="default", max_retries=0)
def declined(card: str) -> None:
    """Exception text with a card number in it: logged as an argument, and raised with its cause."""
    try:
        raise LookupError(f"no customer for card {card}")
    except LookupError as exc:
        logger.warning("charge skipped: %s", exc)
        raise ValueError(f"card {card} declined") from exc
