"""The schedule the elected leader fires. Entries arrive with the scheduler capability."""

from __future__ import annotations


class Schedule:
    """Cron entries, built in code by the register callback. Empty: no leader election runs."""

    def __init__(self) -> None:
        self.entries: list[object] = []

    def __len__(self) -> int:
        return len(self.entries)
