"""The shop example, end to end, as `make demo` runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_demo_relays_orders_to_the_listeners_fires_the_report_and_stops(clean_env, database_url, namespace):
    env = {**os.environ, "DB_URL": database_url, "VALKEY_NAMESPACE": namespace}
    command = [sys.executable, "-m", "examples.shop.demo"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "== both listeners ran for every order: 5 mails sent" in done.stdout
    assert "== the elected leader fired job:shop.nightly_sales_report: Sales report" in done.stdout
    assert "start-up: outbox relay started" in done.stdout
    assert "shutdown: closed database" in done.stdout
    assert "== worker exited with code 0" in done.stdout
