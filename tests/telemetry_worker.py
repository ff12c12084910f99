"""``dramatiq tests.apps.telemetry_app`` as a real worker process, for the telemetry and OTLP logs tests.

Exporters start in each forked worker process and must be flushed before it exits
(Dramatiq's children leave through ``os._exit``, skipping ``atexit``), so those tests
run the real CLI. Their fixtures (``collector``, ``worker_env``, ``run_worker``,
``producer``) are in conftest.py.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from dramatiq import Message
from dramatiq.brokers.redis import RedisBroker

ROOT = Path(__file__).resolve().parent.parent


class Worker:
    """``dramatiq tests.apps.telemetry_app`` with its output in a file."""

    def __init__(self, tmp_path: Path, env: dict[str, str], *args: str, processes: int = 1) -> None:
        self.log_file = tmp_path / f"worker-{time.monotonic_ns()}.log"
        command = [sys.executable, "-m", "dramatiq", "tests.apps.telemetry_app", "-p", str(processes), "-t", "4", *args]
        with open(self.log_file, "w") as log:
            # A session of its own, so a failed test kills the worker processes too, not only their parent.
            self.process = subprocess.Popen(
                command,
                cwd=ROOT,
                env={**os.environ, **env},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    @property
    def log(self) -> str:
        return self.log_file.read_text()

    def stop(self, timeout: float = 30) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):  # already gone
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


def send(broker: RedisBroker, actor: str, *args: Any, queue: str = "default") -> str:
    message = Message(queue_name=queue, actor_name=actor, args=args, kwargs={}, options={})
    return str(broker.enqueue(message).message_id)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
