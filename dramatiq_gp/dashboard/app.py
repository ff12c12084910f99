"""The dashboard's pages and actions, as a Starlette application (see :func:`create_app`)."""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlencode

import redis
from dramatiq.common import current_millis
from sqlalchemy import exc as sa_exc
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from .. import actions
from ..brokers.base import KitBroker
from ..brokers.kinds import broker_for, view_for
from ..brokers.view import dead_letters_of, is_queue_name
from ..durations import format_duration
from ..errors import NotAQueue
from ..records import MARK, TooDeep, json_value
from ..scheduler.dynamic import EventByName
from ..scheduler.schedule import ScheduleError
from ..settings import Settings
from .access import (
    CSRF_FIELD,
    AllowedHosts,
    Credentials,
    RequireCredentials,
    SameOrigin,
    SecurityHeaders,
    csrf_ok,
    csrf_token,
    keep_csrf,
    who,
)
from .reader import PAGE, Reader

HERE = Path(__file__).parent
FLASH_COOKIE = "gp_flash"
#: How a flash of an action refused starts: the page shows it as an error.
REFUSED = "refused: "
#: The answer to a change of stored entries where it is not allowed.
STORE_OFF = (
    "storing schedule entries is off on this dashboard: start it with --store-entries (whoever stores an entry "
    "chooses what the workers run)"
)


class Refused(Exception):
    """An action refused in one line (a bad schedule entry): shown on the page it returns to, nothing done."""


def _when(ms: int | None) -> str:
    if ms is None:
        return "never"
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="seconds")


def _iso(text: str) -> str:
    """An ISO time to the second, as the page shows times (the zone's offset kept); other text (a mark, a time
    a worker wrote otherwise) as it is."""
    try:
        return datetime.fromisoformat(text).isoformat(timespec="seconds")
    except ValueError:
        return text


def _age(ms: int | None) -> str:
    if ms is None:
        return ""
    s = max(0, (current_millis() - ms) // 1000)
    if s < 60:
        return f"{s}s"
    if s < 3_600:
        return f"{s // 60}m {s % 60}s"
    if s < 86_400:
        return f"{s // 3_600}h {s % 3_600 // 60}m"
    return f"{s // 86_400}d {s % 86_400 // 3_600}h"


class _Dashboard:
    """The routes, bound to one :class:`Reader`."""

    def __init__(self, reader: Reader, *, read_only: bool, store_entries: bool) -> None:
        self.reader = reader
        self.read_only = read_only
        self.store_entries = store_entries and not read_only
        self.templates = Jinja2Templates(directory=HERE / "templates")
        self.templates.env.filters.update(
            when=_when,
            age=_age,
            iso=_iso,
            tojson_pretty=lambda v: json.dumps(v, indent=2),
            # A field of the catch-up policy that cannot be read is its mark (see status.unreadable): as it is.
            duration=lambda seconds: (
                seconds if isinstance(seconds, str) else format_duration(timedelta(seconds=seconds))
            ),
            thousands=lambda n: "—" if n is None else f"{n:,}",
        )
        # Only a queue name leads to a page of its dead letters (a name with a '/' did not even make a link,
        # and a `.DQ` or `.XQ` one is refused).
        self.templates.env.tests["queue_name"] = is_queue_name
        # What cannot be read shows its mark (see status.unreadable): a dead letter whose Redis id is one is
        # reached by its message id.
        self.templates.env.tests["marked"] = lambda value: isinstance(value, str) and value.startswith(MARK)

    def render(self, request: Request, name: str, **context: Any) -> Response:
        flash = request.cookies.get(FLASH_COOKIE)
        refresh = _whole(request, "refresh", 0, MIN_REFRESH_S, 3600) if "refresh" in request.query_params else None
        response = self.templates.TemplateResponse(
            request,
            name,
            {
                "read_only": self.read_only,
                "store_entries": self.store_entries,
                "csrf": csrf_token(request),
                "flash": unquote(flash or ""),
                "refused": REFUSED,
                "counts_consumers": self.reader.queue_view.counts_consumers,
                "refresh": refresh,
                **context,
            },
        )
        if flash:
            response.delete_cookie(FLASH_COOKIE, path=request.scope.get("root_path") or "/")
        return keep_csrf(request, response)

    # -- pages ---------------------------------------------------------------------

    def overview(self, request: Request) -> Response:
        now = current_millis()
        return self.render(request, "overview.html", page="overview", now_ms=now, **self.reader.overview(now))

    def scheduler(self, request: Request) -> Response:
        return self.render(request, "scheduler.html", page="scheduler", scheduler=self.reader.scheduler())

    def stored(self, request: Request) -> Response:
        prefix, after = _name_part(request.query_params, "prefix") or "", _name_part(request.query_params, "after")
        return self.render(
            request,
            "stored.html",
            page="scheduler",
            prefix=prefix,
            after=after,
            zone=self.reader.settings.scheduler.timezone,
            pii=self.reader.pii,
            targets=self.reader.targets() if self.store_entries else [],
            **self.reader.stored(prefix, after),
        )

    def outbox(self, request: Request) -> Response:
        return self.render(request, "outbox.html", page="outbox", outbox=self.reader.outbox())

    def dead_letter_queues(self, request: Request) -> Response:
        queues = self.reader.queues()
        return self.render(request, "dead_letter_queues.html", page="dead_letters", queues=queues)

    def dead_letters(self, request: Request) -> Response:
        queue = _queue(request)
        offset = _whole(request, "offset", 0, 0, MAX_OFFSET)
        total, letters = self.reader.dead_letters(queue, offset)
        return self.render(
            request,
            "dead_letters.html",
            page="dead_letters",
            queue=queue,
            total=total,
            letters=letters,
            offset=offset,
            size=PAGE,
            pii=self.reader.pii,
        )

    def dead_letter(self, request: Request) -> Response:
        queue, id = _queue(request), request.path_params["id"]
        letter = self.reader.dead_letter(queue, id)
        if letter is None:
            return PlainTextResponse(f"no dead letter {id} in queue {queue}", 404)
        return self.render(
            request, "dead_letter.html", page="dead_letters", queue=queue, letter=letter, pii=self.reader.pii
        )

    def failures(self, request: Request) -> Response:
        return self.render(request, "failures.html", page="failures", failures=self.reader.failures())

    # -- actions -------------------------------------------------------------------

    async def act(
        self,
        request: Request,
        *,
        title: str,
        consequence: str,
        perform: Callable[[FormData, str], str],
        back: str,
        details: Sequence[tuple[str, str]] = (),
        stores: bool = False,
    ) -> Response:
        """An action: refused when read-only or without the page's CSRF token, confirmed, done, logged.

        ``stores``: it changes stored schedule entries, which is a privilege of its own (``--store-entries``).
        ``details``: what the confirmation page shows in full, beside the consequence.
        """
        if self.read_only:
            return PlainTextResponse("this dashboard is read-only (--read-only)", 403)
        if stores and not self.store_entries:
            return PlainTextResponse(STORE_OFF, 403)
        form = await request.form()
        if not csrf_ok(request, form.get(CSRF_FIELD)):
            return PlainTextResponse("CSRF check failed: reload the page and try again", 403)
        if form.get("confirmed") != "yes":
            fields = [(k, v) for k, v in form.multi_items() if k not in (CSRF_FIELD, "confirmed")]
            return self.render(
                request,
                "confirm.html",
                page=None,
                title=title,
                consequence=consequence,
                details=details,
                fields=fields,
                action=request.url.path,
                back=back,
            )
        try:
            outcome = await run_in_threadpool(perform, form, who(request))
        except Refused as exc:
            outcome = REFUSED + str(exc)
        response = RedirectResponse(back, 303)
        response.set_cookie(
            FLASH_COOKIE, quote(outcome), path=request.scope.get("root_path") or "/", httponly=True, samesite="strict"
        )
        return response

    async def requeue(self, request: Request) -> Response:
        queue = _queue(request)
        form = await request.form()
        ids = None if form.get("all") == "yes" else [str(i) for i in form.getlist("id")]
        if ids == []:
            return PlainTextResponse("give the dead letters to requeue (id), or all=yes", 400)
        what = f"all {queue}'s dead letters" if ids is None else f"{len(ids)} dead letter(s) of queue {queue}"

        def perform(form: FormData, by: str) -> str:
            moved = actions.requeue_dead_letters(self.reader.queue_view, queue, ids, who=by)
            return f"{moved} dead letter(s) of queue {queue} requeued"

        return await self.act(
            request,
            title=f"Requeue {what}?",
            perform=perform,
            back=request.url_for("dead_letters", queue=queue).path,
            consequence="Each goes back to the end of its queue with its message id, so a copy that already "
            "completed is still skipped. It keeps its retry count.",
        )

    async def purge(self, request: Request) -> Response:
        queue = _queue(request)

        def perform(form: FormData, by: str) -> str:
            purged = actions.purge_dead_letters(self.reader.queue_view, queue, who=by)
            return f"{purged} dead letter(s) of queue {queue} deleted"

        return await self.act(
            request,
            title=f"Purge every dead letter of queue {queue}?",
            perform=perform,
            consequence="They are deleted for good.",
            back=request.url_for("dead_letters", queue=queue).path,
        )

    async def replay(self, request: Request) -> Response:
        event_id = request.path_params["event_id"]
        try:
            uuid.UUID(event_id)
        except ValueError:
            return PlainTextResponse(f"{event_id!r} is not an event id", 400)
        if self.reader.engine is None:
            return PlainTextResponse("no database configured: set DB_URL", 400)

        def perform(form: FormData, by: str) -> str:
            if not actions.replay_event(self.reader.engine, event_id, who=by):
                return f"no set-aside event {event_id}"
            return f"event {event_id} pending again"

        return await self.act(
            request,
            title=f"Replay event {event_id}?",
            perform=perform,
            back=request.url_for("outbox").path,
            consequence="It becomes pending again and the relays send it, with its attempts reset.",
        )

    async def pause(self, request: Request) -> Response:
        return await self._entry(
            request,
            pause=True,
            consequence="The leader passes over its ticks from the next one until it is "
            "resumed; the ticks of the pause are not caught up.",
        )

    async def resume(self, request: Request) -> Response:
        return await self._entry(request, pause=False, consequence="It fires again from its next tick.")

    async def run(self, request: Request) -> Response:
        entry = request.path_params["entry"]

        def perform(form: FormData, by: str) -> str:
            with self._sending_broker() as broker:
                try:
                    run = actions.run_entry(broker, self.reader.scheduler_keys, entry, who=by)
                except ScheduleError as exc:
                    raise Refused(str(exc)) from None
            if run is None:
                return f"no schedule entry {entry}"
            paused = " (it is paused: run all the same)" if run.paused else ""
            return f"entry {entry} run now: message {run.message_id}{paused}"

        return await self.act(
            request,
            title=f"Run {entry} now?",
            perform=perform,
            back=await self._back(request),
            consequence="One run is enqueued at once, with an id of its own and now as its scheduled time; the "
            "entry's ticks go on as scheduled. A paused entry runs all the same.",
        )

    @contextlib.contextmanager
    def _sending_broker(self) -> Iterator[KitBroker]:
        """A broker that only sends, to where the workers' queues are, on the dashboard's connection pool: closing
        it (RabbitMQ's closes its Redis client) leaves the pool to the dashboard."""
        client = redis.Redis(connection_pool=self.reader.client.connection_pool)
        broker = broker_for(self.reader.settings, client, middleware=[])
        try:
            yield broker
        finally:
            broker.close()

    async def _entry(self, request: Request, *, pause: bool, consequence: str) -> Response:
        entry = request.path_params["entry"]
        back = await self._back(request)
        act, verb = (actions.pause_entry, "paused") if pause else (actions.resume_entry, "resumed")

        def perform(form: FormData, by: str) -> str:
            if not act(self.reader.client, self.reader.scheduler_keys, entry, who=by):
                return f"no schedule entry {entry}" if pause else f"entry {entry} was not paused"
            return f"entry {entry} {verb}"

        title = f"{'Pause' if pause else 'Resume'} {entry}?"
        return await self.act(request, title=title, perform=perform, back=back, consequence=consequence)

    async def _back(self, request: Request, *, stored: bool = False) -> str:
        """Where a schedule action returns: the page of stored entries (its search and page kept) when it came
        from there or acts on stored entries only, else the scheduler page."""
        form = await request.form()
        if not stored and form.get("back") != "stored":
            return request.url_for("scheduler").path
        query = {k: v for k in ("prefix", "after") if (v := _name_part(form, k))}
        return request.url_for("stored").path + (f"?{urlencode(query)}" if query else "")

    async def add_stored(self, request: Request) -> Response:
        form = await request.form()
        name, spec, zone = (str(form.get(k) or "").strip() for k in ("name", "spec", "zone"))
        event, actor, queue = (str(form.get(k) or "").strip() for k in ("event", "actor", "queue"))
        replace = form.get("replace") == "yes"
        fires = f"{spec} ({zone or self.reader.settings.scheduler.timezone})"
        what = f"event {event} with the data below" if event else f"actor {actor} with the arguments below"
        details = [("trigger", fires)]
        if event:
            details.append(("event", event))
            details.append(("data", str(form.get("data") or "{}")))
        else:
            details.append(("actor", actor + (f" on queue {queue}" if queue else " on its queue")))
            details += [(k, str(form.get(k) or ("[]" if k == "args" else "{}"))) for k in ("args", "kwargs")]

        def perform(form: FormData, by: str) -> str:
            if bool(event) == bool(actor):
                raise Refused("give an event's wire name or an actor's name, not both")
            options: dict[str, Any] = {"tz": zone or None, "replace": replace}
            if event:
                target: Any = EventByName(event, _json_field(form, "data", object))
            else:
                target = actor
                options.update(
                    args=_json_field(form, "args", list), kwargs=_json_field(form, "kwargs", dict), queue=queue or None
                )
            try:
                entry = actions.add_entry(self.reader.schedules, name, spec, target, who=by, **options)
            except ScheduleError as exc:
                raise Refused(str(exc)) from None
            return f"entry {name} stored: next fire {entry.next_fire.isoformat() if entry.next_fire else 'never'}"

        consequence = f"It fires at {fires}: {what}, from its next tick."
        if replace:
            consequence += " An entry of that name is replaced: its ticks start again from the new trigger's next one."
        return await self.act(
            request,
            title=f"Store schedule entry {name}?",
            perform=perform,
            back=await self._back(request, stored=True),
            consequence=consequence,
            details=details,
            stores=True,
        )

    async def remove_stored(self, request: Request) -> Response:
        entry = request.path_params["entry"]

        def perform(form: FormData, by: str) -> str:
            if not actions.remove_entry(self.reader.schedules, entry, who=by):
                return f"no stored schedule entry {entry}"
            return f"entry {entry} removed"

        return await self.act(
            request,
            title=f"Remove stored entry {entry}?",
            perform=perform,
            back=await self._back(request, stored=True),
            consequence="Its ticks stop at once; its last fire and its pause are forgotten. Add it again to undo.",
            stores=True,
        )


#: The shortest ``?refresh=`` period: ``0`` reloaded the page without end.
MIN_REFRESH_S = 2
#: The largest ``?offset=`` into a list: beyond a signed 64-bit integer, Redis refuses the range.
MAX_OFFSET = 2**62


def _whole(request: Request, name: str, default: int, low: int, high: int) -> int:
    """The query parameter ``name`` as a whole number from ``low`` to ``high``; 400 in one line otherwise."""
    text = request.query_params.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if not low <= value <= high:
        raise HTTPException(400, f"{name}={text[:40]!r}: expected a whole number from {low:,} to {high:,}")
    return value


#: What may stand in a search for stored entries' names (``prefix``) or a page's cursor (``after``).
NAME_PART = re.compile(r"[A-Za-z0-9_.\-]{0,200}")


def _name_part(params: Any, name: str) -> str | None:
    """The query or form parameter ``name``, a schedule entry's name or the start of one; 400 in one line
    for anything else."""
    value = params.get(name)
    if value is None or value == "":
        return None
    if not isinstance(value, str) or not NAME_PART.fullmatch(value):
        shown = repr(value[:40]) if isinstance(value, str) else "a file"
        raise HTTPException(400, f"{name}={shown}: a schedule entry's name is letters, digits, '_', '.', '-'")
    return value


def _json_field(form: FormData, name: str, kind: type) -> Any:
    """The form field ``name`` as JSON of ``kind``; :class:`Refused` in one line naming it otherwise."""
    raw = str(form.get(name) or ("[]" if kind is list else "{}"))
    try:
        value = json_value(raw)
    except TooDeep as exc:
        raise Refused(f"{name}: {exc}") from None
    except ValueError as exc:
        raise Refused(f"{name}: not JSON ({exc})") from None
    if kind is not object and not isinstance(value, kind):
        raise Refused(f"{name}: expected a JSON {'list' if kind is list else 'object'}")
    return value


def _queue(request: Request) -> str:
    """The queue named in the path; 400 in one line for anything that is not a queue whose dead letters can be
    asked for (a newline, say, or a queue's ``.XQ``)."""
    try:
        return dead_letters_of(request.path_params["queue"])
    except NotAQueue as exc:
        raise HTTPException(400, str(exc)) from None


def create_app(
    settings: Settings | None = None,
    *,
    read_only: bool = False,
    store_entries: bool = False,
    credentials: Credentials | None = None,
    client: redis.Redis | None = None,
    engine: Any = None,
    allowed_hosts: Sequence[str] | None = None,
) -> Starlette:
    """The dashboard as an ASGI application, to serve (``dramatiq-gp dashboard``) or mount in your own.

    Parameters:
        settings: where to read from; default :meth:`Settings.from_env`.
        read_only: hide every action, and refuse them.
        store_entries: allow storing and removing schedule entries (off by default: an entry makes the
            workers run a schedulable actor or event with the arguments given, at every tick). Refused
            when ``read_only``.
        credentials: what every request must carry; default ``DASHBOARD_*``.
            Mounted in an application that authenticates by itself, pass
            ``Credentials()`` and that application's user is the one logged.
        client: the Redis/Valkey client; default one from ``REDIS_URL``/``VALKEY_*``.
        engine: the outbox's SQLAlchemy engine; default one from ``DB_*`` when set.
            Those built here are closed when the application's lifespan ends (a
            mounted application's lifespan does not run: pass your own to close them).
        allowed_hosts: the ``Host`` names it answers (400 for others); default
            ``DASHBOARD_ALLOWED_HOSTS``, and when that is unset, any (mounted, the
            application decides; ``dramatiq-gp dashboard`` passes its address and localhost).
    """
    settings = settings if settings is not None else Settings.from_env()
    if credentials is None:
        dash = settings.dashboard
        credentials = Credentials(
            dash.user,
            dash.password.get_secret_value() if dash.password is not None else None,
            dash.token.get_secret_value() if dash.token is not None else None,
        )
    owned: list[Callable[[], object]] = []  # closed when the application stops (its lifespan)
    if client is None:
        client = settings.redis.client(socket_connect_timeout=5)
        owned.append(client.close)
    if engine is None and settings.db.configured:
        engine = settings.db.engine()
        owned.append(engine.dispose)
    view = view_for(settings, client)
    dashboard = _Dashboard(Reader(settings, client, engine, view), read_only=read_only, store_entries=store_entries)
    display, db_display = settings.redis.display(), settings.db.display() if settings.db.configured else ""

    def unreachable(request: Request, exc: Exception) -> Response:
        if isinstance(exc, redis.RedisError):
            return PlainTextResponse(f"Redis/Valkey unreachable at {display}: {exc}", 503)
        if isinstance(exc, sa_exc.SQLAlchemyError):
            reason = str(getattr(exc, "orig", None) or exc).splitlines()[0]
            return PlainTextResponse(f"database error at {db_display}: {reason}", 503)
        return PlainTextResponse(f"{view.server} unreachable at {view.where()}: {exc!r}", 503)

    errors: dict[Any, Any] = {}
    for error in (*view.unreachable, redis.RedisError, sa_exc.SQLAlchemyError):
        errors[error] = unreachable

    d = dashboard
    routes = [
        Route("/", d.overview, name="overview"),
        Route("/scheduler", d.scheduler, name="scheduler"),
        Route("/scheduler/stored", d.stored, name="stored"),
        Route("/scheduler/stored/add", d.add_stored, methods=["POST"], name="add_stored"),
        Route("/scheduler/stored/{entry}/remove", d.remove_stored, methods=["POST"], name="remove_stored"),
        Route("/scheduler/{entry}/pause", d.pause, methods=["POST"], name="pause"),
        Route("/scheduler/{entry}/resume", d.resume, methods=["POST"], name="resume"),
        Route("/scheduler/{entry}/run", d.run, methods=["POST"], name="run"),
        Route("/outbox", d.outbox, name="outbox"),
        Route("/outbox/{event_id}/replay", d.replay, methods=["POST"], name="replay"),
        Route("/dead-letters", d.dead_letter_queues, name="dead_letter_queues"),
        Route("/dead-letters/{queue}", d.dead_letters, name="dead_letters"),
        Route("/dead-letters/{queue}/requeue", d.requeue, methods=["POST"], name="requeue"),
        Route("/dead-letters/{queue}/purge", d.purge, methods=["POST"], name="purge"),
        Route("/dead-letters/{queue}/{id:path}", d.dead_letter, name="dead_letter"),  # a Redis id may hold a '/'
        Route("/failures", d.failures, name="failures"),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        for close in owned:
            close()

    if allowed_hosts is None:
        allowed_hosts = settings.dashboard.hosts()
    middleware = [
        Middleware(SecurityHeaders),
        Middleware(SameOrigin),
        Middleware(RequireCredentials, credentials=credentials),
    ]
    if allowed_hosts is not None:
        middleware.insert(1, Middleware(AllowedHosts, hosts=allowed_hosts))
    return Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers=errors,
        lifespan=lifespan,
    )
