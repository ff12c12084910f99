"""A worker app for the inbox kill test: one listener that writes its effect through the inbox.

Run as ``dramatiq tests.apps.inbox_app`` with ``REDIS_URL``, ``VALKEY_NAMESPACE``
and ``DB_URL`` set. ``record`` inserts one row per ``test.inbox_app.ordered``
event into ``inbox_kill_effects`` (no unique key: a second application shows as a
second row). With ``GP_TEST_KILL_AFTER_COMMIT=1`` the worker process SIGKILLs
itself right after the listener's inbox transaction committed and before the
message is acked (from ``after_process_message``, which runs before the ack is
even handed to the settler). ``GP_TEST_CLAIM=0`` takes the listener out of the
Redis claim, so only the inbox stands between a redelivery and a second effect;
``GP_TEST_HEARTBEAT_MS`` shortens Dramatiq's heartbeat timeout, so a killed
worker's messages come back within seconds.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from dramatiq import Broker, Middleware
from dramatiq.broker import MessageProxy

import dramatiq_gp as gp

LISTENER = "listener:test.inbox_app.ordered:record"


@gp.event("test.inbox_app.ordered")
@dataclass(frozen=True)
class Ordered:
    order: int


class KillAfterCommit(Middleware):
    """SIGKILLs this worker process once the listener's transaction committed, before the ack."""

    def after_process_message(
        self, broker: Broker, message: MessageProxy, *, result: Any = None, exception: BaseException | None = None
    ) -> None:
        if message.actor_name == LISTENER and exception is None:
            os.kill(os.getpid(), signal.SIGKILL)


def record(event: Ordered, conn: sa.Connection) -> None:
    conn.execute(sa.text("INSERT INTO inbox_kill_effects (order_id) VALUES (:order)"), {"order": event.order})


def register(registry: gp.Registry, schedule: gp.Schedule) -> None:
    assert kit.engine is not None
    claim = {} if os.environ.get("GP_TEST_CLAIM", "1") == "1" else {"idempotent": False}
    registry.listen(Ordered, record, name="record", inbox=kit.engine, **claim)


kit = gp.Kit(
    registry=gp.Registry(),
    broker_options={"heartbeat_timeout": int(os.environ.get("GP_TEST_HEARTBEAT_MS", "60000"))},
    middleware=[KillAfterCommit()] if os.environ.get("GP_TEST_KILL_AFTER_COMMIT") == "1" else [],
)
register(kit.registry, kit.schedule)
broker = kit.broker
