"""The shop's worker: ``dramatiq examples.shop.worker``."""

from __future__ import annotations

import dramatiq_gp as gp

from . import listeners
from .deps import Dependencies

deps = Dependencies.from_env()


def register(registry: gp.Registry, schedule: gp.Schedule) -> None:
    listeners.register(registry, deps)


kit = gp.Kit(register).with_closer("database", deps.engine.dispose)
broker = kit.broker
