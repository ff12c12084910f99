"""The scheduler: a Schedule built in code, fired by one elected leader among the workers.

* :mod:`.cron`: standard cron, descriptors, ``@every`` and the DST policy;
* :mod:`.schedule`: the fluent :class:`Schedule` and its entries;
* :mod:`.lease`: the leader lease on Redis;
* :mod:`.runner`: firing ticks exactly once, and catching up after a takeover.
"""

from .cron import CronError
from .lease import Lease
from .runner import Runner, tick_message_id
from .schedule import Entry, Schedule, ScheduleError

__all__ = ["CronError", "Entry", "Lease", "Runner", "Schedule", "ScheduleError", "tick_message_id"]
