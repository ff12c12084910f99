"""A worker app for the deploy tests: one event, and the listeners ``GP_TEST_LISTENERS`` names.

Run as ``dramatiq tests.apps.deploy_app`` with ``REDIS_URL``, ``VALKEY_NAMESPACE``,
``DB_URL`` (the outbox, and the ledger) and ``GP_TEST_LISTENERS``: listener names
separated by commas. Listener ``name`` is on queue ``name`` and records each run as
a row of ``deploy_runs`` (``namespace``, ``listener``, ``envelope``, ``order_id``,
``pid``), so a test sees which listener got which event, and how often.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import sqlalchemy as sa

import dramatiq_gp as gp
from tests.apps.app_events import Ordered

ledger = sa.create_engine(os.environ["DB_URL"])

DEPLOY_RUNS = """
CREATE TABLE IF NOT EXISTS deploy_runs (
    namespace text NOT NULL, listener text NOT NULL, envelope text NOT NULL, order_id integer NOT NULL,
    pid integer NOT NULL
)"""


def recorder(name: str) -> Callable[[Ordered], None]:
    def record(event: Ordered) -> None:
        row = {
            "namespace": broker.namespace,
            "listener": name,
            "envelope": gp.current_envelope().id,
            "order_id": event.order_id,
            "pid": os.getpid(),
        }
        with ledger.begin() as conn:
            conn.execute(
                sa.text("INSERT INTO deploy_runs VALUES (:namespace, :listener, :envelope, :order_id, :pid)"), row
            )

    return record


def register(registry: gp.Registry, schedule: gp.Schedule) -> None:
    for name in os.environ["GP_TEST_LISTENERS"].split(","):
        registry.listen(Ordered, recorder(name), name=name, queue=name)


kit = gp.Kit(register, registry=gp.Registry()).with_closer("ledger", ledger.dispose)
broker = kit.broker
