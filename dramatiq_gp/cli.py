"""``dramatiq-gp``: the kit's command line (the worker itself is the ordinary ``dramatiq`` command).

    dramatiq-gp migrate up              create or upgrade the outbox table
    dramatiq-gp outbox failed           list the events the relays set aside
    dramatiq-gp outbox retry ID...      make set-aside events pending again (or --all)

The database comes from ``DB_URL`` (or ``DB_HOST``, ``DB_USER``...).
"""

from __future__ import annotations

import argparse
import json
import sys

import sqlalchemy as sa

from . import outbox
from .errors import ConfigError
from .settings import DatabaseSettings, Settings


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dramatiq-gp", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    migrate = commands.add_parser("migrate", help="database migrations")
    migrate.add_argument("direction", choices=["up"], help="create or upgrade the outbox table")
    box = commands.add_parser("outbox", help="look after the outbox")
    actions = box.add_subparsers(dest="action", required=True)
    failed = actions.add_parser("failed", help="list the events set aside")
    failed.add_argument("--limit", type=int, default=100)
    failed.add_argument("--json", action="store_true", help="one JSON object per line")
    retry = actions.add_parser("retry", help="make set-aside events pending again")
    which = retry.add_mutually_exclusive_group(required=True)
    which.add_argument("ids", nargs="*", default=[], metavar="ID")
    which.add_argument("--all", action="store_true")
    return parser


def _engine(db: DatabaseSettings) -> sa.Engine:
    if not db.configured:
        raise ConfigError("no database configured: set DB_URL (or DB_HOST, DB_USER, DB_PASSWORD, DB_NAME)")
    return sa.create_engine(db.sqlalchemy_url())


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        settings = Settings.from_env()
        engine = _engine(settings.db)
    except ConfigError as exc:
        print(f"dramatiq-gp: {exc}", file=sys.stderr)
        return 2
    try:
        with engine.begin() as conn:
            if args.command == "migrate":
                outbox.migrate(conn)
                print(f"outbox table {outbox.TABLE_NAME!r} is up to date in {settings.db.display()}")
            elif args.action == "failed":
                for event in outbox.failed_events(conn, limit=args.limit):
                    if args.json:
                        print(json.dumps({**vars(event), "id": str(event.id)}, default=str))
                    else:
                        print(f"{event.id}  {event.event}  attempts={event.attempts}  failed={event.failed_at}")
                        print(f"    {event.last_error}")
            else:
                count = outbox.retry_failed(conn, None if args.all else args.ids)
                print(f"{count} event(s) pending again")
    except sa.exc.SQLAlchemyError as exc:
        reason = getattr(exc, "orig", None) or exc
        print(f"dramatiq-gp: database error at {settings.db.display()}: {reason}", file=sys.stderr)
        return 1
    finally:
        engine.dispose()
    return 0


if __name__ == "__main__":
    sys.exit(main())
