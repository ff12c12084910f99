"""The shop's worker: ``dramatiq examples.shop.worker``."""

from __future__ import annotations

import dramatiq_gp as gp

from . import jobs, listeners
from .deps import Dependencies

deps = Dependencies.from_env()


def register(registry: gp.Registry, schedule: gp.Schedule) -> None:
    listeners.register(registry, deps)
    jobs.register(schedule, deps)


# The kit shares the shop's engine: the relay reads the outbox the orders are written with.
kit = gp.Kit(register, engine=deps.engine).with_closer("database", deps.engine.dispose)
broker = kit.broker
