"""``dramatiq-gp``: the kit's command line (the worker itself is the ordinary ``dramatiq`` command).

Connections come from the same environment as the worker: ``REDIS_URL`` or
``VALKEY_*``, ``DB_URL`` or ``DB_*``, ``VALKEY_NAMESPACE``, ``SCHEDULER_*``.
Every command exits non-zero with a one-line message on error, and never prints
a password.
"""

from __future__ import annotations

import dataclasses
import getpass
import importlib
import json
import os
import sys
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import click
import redis
from dramatiq.errors import BrokerError

from . import keys
from .durations import EPOCH, format_duration
from .errors import ConfigError, NotAQueue
from .records import text
from .scheduler.cron import CronError, parse
from .settings import Settings

if TYPE_CHECKING:
    from .brokers.view import QueueView

F = TypeVar("F", bound=Callable[..., Any])


def _fail(message: str) -> None:
    raise click.ClickException(message)


#: Help shown for a group called without a command; click < 8.2 exits with it instead.
_HELP_INSTEAD: Any = getattr(click.exceptions, "NoArgsIsHelpError", ())


class _UsageError(click.ClickException):
    exit_code = click.UsageError.exit_code


def _one_line(exc: click.UsageError) -> click.ClickException:
    """Click's usage error (usage, hint, blank line, error) as the one line the command promises."""
    message = " ".join(line.strip() for line in exc.format_message().splitlines() if line.strip())
    if exc.ctx is not None:
        message += f" (see '{exc.ctx.command_path} --help')"
    return _UsageError(message)


class _OneLineErrors(click.Group):
    """The top-level group: every usage error below it, too, prints one line."""

    def make_context(self, *args: Any, **kwargs: Any) -> click.Context:
        try:
            return super().make_context(*args, **kwargs)
        except click.UsageError as exc:
            if isinstance(exc, _HELP_INSTEAD):
                raise
            raise _one_line(exc) from None

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.UsageError as exc:
            if isinstance(exc, _HELP_INSTEAD):
                raise
            raise _one_line(exc) from None


def _settings() -> Settings:
    """The settings, with logging set up as the worker's (``LOG_*``): actions log who did them there."""
    from .telemetry import configure_logging

    try:
        settings = Settings.from_env()
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    configure_logging(settings.log, send_default_pii=settings.sentry.send_default_pii)
    return settings


@contextmanager
def _database(settings: Settings) -> Iterator[Any]:
    import sqlalchemy as sa

    if not settings.db.configured:
        _fail("no database configured: set DB_URL (or DB_HOST, DB_USER, DB_PASSWORD, DB_NAME)")
    engine = settings.db.engine()
    try:
        yield engine
    except sa.exc.SQLAlchemyError as exc:
        reason = str(getattr(exc, "orig", None) or exc).splitlines()[0]
        raise click.ClickException(f"database error at {settings.db.display()}: {reason}") from None
    finally:
        engine.dispose()


def _redis(settings: Settings) -> redis.Redis:
    """A Redis client closed when the command ends: left to the garbage collector, its socket warns."""
    client = settings.redis.client(socket_connect_timeout=5)
    click.get_current_context().call_on_close(client.close)
    try:
        client.ping()
    except redis.RedisError as exc:
        raise click.ClickException(f"Redis/Valkey unreachable at {settings.redis.display()}: {exc}") from None
    return client


@click.group(cls=_OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """The dramatiq-gp command: migrations, status, the outbox and the schedule.

    \b
    Example:
      DB_URL=postgresql://app@db/app dramatiq-gp migrate up
    """


# -- migrate -----------------------------------------------------------------------


@main.group()
def migrate() -> None:
    """The outbox and inbox tables.

    \b
    Example:
      dramatiq-gp migrate status
    """


@migrate.command("up")
def migrate_up() -> None:
    """Create the outbox and inbox tables, their indexes and later columns where missing (safe to run again).

    \b
    Example:
      DB_URL=postgresql://app@db/app dramatiq-gp migrate up
    """
    from . import outbox

    settings = _settings()
    with _database(settings) as engine, engine.begin() as conn:
        outbox.migrate(conn)
    click.echo(f"inbox table {outbox.INBOX_TABLE_NAME!r} is up to date in {settings.db.display()}")
    click.echo(f"outbox table {outbox.TABLE_NAME!r} is up to date in {settings.db.display()}")


@migrate.command("status")
def migrate_status() -> None:
    """Whether the outbox and inbox tables, their indexes and columns exist; exits 1 if something is missing.

    \b
    Example:
      dramatiq-gp migrate status
    """
    import sqlalchemy as sa

    from .outbox.table import INBOX, OUTBOX_EVENTS, missing_columns

    settings = _settings()
    problems = []
    with _database(settings) as engine:
        inspector = sa.inspect(engine)
        for kind, table in (("outbox", OUTBOX_EVENTS), ("inbox", INBOX)):
            if not inspector.has_table(table.name):
                problems.append(f"{kind} table {table.name!r} is missing: run `dramatiq-gp migrate up`")
                continue
            present = {index["name"] for index in inspector.get_indexes(table.name)}
            missing = sorted(str(index.name) for index in table.indexes if index.name not in present)
            if missing:
                problems.append(
                    f"{kind} table present; missing index(es) {', '.join(missing)}: run `dramatiq-gp migrate up`"
                )
            columns = [name for table_name, name in missing_columns(engine) if table_name == table.name]
            if columns:
                problems.append(
                    f"{kind} table present; missing column(s) {', '.join(columns)}: run `dramatiq-gp migrate up`"
                )
    if problems:
        click.echo("\n".join(problems))
        sys.exit(1)
    click.echo(f"inbox table {INBOX.name!r} is up to date in {settings.db.display()}")
    click.echo(f"outbox table {OUTBOX_EVENTS.name!r} is up to date in {settings.db.display()}")


# -- outbox ------------------------------------------------------------------------


@main.group("outbox")
def outbox_group() -> None:
    """Events the relays set aside, and delayed events not yet due.

    \b
    Example:
      dramatiq-gp outbox failed --json
    """


@outbox_group.command("failed")
@click.option("--limit", default=100, show_default=True, help="at most this many")
@click.option("--json", "as_json", is_flag=True, help="one JSON object per line")
def outbox_failed(limit: int, as_json: bool) -> None:
    """List the events set aside after too many failed relay attempts.

    \b
    Example:
      dramatiq-gp outbox failed --limit 20
    """
    from . import outbox

    with _database(_settings()) as engine, engine.begin() as conn:
        for event in outbox.failed_events(conn, limit=limit):
            if as_json:
                click.echo(json.dumps({**vars(event), "id": str(event.id)}, default=str))
            else:
                click.echo(f"{event.id}  {event.event}  attempts={event.attempts}  failed={event.failed_at}")
                click.echo(f"    {event.last_error}")


@outbox_group.command("scheduled")
@click.option("--limit", default=100, show_default=True, help="at most this many")
@click.option("--json", "as_json", is_flag=True, help="one JSON object per line")
def outbox_scheduled(limit: int, as_json: bool) -> None:
    """List the delayed events not yet due, soonest first (dispatch with delay= or at=).

    \b
    Example:
      dramatiq-gp outbox scheduled --limit 20
    """
    from . import outbox

    with _database(_settings()) as engine, engine.connect() as conn:
        for event in outbox.scheduled_events(conn, limit=limit):
            if as_json:
                click.echo(json.dumps({**vars(event), "id": str(event.id)}, default=str))
            else:
                click.echo(f"{event.id}  {event.event}  due={event.not_before}  dispatched={event.created_at}")


@outbox_group.command("retry")
@click.argument("ids", nargs=-1)
@click.option("--all", "every", is_flag=True, help="every set-aside event")
def outbox_retry(ids: tuple[str, ...], every: bool) -> None:
    """Make set-aside events pending again, by id or --all.

    \b
    Example:
      dramatiq-gp outbox retry 0b6c1f0e-4c5d-4d4e-9a53-2f1b2c3d4e5f
    """
    from . import outbox

    if bool(ids) == every:
        _fail("give the event ids to retry, or --all")
    for given in ids:
        try:
            uuid.UUID(given)
        except ValueError:
            _fail(f"{given!r} is not an event id (a UUID, as `dramatiq-gp outbox failed` lists them)")
    with _database(_settings()) as engine, engine.begin() as conn:
        count = outbox.retry_failed(conn, None if every else list(ids))
    click.echo(f"{count} event(s) pending again")


@outbox_group.command("replay")
@click.argument("event_id")
def outbox_replay(event_id: str) -> None:
    """Replay one set-aside event: pending again, for the relays to send.

    \b
    Example:
      dramatiq-gp outbox replay 0b6c1f0e-4c5d-4d4e-9a53-2f1b2c3d4e5f
    """
    from .actions import replay_event

    try:
        uuid.UUID(event_id)
    except ValueError:
        _fail(f"{event_id!r} is not an event id (a UUID, as `dramatiq-gp outbox failed` lists them)")
    with _database(_settings()) as engine:
        if not replay_event(engine, event_id, who=_who()):
            _fail(f"no set-aside event {event_id}")
    click.echo(f"event {event_id} pending again")


@outbox_group.command("backfill")
@click.argument("task_type")
@click.option("--since", "since_text", required=True, help="an ISO time (UTC unless it says) or a duration ago: 2h")
@click.option("--until", "until_text", help="the same; default now")
def outbox_backfill(task_type: str, since_text: str, until_text: str | None) -> None:
    """Send a listener the events committed before it was live, from those the outbox keeps.

    A fan-out reaches the listeners live when it runs; a listener a deploy adds misses
    the events before. This sends it its copy of every published event of its type
    committed since --since and kept (OUTBOX_RETENTION): those it handled already are
    skipped by their message ids.

    \b
    Example:
      dramatiq-gp outbox backfill listener:shop.order_placed:archive_pdf --since 2h
    """
    from .actions import backfill_listener

    since = _moment(since_text, "--since")
    until = _moment(until_text, "--until") if until_text else None
    settings = _settings()
    client = _redis(settings)
    with _database(settings) as engine, _sending_broker(settings, client) as broker:
        try:
            sent, oldest = backfill_listener(engine, broker, task_type, since, until, who=_who())
        except (ValueError, LookupError) as exc:
            _fail(str(exc))
    click.echo(f"{sent} event(s) sent to {task_type}")
    if oldest is None or oldest > since:
        kept = "none is" if oldest is None else f"the oldest is from {oldest.isoformat(timespec='seconds')}"
        click.echo(f"of the events of that type the outbox keeps (OUTBOX_RETENTION), {kept}")


#: The end of the times a time option takes (from the epoch, :data:`~dramatiq_gp.durations.EPOCH`): none so late
#: that showing it in a zone east of UTC passes the year 9999.
LATEST = datetime(9999, 1, 1, tzinfo=UTC)


def _moment(text: str, option: str) -> datetime:
    """An ISO time (UTC when it names no zone), or a duration before now, from 1970 to 9998."""
    from .durations import parse_duration

    out_of_range = f"{option} {text!r}: expected a time from 1970 to 9998 (an ISO time, or a duration ago)"
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        try:
            ago = parse_duration(text)
        except ValueError:
            _fail(f"{option} {text!r}: expected an ISO time (2026-12-01T09:00:00Z) or a duration ago (2h)")
            raise
        now = datetime.now(UTC)
        if ago > now - EPOCH:  # compared first: now - ago overflows for ago past the year 1
            _fail(out_of_range)
        return now - ago
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    if not EPOCH <= moment < LATEST:
        _fail(out_of_range)
    return moment


@contextmanager
def _sending_broker(settings: Settings, client: redis.Redis) -> Iterator[Any]:
    """A broker that only sends, to where the workers' queues are; closed at the end."""
    from .brokers.kinds import broker_for

    broker = broker_for(settings, client, middleware=[])
    try:
        yield broker
    finally:
        broker.close()


# -- dead letters ------------------------------------------------------------------


def _who() -> str:
    """Who runs this command, for the line every action logs (:mod:`dramatiq_gp.actions`)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid {os.getuid()}"
    return f"{user} (cli)"


@contextmanager
def _queues(settings: Settings, client: redis.Redis | None = None) -> Iterator[QueueView]:
    """The view of the queues (``client``: the command's Redis client, if it has one already); its server out of
    reach ends the command with one line."""
    from .brokers.kinds import view_for

    view = view_for(settings, client if client is not None else _redis(settings))
    try:
        yield view
    except view.unreachable as exc:
        raise click.ClickException(f"{view.server} unreachable at {view.where()}: {exc!r}") from None
    except NotAQueue as exc:  # refused before anything was read or changed
        raise click.ClickException(str(exc)) from None


@main.group()
def dlq() -> None:
    """Dead letters: list, show, requeue and purge them.

    \b
    Example:
      dramatiq-gp dlq list default
    """


@dlq.command("list")
@click.argument("queue", required=False)
@click.option("--offset", default=0, show_default=True, type=click.IntRange(min=0), help="skip this many")
@click.option("--limit", default=50, show_default=True, type=click.IntRange(1, 1000), help="at most this many")
@click.option("--json", "as_json", is_flag=True, help="one JSON object per line")
def dlq_list(queue: str | None, offset: int, limit: int, as_json: bool) -> None:
    """List a queue's dead letters (every queue's, without QUEUE); on RabbitMQ the oldest first, else the newest.

    \b
    Example:
      dramatiq-gp dlq list default --limit 20
    """
    from .brokers.view import is_queue_name

    settings = _settings()
    with _queues(settings) as view:
        every = view.counts(view.names(thorough=True)) if queue is None else []
        queues = [queue] if queue is not None else [q["name"] for q in every if q["dead"] and is_queue_name(q["name"])]
        if queue is None and not queues and not as_json:
            click.echo("no dead letters in any queue")
        for name in queues:
            _dlq_list_one(view, name, offset, limit, as_json, settings.sentry.send_default_pii)


def _dlq_list_one(view: QueueView, queue: str, offset: int, limit: int, as_json: bool, pii: bool) -> None:
    total = view.dead_count(queue)
    letters = view.dead_letters(queue, offset=offset, limit=limit, pii=pii)
    if as_json:
        for letter in letters:
            click.echo(json.dumps(letter.as_dict()))
        return
    click.echo(f"queue {queue}: {total} dead letter(s)")
    for letter in letters:
        dead_at = (
            datetime.fromtimestamp(letter.dead_at_ms / 1000, UTC).isoformat(timespec="seconds")
            if isinstance(letter.dead_at_ms, int)
            else letter.dead_at_ms
        )
        click.echo(
            f"{letter.id}  {letter.task_type}  message {letter.message_id}  attempts={letter.attempts}  "
            f"dead since {dead_at}"
        )
        if letter.reason:
            click.echo(f"    {letter.reason}")


@dlq.command("show")
@click.argument("queue")
@click.argument("dead_letter_id")
def dlq_show(queue: str, dead_letter_id: str) -> None:
    """Show one dead letter (its arguments only with SENTRY_SEND_DEFAULT_PII=true), as JSON.

    \b
    Example:
      dramatiq-gp dlq show default 6f1d2c3b-...
    """
    settings = _settings()
    with _queues(settings) as view:
        letter = view.dead_letter(queue, dead_letter_id, pii=settings.sentry.send_default_pii)
    if letter is None:
        _fail(f"no dead letter {dead_letter_id} in queue {queue}")
    else:
        click.echo(json.dumps(letter.as_dict(), indent=2))


@dlq.command("requeue")
@click.argument("queue")
@click.argument("ids", nargs=-1)
@click.option("--all", "every", is_flag=True, help="every dead letter of the queue")
def dlq_requeue(queue: str, ids: tuple[str, ...], every: bool) -> None:
    """Put dead letters back on their queue, by id or --all; each keeps its message id.

    \b
    Example:
      dramatiq-gp dlq requeue default --all
    """
    from .actions import requeue_dead_letters

    if bool(ids) == every:
        _fail("give the dead letter ids to requeue (as `dramatiq-gp dlq list` shows them), or --all")
    with _queues(_settings()) as view:
        moved = requeue_dead_letters(view, queue, None if every else list(ids), who=_who())
    click.echo(f"{moved} dead letter(s) of queue {queue} requeued")


@dlq.command("purge")
@click.argument("queue")
@click.option("--yes", is_flag=True, help="do it: the dead letters are deleted for good")
def dlq_purge(queue: str, yes: bool) -> None:
    """Delete a queue's dead letters for good.

    \b
    Example:
      dramatiq-gp dlq purge default --yes
    """
    from .actions import purge_dead_letters

    if not yes:
        _fail(f"purging deletes every dead letter of queue {queue} for good: add --yes")
    with _queues(_settings()) as view:
        purged = purge_dead_letters(view, queue, who=_who())
    click.echo(f"{purged} dead letter(s) of queue {queue} deleted")


# -- schedule ----------------------------------------------------------------------


@main.group()
def schedule() -> None:
    """Preview the schedule, pause and resume its entries, run one now or backfill a past window.

    \b
    Example:
      dramatiq-gp schedule next "0 3 * * *" --tz Europe/Budapest
    """


@schedule.command("next")
@click.argument("entry_or_spec")
@click.option("-n", "count", default=5, show_default=True, help="how many fire times")
@click.option("--tz", default=None, help="IANA zone (default: the entry's, or SCHEDULER_TIMEZONE)")
def schedule_next(entry_or_spec: str, count: int, tz: str | None) -> None:
    """The next fire times of a cron spec, of a schedule entry, or of an APScheduler trigger.

    ENTRY_OR_SPEC is a cron spec; or an entry's name, as a worker published it; or
    module:attribute naming an APScheduler trigger object in your code.

    \b
    Examples:
      dramatiq-gp schedule next "30 6 * * 1-5" -n 3 --tz Europe/Budapest
      dramatiq-gp schedule next shop.nightly_sales_report
      dramatiq-gp schedule next app.schedules:every_five_minutes
    """
    from .scheduler.triggers import SpecTrigger, upcoming

    settings = _settings()
    spec_text, zone_name = entry_or_spec, tz or settings.scheduler.timezone
    one_word = not entry_or_spec.startswith("@") and len(entry_or_spec.split()) == 1
    if one_word and ":" in entry_or_spec:
        trigger = _imported_trigger(entry_or_spec)
        zone = _zone(zone_name)
    else:
        if one_word:  # an entry name
            client = _redis(settings)
            scheduler = _scheduler_keys(settings)
            published = client.hget(scheduler.entries, entry_or_spec)
            stored = _stored_trigger(client, scheduler, entry_or_spec) if published is None else None
            if stored is not None:
                trigger, zone = stored
                for at in upcoming(trigger, datetime.now(UTC), count):
                    click.echo(at.astimezone(zone).isoformat())
                return
            if published is None:
                where = scheduler.prefix
                _fail(f"no schedule entry {entry_or_spec!r} published under {where!r}; give a cron spec instead")
            spec_text, _, entry_zone = text(published).rpartition("|")
            zone_name = tz or entry_zone
            try:
                parse(spec_text)
            except CronError:  # an APScheduler trigger: the leader publishes its next fire times
                zone = _zone(zone_name)
                times = json.loads(text(client.hget(scheduler.upcoming, entry_or_spec) or "[]"))
                for at_text in [t for t in times if datetime.fromisoformat(t) > datetime.now(UTC)][:count]:
                    click.echo(datetime.fromisoformat(at_text).astimezone(zone).isoformat())
                return
        try:
            zone = _zone(zone_name)
            trigger = SpecTrigger(parse(spec_text), zone)
        except CronError as exc:
            raise click.ClickException(str(exc)) from None
    for at in upcoming(trigger, datetime.now(UTC), count):
        click.echo(at.astimezone(zone).isoformat())


def _stored_trigger(client: redis.Redis, scheduler: keys.SchedulerKeys, name: str) -> tuple[Any, ZoneInfo] | None:
    """The trigger and zone of the entry ``name`` stored at run time, if there is one."""
    from .scheduler.dynamic import decode_raw
    from .scheduler.schedule import ScheduleError

    raw = client.hget(scheduler.dynamic, name)
    if raw is None:
        return None
    try:
        entry = decode_raw(name, raw)
    except ScheduleError as exc:
        _fail(str(exc))
        raise
    return entry.trigger, entry.zone


def _schedules(settings: Settings) -> Any:
    from .scheduler.dynamic import Schedules

    namespace = _scheduler_keys(settings).namespace
    # Whether a leader runs, the command says on its own output.
    return Schedules(_redis(settings), namespace, timezone=settings.scheduler.timezone, warn_leaderless=False)


@schedule.command("add")
@click.argument("name")
@click.argument("spec")
@click.option("--event", "event_name", help="the event each tick dispatches (its wire name)")
@click.option("--data", default="{}", show_default=True, help="the event's payload, as JSON")
@click.option("--actor", help="the actor each tick sends")
@click.option("--args", "args_json", default="[]", show_default=True, help="the actor's arguments, as a JSON list")
@click.option("--kwargs", "kwargs_json", default="{}", show_default=True, help="its keyword arguments, as JSON")
@click.option("--queue", help="the actor's queue (default: default)")
@click.option("--tz", help="IANA zone of the spec (default: SCHEDULER_TIMEZONE)")
@click.option("--options", "options_json", default="{}", show_default=True, help="message options, as JSON")
@click.option("--replace", is_flag=True, help="change the entry if it exists")
@click.option(
    "--overlap",
    type=click.Choice(["allow", "skip", "wait"]),
    default="allow",
    show_default=True,
    help="an actor's run while the entry's previous run still runs",
)
def schedule_add(
    name: str,
    spec: str,
    event_name: str | None,
    data: str,
    actor: str | None,
    args_json: str,
    kwargs_json: str,
    queue: str | None,
    tz: str | None,
    options_json: str,
    replace: bool,
    overlap: str,
) -> None:
    """Store a schedule entry the leader fires from its next tick (no code change, no restart).

    SPEC is a cron spec, a descriptor or @every. Give --event (an event's wire name,
    with --data) or --actor (with --args, --kwargs). Either must be marked
    schedulable in the application's code: it is checked, with its arguments or data,
    against what the workers publish (the code is not loaded here).

    \b
    Examples:
      dramatiq-gp schedule add digest.42 "0 8 * * *" --tz Europe/Budapest --event digest.due --data '{"customer": 42}'
      dramatiq-gp schedule add cleanup.tmp "@every 10m" --actor cleanup --args '["/tmp"]'
    """
    from .actions import add_entry
    from .scheduler.dynamic import EventByName
    from .scheduler.schedule import ScheduleError

    if (event_name is None) == (actor is None):
        _fail("give one of --event and --actor")
    options = _json_option(options_json, "--options", dict)
    schedules = _schedules(_settings())
    try:
        if event_name is not None:
            target: Any = EventByName(event_name, _json_option(data, "--data", object))
            entry = add_entry(schedules, name, spec, target, who=_who(), tz=tz, replace=replace, **options)
        else:
            args, kwargs = _json_option(args_json, "--args", list), _json_option(kwargs_json, "--kwargs", dict)
            entry = add_entry(
                schedules,
                name,
                spec,
                actor,
                who=_who(),
                args=args,
                kwargs=kwargs,
                queue=queue,
                tz=tz,
                replace=replace,
                overlap=overlap,
                **options,
            )
    except ScheduleError as exc:
        raise click.ClickException(str(exc)) from None
    next_fire = entry.next_fire.isoformat() if entry.next_fire else "never"
    click.echo(f"entry {name} stored: next fire {next_fire}")
    if not schedules.leader_runs():
        click.echo(
            "no scheduler leader runs now: it fires once a worker with a schedule, or SCHEDULER_DYNAMIC=true, runs"
        )


@schedule.command("remove")
@click.argument("name")
def schedule_remove(name: str) -> None:
    """Remove a stored schedule entry: its ticks stop at once (code entries are removed in code)."""
    from .actions import remove_entry

    if not remove_entry(_schedules(_settings()), name, who=_who()):
        _fail(f"no stored schedule entry {name!r} (`dramatiq-gp schedule list` lists them)")
    click.echo(f"entry {name} removed")


@schedule.command("list")
@click.argument("prefix", default="")
@click.option("--limit", default=100, show_default=True, type=click.IntRange(1), help="how many entries at most")
@click.option("--json", "as_json", is_flag=True, help="one JSON object per line")
def schedule_list(prefix: str, limit: int, as_json: bool) -> None:
    """The stored schedule entries whose name starts with PREFIX, by name, and how many there are in all."""
    schedules = _schedules(_settings())
    for entry in schedules.list(prefix, limit=limit):
        next_fire = entry.next_fire.isoformat() if entry.next_fire else None
        if as_json:
            record = {**dataclasses.asdict(entry), "next_fire": next_fire}
            click.echo(json.dumps(record))
        else:
            click.echo(f"{entry.name}  {entry.trigger} ({entry.zone})  {entry.kind} {entry.target}  next {next_fire}")
    if not as_json:
        click.echo(f"{len(schedules)} stored entr{'y' if len(schedules) == 1 else 'ies'} in all")


def _json_option(raw: str, option: str, kind: type) -> Any:
    from .records import TooDeep, json_value

    try:
        value = json_value(raw)
    except TooDeep as exc:
        _fail(f"{option}: {exc}")
        raise
    except ValueError as exc:
        _fail(f"{option} {raw!r}: not JSON ({exc})")
        raise
    if kind is not object and not isinstance(value, kind):
        _fail(f"{option} {raw!r}: expected a JSON {'list' if kind is list else 'object'}")
    return value


def _scheduler_keys(settings: Settings) -> keys.SchedulerKeys:
    """The keys of the scheduler these settings name (``SCHEDULER_NAMESPACE``, by default the queues')."""
    return keys.SchedulerKeys(settings.scheduler.namespace or settings.redis.namespace)


@schedule.command("pause")
@click.argument("entry")
def schedule_pause(entry: str) -> None:
    """Stop an entry firing: the leader passes over its ticks, from the next one, until it is resumed.

    \b
    Example:
      dramatiq-gp schedule pause shop.nightly_sales_report
    """
    from .actions import pause_entry

    settings = _settings()
    client, scheduler = _redis(settings), _scheduler_keys(settings)
    if not pause_entry(client, scheduler, entry, who=_who()):
        _fail(f"no schedule entry {entry!r} in scheduler {scheduler.namespace} (`dramatiq-gp status` lists them)")
    click.echo(f"entry {entry} paused: its ticks are passed over until `dramatiq-gp schedule resume {entry}`")


@schedule.command("resume")
@click.argument("entry")
def schedule_resume(entry: str) -> None:
    """Let a paused entry fire again, from its next tick (the ticks of the pause are not caught up).

    \b
    Example:
      dramatiq-gp schedule resume shop.nightly_sales_report
    """
    from .actions import resume_entry

    settings = _settings()
    client, scheduler = _redis(settings), _scheduler_keys(settings)
    if not resume_entry(client, scheduler, entry, who=_who()):
        _fail(f"schedule entry {entry!r} is not paused")
    click.echo(f"entry {entry} resumed: it fires from its next tick")


@schedule.command("run")
@click.argument("entry")
def schedule_run(entry: str) -> None:
    """Run an entry once, now, besides its ticks: one message with an id of its own.

    Its scheduled time is now, and its firing is marked as run by hand ("manual":
    true). A paused entry runs all the same: it was asked for by name.

    \b
    Example:
      dramatiq-gp schedule run shop.nightly_sales_report
    """
    from .actions import run_entry
    from .scheduler.schedule import ScheduleError

    settings = _settings()
    client, scheduler = _redis(settings), _scheduler_keys(settings)
    with _sending_broker(settings, client) as broker:
        try:
            run = run_entry(broker, scheduler, entry, who=_who())
        except ScheduleError as exc:
            _fail(str(exc))
            raise
        except (redis.RedisError, BrokerError) as exc:
            _fail(f"entry {entry} not run: the message could not be enqueued: {exc}")
            raise
    if run is None:
        _fail(f"no schedule entry {entry!r} in scheduler {scheduler.namespace} (`dramatiq-gp status` lists them)")
        return
    click.echo(f"entry {entry} run now: message {run.message_id} enqueued on queue {run.queue}")
    if run.paused:
        click.echo(f"entry {entry} is paused: run all the same, as asked; its ticks are still passed over")


@schedule.command("backfill")
@click.argument("entry")
@click.option("--from", "from_text", required=True, help="the window's start: an ISO time (UTC unless it says) or 2h")
@click.option("--to", "to_text", help="its end, included: the same; default now")
@click.option("--trigger", "trigger_path", help="module:attribute of the entry's APScheduler trigger, if it has one")
@click.option("--dry-run", is_flag=True, help="show the ticks and what each is; enqueue nothing")
@click.option("--yes", is_flag=True, help="enqueue without asking")
def schedule_backfill(
    entry: str, from_text: str, to_text: str | None, trigger_path: str | None, dry_run: bool, yes: bool
) -> None:
    """Enqueue the ticks of a past window that did not run, under the ids the leader gives them.

    Shows each tick of the window and what it is, "ran" (it completed: a done mark),
    "fired" (the leader or a backfill enqueued it) or "will run", with the counts,
    then asks before enqueuing those that will run. A tick enqueued already is not
    enqueued again, so running the same backfill twice enqueues nothing the second time.

    \b
    Examples:
      dramatiq-gp schedule backfill shop.hourly_digest --from 2026-12-01T06:00:00Z --to 2026-12-01T12:00:00Z
      dramatiq-gp schedule backfill shop.hourly_digest --from 6h --dry-run
    """
    from .actions import backfill_entry
    from .scheduler import manual
    from .scheduler.runner import tick_claim_ttl_ms
    from .scheduler.schedule import ScheduleError

    now = datetime.now(UTC)
    start = _moment(from_text, "--from")
    end = _moment(to_text, "--to") if to_text else now
    if end > now:
        _fail(f"--to {end.isoformat(timespec='seconds')} is in the future: the ticks to come are the leader's to fire")
    if start >= end:
        _fail(
            f"--from {start.isoformat(timespec='seconds')} is not before --to {end.isoformat(timespec='seconds')}: "
            "the window is reversed or empty"
        )
    settings = _settings()
    client, scheduler = _redis(settings), _scheduler_keys(settings)
    trigger = _imported_trigger(trigger_path) if trigger_path else None
    try:
        template = manual.template(client, scheduler, entry)
        if template is None:
            _fail(f"no schedule entry {entry!r} in scheduler {scheduler.namespace} (`dramatiq-gp status` lists them)")
            return
        ticks = manual.backfill_ticks(template, start, end, trigger)
    except ScheduleError as exc:
        _fail(str(exc))
        raise
    zone = template.zone
    shown = [moment.astimezone(zone).isoformat(timespec="seconds") for moment in (start, end)]
    window = f"from {shown[0]} to {shown[1]}"
    if not ticks:
        _fail(f"entry {entry} has no tick {window}: nothing to backfill")
    states = manual.tick_states(client, scheduler, settings.redis.namespace, entry, ticks)
    click.echo(f"backfill of entry {entry} ({template.trigger}, {zone.key}) {window}:")
    for tick, state in zip(ticks, states, strict=True):
        click.echo(f"  {tick.astimezone(zone).isoformat()}  {state}")
    due = [tick for tick, state in zip(ticks, states, strict=True) if state == manual.WILL_RUN]
    counts = ", ".join(f"{states.count(state)} {state}" for state in (manual.RAN, manual.FIRED, manual.WILL_RUN))
    click.echo(f"{len(ticks)} tick(s): {counts}")
    retention = settings.worker.dedup_retention
    if ticks[0] < now - retention:
        click.echo(
            f"ticks before {(now - retention).astimezone(zone).isoformat(timespec='seconds')} are older than "
            f"WORKER_DEDUP_RETENTION ({format_duration(retention)}): one that ran then left no mark, and runs again"
        )
    if manual.is_paused(client, scheduler, entry):
        click.echo(f"entry {entry} is paused: its ticks are backfilled all the same, as asked")
    if not due:
        click.echo("nothing to enqueue: every tick of the window ran or was fired")
        return
    if dry_run:
        click.echo(f"dry run: {len(due)} tick(s) would be enqueued, none was")
        return
    if not yes:
        click.confirm(f"enqueue {len(due)} tick(s) of entry {entry}?", abort=True)
    # A claim outlives the done mark its run leaves, and any catch-up of the leader's that could reach the tick.
    keep_ms = max(int(retention.total_seconds() * 1000), tick_claim_ttl_ms(settings.scheduler))
    with _sending_broker(settings, client) as broker:
        try:
            sent, taken = backfill_entry(broker, scheduler, template, due, keep_ms=keep_ms, who=_who())
        except (redis.RedisError, BrokerError) as exc:
            _fail(f"nothing enqueued: {exc}")
            raise
    meanwhile = f"; {taken} claimed meanwhile by the leader or another backfill, not enqueued again" if taken else ""
    click.echo(f"{sent} tick(s) of entry {entry} enqueued{meanwhile}")


def _zone(name: str) -> ZoneInfo:
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise click.ClickException(f"--tz {name!r} is not an IANA time zone (e.g. UTC, Europe/Budapest)") from None


def _imported_trigger(path: str) -> Any:
    from apscheduler.triggers.base import BaseTrigger

    module_name, _, attribute = path.partition(":")
    sys.path.insert(0, str(Path.cwd()))  # as the dramatiq command finds the application
    try:
        trigger = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise click.ClickException(f"cannot import {path!r}: {exc}") from None
    if not isinstance(trigger, BaseTrigger):
        raise click.ClickException(f"{path!r} is a {type(trigger).__name__}, not an APScheduler trigger")
    return trigger


# -- generators --------------------------------------------------------------------


def _apply(make: Callable[[], Any]) -> None:
    from .generate import GenerateError

    try:
        plan = make()
    except GenerateError as exc:
        raise click.ClickException(str(exc)) from None
    for line in plan.apply():
        click.echo(line)


_project = click.option(
    "-C",
    "--project",
    "root",
    default=".",
    show_default=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="the project's directory",
)


@main.group()
def new() -> None:
    """Start a project or a module.

    \b
    Example:
      dramatiq-gp new project shop && cd shop && dramatiq-gp new module billing
    """


@new.command("project")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option("--name", default=None, help="the Python package (default: from the directory)")
@click.option("--no-worker", is_flag=True, help="no worker entry point (add it later with `add worker`)")
def new_project(directory: Path, name: str | None, no_worker: bool) -> None:
    """An application skeleton: config from env, worker, migrate entry point, docker-compose.yml, README, tests.

    \b
    Example:
      dramatiq-gp new project shop --name shop
    """
    from . import generate

    _apply(lambda: generate.new_project(directory, name, worker=not no_worker))


@new.command("module")
@click.argument("module")
@_project
def new_module(module: str, root: Path) -> None:
    """A module (events, listeners, jobs, register) registered in the worker.

    \b
    Example:
      dramatiq-gp new module billing
    """
    from . import generate

    _apply(lambda: generate.new_module(root, module))


@main.group()
def add() -> None:
    """Add a worker, an event, a listener or a job to a project.

    \b
    Example:
      dramatiq-gp add listener billing InvoicePaid send_receipt --queue mail
    """


@add.command("worker")
@_project
def add_worker(root: Path) -> None:
    """The worker entry point, for a project made with --no-worker.

    \b
    Example:
      dramatiq-gp add worker
    """
    from . import generate

    _apply(lambda: generate.add_worker(root))


@add.command("event")
@click.argument("module")
@click.argument("event")
@_project
def add_event(module: str, event: str, root: Path) -> None:
    """An event class in a module's events.py.

    \b
    Example:
      dramatiq-gp add event billing InvoicePaid
    """
    from . import generate

    _apply(lambda: generate.add_event(root, module, event))


@add.command("listener")
@click.argument("module")
@click.argument("event")
@click.argument("name")
@click.option("--queue", default="default", show_default=True)
@click.option("--async", "is_async", is_flag=True, help="an async def stub (runs on the event-loop thread)")
@_project
def add_listener(module: str, event: str, name: str, queue: str, is_async: bool, root: Path) -> None:
    """A listener stub for an event, registered in the module.

    \b
    Example:
      dramatiq-gp add listener billing InvoicePaid send_receipt --queue mail
      dramatiq-gp add listener billing InvoicePaid notify_crm --async
    """
    from . import generate

    _apply(lambda: generate.add_listener(root, module, event, name, queue=queue, is_async=is_async))


@add.command("job")
@click.argument("module")
@click.argument("name")
@click.option("--cron", required=True, help='when it runs: "0 3 * * *", "@daily", "@every 10m"')
@click.option("--queue", default="default", show_default=True)
@click.option("--async", "is_async", is_flag=True, help="an async def stub (runs on the event-loop thread)")
@_project
def add_job(module: str, name: str, cron: str, queue: str, is_async: bool, root: Path) -> None:
    """A job stub on a cron schedule, registered in the module.

    \b
    Example:
      dramatiq-gp add job billing nightly_report --cron "0 3 * * *"
      dramatiq-gp add job billing sync_invoices --cron "@every 10m" --async
    """
    from . import generate

    _apply(lambda: generate.add_job(root, module, name, cron=cron, queue=queue, is_async=is_async))


# -- dashboard ---------------------------------------------------------------------


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="address to listen on")
@click.option("--port", default=8642, show_default=True, type=click.IntRange(0, 65535), help="port to listen on")
@click.option("--read-only", is_flag=True, help="show everything, do nothing: every action is hidden and refused")
@click.option(
    "--store-entries",
    is_flag=True,
    help="also let it store and remove schedule entries (a privilege: an entry makes the workers run a "
    "schedulable actor or event, with the arguments given, at every tick)",
)
def dashboard(host: str, port: int, read_only: bool, store_entries: bool) -> None:
    """Serve the web dashboard: queues, workers, the scheduler, the outbox, dead letters, recent failures.

    Off loopback it refuses to start without DASHBOARD_USER and DASHBOARD_PASSWORD,
    or DASHBOARD_TOKEN, or with a weak one (a password under 12 characters, a
    placeholder such as CHANGE-ME). Needs the dashboard extra
    (pip install 'dramatiq-gp[dashboard]').

    \b
    Example:
      dramatiq-gp dashboard --port 8642 --read-only
    """
    try:
        from .dashboard import create_app, loopback
        from .dashboard.server import serve
    except ImportError as exc:
        raise click.ClickException(
            f"the dashboard needs the dashboard extra: pip install 'dramatiq-gp[dashboard]' ({exc})"
        ) from None
    if read_only and store_entries:
        _fail("give --read-only or --store-entries, not both")
    settings = _settings()
    if not loopback(host) and not settings.dashboard.credentials:
        _fail(
            f"--host {host} is not loopback: set DASHBOARD_USER and DASHBOARD_PASSWORD, or DASHBOARD_TOKEN, "
            "so that not everyone who can reach it can act on your queues"
        )
    weak = None if loopback(host) else settings.dashboard.weak()
    if weak:
        _fail(
            f"--host {host} is not loopback and {weak}: use a random one, "
            "e.g. python -c 'import secrets; print(secrets.token_urlsafe(24))'"
        )
    client = _redis(settings)
    hosts = settings.dashboard.hosts()
    if hosts is None and loopback(host):
        # Without credentials by default: a page rebinding its own name to this address must not get in.
        hosts = [host, "localhost", "127.0.0.1", "::1"]
    app = create_app(settings, read_only=read_only, store_entries=store_entries, client=client, allowed_hosts=hosts)
    mode = " (read-only)" if read_only else " (storing schedule entries allowed)" if store_entries else ""
    click.echo(f"dashboard{mode} on http://{host}:{port}/ reading {settings.redis.display()}")
    serve(app, host=host, port=port, trusted_proxies=settings.dashboard.trusted_proxies)


# -- health ------------------------------------------------------------------------


@main.command()
@click.option("--ready", is_flag=True, help="ready, not only alive: booted, dependencies answering, not draining")
@click.option("--json", "as_json", is_flag=True, help="one JSON object: the verdict and every process's report")
@click.option(
    "--group",
    type=click.IntRange(1),
    metavar="PID",
    help="only the worker processes of the dramatiq command of this pid (what its --pid-file holds)",
)
def health(ready: bool, as_json: bool, group: int | None) -> None:
    """Whether the worker processes on this machine (this container) are alive, or ready; exit code 0 or 1.

    For an exec probe: it reads the reports the worker processes of this namespace
    write locally every WORKER_HEALTH_INTERVAL, so it needs no port and no network,
    and answers when Redis/Valkey is down (alive, not ready). It reads those of
    every running dramatiq command of this user and namespace, or of the one --group
    names; finding none, it says where it looked.

    \b
    Example:
      dramatiq-gp health --ready
    """
    from . import groupdir
    from .errors import UnsafeDirectory
    from .health import KIND, read

    namespace = _settings().redis.namespace
    try:
        found = groupdir.groups(KIND, namespace)
    except UnsafeDirectory as exc:
        raise click.ClickException(str(exc)) from None
    directories = [found[group]] if group in found else [] if group else list(found.values())
    where = groupdir.root() / groupdir.name(KIND, namespace, group or "<pid>")
    verdict = read(directories, where=str(where))
    if as_json:
        click.echo(json.dumps(verdict.as_dict()))
    ok = verdict.ready if ready else verdict.alive
    state = "ready" if ready else "alive"
    if not ok:
        _fail(f"not {state}: {'; '.join(verdict.why)}")
    if not as_json:
        click.echo(f"{state}: {len(verdict.reports)} worker process(es)")


# -- status ------------------------------------------------------------------------


@main.command()
@click.option("--json", "as_json", is_flag=True, help="one JSON object")
def status(as_json: bool) -> None:
    """The scheduler leader and entries, the outbox backlog, and per-queue message counts.

    Reads Redis (and PostgreSQL when DB_URL is set) and writes nothing.

    \b
    Example:
      dramatiq-gp status --json
    """
    from .scheduler.status import scheduler_status
    from .status import outbox_status, skipped_status

    settings = _settings()
    client = _redis(settings)
    namespace = settings.redis.namespace
    schedulers = {_scheduler_keys(settings)}
    found = client.scan_iter(keys.ALL_SCHEDULER_ENTRIES, count=1000)
    schedulers |= {keys.SchedulerKeys.from_entries_key(key.decode()) for key in found}
    with _queues(settings, client) as view:
        queues = view.counts(view.names(thorough=True))
    report: dict[str, Any] = {
        "schedulers": [scheduler_status(client, s) for s in sorted(schedulers, key=lambda s: s.namespace)],
        "outbox": None,
        "queues": queues,
        "skipped_task_types": skipped_status(client, namespace),
    }
    if settings.db.configured:
        with _database(settings) as engine:
            report["outbox"] = outbox_status(engine)
    if as_json:
        click.echo(json.dumps(report))
        return
    for scheduler in report["schedulers"]:
        leader = scheduler["leader"]
        who = (
            f"{leader['host']} pid {leader['pid']} epoch {leader['epoch']}, lease until {leader['expires_at']}"
            if leader
            else "none"
        )
        click.echo(f"scheduler {scheduler['namespace']}: leader {who}")
        for entry in scheduler["entries"]:
            line = f"  {entry['name']}  {entry['trigger']} ({entry['zone']})"
            paused = entry["paused"]
            if isinstance(paused, dict):
                paused = f"by {paused['by']} at {paused['at']}"
            paused = f"  paused {paused}" if paused else ""  # a mark when who paused it cannot be read
            last = entry["last_fired"] or "never"
            click.echo(f"{line}  next {entry['next_fire'] or 'none'}  last {last}{paused}")
        stored = scheduler["stored"]
        if stored["count"]:
            soonest = ", ".join(f"{each['name']} at {each['next_fire']}" for each in stored["next"])
            click.echo(f"  {stored['count']} stored entries (`dramatiq-gp schedule list`); next: {soonest}")
    if report["outbox"] is not None:
        box = report["outbox"]
        oldest = f" (oldest {box['oldest_pending_age_s']} s)" if box["oldest_pending_age_s"] is not None else ""
        click.echo(
            f"outbox: {box['pending']} pending{oldest}, {box['scheduled']} scheduled, {box['set_aside']} set aside"
        )
    for queue in report["queues"]:
        if queue.get("unknown"):  # RabbitMQ: its counts cannot be trusted now
            click.echo(f"queue {queue['name']}: counts unknown ({queue['unknown']}), {queue['in_flight']} in flight")
            continue
        if queue["ready"] is None:  # its name is not UTF-8: marked
            click.echo(f"queue {queue['name']}: not counted")
            continue
        if "consumers" in queue:
            click.echo(
                f"queue {queue['name']}: {queue['ready']} ready, {queue['in_flight']} in flight, "
                f"{queue['delayed']} delayed, {queue['dead']} dead, {queue['consumers']} consumers "
                "(RabbitMQ)"
            )
            continue
        click.echo(
            f"queue {queue['name']}: {queue['ready']} ready, {queue['in_flight']} in flight, "
            f"{queue['delayed']} delayed, {queue['dead']} dead"
        )
    for task_type, count in report["skipped_task_types"].items():
        click.echo(f"skipped (no handler, kept as dead letters): {task_type}: {count}")


# -- exporter ----------------------------------------------------------------------


@main.command()
@click.option("--host", default="0.0.0.0", show_default=True, help="address to listen on")
@click.option("--port", default=9191, show_default=True, type=click.IntRange(0, 65535), help="port to listen on")
def exporter(host: str, port: int) -> None:
    """Serve the queues, the outbox, the scheduler and the workers' health to Prometheus, on /metrics.

    Run one for the whole deployment, not one per worker: each queue's messages are
    counted once. Reads Redis (RabbitMQ when BROKER_URL is set, PostgreSQL when DB_URL
    is) afresh at every scrape and writes nothing. A server out of reach is no error:
    dramatiq_gp_exporter_source_up says so, and the rest still serves.

    \b
    Example:
      dramatiq-gp exporter --port 9191
    """
    from .endpoint import Server
    from .exporter import Exporter

    settings = _settings()
    context = click.get_current_context()
    # Not pinged: a Redis/Valkey down at start is a scrape's source_up 0, until it answers.
    client = settings.redis.client(socket_connect_timeout=5, socket_timeout=5)
    context.call_on_close(client.close)
    engine = settings.db.engine() if settings.db.configured else None
    if engine is not None:
        context.call_on_close(engine.dispose)
    metrics = Exporter(settings, client, engine)
    try:
        server = Server("exporter", (host, port), {"/metrics": metrics.scrape})
    except OSError as exc:
        raise click.ClickException(f"cannot serve on {host}:{port}: {exc.strerror or exc}") from None
    reading = [settings.redis.display(), *([settings.rabbitmq.display()] if settings.rabbitmq.url else [])]
    reading += [settings.db.display()] if engine is not None else []
    click.echo(f"exporter on http://{host}:{server.server_address[1]}/metrics reading {', '.join(reading)}")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass  # Ctrl-C: the end of a run by hand, not an error
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
