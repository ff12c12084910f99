"""A worker app for the payload-compatibility test: this version's event classes, one per case.

Run as ``dramatiq tests.apps.compat_app`` with ``REDIS_URL``, ``VALKEY_NAMESPACE`` and
``DB_URL``. Each case is an event of its own, as this version declares it; the
test sends each one in the shape another version wrote. Every listener records
the event it decoded as a row of ``compat_runs`` (``namespace``, ``event``,
``fields``: the decoded event as JSON), on queue ``compat``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

import dramatiq_gp as gp

ledger = sa.create_engine(os.environ["DB_URL"])


@gp.event("test.compat.added")
@dataclass(frozen=True)
class Added:
    """This version added ``referrer``, with a default: an older writer leaves it out."""

    user_id: int
    email: str
    referrer: str = ""


@gp.event("test.compat.extra")
@dataclass(frozen=True)
class Extra:
    """A newer writer added ``referrer``: this version has no such field."""

    user_id: int
    email: str


@gp.event("test.compat.default_removed")
@dataclass(frozen=True)
class DefaultRemoved:
    """A newer writer removed ``plan``, which has a default here."""

    user_id: int
    email: str
    plan: str = "free"


@gp.event("test.compat.required_removed")
@dataclass(frozen=True)
class RequiredRemoved:
    """A newer writer removed ``email``, which this version requires."""

    user_id: int
    email: str


@gp.event("test.compat.required_added")
@dataclass(frozen=True)
class RequiredAdded:
    """This version added ``country`` without a default: an older writer leaves it out."""

    user_id: int
    email: str
    country: str


@gp.event("test.compat.renamed")
@dataclass(frozen=True)
class Renamed:
    """A newer writer calls this event ``test.compat.renamed_v2``."""

    user_id: int


CASES = (Added, Extra, DefaultRemoved, RequiredRemoved, RequiredAdded, Renamed)


def record(event: Any) -> None:
    row = {
        "namespace": broker.namespace,
        "event": gp.current_envelope().event,
        "fields": json.dumps(dataclasses.asdict(event)),
    }
    with ledger.begin() as conn:
        conn.execute(sa.text("INSERT INTO compat_runs VALUES (:namespace, :event, CAST(:fields AS jsonb))"), row)


def register(registry: gp.Registry, schedule: gp.Schedule) -> None:
    for cls in CASES:
        registry.listen(cls, record, name="record", queue="compat")


kit = gp.Kit(register, registry=gp.Registry()).with_closer("ledger", ledger.dispose)
broker = kit.broker
