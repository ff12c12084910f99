"""Place a few orders: ``python -m examples.shop.place_orders 5``.

This is the web application's side: each order and its ``OrderPlaced`` event are
written in one transaction, so the event exists exactly when the order does. It
needs no Kit and no Redis; the worker's outbox relay delivers the event.
"""

from __future__ import annotations

import random
import sys

from sqlalchemy.orm import Session

import dramatiq_gp as gp

from .db import orders
from .deps import Dependencies
from .events import OrderPlaced


def place_order(session: Session, order_id: int, email: str, total_cents: int) -> str:
    session.execute(orders.insert().values(id=order_id, customer_email=email, total_cents=total_cents))
    return gp.dispatch(session, OrderPlaced(order_id, email, total_cents))


def main(count: int) -> None:
    engine = Dependencies.from_env().engine
    first = random.randrange(10_000, 90_000)
    for order_id in range(first, first + count):
        with Session(engine) as session, session.begin():
            event_id = place_order(session, order_id, f"customer{order_id}@example.com", random.randrange(500, 20_000))
        print(f"placed order {order_id} (event {event_id})")
    engine.dispose()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
