"""Exactly-once effects: a handler's database work commits together with its message id (the inbox).

Delivery is at least once. A worker killed after a handler's transaction
committed, but before its ack reached Redis, leaves the message unacknowledged,
and another worker runs it again; Redis cannot know the effect happened. The
inbox can: the message id is inserted in the same transaction as the effect, so
the two commit or roll back together, and a later copy finds the id and is
skipped (see :mod:`dramatiq_gp.outbox.inbox` for the transaction itself).

This module is the part the listeners, the jobs and :func:`inbox` share without
importing SQLAlchemy: the one wrapper their actors run a handler in
(:func:`run_handler`, :func:`run_handler_async`), which message the calling thread
is running, and the skip a duplicate raises.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from contextvars import ContextVar
from datetime import datetime
from typing import TYPE_CHECKING, Any, NamedTuple, overload

from dramatiq.middleware import CurrentMessage

from .errors import AlreadyApplied
from .names import fan_out_id, job_name, tick_message_id

if TYPE_CHECKING:
    import sqlalchemy as sa
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession, async_sessionmaker
    from sqlalchemy.orm import Session, sessionmaker


class Running(NamedTuple):
    """The message a listener's or job's actor runs, as what it carries: its ids are computed from it."""

    #: The actor: ``listener:<event>:<name>`` or ``job:<name>``.
    task_type: str
    #: A listener's: the envelope it handles.
    envelope_id: str | None = None
    #: A job's: the tick it fires for (ISO 8601).
    scheduled_at: str | None = None
    #: A job's run asked for by hand: its own message id (its ``scheduled_at`` is no tick).
    message_id: str | None = None


#: The message the current thread runs, set by listeners and jobs around their handler.
_running: ContextVar[Running | None] = ContextVar("dramatiq_gp_running", default=None)


def run_handler(running: Running, bind: Any, handler: Callable[..., object], *args: Any) -> None:
    """Call ``handler(*args)`` as the message ``running``: how a listener's or job's actor runs its handler.

    The thread is marked as running that message meanwhile, so :func:`inbox` inside the
    handler finds it. With ``bind`` (the ``inbox=`` an Engine or sessionmaker) the
    handler runs in the message's inbox transaction, given as its last argument. A copy
    whose effect committed already raises :class:`AlreadyApplied` on entering (logged
    there): it ends here, and the message is done.
    """
    token = _running.set(running)
    try:
        if bind is None:
            handler(*args)
        else:
            from .outbox.inbox import transaction

            with transaction(bind, *_message_of(running)) as tx:
                handler(*args, tx)
    except AlreadyApplied:
        pass
    finally:
        _running.reset(token)  # the worker thread's next message may be a plain actor's


async def run_handler_async(running: Running, bind: Any, handler: Callable[..., Any], *args: Any) -> None:
    """:func:`run_handler` for an ``async def`` handler, awaited (``bind``: an AsyncEngine or async_sessionmaker).

    The mark is not reset afterwards: Dramatiq runs the actor's coroutine as a task of its
    own on its event-loop thread, in a copy of the worker thread's context
    (:mod:`dramatiq_gp.aio`), so what it sets goes with the task and the worker thread's
    context never sees it.
    """
    _running.set(running)
    try:
        if bind is None:
            await handler(*args)
        else:
            from .outbox.inbox import transaction_async

            async with transaction_async(bind, *_message_of(running)) as tx:
                await handler(*args, tx)
    except AlreadyApplied:
        pass


def _message_of(running: Running) -> tuple[str, str, str | None]:
    """The message id, task type and envelope id (``None`` for a job) of ``running``, recomputed the
    way they were made (:func:`~dramatiq_gp.fan_out_id`, the tick's id); a job's run asked for by hand
    carries its own."""
    task_type, envelope_id, scheduled_at, message_id = running
    if envelope_id is not None:
        return fan_out_id(envelope_id, task_type), task_type, envelope_id
    if message_id is not None:
        return message_id, task_type, None
    assert scheduled_at is not None
    entry = job_name(task_type) or task_type
    return tick_message_id(entry, datetime.fromisoformat(scheduled_at)), task_type, None


def current_message() -> tuple[str, str, str | None]:
    """The running message's id, task type and envelope id (``None`` for a job).

    The ids are recomputed from what the message carries, the way they were made
    (:func:`~dramatiq_gp.fan_out_id`, the tick's id), so nothing is looked up.
    In a plain Dramatiq actor, Dramatiq's ``CurrentMessage`` middleware gives them.

    Raises:
        RuntimeError: called outside a listener, a job, or an actor under ``CurrentMessage``.
    """
    running = _running.get()
    if running is not None:
        return _message_of(running)
    message = CurrentMessage.get_current_message()
    if message is not None:
        return message.message_id, message.actor_name, None
    raise RuntimeError(
        "gp.inbox() needs the message it runs for: call it inside a listener or a job, "
        "or add Dramatiq's CurrentMessage middleware for a plain actor"
    )


@overload
def inbox(bind: sa.Engine) -> AbstractContextManager[sa.Connection]: ...


@overload
def inbox(bind: sessionmaker[Session]) -> AbstractContextManager[Session]: ...


@overload
def inbox(bind: AsyncEngine) -> AbstractAsyncContextManager[AsyncConnection]: ...


@overload
def inbox(bind: async_sessionmaker[AsyncSession]) -> AbstractAsyncContextManager[AsyncSession]: ...


def inbox(bind: Any) -> AbstractContextManager[Any] | AbstractAsyncContextManager[Any]:
    """The running message's inbox transaction: ``with gp.inbox(engine) as conn:``.

    Begins a transaction on ``bind`` (an ``Engine`` gives a ``Connection``, a
    ``sessionmaker`` a ``Session``) and inserts the running message's id into the
    inbox. If the id is there already, the message's effect committed before: one
    ``task skipped`` line is logged and :class:`AlreadyApplied` is raised, so the
    body does not run (the kit's listeners and jobs then end the message as done).
    Otherwise the body runs in that transaction and the id commits with it; an
    exception rolls both back, and the retry runs the body again.

    In an ``async def`` listener or job, give an ``AsyncEngine`` (an ``AsyncConnection``)
    or ``async_sessionmaker`` (an ``AsyncSession``) and use ``async with gp.inbox(...)``.

    One inbox transaction per message: a second one for the same message is
    taken for a duplicate.

    Raises:
        RuntimeError: not inside a listener or a job (see :func:`current_message`).
        RegistrationError: ``bind`` is not an Engine or sessionmaker on PostgreSQL or SQLite.
        AlreadyApplied: on entering, for a message whose effect committed already.
    """
    from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker

    from .outbox.inbox import check_bind, transaction, transaction_async

    is_async = isinstance(bind, AsyncEngine | async_sessionmaker)
    check_bind(bind, "gp.inbox()", is_async=is_async)
    message_id, task_type, envelope_id = current_message()
    if is_async:
        return transaction_async(bind, message_id, task_type, envelope_id)
    return transaction(bind, message_id, task_type, envelope_id)
