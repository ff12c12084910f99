"""The scheduler: a Schedule built in code, fired by one elected leader among the workers.

* :mod:`.cron`: standard cron, descriptors, ``@every`` and the DST policy;
* :mod:`.schedule`: the fluent :class:`Schedule`, its entries, and the module-level ``@job``;
* :mod:`.lease`: the leader lease on Redis;
* :mod:`.runner`: firing ticks exactly once, and catching up after a takeover.
"""

from .cron import CronError
from .lease import Lease
from .runner import Runner
from .schedule import Entry, Schedule, ScheduleError, default_schedule, job

__all__ = ["CronError", "Entry", "Lease", "Runner", "Schedule", "ScheduleError", "default_schedule", "job"]
