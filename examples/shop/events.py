"""The shop's events. The wire names are the contract; the classes may move."""

from __future__ import annotations

from dataclasses import dataclass

import dramatiq_gp as gp


@gp.event("shop.order_placed")
@dataclass(frozen=True)
class OrderPlaced:
    order_id: int
    customer_email: str
    total_cents: int


@gp.event("shop.sync_inventory")
@dataclass(frozen=True)
class SyncInventory:
    """Time to reconcile stock with the warehouse (every 15 minutes)."""


# Operators may store entries that dispatch it (a digest at another hour, for one customer): OrderPlaced and
# SyncInventory they may not, as they carry what only the shop's own code should say happened.
@gp.schedulable
@gp.event("shop.digest_due")
@dataclass(frozen=True)
class DigestDue:
    """Time for the daily digest (06:30)."""
