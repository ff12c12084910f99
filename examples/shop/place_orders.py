"""Place a few orders: ``python -m examples.shop.place_orders 5``."""

from __future__ import annotations

import random
import sys

from .events import OrderPlaced
from .worker import kit


def main(count: int) -> None:
    first = random.randrange(10_000, 90_000)
    for order_id in range(first, first + count):
        envelope_id = kit.dispatch(
            OrderPlaced(order_id, f"customer{order_id}@example.com", random.randrange(500, 20_000))
        )
        print(f"placed order {order_id} (envelope {envelope_id})")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
