"""The APScheduler executor that fires the schedule's ticks through the runner."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from apscheduler.executors.base import BaseExecutor


class TickExecutor(BaseExecutor):  # type: ignore[misc]
    """Calls a job's function with its due run times; the runner's fires each tick in one Lua call.

    Unlike APScheduler's own executors it passes the scheduled run times on (each
    tick's time is its identity: its message id, its claim) and leaves misfire
    handling to the runner. It runs in the scheduler's thread: a firing is one round
    trip, and the ticks of one entry stay in order.
    """

    ALIAS = "gp-ticks"

    def _do_submit_job(self, job: Any, run_times: list[datetime]) -> None:
        try:
            job.func(*run_times)
        except Exception as exc:
            self._run_job_error(job.id, exc, exc.__traceback__)
        else:
            self._run_job_success(job.id, [])
