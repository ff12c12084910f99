"""Done marks: the message ids that completed, kept for ``WORKER_DEDUP_RETENTION`` in about 20 bytes each.

A copy of a completed message id is skipped for as long as its mark is kept
(:class:`~dramatiq_gp.middleware.IdempotentExecution`). One key per id, with its own
TTL, cost about 152 bytes of Redis memory: 13 GB at 1,000 messages/s and the
default 24 h. So the marks are packed instead:

* time is cut into slices of a quarter of the retention; a mark goes into the slice
  its write falls in, and the slice's keys expire whole five slices after it began.
  A mark is therefore kept at least the retention, at most a slice longer, and a
  look-up reads five slices;
* a slice is spread over shards, small hashes keyed by a 12-byte digest of the
  message id. Redis keeps a hash of at most 128 short fields in its compact
  encoding (``hash-max-listpack-entries``, ``hash-max-ziplist-entries`` before 7),
  about 16 bytes a field here, against some 80 in a full hash table. A slice gets
  one shard per :data:`FILL` marks of the slice before, and when a shard reaches
  :data:`GROW_AT` the slice's later marks go to a new level of twice as many
  shards (a look-up reads each level);
* every time comes from the server (``TIME``), so workers agree on the slice
  whatever their clocks say.

A digest of 96 bits stands for the id: two ids share one with a chance of 2⁻⁹⁶ per
pair, about 10⁻²¹ for a message against a day of marks at 1,000 messages/s, and
10⁻¹⁰ that it happens to any message in a year of that.

The scripts that write marks (the Redis broker's settle, the RabbitMQ broker's
record) and the one that reads them (the idempotency claim) are each prepended
with ``done_marks/library.lua`` by :func:`with_library`. Which slices exist, and their
shard counts, sit in one small hash (``<ns>:gp:marks:slices``), so a look-up learns
every key a mark could be in with one read.
"""

from __future__ import annotations

from collections.abc import Sequence
from hashlib import blake2b

import redis

from .. import keys
from ..lua import scripts

#: Slices per retention: a mark is kept between 1 and 1 + 1/SLICES retentions.
SLICES = 4
#: Marks per shard a slice is sized for, from the marks of the slice before.
FILL = 64
#: Marks in a shard at which its slice moves on to a level of twice the shards;
#: below Redis's 128 fields of the compact encoding.
GROW_AT = 120
#: Shards of a slice at least, however quiet the slice before.
MIN_SHARDS = 16
DIGEST_BYTES = 12

_SCRIPTS = scripts(__file__)
_LIBRARY = (
    "local MARKS_SLICES, MARKS_FILL, MARKS_GROW_AT, MARKS_MIN_SHARDS, MARKS_DIGEST_BYTES = "
    f"{SLICES}, {FILL}, {GROW_AT}, {MIN_SHARDS}, {DIGEST_BYTES}\n" + _SCRIPTS["library"]
)


def digest(message_id: str) -> bytes:
    """What stands for ``message_id`` in its done mark."""
    return blake2b(message_id.encode(), digest_size=DIGEST_BYTES).digest()


def with_library(script: str) -> str:
    """``script`` with the done marks' Lua functions (``mark_done``, ``marks_places``, ...) before it."""
    return _LIBRARY + script


def is_done(client: redis.Redis, namespace: str, message_id: str) -> bool:
    """Whether ``message_id`` has a done mark: a copy of it would be skipped."""
    return are_done(client, namespace, [message_id])[0]


def are_done(client: redis.Redis, namespace: str, message_ids: Sequence[str]) -> list[bool]:
    """Whether each of ``message_ids`` has a done mark, in one call."""
    if not message_ids:
        return []
    script, prefix = with_library(_SCRIPTS["marked"]), keys.done_marks(namespace)
    return [bool(found) for found in client.eval(script, 0, prefix, *(digest(i) for i in message_ids))]
