"""The shop's scheduled work: two event schedules and the nightly sales report job."""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import datetime, timedelta

import sqlalchemy as sa

import dramatiq_gp as gp

from .db import sales
from .deps import Dependencies
from .events import DigestDue, SyncInventory

#: When the report runs; the demo sets SHOP_REPORT_CRON="@every 3s" to see it fire.
REPORT_CRON = os.environ.get("SHOP_REPORT_CRON", "0 3 * * *")


def nightly_sales_report(deps: Dependencies) -> Callable[[datetime], None]:
    def run(scheduled_at: datetime) -> None:
        # A database error raises here, and the job is retried (25 times by default).
        with deps.engine.connect() as conn:
            count, total = conn.execute(
                sa.select(sa.func.count(), sa.func.coalesce(sa.func.sum(sales.c.total_cents), 0))
            ).one()
        deps.mailer.send(
            dedup_key=f"sales-report:{scheduled_at.isoformat()}",
            recipient="owner@example.com",
            subject=f"Sales report {scheduled_at:%Y-%m-%d %H:%M}",
            body=f"{count} orders, {total / 100:.2f} EUR.",
        )

    return run


def register(schedule: gp.Schedule, deps: Dependencies) -> None:
    (
        schedule.every(timedelta(minutes=15), SyncInventory())
        .daily_at("06:30", DigestDue())
        .job("shop.nightly_sales_report", REPORT_CRON, nightly_sales_report(deps), queue="reports", max_retries=25)
    )
