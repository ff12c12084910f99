"""The names and ids the kit gives messages: one grammar of task types, one rule per deterministic id.

Task types (Dramatiq actor names), as the Go kit names them:

* ``listener:<event>:<listener>``: one listener of one event;
* ``event:<event>``: the fan-out of an event from the outbox to its listeners;
* ``schedule:<event>``: a scheduled event's firing, fanned out the same way;
* ``job:<name>``: a scheduled job.

Names (of events, listeners, entries) are letters, digits, ``_``, ``.`` and ``-``.
Message ids that must come out the same however often they are computed:

* a listener's copy of an envelope: :func:`fan_out_id` (uuid5 of the envelope id and the task type);
* a tick of a schedule entry: :func:`tick_message_id` (uuid5 of the entry and the tick).

An outbox event's message id is the row's id, and a scheduled event's envelope
id is its tick's message id, so a retried fan-out or firing duplicates nothing.
"""

from __future__ import annotations

import re
import uuid
from datetime import datetime

#: What an event, listener or schedule entry may be called.
NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")

#: Namespace of the fan-out message ids.
FAN_OUT_NAMESPACE = uuid.UUID("6b1f3c6e-3d2a-5e0c-9a51-2f2b8f1d6a10")
#: Namespace of the tick message ids.
TICK_NAMESPACE = uuid.UUID("0f0c1a52-9e8a-5b0e-8d4f-6f2b4c3e9a77")

JOB = "job:"

#: The queue of the ``event:<event>`` fan-out messages.
EVENT_QUEUE = "default"


def is_delay_queue(queue_name: str) -> bool:
    """Whether ``queue_name`` is a delay queue (Dramatiq's ``<queue>.DQ``), where messages wait for their ``eta``."""
    return queue_name.endswith(".DQ")


def listener_actor(event: str, listener: str) -> str:
    return f"listener:{event}:{listener}"


def event_actor(event: str) -> str:
    """The actor that fans out events named ``event``."""
    return f"event:{event}"


def schedule_actor(event: str) -> str:
    return f"schedule:{event}"


def job_actor(name: str) -> str:
    return f"{JOB}{name}"


def job_name(actor_name: str) -> str | None:
    """The job's name, for a ``job:<name>`` task type; ``None`` for any other."""
    return actor_name.removeprefix(JOB) if actor_name.startswith(JOB) else None


def fan_out_id(envelope_id: str, actor_name: str) -> str:
    """The message id of ``actor_name``'s copy of envelope ``envelope_id``."""
    return str(uuid.uuid5(FAN_OUT_NAMESPACE, f"{envelope_id}/{actor_name}"))


def tick_message_id(entry: str, tick: datetime) -> str:
    """The message id of ``entry``'s firing for ``tick``."""
    return str(uuid.uuid5(TICK_NAMESPACE, f"{entry}@{round(tick.timestamp() * 1000)}"))
