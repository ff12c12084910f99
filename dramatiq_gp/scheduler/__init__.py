"""The scheduler: a Schedule built in code, fired by one elected leader among the workers.

* :mod:`.cron`: standard cron, descriptors, ``@every`` and the DST policy;
* :mod:`.schedule`: the fluent :class:`Schedule`, its entries, and the module-level ``@job``;
* :mod:`.dynamic`: the entries the application stores at run time, and their due-time index;
* :mod:`.targets`: what a stored entry may target (what the code marks ``schedulable``), published for the operators;
* :mod:`.lease`: the leader lease on Redis;
* :mod:`.runner`: firing ticks exactly once, and catching up after a takeover;
* :mod:`.outlet`: where a fired tick goes, one outlet per kind of broker;
* :mod:`.executor`: the APScheduler executor that hands the runner its due ticks;
* :mod:`.manual`: runs asked for by hand (run now, backfill), built from the templates the workers publish;
* :mod:`.status`: what ``dramatiq-gp status`` and the dashboard show of the scheduler.
"""

from .cron import CronError
from .dynamic import Schedules, StoredEntry
from .lease import Lease
from .runner import Runner
from .schedule import OVERLAP_OPTION, Entry, Schedule, ScheduleError, default_schedule, job
from .targets import schedulable

__all__ = [
    "OVERLAP_OPTION",
    "CronError",
    "Entry",
    "Lease",
    "Runner",
    "Schedule",
    "ScheduleError",
    "Schedules",
    "StoredEntry",
    "default_schedule",
    "job",
    "schedulable",
]
