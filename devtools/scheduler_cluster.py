"""Several scheduler processes on one Redis, for the failover tests and the scheduler benchmark.

``python -m devtools.scheduler_cluster`` is one such process: a Kit whose schedule
is one job, ``tick``, on ``GP_TEST_SPEC`` (default ``@every 1s``; empty: no code entry), running the
schedule runner and nothing else until SIGTERM; its firings pile up on the
``default`` queue. :class:`Cluster` starts, kills, pauses and counts them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import redis

from dramatiq_gp.keys import SchedulerKeys

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Firing:
    tick: datetime
    message_id: str
    enqueued_ms: int


class Cluster:
    """``size`` scheduler processes sharing ``env`` (REDIS_URL, VALKEY_NAMESPACE, SCHEDULER_*)."""

    def __init__(self, env: dict[str, str], log_dir: Path, size: int = 3) -> None:
        self.env = {**os.environ, **env}
        self.namespace = env["VALKEY_NAMESPACE"]
        self.keys = SchedulerKeys(env.get("SCHEDULER_NAMESPACE", self.namespace))
        self.client = redis.Redis.from_url(env["REDIS_URL"], decode_responses=True)
        self.log_dir = log_dir
        self.processes: list[subprocess.Popen[bytes] | None] = [None] * size
        self._logs: list[Path] = [log_dir / f"scheduler-{i}.log" for i in range(size)]
        self._stopped = False

    def start(self, index: int | None = None) -> None:
        for i in range(len(self.processes)) if index is None else [index]:
            log = open(self._logs[i], "ab")  # noqa: SIM115  (the child owns it)
            self.processes[i] = subprocess.Popen(
                [sys.executable, "-m", "devtools.scheduler_cluster"], cwd=ROOT, env=self.env, stdout=log, stderr=log
            )
            log.close()

    def log(self, index: int) -> str:
        return self._logs[index].read_text()

    def pids(self) -> list[int]:
        return [p.pid for p in self.processes if p is not None and p.poll() is None]

    def leader(self) -> tuple[int, int] | None:
        """(pid, epoch) of the current lease holder, if any."""
        info = self.client.hgetall(self.keys.leader)
        if not info or self.client.pttl(self.keys.lease) <= 0:
            return None
        return int(info["pid"]), int(info["epoch"])

    def wait_for_leader(self, timeout: float = 30, other_than: int | None = None) -> tuple[int, int]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            leader = self.leader()
            if leader and leader[0] != other_than and leader[0] in self.pids():
                return leader
            time.sleep(0.005)
        raise TimeoutError("no scheduler process took the lease")

    def index_of(self, pid: int) -> int:
        return next(i for i, p in enumerate(self.processes) if p is not None and p.pid == pid)

    def kill(self, index: int, sig: signal.Signals = signal.SIGKILL) -> None:
        process = self.processes[index]
        assert process is not None
        process.send_signal(sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            process.wait(30)
            self.processes[index] = None

    def firings(self) -> list[Firing]:
        found = []
        for data in self.client.hvals(f"{self.namespace}:default.msgs"):
            message = json.loads(data)
            tick = datetime.fromisoformat(message["args"][0]["scheduled_at"])
            found.append(Firing(tick, message["message_id"], message["message_timestamp"]))
        return sorted(found, key=lambda f: f.tick)

    def stop(self) -> None:
        """Stop every process and delete the cluster's keys; once."""
        if self._stopped:
            return
        self._stopped = True
        for i, process in enumerate(self.processes):
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGCONT)
                process.terminate()
                process.wait(30)
            self.processes[i] = None
        for key in self.client.scan_iter(f"{self.namespace}*", count=1000):
            self.client.delete(key)
        self.client.close()


def _process() -> None:
    import dramatiq_gp as gp

    # GP_TEST_SPEC="" leaves the code schedule empty (with SCHEDULER_DYNAMIC=true: stored entries only).
    spec = os.environ.get("GP_TEST_SPEC", "@every 1s")

    def register(registry: gp.Registry, schedule: gp.Schedule) -> None:
        if spec:
            schedule.job("tick", spec, lambda: None)

    kit = gp.Kit(register, registry=gp.Registry())
    assert kit.scheduler is not None
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    kit.scheduler.start()
    stop.wait()
    kit.scheduler.stop()


if __name__ == "__main__":
    _process()
