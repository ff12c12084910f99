"""The shop end to end: start a worker, place orders, watch them flow through the outbox to the listeners.

``make demo`` runs this with a reachable Redis and PostgreSQL (local or embedded).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import sqlalchemy as sa

from .db import metadata, sales, sent_emails
from .deps import Dependencies

ROOT = Path(__file__).resolve().parents[2]
ORDERS = 5
#: The worker module: the Kit's (``worker.py``), or ``SHOP_WORKER=examples.shop.middleware_worker``
#: for the same worker built as a middleware list.
WORKER = os.environ.get("SHOP_WORKER", "examples.shop.worker")


def _stream(process: subprocess.Popen[str], seen: list[str]) -> None:
    assert process.stdout is not None
    for line in process.stdout:
        seen.append(line)
        print(f"  worker | {line.rstrip()}", flush=True)


def _wait_until(condition, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"demo failed: timed out waiting for {what}")
        time.sleep(0.1)


def main() -> int:
    engine = Dependencies.from_env().engine
    metadata.drop_all(engine)
    metadata.create_all(engine)
    print(
        f"== tables created (the outbox included); starting the worker: dramatiq {WORKER}",
        flush=True,
    )

    lines: list[str] = []
    # The nightly report runs every 3 seconds here, so the demo shows a scheduled job firing.
    env = {**os.environ, "SHOP_REPORT_CRON": "@every 3s"}
    worker = subprocess.Popen(
        [sys.executable, "-m", "dramatiq", WORKER, "--processes", "1", "--threads", "4"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    threading.Thread(target=_stream, args=(worker, lines), daemon=True).start()
    try:
        _wait_until(lambda: any("start-up: consumers started" in line for line in lines), 60, "the worker")
        print(f"== placing {ORDERS} orders: each order and its OrderPlaced event in one transaction", flush=True)
        subprocess.run([sys.executable, "-m", "examples.shop.place_orders", str(ORDERS)], cwd=ROOT, check=True)

        confirmations = sa.select(sent_emails.c.recipient, sent_emails.c.subject).where(
            sent_emails.c.dedup_key.like("order-confirmation:%")
        )

        def done() -> bool:
            with engine.connect() as conn:
                recorded = conn.execute(sa.select(sa.func.count()).select_from(sales)).scalar_one()
                return len(conn.execute(confirmations).all()) == ORDERS and recorded == ORDERS

        _wait_until(done, 60, "the listeners")
        with engine.connect() as conn:
            mails = conn.execute(confirmations).all()
            total = conn.execute(sa.select(sa.func.sum(sales.c.total_cents))).scalar_one()
        print(
            "== the outbox relay enqueued each event, the event:shop.order_placed task fanned it out, and\n"
            f"== both listeners ran for every order: {len(mails)} mails sent (queue 'mail'), "
            f"{ORDERS} sales recorded totalling {total / 100:.2f} EUR (queue 'default')",
            flush=True,
        )
        for recipient, subject in mails:
            print(f"   mail to {recipient}: {subject}")

        with engine.connect() as conn:
            since = conn.execute(sa.select(sa.func.now())).scalar_one()
        reports = (
            sa.select(sent_emails.c.subject, sent_emails.c.body)
            .where(sent_emails.c.subject.like("Sales report%"), sent_emails.c.sent_at > since)
            .order_by(sent_emails.c.sent_at)
        )

        def report_sent() -> bool:
            with engine.connect() as conn:
                return conn.execute(reports).first() is not None

        _wait_until(report_sent, 30, "the scheduled sales report")
        with engine.connect() as conn:
            report = conn.execute(reports).first()
        assert report is not None
        print(f"== the elected leader fired job:shop.nightly_sales_report: {report.subject}: {report.body}", flush=True)
        print("== stopping the worker (SIGTERM): producers stop, tasks drain, closers run", flush=True)
    finally:
        worker.send_signal(signal.SIGTERM)
        code = worker.wait(60)
        engine.dispose()
    print(f"== worker exited with code {code}")
    return code


if __name__ == "__main__":
    sys.exit(main())
