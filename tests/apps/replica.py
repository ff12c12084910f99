"""One replica of a test app under the real ``dramatiq`` command, for the tests that kill or restart things.

A replica is ``dramatiq <app> -p 1 -t <threads>``: the CLI's parent process and one
worker process, in a session of their own so that the test can signal both, and
so that a failed test leaves no worker behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


class Replica:
    """``dramatiq <app> [args]`` with ``env`` added to this environment, its output in ``log``."""

    def __init__(self, app: str, env: dict[str, str], log: Path, threads: int = 2, args: Sequence[str] = ()) -> None:
        self.log_file = log
        command = [sys.executable, "-m", "dramatiq", app, "-p", "1", "-t", str(threads), *args]
        with open(log, "ab") as out:
            self.process = subprocess.Popen(
                command,
                cwd=ROOT,
                env={**os.environ, **env},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    @property
    def log(self) -> str:
        return self.log_file.read_text()

    def started(self) -> bool:
        """Whether the worker process has started its consumers; fails at once if the replica exited."""
        assert self.process.poll() is None, self.log
        return "consumers started" in self.log

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM to every process of the replica: the graceful shutdown of a deploy."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        return self.process.wait(timeout)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):  # already gone
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
