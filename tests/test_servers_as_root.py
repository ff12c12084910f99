"""As root, PostgreSQL runs as the user ``pgserver``: it must start with the virtualenv in a 0700 home.

The situation is rebuilt in a child process whose ``pgserver`` package is found
through a directory of mode 0700 (as in a virtualenv under /root), with ``TMPDIR``
pointing at a directory of this test's own, removed afterwards.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import pgserver  # type: ignore[import-untyped]
import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="only root runs PostgreSQL as another user")
COPY = f"dramatiq-gp-pgserver-{version('pgserver')}"  # the copy of pgserver's programs the user can reach

CHILD = """
import sys
from pathlib import Path

import pgserver
import psycopg

print(pgserver.__file__)
if sys.argv[1] == "tests":
    from servers import OwnPostgres

    server = OwnPostgres(Path(sys.argv[2]))
    server.start()
    with psycopg.connect(server.url.replace("+psycopg", "")) as conn:
        print(conn.execute("SELECT 40 + 2").fetchone()[0])
    server.stop()
else:
    from devtools.services import embedded_postgres

    with embedded_postgres() as url, psycopg.connect(url.replace("+psycopg", "")) as conn:
        print(conn.execute("SELECT 40 + 2").fetchone()[0])
"""


@pytest.fixture
def home(tmp_path: Path) -> Iterator[tuple[Path, dict[str, str]]]:
    """A 0700 "home" holding the site-packages a child imports pgserver from, and the child's environment."""
    home = tmp_path / "home"
    site = home / "venv" / "site-packages"
    site.mkdir(parents=True)
    home.chmod(0o700)
    package = Path(pgserver.__file__).parent
    (site / "pgserver").symlink_to(package, target_is_directory=True)
    (site / "pgserver.libs").symlink_to(package.parent / "pgserver.libs", target_is_directory=True)
    temp = Path(tempfile.mkdtemp(prefix="gp-root-test-"))
    temp.chmod(0o755)
    env = {
        **os.environ,
        "TMPDIR": str(temp),
        "PYTHONPATH": os.pathsep.join([str(site), str(ROOT), str(ROOT / "tests")]),
    }
    try:
        yield home, env
        # A server the child left running would be listed here, by its data directory.
        assert subprocess.run(["pgrep", "-f", str(temp)], capture_output=True).returncode == 1
    finally:
        shutil.rmtree(temp)


def _modes(path: Path) -> dict[Path, int]:
    return {p: p.stat().st_mode for p in (path, *path.parents)}


def _run(env: dict[str, str], *args: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", CHILD, *args], env=env, cwd="/", capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_own_postgres_starts_with_pgserver_in_a_0700_home(home, tmp_path):
    home, env = home
    before = _modes(home / "venv" / "site-packages")
    imported, answer = _run(env, "tests", str(tmp_path / "pg"))
    assert imported.startswith(str(home))  # the child did find pgserver through the 0700 directory
    assert answer == "42"
    assert _modes(home / "venv" / "site-packages") == before  # nothing was opened up to reach it
    # The cluster lived where PostgreSQL's user could reach it, and went with the child.
    link = tmp_path / "pg" / "data"
    assert link.is_symlink() and not link.exists()
    assert [p.name for p in Path(env["TMPDIR"]).iterdir()] == [COPY]


def test_the_embedded_postgres_starts_with_pgserver_in_a_0700_home(home):
    home, env = home
    before = _modes(home / "venv" / "site-packages")
    imported, answer = _run(env, "devtools")
    assert imported.startswith(str(home))
    assert answer == "42"
    assert _modes(home / "venv" / "site-packages") == before
    assert [p.name for p in Path(env["TMPDIR"]).iterdir()] == [COPY]
