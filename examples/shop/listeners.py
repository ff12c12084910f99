"""What happens when an order is placed: two listeners, each retried on its own."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import UTC, datetime

import sqlalchemy as sa

import dramatiq_gp as gp

from .db import sales
from .deps import Dependencies
from .events import DigestDue, OrderPlaced, SyncInventory

logger = logging.getLogger(__name__)


def send_confirmation(deps: Dependencies) -> Callable[[OrderPlaced], None]:
    def handle(event: OrderPlaced) -> None:
        deps.mailer.send(
            dedup_key=f"order-confirmation:{event.order_id}",
            recipient=event.customer_email,
            subject=f"Your order #{event.order_id}",
            body=f"Thank you! We received {event.total_cents / 100:.2f} EUR.",
        )

    return handle


def record_sale(deps: Dependencies) -> Callable[[OrderPlaced, sa.Connection], None]:
    def handle(event: OrderPlaced, conn: sa.Connection) -> None:
        # In the listener's inbox transaction: the sale and the message id commit together,
        # so a copy of the message (a worker killed before its ack) finds the id and is skipped.
        conn.execute(sales.insert().values(order_id=event.order_id, total_cents=event.total_cents))

    return handle


def sync_inventory(deps: Dependencies) -> Callable[[SyncInventory], None]:
    def handle(event: SyncInventory) -> None:
        logger.info("inventory synchronised with the warehouse")

    return handle


def send_digest(deps: Dependencies) -> Callable[[DigestDue], None]:
    def handle(event: DigestDue) -> None:
        with deps.engine.connect() as conn:
            orders = conn.execute(sa.select(sa.func.count()).select_from(sales)).scalar_one()
        today = datetime.now(UTC).date().isoformat()
        deps.mailer.send(f"digest:{today}", "ops@example.com", f"Digest {today}", f"{orders} orders so far.")

    return handle


def register(registry: gp.Registry, deps: Dependencies) -> None:
    registry.listen(OrderPlaced, send_confirmation(deps), name="send_confirmation", queue="mail", max_retries=10)
    registry.listen(OrderPlaced, record_sale(deps), name="record_sale", inbox=deps.engine)
    registry.listen(SyncInventory, sync_inventory(deps), name="sync_inventory")
    registry.listen(DigestDue, send_digest(deps), name="send_digest", queue="mail")
