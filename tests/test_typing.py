"""The package's annotations reach its users' type checkers (PEP 561)."""

from __future__ import annotations

import os
import subprocess
import sys


def test_mypy_in_a_users_project_reads_the_installed_package_as_typed(tmp_path):
    # Found as an installed package, as in a user's project: from their directory, not through MYPYPATH.
    # Without py.typed mypy reports import-untyped and every name from dramatiq_gp is Any.
    (tmp_path / "app.py").write_text("import dramatiq_gp as gp\n\nkit: gp.Kit | None = None\n")
    env = {name: value for name, value in os.environ.items() if name != "MYPYPATH"}
    # Following imports would type-check the kit and its dependencies too (seconds each run);
    # whether the package counts as typed is decided before that.
    command = [sys.executable, "-m", "mypy", "--follow-imports=skip", "--cache-dir", str(tmp_path / "cache"), "app.py"]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert "import-untyped" not in done.stdout, done.stdout
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_name_the_package_exports_is_there():
    """``from dramatiq_gp import *`` and ``gp.<name>`` find every name ``__all__`` promises (the docs use them)."""
    import dramatiq_gp as gp

    assert [name for name in gp.__all__ if not hasattr(gp, name)] == []
