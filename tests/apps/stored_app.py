"""A worker app with no code schedule, for the stored-entries tests: an actor and a listener that record each run.

Run as ``dramatiq tests.apps.stored_app`` with ``REDIS_URL``, ``VALKEY_NAMESPACE``
and ``SCHEDULER_DYNAMIC=true``. Each run appends a JSON line to the Redis list
``<namespace>:test:runs``: the actor's ``{"actor": customer}``, the listener's
``{"event": customer, "scheduled_at": ...}`` from the envelope, the unmarked
actor's ``{"deleted": account}``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import dramatiq

import dramatiq_gp as gp


@gp.schedulable
@gp.event("test.stored.digest")
@dataclass(frozen=True)
class Digest:
    customer: int


def _record(run: dict[str, object]) -> None:
    broker.client.rpush(f"{broker.namespace}:test:runs", json.dumps(run))


def on_digest(event: Digest) -> None:
    at = gp.current_envelope().scheduled_at
    _record({"event": event.customer, "scheduled_at": at.isoformat() if at else None})


def register(registry: gp.Registry, schedule: gp.Schedule) -> None:
    registry.listen(Digest, on_digest, name="record")


kit = gp.Kit(register, registry=gp.Registry())
broker = kit.broker


@gp.schedulable
@dramatiq.actor(queue_name="digests")
def send_digest(customer: int, *, channel: str = "mail") -> None:
    _record({"actor": customer, "channel": channel})


# Not marked: no stored entry may run it, whatever is written into Redis.
@dramatiq.actor(queue_name="digests")
def delete_account(account: int) -> None:
    _record({"deleted": account})
