"""The Sentry middleware's scopes, hook by hook, against sentry-sdk's own.

The middleware forks a message's scopes as ``sentry_sdk.isolation_scope()`` does
(both the current and the isolation scope), through ``Scope.fork``,
``Scope.set_current_scope`` and ``Scope.set_isolation_scope``, without the
generator: these tests pin that the two agree. The end-to-end reports (one event
per final failure, its tags, trace id and breadcrumbs) are in test_telemetry_cli.py.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import sentry_sdk
from dramatiq import Message
from dramatiq.broker import MessageProxy
from dramatiq.brokers.stub import StubBroker
from sentry_sdk import Scope
from sentry_sdk.integrations import logging as sentry_logging

import dramatiq_gp as gp
from dramatiq_gp.middleware.sentry import Sentry
from helpers import SentryRecorder


@pytest.fixture
def recorder() -> Iterator[SentryRecorder]:
    recorder = SentryRecorder()
    sentry_sdk.init(dsn="https://key@o1.ingest.sentry.io/1", transport=recorder)
    try:
        yield recorder
    finally:
        sentry_sdk.flush()
        sentry_sdk.get_global_scope().set_client(None)


def _message(actor_name: str = "charge", retries: int = 0) -> MessageProxy:
    options = {"retries": retries}
    return MessageProxy(Message(queue_name="default", actor_name=actor_name, args=(), kwargs={}, options=options))


def test_a_message_runs_in_forks_of_both_scopes_as_isolation_scope_makes_them_and_the_old_ones_come_back(recorder):
    with sentry_sdk.isolation_scope() as reference:  # what sentry-sdk itself does, for comparison
        forked_by_sentry = (Scope.get_current_scope(), Scope.get_isolation_scope())
        assert forked_by_sentry[1] is reference
    broker, middleware = StubBroker(), Sentry()
    sentry_sdk.add_breadcrumb(message="before any message")
    before = (Scope.get_current_scope(), Scope.get_isolation_scope())
    assert forked_by_sentry[0] is not before[0] and forked_by_sentry[1] is not before[1]

    first = _message()
    middleware.before_process_message(broker, first)
    current, isolation = Scope.get_current_scope(), Scope.get_isolation_scope()
    assert current is not before[0] and isolation is not before[1]
    assert isolation._tags == {"task_type": "charge", "queue": "default", "message_id": first.message_id, "attempt": 1}
    assert list(isolation._breadcrumbs) == []  # nothing from before the message
    # What the task itself puts on either scope stays with it.
    sentry_sdk.set_tag("customer", "ada")
    current.set_tag("step", "card")
    sentry_sdk.add_breadcrumb(message="charging")
    middleware.after_process_message(broker, first, exception=None)
    assert (Scope.get_current_scope(), Scope.get_isolation_scope()) == before
    assert "customer" not in before[1]._tags and "step" not in before[0]._tags

    second = _message(retries=2)
    middleware.before_process_message(broker, second)
    isolation = Scope.get_isolation_scope()
    assert isolation._tags == {"task_type": "charge", "queue": "default", "message_id": second.message_id, "attempt": 3}
    assert "step" not in Scope.get_current_scope()._tags
    assert [c["message"] for c in isolation._breadcrumbs] == []
    sentry_sdk.add_breadcrumb(message="charging again")
    second.fail()
    try:
        raise RuntimeError("the payment SDK is down")
    except RuntimeError as exc:
        middleware.after_process_message(broker, second, exception=exc)
    assert (Scope.get_current_scope(), Scope.get_isolation_scope()) == before

    (event,) = recorder.events
    assert event["tags"]["message_id"] == second.message_id and "customer" not in event["tags"]
    assert [c["message"] for c in event["breadcrumbs"]["values"]] == ["charging again"]
    assert event["contexts"]["dramatiq"]["args"] == "[Filtered]"


def test_without_an_active_client_a_message_gets_no_scope_of_its_own():
    assert not sentry_sdk.get_client().is_active()
    broker, middleware, message = StubBroker(), Sentry(), _message()
    before = (Scope.get_current_scope(), Scope.get_isolation_scope())
    middleware.before_process_message(broker, message)
    assert (Scope.get_current_scope(), Scope.get_isolation_scope()) == before
    assert "task_type" not in Scope.get_isolation_scope()._tags
    middleware.after_process_message(broker, message, exception=RuntimeError("unseen"))
    assert (Scope.get_current_scope(), Scope.get_isolation_scope()) == before


def test_the_task_log_costs_no_client_look_up_for_sentry_logs(clean_env, namespace):
    """sentry-sdk's logging patch looks the client up for each record not on its Sentry Logs ignore list."""

    lists = [sentry_logging._IGNORED_LOGGERS]
    if hasattr(sentry_logging, "ignore_logger_for_sentry_logs"):  # a list of its own since sentry-sdk 2.5x
        lists.append(sentry_logging._IGNORED_LOGGERS_SENTRY_LOGS)
    saved = [set(ignored) for ignored in lists]
    clean_env.setenv("SENTRY_DSN", "https://key@127.0.0.1:9/1")
    telemetry = gp.Telemetry(gp.Settings.from_env(), namespace=namespace)
    try:
        telemetry._start_sentry()
        for ignored in lists:
            assert {"dramatiq_gp.tasks", "dramatiq.worker.WorkerThread"} <= ignored
    finally:
        sentry_sdk.get_global_scope().set_client(None)
        for ignored, was in zip(lists, saved, strict=True):
            ignored.clear()
            ignored.update(was)


@pytest.mark.parametrize("pii", [False, True])
def test_the_kit_starts_sentry_without_a_warning_and_with_the_pii_setting(clean_env, namespace, pii):
    """sentry-sdk 2.75 deprecates ``send_default_pii``: the kit passes it only when on, and without the warning."""
    clean_env.setenv("SENTRY_DSN", "https://key@127.0.0.1:9/1")
    clean_env.setenv("SENTRY_SEND_DEFAULT_PII", "true" if pii else "false")
    telemetry = gp.Telemetry(gp.Settings.from_env(), namespace=namespace)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            telemetry._start_sentry()
        assert sentry_sdk.get_client().is_active()
        assert sentry_sdk.get_client().should_send_default_pii() is pii
        assert sentry_sdk.get_client().options["include_local_variables"] is pii
    finally:
        sentry_sdk.get_global_scope().set_client(None)
