"""The shop example, end to end, as `make demo` runs it, with its worker built by the Kit and as a middleware list."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "worker", ["examples.shop.worker", "examples.shop.middleware_worker"], ids=["kit", "middleware"]
)
def test_the_demo_relays_orders_to_the_listeners_fires_the_report_and_stops(clean_env, database_url, namespace, worker):
    env = {**os.environ, "DB_URL": database_url, "VALKEY_NAMESPACE": namespace, "SHOP_WORKER": worker}
    command = [sys.executable, "-m", "examples.shop.demo"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "== both listeners ran for every order: 5 mails sent" in done.stdout
    assert "== the elected leader fired job:shop.nightly_sales_report: Sales report" in done.stdout
    assert "start-up: outbox relay started" in done.stdout
    assert "shutdown: closed database" in done.stdout
    assert "== worker exited with code 0" in done.stdout
