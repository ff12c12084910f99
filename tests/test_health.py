"""Liveness and readiness of real ``dramatiq`` worker processes: the HTTP probes and ``dramatiq-gp health``.

Each worker process judges itself every ``WORKER_HEALTH_INTERVAL`` (200 ms here) and
writes its report where the probes read it; these tests wedge a thread, stop Redis,
fail an application check and start a drain, and read what an orchestrator would.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dramatiq
import pytest
import redis

import dramatiq_gp as gp
from devtools.services import server_port
from dramatiq_gp import keys
from dramatiq_gp.endpoint import MAX_CONNECTIONS
from helpers import wait_for
from servers import OwnRabbitmq, OwnRedis, skip_without_rabbitmq

ROOT = Path(__file__).resolve().parent.parent


class Worker:
    """``dramatiq tests.apps.health_app -p <processes>`` with its health endpoint on a port of its own."""

    def __init__(
        self, tmp_path: Path, redis_url: str, processes: int = 2, namespace: str | None = None, **env: str
    ) -> None:
        self.namespace = namespace or f"gp-health-{uuid.uuid4().hex[:8]}"
        self.port = server_port()
        self.marker = tmp_path / "unhealthy"
        self.env = {
            **os.environ,
            "REDIS_URL": redis_url,
            "VALKEY_NAMESPACE": self.namespace,
            "WORKER_HEALTH_PORT": str(self.port),
            "WORKER_HEALTH_HOST": "127.0.0.1",
            "WORKER_HEALTH_INTERVAL": "200ms",
            "GP_TEST_UNHEALTHY": str(self.marker),
            **env,
        }
        self.log_file = tmp_path / "worker.log"
        with open(self.log_file, "a") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "dramatiq", "tests.apps.health_app", "-p", str(processes), "-t", "2"],
                cwd=ROOT,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def probe(self, path: str) -> tuple[int, dict[str, Any]]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            body = error.read()
            return error.code, json.loads(body) if error.headers["Content-Type"] == "application/json" else {}
        except (urllib.error.URLError, ConnectionError):
            return 0, {}

    def health(self, *args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "dramatiq_gp", "health", *args]
        return subprocess.run(command, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=30)

    def send(self, actor: str, *args: Any) -> None:
        """Enqueue as a producer would, through the kit's broker in this process."""
        broker = gp.RedisBroker(url=self.env["REDIS_URL"], namespace=self.namespace)
        try:
            broker.declare_queue("default")
            broker.enqueue(dramatiq.Message("default", actor, args, {}, {}))
        finally:
            broker.close()

    def signal(self, signum: int) -> None:
        os.killpg(self.process.pid, signum)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    @property
    def log(self) -> str:
        return self.log_file.read_text()


@pytest.fixture
def worker(tmp_path: Path, redis_url: str) -> Iterator[Worker]:
    started = Worker(tmp_path, redis_url)
    try:
        yield started
    finally:
        started.kill()


def _ready(worker: Worker, processes: int = 2) -> None:
    def up() -> bool:
        status, body = worker.probe("/readyz")
        return status == 200 and len(body["processes"]) == processes

    wait_for(up, timeout=30, interval=0.1)


def _failing_everywhere(worker: Worker, reason: str, processes: int = 2) -> None:
    """Wait until every process of the group is not ready for ``reason`` (each notices at its own next check)."""

    def failing() -> bool:
        status, body = worker.probe("/readyz")
        reasons = [" ".join(p["failing"]) for p in body.get("processes", [])]
        return status == 503 and len(reasons) == processes and all(reason in r for r in reasons)

    wait_for(failing, timeout=15, interval=0.1)


def test_a_booted_worker_group_is_alive_and_ready_on_one_port_and_in_redis(worker: Worker, rdb: redis.Redis) -> None:
    _ready(worker)
    status, body = worker.probe("/livez")
    assert status == 200 and body["alive"] is True
    assert {p["pid"] for p in body["processes"]} == {p["pid"] for p in worker.probe("/readyz")[1]["processes"]}
    assert worker.health().returncode == 0
    ready = worker.health("--ready")
    assert ready.returncode == 0, ready.stderr
    assert ready.stdout.strip() == "ready: 2 worker process(es)"
    records = wait_for(lambda: len(found := rdb.hgetall(keys.health(worker.namespace))) == 2 and found)
    assert all(json.loads(r)["ready"] is True for r in records.values())
    assert worker.probe("/nothing")[0] == 404


def test_a_thread_wedged_past_its_time_limit_makes_the_worker_not_alive(worker: Worker) -> None:
    _ready(worker)
    worker.send("wedge")
    # Its time limit is 1 s; past it by WEDGED_AFTER_S (10 s) the thread counts as stuck.
    _, body = wait_for(lambda: (s := worker.probe("/livez"))[0] == 503 and s, timeout=30, interval=0.2)
    assert any("wedge" in why and "past its time limit of 1 s" in why for why in body["why"]), body
    result = worker.health()
    assert result.returncode == 1
    assert "not alive" in result.stderr and "past its time limit" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert worker.probe("/readyz")[0] == 503


def test_redis_down_makes_the_worker_not_ready_but_still_alive(tmp_path: Path) -> None:
    server = OwnRedis(tmp_path / "redis")
    server.start()
    worker = Worker(tmp_path, server.url)
    try:
        _ready(worker)
        server.stop()

        _failing_everywhere(worker, "redis: ")
        assert worker.probe("/livez")[0] == 200
        assert worker.health().returncode == 0
        not_ready = worker.health("--ready")
        assert not_ready.returncode == 1 and "redis: " in not_ready.stderr
        server.start()
        _ready(worker)
    finally:
        worker.kill()
        server.stop()


def test_a_failing_application_check_makes_the_worker_not_ready_with_its_name_and_error(worker: Worker) -> None:
    _ready(worker)
    worker.marker.write_text("index unreachable")
    _failing_everywhere(worker, "search_index: index unreachable")
    assert worker.probe("/livez")[0] == 200
    worker.marker.unlink()
    _ready(worker)


def test_readiness_goes_false_the_moment_the_drain_starts(worker: Worker, rdb: redis.Redis) -> None:
    _ready(worker)
    worker.send("slow", 3)
    wait_for(lambda: "slow" in worker.log or rdb.hlen(f"{worker.namespace}:default.msgs") == 0, timeout=15)
    worker.signal(signal.SIGTERM)
    # Within a fraction of the 200 ms interval: the signal handler writes the report itself.
    _, body = wait_for(lambda: (s := worker.probe("/readyz"))[0] == 503 and s, timeout=2, interval=0.02)
    assert any("draining" in p["failing"] for p in body["processes"]), body
    assert worker.health("--ready").returncode == 1
    assert worker.process.poll() is None  # still draining the slow task
    assert worker.process.wait(30) == 0
    assert worker.health().returncode == 1  # no process reports any more
    assert rdb.hlen(keys.health(worker.namespace)) == 0


def test_a_bad_health_port_stops_start_up_in_one_line(tmp_path: Path, redis_url: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "dramatiq_gp", "health"],
        cwd=ROOT,
        env={**os.environ, "REDIS_URL": redis_url, "WORKER_HEALTH_PORT": "eighty"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 1
    assert "WORKER_HEALTH_PORT" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_rabbitmq_down_makes_a_worker_with_its_queues_there_not_ready_but_still_alive(
    tmp_path: Path, redis_url: str
) -> None:
    skip_without_rabbitmq()
    # Not tmp_path: as root that is under /tmp/pytest-of-root (0700), out of the user rabbitmq's reach.
    directory = Path(tempfile.mkdtemp(prefix="gp-rabbitmq-health-"))
    directory.chmod(0o755)
    node = OwnRabbitmq(directory / "node")
    node.start()
    worker = Worker(tmp_path, redis_url, processes=1, BROKER_URL=node.url)
    try:
        _ready(worker, processes=1)
        node.stop()

        def broker_failing() -> bool:
            status, body = worker.probe("/readyz")
            failing = body["processes"][0]["failing"] if status == 503 else []
            return any(f.startswith("broker: RabbitMQ unreachable") for f in failing)

        wait_for(broker_failing, timeout=30, interval=0.2)
        assert worker.probe("/livez")[0] == 200
    finally:
        worker.kill()
        node.stop()
        shutil.rmtree(directory, ignore_errors=True)


def _children(worker: Worker) -> set[int]:
    """The pids of the worker processes its ``dramatiq`` command started."""
    found = subprocess.run(["pgrep", "-P", str(worker.process.pid)], capture_output=True, text=True).stdout
    return {int(pid) for pid in found.split()}


def test_two_groups_of_one_namespace_on_one_machine_each_answer_for_their_own_processes(
    tmp_path: Path, redis_url: str
) -> None:
    namespace, shared_tmp = f"gp-health-{uuid.uuid4().hex[:8]}", tmp_path / "tmp"
    shared_tmp.mkdir()
    groups = []
    try:
        for name, processes in (("a", 2), ("b", 1)):
            (tmp_path / name).mkdir()
            groups.append(Worker(tmp_path / name, redis_url, processes, namespace, TMPDIR=str(shared_tmp)))
        a, b = groups
        _ready(a, 2)
        _ready(b, 1)
        assert {p["pid"] for p in a.probe("/readyz")[1]["processes"]} == _children(a)
        assert {p["pid"] for p in b.probe("/readyz")[1]["processes"]} == _children(b)

        b.marker.write_text("index unreachable")
        _failing_everywhere(b, "search_index: index unreachable", processes=1)
        status, body = a.probe("/readyz")
        assert status == 200 and len(body["processes"]) == 2, body
        # The CLI reads every group of the namespace, or the one it is given (the pid a --pid-file holds).
        own = a.health("--ready", "--group", str(a.process.pid))
        assert (own.returncode, own.stdout.strip()) == (0, "ready: 2 worker process(es)"), own.stderr
        every = a.health("--ready")
        assert every.returncode == 1 and "search_index: index unreachable" in every.stderr
    finally:
        for group in groups:
            group.kill()
    nothing = a.health("--group", str(a.process.pid))
    looked = shared_tmp / f"dramatiq-gp-{os.geteuid()}" / f"health-{namespace}-{a.process.pid}"
    assert nothing.returncode == 1
    assert nothing.stderr.splitlines() == [f"Error: not alive: no worker process has reported in {looked}"]


def _planted(tmp: Path, how: str) -> Path:
    """This user's group directory under ``tmp``, made first as another user would, or open, or a link."""
    planted = tmp / f"dramatiq-gp-{os.geteuid()}"
    if how == "a symbolic link":
        elsewhere = tmp / "elsewhere"
        elsewhere.mkdir(mode=0o700)
        planted.symlink_to(elsewhere)
        return elsewhere
    planted.mkdir()
    planted.chmod(0o777)  # as another user's mkdir in a shared /tmp would leave it for the trap
    if how == "another user's":
        os.chown(planted, 65534, 65534)
    (planted / "planted.json").write_text("{}")
    return planted


@pytest.mark.parametrize(
    ("how", "why"),
    [
        pytest.param(
            "another user's",
            "it belongs to uid 65534, not to uid 0 running this",
            marks=pytest.mark.skipif(os.geteuid() != 0, reason="only root can make a directory another user's"),
        ),
        ("open to others", "its mode 0777 lets other users in"),
        ("a symbolic link", "it is a symbolic link"),
    ],
)
def test_a_group_directory_not_the_users_alone_is_refused_in_one_line_and_nothing_is_written_there(
    tmp_path: Path, redis_url: str, how: str, why: str
) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    planted = _planted(tmp, how)
    before = sorted(planted.iterdir())
    worker = Worker(tmp_path, redis_url, processes=2, TMPDIR=str(tmp))
    try:
        assert worker.process.wait(60) == 2  # the dramatiq command's code for a start-up that failed on purpose
    finally:
        worker.kill()
    expected = f"start-up failed: refusing {tmp / f'dramatiq-gp-{os.geteuid()}'}: {why}; remove it, or set TMPDIR"
    failures = [line for line in worker.log.splitlines() if "start-up failed" in line]
    # One line per worker process that got that far (the command stops the others once one exits).
    assert 1 <= len(failures) <= 2 and all(expected in line for line in failures), worker.log
    assert "Traceback" not in worker.log
    assert sorted(planted.iterdir()) == before
    refused = worker.health()
    assert refused.returncode == 1
    assert len(refused.stderr.splitlines()) == 1 and f"Error: refusing {tmp}" in refused.stderr, refused.stderr


def _threads(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("Threads:")))


def test_idle_connections_are_cut_and_hold_a_bounded_number_of_threads_while_a_probe_is_answered(
    tmp_path: Path, redis_url: str
) -> None:
    worker = Worker(tmp_path, redis_url, processes=1)
    idle: list[socket.socket] = []
    try:
        _ready(worker, processes=1)
        (serving,) = _children(worker)
        threads = _threads(serving)
        for _ in range(3 * MAX_CONNECTIONS):
            idle.append(socket.create_connection(("127.0.0.1", worker.port), timeout=10))
        status, body = worker.probe("/readyz")
        assert status == 200 and body["ready"] is True
        assert _threads(serving) <= threads + MAX_CONNECTIONS
        # Each is cut: the oldest at once to make room, the last ones after READ_TIMEOUT_S without a request.
        for connection in idle:
            assert connection.recv(1) == b""
    finally:
        for connection in idle:
            connection.close()
        worker.kill()
