"""The shop's dependencies, passed explicitly to every listener (and, later, job)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

from .db import sent_emails

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Mailer:
    """Sends mail by writing it to a table (a stand-in for an SMTP or API client)."""

    engine: sa.Engine

    def send(self, dedup_key: str, recipient: str, subject: str, body: str) -> bool:
        """Send once per ``dedup_key``; returns False if it was already sent."""
        try:
            with self.engine.begin() as conn:
                conn.execute(
                    sent_emails.insert().values(dedup_key=dedup_key, recipient=recipient, subject=subject, body=body)
                )
        except IntegrityError:
            logger.info("mail %s was already sent", dedup_key)
            return False
        logger.info("mail sent to %s: %s", recipient, subject)
        return True


@dataclass(frozen=True)
class Dependencies:
    engine: sa.Engine
    mailer: Mailer

    @classmethod
    def from_env(cls) -> Dependencies:
        # create_engine opens no connection: each worker process connects on first use.
        engine = sa.create_engine(os.environ.get("DB_URL", "sqlite:///shop.db"), pool_pre_ping=True)
        return cls(engine=engine, mailer=Mailer(engine))
