"""Create the shop's tables, the outbox and the inbox included: ``python -m examples.shop.migrate``."""

from __future__ import annotations

from .db import metadata
from .deps import Dependencies


def main() -> None:
    engine = Dependencies.from_env().engine
    metadata.create_all(engine)
    engine.dispose()


if __name__ == "__main__":
    main()
