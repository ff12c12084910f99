"""The code samples in README.md and docs/ run as written.

A ``python`` block whose first line is ``# file: <path>`` is written to that path
in a scratch directory; the other ``python`` blocks of the page run, in order, as
one script there, against the test Redis, in this test's namespace.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _samples(page: Path) -> tuple[dict[str, str], str]:
    files, script = {}, []
    for block in BLOCK.findall(page.read_text()):
        first, _, rest = block.partition("\n")
        if first.startswith("# file: "):
            files[first.removeprefix("# file: ").strip()] = rest
        else:
            script.append(block)
    return files, "\n".join(script)


@pytest.mark.parametrize("page", [p for p in PAGES if _samples(p)[1]], ids=lambda p: p.name)
def test_samples_run(page, tmp_path, clean_env, namespace, rdb):
    files, script = _samples(page)
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    env = {**os.environ, "VALKEY_NAMESPACE": namespace, "PYTHONPATH": str(tmp_path)}
    command = [sys.executable, "-c", script]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr, done.stderr


def test_the_readme_sample_dispatches_to_the_mail_queue(tmp_path, clean_env, namespace, rdb):
    _, script = _samples(ROOT / "README.md")
    env = {**os.environ, "VALKEY_NAMESPACE": namespace}
    subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, check=True, capture_output=True)
    assert rdb.llen(f"{namespace}:mail") == 1


def test_the_readme_names_the_two_commands_near_the_top():
    top = (ROOT / "README.md").read_text().splitlines()[:15]
    assert any(line.startswith("make demo") for line in top)
    assert any(line.startswith("make test") for line in top)
