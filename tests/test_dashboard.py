"""The dashboard over real HTTP (uvicorn) against real Redis: what it shows, what it lets through, and its cost.

The browser half, against the shop's worker, is in ``test_dashboard_browser.py``.
"""

from __future__ import annotations

import base64
import contextlib
import html
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import dramatiq
import pytest
from click.testing import CliRunner
from starlette.applications import Starlette
from starlette.authentication import AuthCredentials, AuthenticationBackend, SimpleUser
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.routing import Mount

import dramatiq_gp as gp
from apps.app_events import Numbered
from devtools.asgi import serving
from dramatiq_gp import keys
from dramatiq_gp.brokers.kinds import view_for
from dramatiq_gp.brokers.redis_view import RedisQueueView
from dramatiq_gp.brokers.view import QueueView
from dramatiq_gp.cli import main as cli_main
from dramatiq_gp.dashboard import Credentials, create_app
from dramatiq_gp.scheduler.dynamic import EventByName
from dramatiq_gp.settings import weak_secret
from helpers import (
    BAD_DEAD_LETTERS,
    BAD_SCHEDULER,
    Browser,
    bury,
    publish_schedulable,
    publish_schedule,
    spoil_schedule,
    stored_dead_letter,
    wait_for,
)


def _queues(kit: gp.Kit) -> QueueView:
    """The view of the kit's queues the dashboard reads, wherever they are."""
    return view_for(kit.settings, kit.broker.client)


def _failing_kit(make_kit: Any, namespace: str, env: dict[str, str] | None = None) -> tuple[gp.Kit, threading.Event]:
    """A Kit with ``work`` (on default) and ``mail`` (on mail), and ``charge``, which fails while ``fail`` is set."""
    fail = threading.Event()
    fail.set()
    kit = make_kit(env={"VALKEY_NAMESPACE": namespace, "WORKER_QUEUES": "default:3,mail:1", **(env or {})})

    @dramatiq.actor(broker=kit.broker, actor_name="work")
    def work() -> None:
        pass

    @dramatiq.actor(broker=kit.broker, actor_name="mail", queue_name="mail")
    def mail() -> None:
        pass

    @dramatiq.actor(broker=kit.broker, actor_name="charge", max_retries=0)
    def charge(customer: str) -> None:
        if fail.is_set():
            raise RuntimeError("the card was declined")

    return kit, fail


def _commandstats(client: Any) -> dict[str, int]:
    stats = client.info("commandstats")
    return {name: int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in ("scan", "keys")}


def test_the_overview_shows_the_queues_workers_throughput_and_failures_without_scanning(
    make_kit, start_worker, namespace, rdb
):
    # A long settle window: each settle call carries both queues' acks with their idempotency keys between them.
    kit, _ = _failing_kit(make_kit, namespace, env={"WORKER_SETTLE_WINDOW": "200ms"})
    work, mail, charge = (kit.broker.get_actor(name) for name in ("work", "mail", "charge"))
    for _ in range(20):
        work.send()
    for _ in range(5):
        mail.send()
    declined = charge.send("ada@example.com")
    start_worker(kit)
    wait_for(lambda: RedisQueueView(kit.broker.client, namespace).dead_count("default") == 1)
    kit.broker.join("default")
    kit.broker.join("mail")
    kit.broker.flush_settles()
    wait_for(lambda: rdb.hexists(keys.health(namespace), kit.broker.broker_id))  # its first health check

    with serving(create_app()) as base:
        before = _commandstats(rdb)
        page = Browser(base).open("/")
        assert _commandstats(rdb) == before  # no SCAN or KEYS on the request path
        failures = Browser(base).open("/failures").body
    assert page.status == 200
    row = re.search(r'<tr data-queue="default">(.*?)</tr>', page.body, re.S)
    assert row, page.body
    cells = re.findall(r'<td class="n[^"]*">(.*?)</td>', row.group(1), re.S)
    # ready, in flight, delayed, dead (a link to its dead letters), weight, done per minute
    assert cells[:3] == ["0", "0", "0"] and ">1</a>" in cells[3] and cells[4].startswith("3"), cells
    assert 'data-queue="mail"' in page.body
    assert f'<td class="n">{os.getpid()}</td>' in page.body  # this process, from its heartbeat
    assert '<td class="health">ready</td>' in page.body
    assert "default:3, mail:1" in page.body

    throughput = gp.dashboard.reader.Reader(gp.Settings.from_env(), kit.broker.client).throughput(
        dramatiq.common.current_millis()
    )
    assert throughput["per_queue"]["default"] == {"done": 20, "retried": 0, "dead": 1}
    assert throughput["per_queue"]["mail"]["done"] == 5

    assert "RuntimeError: the card was declined" in failures
    assert declined.message_id in failures
    assert "ada@example.com" not in failures  # the arguments are never kept


def test_a_starting_consumer_drops_the_records_and_health_of_workers_gone_for_an_hour(
    make_kit, start_worker, namespace, rdb
):
    now = dramatiq.common.current_millis()
    workers = keys.workers(namespace)
    rdb.hset(workers, "gone", json.dumps({"host": "old", "pid": 1, "started_ms": now - 7_200_000}))
    rdb.hset(workers, "starting", json.dumps({"host": "new", "pid": 2, "started_ms": now - 1_000}))
    rdb.hset(workers, "alive", json.dumps({"host": "up", "pid": 3, "started_ms": now - 7_200_000}))
    rdb.zadd(keys.heartbeats(namespace), {"alive": now})
    for worker in ("gone", "starting", "alive"):
        rdb.hset(keys.health(namespace), worker, json.dumps({"alive": True, "ready": True}))
    kit = make_kit(env={"VALKEY_NAMESPACE": namespace})
    dramatiq.actor(lambda: None, broker=kit.broker, actor_name="noop")
    start_worker(kit)
    wait_for(lambda: rdb.hexists(workers, kit.broker.broker_id))
    assert sorted(rdb.hkeys(workers)) == sorted(["starting", "alive", kit.broker.broker_id])
    assert set(rdb.hkeys(keys.health(namespace))) - {kit.broker.broker_id} == {"alive", "starting"}
    assert rdb.smembers(keys.declared_queues(namespace)) == {"default"}


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"], indirect=True)
def test_an_action_needs_the_pages_csrf_token_and_a_confirmation_and_is_logged_with_who(
    broker, make_kit, start_worker, namespace, caplog
):
    kit, fail = _failing_kit(make_kit, namespace)
    ran: list[str] = []
    kit.broker.add_middleware(_Ran(ran))
    declined = kit.broker.get_actor("charge").send("c1")
    start_worker(kit)
    wait_for(lambda: _queues(kit).dead_count("default") == 1)
    fail.clear()  # the card works now
    (letter,) = _queues(kit).dead_letters("default")

    with serving(create_app()) as base:
        browser = Browser(base)
        token = browser.csrf("/dead-letters/default")
        assert browser.open("/dead-letters/default/requeue", {"id": letter.id}).status == 403
        assert browser.open("/dead-letters/default/requeue", {"id": letter.id, "csrf": "forged"}).status == 403
        other = Browser(base)  # another site's page: it has no cookie of ours
        assert other.open("/dead-letters/default/requeue", {"id": letter.id, "csrf": token}).status == 403

        confirm = browser.open("/dead-letters/default/requeue", {"id": letter.id, "csrf": token})
        assert confirm.status == 200 and "Requeue 1 dead letter(s) of queue default?" in confirm.body
        assert _queues(kit).dead_count("default") == 1  # nothing done yet

        with caplog.at_level(logging.INFO, logger="dramatiq_gp.actions"):
            done = browser.open("/dead-letters/default/requeue", {"id": letter.id, "csrf": token, "confirmed": "yes"})
        assert done.status == 200 and done.url.endswith("/dead-letters/default")
        assert "1 dead letter(s) of queue default requeued" in done.body
        wait_for(lambda: ran == [declined.message_id])  # it ran again, under its message id
    assert [r.getMessage() for r in caplog.records if r.name == "dramatiq_gp.actions"] == [
        "dlq requeue by anonymous (dashboard, 127.0.0.1): 1 dead letter(s) of queue default requeued"
    ]


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"], indirect=True)
def test_a_dead_letter_page_or_action_on_a_queues_dq_or_xq_is_a_400_in_one_line_and_changes_nothing(
    broker, make_kit, start_worker, namespace, caplog
):
    # On Redis each requeue of default.XQ lost a dead letter (5, then 2 after 3 tries) and answered
    # "503 unreachable"; on RabbitMQ it said "3 requeued" and moved none.
    kit, _ = _failing_kit(make_kit, namespace)
    for n in range(5):
        kit.broker.get_actor("charge").send(f"c{n}")
    start_worker(kit)
    wait_for(lambda: _queues(kit).dead_count("default") == 5)
    before = sorted(d.message_id or "" for d in _queues(kit).dead_letters("default"))

    with serving(create_app()) as base:
        browser = Browser(base)
        token = browser.csrf("/dead-letters/default")
        with caplog.at_level(logging.INFO, logger="dramatiq_gp.actions"):
            for queue, kind in (("default.XQ", "dead-letter"), ("default.DQ", "delay")):
                act = {"csrf": token, "confirmed": "yes"}
                for path, form in [
                    *[(f"/dead-letters/{queue}/requeue", {**act, "all": "yes"})] * 3,
                    (f"/dead-letters/{queue}/requeue", {**act, "id": before[0]}),
                    (f"/dead-letters/{queue}", None),
                    (f"/dead-letters/{queue}/{before[0]}", None),
                    (f"/dead-letters/{queue}/purge", act),
                ]:
                    refused = browser.open(path, form)
                    assert (refused.status, refused.body) == (
                        400,
                        f"{queue!r} is the {kind} queue of queue 'default': dead letters are kept under their "
                        "queue's own name, so give 'default'",
                    ), path
        page = browser.open("/dead-letters/default")
    assert page.status == 200 and '<span class="muted">5</span>' in page.body
    assert sorted(d.message_id or "" for d in _queues(kit).dead_letters("default")) == before
    assert [r for r in caplog.records if r.name == "dramatiq_gp.actions"] == []


class _Ran(dramatiq.Middleware):
    def __init__(self, ran: list[str]) -> None:
        self.ran = ran

    def after_process_message(self, broker, message, *, result=None, exception=None):
        if exception is None and message.actor_name == "charge":
            self.ran.append(message.message_id)


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"], indirect=True)
def test_purge_after_confirmation_and_the_body_shown_only_with_pii_on(broker, make_kit, start_worker, namespace):
    kit, _ = _failing_kit(make_kit, namespace, env={"SENTRY_SEND_DEFAULT_PII": "true"})
    for customer in ("ada@example.com", "bob@example.com"):
        kit.broker.get_actor("charge").send(customer)
    start_worker(kit)
    wait_for(lambda: _queues(kit).dead_count("default") == 2)
    letter = _queues(kit).dead_letters("default")[0]

    with serving(create_app()) as base:
        browser = Browser(base)
        shown = browser.open(f"/dead-letters/default/{letter.id}").body
        assert "ada@example.com" in shown or "bob@example.com" in shown
        assert "RuntimeError: the card was declined" in shown
        token = browser.csrf("/dead-letters/default")
        confirm = browser.open("/dead-letters/default/purge", {"csrf": token})
        assert "Purge every dead letter of queue default?" in confirm.body
        assert _queues(kit).dead_count("default") == 2
        done = browser.open("/dead-letters/default/purge", {"csrf": token, "confirmed": "yes"})
        assert "2 dead letter(s) of queue default deleted" in done.body
    assert _queues(kit).dead_count("default") == 0


def test_read_only_hides_and_refuses_every_action(make_kit, start_worker, namespace, rdb):
    kit, _ = _failing_kit(make_kit, namespace)
    kit.broker.get_actor("charge").send("c1")
    start_worker(kit)
    wait_for(lambda: RedisQueueView(kit.broker.client, namespace).dead_count("default") == 1)
    rdb.hset(keys.SchedulerKeys(namespace).entries, "nightly", "0 3 * * *|UTC")
    (letter,) = RedisQueueView(kit.broker.client, namespace).dead_letters("default")

    with serving(create_app(read_only=True)) as base:
        browser = Browser(base)
        for path in ("/", "/scheduler", "/dead-letters/default", f"/dead-letters/default/{letter.id}", "/outbox"):
            page = browser.open(path)
            assert page.status == 200 and "<button" not in page.body and 'id="read-only"' in page.body, path
        assert "nightly" in browser.open("/scheduler").body
        for path in ("/dead-letters/default/requeue", "/dead-letters/default/purge", "/scheduler/nightly/pause"):
            refused = browser.open(path, {"all": "yes", "confirmed": "yes"})
            assert refused.status == 403 and "read-only" in refused.body, path
    assert RedisQueueView(kit.broker.client, namespace).dead_count("default") == 1
    assert not rdb.hlen(keys.SchedulerKeys(namespace).paused)


def test_what_a_message_carries_is_shown_as_text_never_as_markup(clean_env, namespace, rdb):
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    clean_env.setenv("SENTRY_SEND_DEFAULT_PII", "true")
    script = "<script>alert(1)</script>"
    message = {
        "queue_name": "default",
        "actor_name": script,
        "args": [script],
        "kwargs": {},
        "options": {"redis_message_id": "x1", "traceback": f"Traceback ...\nValueError: {script}\n"},
        "message_id": "m1",
        "message_timestamp": 0,
    }
    rdb.sadd(keys.declared_queues(namespace), "default")
    rdb.zadd(keys.dead(namespace, "default"), {"x1": dramatiq.common.current_millis()})
    rdb.hset(keys.dead_messages(namespace, "default"), "x1", json.dumps(message))
    rdb.lpush(
        keys.failures(namespace),
        json.dumps(
            {
                "at_ms": 0,
                "queue": "default",
                "task_type": script,
                "message_id": "m1",
                "attempt": 1,
                "will_retry": False,
                "error": f"ValueError: {script}",
            }
        ),
    )
    with serving(create_app()) as base:
        browser = Browser(base)
        for path in ("/dead-letters/default", "/dead-letters/default/x1", "/failures"):
            body = browser.open(path).body
            assert "&lt;script&gt;alert(1)&lt;/script&gt;" in body and "<script>" not in body, path


TOKEN = "t0ken-of-twenty-chars"


@pytest.mark.parametrize(
    "credentials",
    [
        ("", None, None),
        (None, None, ""),
        (None, None, "   "),
        ("alice", "", None),
        ("alice", " ", None),
        (None, None, "short"),
        ("alice", None, None),
    ],
    ids=["empty-user", "empty-token", "blank-token", "empty-password", "blank-password", "short-token", "no-password"],
)
def test_credentials_fail_closed_on_an_empty_blank_short_or_half_secret(credentials):
    # An empty token once read as "no token": on --host 0.0.0.0 every request, actions included, passed.
    with pytest.raises(ValueError, match="the dashboard's"):
        Credentials(*credentials)


def test_with_credentials_every_request_needs_them(clean_env, namespace):
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    app = create_app(credentials=Credentials("alice", "s3cret", TOKEN))
    basic = "Basic " + base64.b64encode(b"alice:s3cret").decode()
    wrong = "Basic " + base64.b64encode(b"alice:guess").decode()
    with serving(app) as base:
        refused = Browser(base).open("/")
        assert refused.status == 401 and refused.headers["WWW-Authenticate"] == 'Basic realm="dramatiq-gp"'
        assert Browser(base, {"Authorization": wrong}).open("/").status == 401
        assert Browser(base, {"Authorization": "Bearer nope"}).open("/scheduler").status == 401
        assert Browser(base, {"Authorization": basic}).open("/").status == 200
        assert Browser(base, {"Authorization": f"Bearer {TOKEN}"}).open("/scheduler").status == 200
        assert Browser(base).open("/static/dashboard.css").status == 401


@pytest.mark.parametrize("broker", ["rabbitmq"], indirect=True)
def test_on_rabbitmq_a_queue_whose_sends_went_unconfirmed_shows_its_counts_as_unknown(broker, make_kit, namespace, rdb):
    kit = make_kit(env={"VALKEY_NAMESPACE": namespace})
    dramatiq.actor(lambda: None, broker=kit.broker, actor_name="work").send()
    # What a process whose send RabbitMQ did not confirm records (see the cluster test for the real thing).
    rdb.hset(keys.unconfirmed(namespace), "default", int(time.time() * 1000))
    with serving(create_app()) as base:
        row = re.search(r'<tr data-queue="default">(.*?)</tr>', Browser(base).open("/").body, re.S)
        assert row and "counts unknown" in row.group(1) and "its quorum is likely lost" in row.group(1)
        cells = re.findall(r'<td class="n[^"]*">(.*?)</td>', row.group(1), re.S)
        assert cells[:4] == ["—", "0", "—", "—"], cells  # ready, in flight (held: known), delayed, dead
    done = CliRunner().invoke(cli_main, ["status"])
    (line,) = [line for line in done.output.splitlines() if line.startswith("queue default:")]
    assert line.startswith("queue default: counts unknown (a send to it went unconfirmed at ") and line.endswith(
        "its quorum is likely lost), 0 in flight"
    )
    rdb.hset(keys.unconfirmed(namespace), "default", int(time.time() * 1000) - 61_000)  # over a minute ago
    report = json.loads(CliRunner().invoke(cli_main, ["status", "--json"]).output)
    assert [q["unknown"] for q in report["queues"] if q["name"] == "default"] == [None]


@pytest.mark.parametrize("broker", ["rabbitmq"], indirect=True)
def test_on_rabbitmq_the_overview_reads_the_queues_from_it_and_the_workers_and_throughput_from_redis(
    broker, make_kit, start_worker, namespace
):
    kit = make_kit(env={"VALKEY_NAMESPACE": namespace, "WORKER_QUEUES": "default:2"})
    ran = threading.Event()

    @dramatiq.actor(broker=kit.broker, actor_name="work")
    def work() -> None:
        ran.wait(10)

    for _ in range(7):
        work.send()
    with serving(create_app()) as base:
        browser = Browser(base)
        page = browser.open("/")
        row = re.search(r'<tr data-queue="default">(.*?)</tr>', page.body, re.S)
        assert row, page.body
        cells = re.findall(r'<td class="n[^"]*">(.*?)</td>', row.group(1), re.S)
        # ready, in flight (what workers hold), delayed, dead, consumers, weight (no worker yet), done per minute
        assert cells == ["7", "0", "0", "0", "0", "—", "0"], cells  # nothing held by a worker
        assert '/dead-letters/default">default</a>' in browser.open("/dead-letters").body

        start_worker(kit)
        ran.set()
        reader = gp.dashboard.reader.Reader(gp.Settings.from_env(), kit.broker.client)
        wait_for(
            lambda: reader.throughput(dramatiq.common.current_millis())["per_queue"].get("default", {}).get("done") == 7
        )
        page = browser.open("/")
    assert f'<td class="n">{os.getpid()}</td>' in page.body  # this process, from its heartbeat
    assert '<td class="health">ready</td>' in page.body
    assert "default:2" in page.body


def test_a_store_out_of_reach_is_a_503_naming_it(clean_env, namespace):
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    clean_env.setenv("REDIS_URL", "redis://127.0.0.1:1/0")
    clean_env.setenv("DB_URL", "postgresql://nobody@127.0.0.1:1/none")
    with serving(create_app()) as base:
        overview = Browser(base).open("/")
        outbox = Browser(base).open("/outbox")
    assert overview.status == 503 and overview.body.startswith("Redis/Valkey unreachable at redis://127.0.0.1:1/0")
    assert outbox.status == 503 and outbox.body.startswith(
        "database error at postgresql+psycopg://nobody@127.0.0.1:1/none"
    )


class _Carol(AuthenticationBackend):
    async def authenticate(self, conn: Any) -> tuple[AuthCredentials, SimpleUser]:
        return AuthCredentials(["authenticated"]), SimpleUser("carol")


def test_mounted_in_an_application_it_keeps_the_mount_path_and_logs_the_applications_user(
    clean_env, namespace, rdb, caplog
):
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    rdb.hset(keys.SchedulerKeys(namespace).entries, "nightly", "0 3 * * *|UTC")
    app = Starlette(
        routes=[Mount("/ops", create_app(client=rdb))],  # a mounted app's lifespan does not run: our client
        middleware=[Middleware(AuthenticationMiddleware, backend=_Carol())],
    )
    with serving(app) as base:
        browser = Browser(base)
        page = browser.open("/ops/")
        assert page.status == 200
        assert f'href="{base}/ops/scheduler"' in page.body
        assert browser.open("/ops/static/dashboard.css").status == 200
        token = browser.csrf("/ops/scheduler")
        confirm = browser.open("/ops/scheduler/nightly/pause", {"csrf": token})
        assert (
            'action="/ops/scheduler/nightly/pause"' in confirm.body
        )  # posts back here, by a path: not built from Host
        with caplog.at_level(logging.INFO, logger="dramatiq_gp.actions"):
            done = browser.open("/ops/scheduler/nightly/pause", {"csrf": token, "confirmed": "yes"})
    assert done.status == 200 and done.url == f"{base}/ops/scheduler"
    assert [r.getMessage() for r in caplog.records if r.name == "dramatiq_gp.actions"] == [
        "schedule pause by carol (dashboard, 127.0.0.1): entry nightly paused"
    ]


OFF_LOOPBACK = "--host 0.0.0.0 is not loopback: set DASHBOARD_USER and DASHBOARD_PASSWORD, or DASHBOARD_TOKEN"
ALICE = {"DASHBOARD_USER": "alice"}
NO_REDIS = {"REDIS_URL": "redis://127.0.0.1:1/0"}


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--host", "0.0.0.0"], {}, OFF_LOOPBACK),
        ([], {"DASHBOARD_USER": "alice"}, "DASHBOARD_USER and DASHBOARD_PASSWORD go together: set both or neither"),
        (["--host", "0.0.0.0"], {"DASHBOARD_TOKEN": ""}, "DASHBOARD_TOKEN is set but empty"),
        (["--host", "0.0.0.0"], {"DASHBOARD_TOKEN": "  "}, "DASHBOARD_TOKEN is set but empty"),
        (["--host", "0.0.0.0"], {"DASHBOARD_TOKEN": "s3cr3t-but-short"[:12]}, "DASHBOARD_TOKEN is shorter than 16"),
        ([], {"DASHBOARD_USER": "alice", "DASHBOARD_PASSWORD": ""}, "DASHBOARD_PASSWORD is set but empty"),
        ([], {"REDIS_URL": "redis://127.0.0.1:1/0"}, "Redis/Valkey unreachable at redis://127.0.0.1:1/0"),
        # Off loopback a weak secret is refused before anything is reached (Redis here is not there).
        (["--host", "0.0.0.0"], {**ALICE, "DASHBOARD_PASSWORD": "CHANGE-ME", **NO_REDIS}, "is a placeholder"),
        (["--host", "0.0.0.0"], {**ALICE, "DASHBOARD_PASSWORD": "s3cr3t", **NO_REDIS}, "shorter than 12 characters"),
        (["--host", "::"], {**ALICE, "DASHBOARD_PASSWORD": "Password-2024", **NO_REDIS}, "is a placeholder"),
        (["--host", "0.0.0.0"], {"DASHBOARD_TOKEN": "CHANGE-ME-s3cr3t-token", **NO_REDIS}, "TOKEN is a placeholder"),
    ],
    ids=[
        "off-loopback",
        "half-credentials",
        "empty-token",
        "blank-token",
        "short-token",
        "empty-password",
        "no-redis",
        "placeholder-password",
        "short-password",
        "placeholder-with-digits",
        "placeholder-token",
    ],
)
def test_the_dashboard_command_refuses_to_start_in_one_line(args, env, message, clean_env):
    run_env = {**os.environ, **env}
    done = subprocess.run(
        [sys.executable, "-m", "dramatiq_gp", "dashboard", "--port", "0", *args],
        env=run_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1, done
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert message in done.stderr
    assert "s3cr3t" not in done.stderr  # never the secret itself


@pytest.mark.parametrize(
    ("name", "secret", "problem"),
    [
        ("DASHBOARD_PASSWORD", "x", "shorter than 12 characters"),
        ("DASHBOARD_PASSWORD", "  eleven-chr  ", "shorter than 12 characters"),
        ("DASHBOARD_PASSWORD", "change_me_please", "a placeholder"),
        ("DASHBOARD_PASSWORD", "ADMIN-123456789", "a placeholder"),
        ("DASHBOARD_PASSWORD", "Alice.Example", "the user name"),
        ("DASHBOARD_PASSWORD", "abababababababab", "fewer than 4 distinct characters"),
        ("DASHBOARD_PASSWORD", "correct-horse-battery", None),
        ("DASHBOARD_TOKEN", "your-secret-goes-here", "a placeholder"),
        ("DASHBOARD_TOKEN", "q8CwF1pY0kzT3uVn_e5RmA", None),
    ],
)
def test_which_secrets_are_too_weak_off_loopback(name, secret, problem):
    found = weak_secret(name, secret, user="alice.example")
    assert (found is None) if problem is None else (found is not None and problem in found and name in found)


# -- docs/dashboard.md --------------------------------------------------------------------

DASHBOARD_PAGE = Path(__file__).resolve().parent.parent / "docs" / "dashboard.md"


def test_the_pages_mounting_example_serves_the_dashboard_under_its_path(clean_env, namespace, redis_url):
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    (source,) = re.findall(r"```python\n(.*?)```", DASHBOARD_PAGE.read_text(), re.S)
    scope: dict[str, Any] = {}
    exec(source.replace("redis://127.0.0.1:6379/0", redis_url), scope)
    try:
        with serving(scope["app"]) as base:
            page = Browser(base).open("/ops/queues/scheduler")
            assert page.status == 200 and f'href="{base}/ops/queues/"' in page.body
    finally:
        scope["client"].close()


def test_the_pages_refusals_are_what_the_command_prints(clean_env):
    shown = re.findall(
        r"^\$ ((?:\w+=\S+ )*dramatiq-gp dashboard --host 0\.0\.0\.0)\n(Error: .*)$", DASHBOARD_PAGE.read_text(), re.M
    )
    assert len(shown) == 2  # no credentials; a placeholder password
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    for command, error in shown:
        done = subprocess.run(command, shell=True, env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 1 and done.stderr == error + "\n"


# -- hardening ----------------------------------------------------------------------------


def _raw_get(base: str, path: str, host: str) -> tuple[int, dict[str, str], str]:
    """GET ``path`` with this ``Host`` header (urllib would write its own)."""
    import http.client

    address = urllib.parse.urlsplit(base)
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=10)
    try:
        connection.putrequest("GET", path, skip_host=True)
        connection.putheader("Host", host)
        connection.endheaders()
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read().decode()
    finally:
        connection.close()


def test_a_request_naming_a_host_it_does_not_allow_gets_400(clean_env, namespace):
    # A page that rebinds its own name to 127.0.0.1 sends that name as Host: without this check it read the
    # CSRF token and purged dead letters on a loopback dashboard without credentials.
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    with serving(create_app(allowed_hosts=["127.0.0.1", "localhost", "::1"])) as base:
        port = urllib.parse.urlsplit(base).port
        assert _raw_get(base, "/", f"rebind.attacker.example:{port}")[0] == 400
        assert _raw_get(base, "/scheduler", "rebind.attacker.example")[0] == 400
        for allowed in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", "LOCALHOST"):
            assert _raw_get(base, "/", allowed)[0] == 200, allowed
    clean_env.setenv("DASHBOARD_ALLOWED_HOSTS", "ops.example.com, *.internal")
    with serving(create_app()) as base:
        assert _raw_get(base, "/", "ops.example.com")[0] == 200
        assert _raw_get(base, "/", "dash.internal:8642")[0] == 200
        assert _raw_get(base, "/", "127.0.0.1")[0] == 400


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({"Origin": "http://127.0.0.1:{port}", "Sec-Fetch-Site": "same-origin"}, 200),
        ({"Origin": "http://localhost:{port}"}, 403),  # another origin, though the same machine
        ({"Origin": "http://127.0.0.1:{other}"}, 403),  # another port of the same host
        ({"Origin": "null"}, 403),  # a sandboxed frame or a file
        ({"Sec-Fetch-Site": "same-site"}, 403),  # what a page on another port is to the browser
        ({"Sec-Fetch-Site": "cross-site"}, 403),
        ({"Sec-Fetch-Site": "none"}, 200),  # typed or bookmarked
        ({}, 200),  # not a browser (curl, a script): its CSRF token and credentials still hold
    ],
    ids=["same-origin", "other-host", "other-port", "null", "same-site", "cross-site", "none", "no-browser"],
)
def test_a_post_from_a_page_of_another_origin_is_refused_and_logged(headers, status, clean_env, namespace, rdb, caplog):
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    publish_schedule(rdb, namespace)
    with serving(create_app()) as base:
        port = urllib.parse.urlsplit(base).port
        browser = Browser(base)
        token = browser.csrf("/scheduler")
        browser.headers = {k: v.format(port=port, other=port + 1) for k, v in headers.items()}
        with caplog.at_level(logging.WARNING, logger="dramatiq_gp.dashboard"):
            done = browser.open("/scheduler/good/pause", {"csrf": token, "confirmed": "yes"})
    assert done.status == status, done.body
    paused = rdb.hexists(keys.SchedulerKeys(namespace).paused, "good")
    refusals = [r.getMessage() for r in caplog.records if "another origin" in r.getMessage()]
    if status == 403:
        assert done.body == "refused: this request comes from a page of another origin" and not paused
        (line,) = refusals
        assert line.startswith("dashboard: POST /scheduler/good/pause from 127.0.0.1 refused:")
    else:
        assert paused and not refusals


@contextlib.contextmanager
def _command(namespace: str, redis_url: str, log: Path, *args: str) -> Iterator[str]:
    """``dramatiq-gp dashboard`` in a process of its own, on a free port; yields its base URL."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "VALKEY_NAMESPACE": namespace, "REDIS_URL": redis_url}
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "dramatiq_gp", "dashboard", "--port", str(port), *args],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    try:

        def up() -> bool:
            try:
                return _raw_get(base, "/", f"127.0.0.1:{port}")[0] == 200
            except ConnectionRefusedError:
                return process.poll() is not None

        wait_for(up, timeout=30, interval=0.2)
        assert process.poll() is None, log.read_text()
        yield base
    finally:
        process.terminate()
        process.wait(30)


def test_the_command_answers_only_its_own_address_and_localhost_and_believes_no_forwarded_header(
    clean_env, namespace, redis_url, rdb, tmp_path
):
    rdb.hset(keys.SchedulerKeys(namespace).entries, "nightly", "0 3 * * *|UTC")
    with _command(namespace, redis_url, tmp_path / "log") as base:
        port = urllib.parse.urlsplit(base).port
        assert _raw_get(base, "/", f"localhost:{port}")[0] == 200
        assert _raw_get(base, "/", f"rebind.attacker.example:{port}")[0] == 400
        # uvicorn believes X-Forwarded-For from loopback by default: anyone on the machine could name the client.
        browser = Browser(base, {"X-Forwarded-For": "10.9.8.7"})
        token = browser.csrf("/scheduler")
        assert browser.open("/scheduler/nightly/pause", {"csrf": token, "confirmed": "yes"}).status == 200
    assert "schedule pause by anonymous (dashboard, 127.0.0.1): entry nightly paused" in (tmp_path / "log").read_text()


def test_the_command_cuts_connections_that_send_no_request_and_holds_a_bounded_number(
    clean_env, namespace, redis_url, tmp_path
):
    import socket

    from dramatiq_gp.endpoint import MAX_CONNECTIONS, READ_TIMEOUT_S

    with _command(namespace, redis_url, tmp_path / "log") as base:
        port = urllib.parse.urlsplit(base).port
        # Silent sockets, and ones that send half a request's headers (uvicorn waited on both for ever).
        idle = [socket.create_connection(("127.0.0.1", port), timeout=3 * READ_TIMEOUT_S) for _ in range(40)]
        for half in idle[-10:]:
            half.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        try:
            started = time.monotonic()
            assert _raw_get(base, "/", f"127.0.0.1:{port}")[0] == 200  # a real request still gets in at once
            cut = [connection.recv(1) for connection in idle]  # each is closed by the server: b""
            assert cut == [b""] * len(idle)
            assert time.monotonic() - started < 2 * READ_TIMEOUT_S
        finally:
            for connection in idle:
                connection.close()
    log = (tmp_path / "log").read_text()
    assert f"dashboard: more than {MAX_CONNECTIONS} connections open at once: cutting the oldest one" in log


def test_every_response_forbids_framing_caching_and_sniffing(clean_env, namespace):
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    with serving(create_app(credentials=Credentials("alice", "s3cret"))) as base:
        basic = {"Authorization": "Basic " + base64.b64encode(b"alice:s3cret").decode()}
        for path, headers, status in [
            ("/", basic, 200),
            ("/static/dashboard.css", basic, 200),
            ("/", {}, 401),
            ("/dead-letters/a%0Ab", basic, 400),
        ]:
            reply = Browser(base, headers).open(path)
            assert reply.status == status, path
            assert reply.headers["X-Frame-Options"] == "DENY"
            assert reply.headers["Content-Security-Policy"] == "frame-ancestors 'none'"
            assert reply.headers["Cache-Control"] == "no-store"
            assert reply.headers["X-Content-Type-Options"] == "nosniff"
            assert reply.headers["Referrer-Policy"] == "same-origin"


def test_over_tls_the_csrf_cookie_is_host_prefixed_and_secure(clean_env, namespace, rdb):
    # Served here by uvicorn, which believes X-Forwarded-Proto from loopback: as behind a TLS-terminating proxy.
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    rdb.hset(keys.SchedulerKeys(namespace).entries, "nightly", "0 3 * * *|UTC")
    with serving(create_app()) as base:
        cookie = Browser(base, {"X-Forwarded-Proto": "https"}).open("/scheduler").headers["Set-Cookie"]
        assert cookie.startswith("__Host-gp_csrf=") and "Secure" in cookie and "Path=/;" in cookie
        cookie = Browser(base).open("/scheduler").headers["Set-Cookie"]
        assert cookie.startswith("gp_csrf=") and "Secure" not in cookie


def test_wrong_credentials_are_slowed_down_and_logged_once_per_client_per_minute(clean_env, namespace, caplog):
    import time

    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    wrong = {"Authorization": "Bearer " + "x" * 20}
    with serving(create_app(credentials=Credentials(token="t" * 20))) as base:
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="dramatiq_gp.dashboard"):
            for _ in range(4):
                assert Browser(base, wrong).open("/").status == 401
        assert time.monotonic() - started >= 4 * 0.5
        assert Browser(base).open("/").status == 401  # no credentials at all: a browser's first try, not slowed
    lines = [r.getMessage() for r in caplog.records if r.name == "dramatiq_gp.dashboard"]
    assert lines == ["dashboard: 1 failed login(s) from 127.0.0.1 in the last 60s"]


def test_a_queue_name_in_the_path_cannot_write_a_line_of_its_own(clean_env, namespace, caplog, rdb):
    # %0A in the queue once wrote a forged "dlq purge by ..." line.
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    rdb.hset(keys.SchedulerKeys(namespace).entries, "nightly", "0 3 * * *|UTC")
    with serving(create_app()) as base:
        browser = Browser(base)
        token = browser.csrf("/scheduler")
        with caplog.at_level(logging.INFO, logger="dramatiq_gp.actions"):
            forged = browser.open(
                "/dead-letters/x%0Adlq%20purge%20by%20admin/purge", {"csrf": token, "confirmed": "yes"}
            )
            assert forged.status == 400 and "is not a queue name" in forged.body
            done = browser.open("/dead-letters/default/purge", {"csrf": token, "confirmed": "yes"})
    assert done.status == 200
    assert [r.getMessage() for r in caplog.records if r.name == "dramatiq_gp.actions"] == [
        "dlq purge by anonymous (dashboard, 127.0.0.1): 0 dead letter(s) of queue default deleted"
    ]


@pytest.mark.parametrize(
    ("path", "error"),
    [
        ("/?refresh=0", "refresh='0': expected a whole number from 2 to 3,600"),
        ("/scheduler?refresh=soon", "refresh='soon': expected a whole number from 2 to 3,600"),
        ("/dead-letters/default?offset=99999999999999999999999", "offset='99999999999999999999999': expected"),
        ("/dead-letters/default?offset=-1", "offset='-1': expected a whole number from 0 to"),
    ],
    ids=["refresh-zero", "refresh-word", "huge-offset", "negative-offset"],
)
def test_bad_input_on_a_page_is_a_400_in_one_line(clean_env, namespace, path, error):
    # refresh=0 reloaded the page without end; a huge offset was reported as "Redis/Valkey unreachable".
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    with serving(create_app()) as base:
        reply = Browser(base).open(path)
        assert reply.status == 400 and reply.body.startswith(error) and len(reply.body.splitlines()) == 1
        refreshing = Browser(base).open("/?refresh=5")
        assert refreshing.status == 200 and '<meta http-equiv="refresh" content="5">' in refreshing.body


def test_a_basic_authorization_that_is_not_ascii_is_refused_not_a_server_error(clean_env, namespace):
    import http.client

    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    with serving(create_app(credentials=Credentials("alice", "s3cret"))) as base:
        address = urllib.parse.urlsplit(base)
        connection = http.client.HTTPConnection(address.hostname, address.port, timeout=10)
        try:
            connection.putrequest("GET", "/")
            connection.putheader("Authorization", "Basic ÿÿÿ".encode("latin-1"))
            connection.endheaders()
            assert connection.getresponse().status == 401
        finally:
            connection.close()


@pytest.mark.parametrize("case", BAD_DEAD_LETTERS)
def test_one_bad_dead_letter_is_marked_linked_and_acted_on_alone_and_the_rest_of_its_page_shows(
    case, clean_env, namespace, rdb
):
    id, stored, score, shown = BAD_DEAD_LETTERS[case]
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    bury(rdb, namespace, "default", "good", stored_dead_letter("good"))
    bury(rdb, namespace, "default", id, stored, score)
    with serving(create_app()) as base:
        browser = Browser(base)
        page = browser.open("/dead-letters/default")
        assert page.status == 200, page.body
        assert "m-good" in page.body and shown in html.unescape(page.body)
        (link,) = [
            html.unescape(href)
            for href in re.findall(r'<td><a href="([^"]+)">', page.body)
            if not href.endswith("/good")
        ]
        one = browser.open(urllib.parse.urlsplit(link).path)
        assert one.status == 200, one.body
        assert shown in html.unescape(one.body) and f"<code>{html.escape(id)}</code>" in one.body
        token = browser.csrf("/dead-letters/default")
        done = browser.open("/dead-letters/default/requeue", {"csrf": token, "id": id, "confirmed": "yes"})
        assert "1 dead letter(s) of queue default requeued" in done.body
    assert rdb.zrange(keys.dead(namespace, "default"), 0, -1) == ["good"]
    assert rdb.lrange(keys.queue(namespace, "default"), 0, -1) == [id]


def test_a_dead_letters_arguments_nested_too_deep_show_marked_with_the_rest_of_it(clean_env, namespace, rdb):
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    clean_env.setenv("SENTRY_SEND_DEFAULT_PII", "true")
    bury(rdb, namespace, "default", "deep", stored_dead_letter("deep", "[" * 101 + "]" * 101))
    mark = "(unreadable: nested deeper than 100 levels)"
    with serving(create_app()) as base:
        one = Browser(base).open("/dead-letters/default/deep")
    assert one.status == 200 and "RuntimeError: the card was declined" in one.body
    (body,) = re.findall(r'<pre id="body">(.*?)</pre>', one.body, re.S)
    assert json.loads(html.unescape(body)) == {"args": mark, "kwargs": {}}
    shown = CliRunner().invoke(cli_main, ["dlq", "show", "default", "deep"])
    assert shown.exit_code == 0 and json.loads(shown.output)["args"] == mark


def test_a_dead_letter_whose_redis_id_is_not_utf8_is_marked_and_reached_by_its_message_id(clean_env, namespace, rdb):
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    bury(rdb, namespace, "default", "good", stored_dead_letter("good"))
    bury(rdb, namespace, "default", b"d\xff", stored_dead_letter("garbled"))
    mark = "(unreadable: id not UTF-8: b'd\\xff')"
    with serving(create_app()) as base:
        browser = Browser(base)
        page = browser.open("/dead-letters/default")
        assert page.status == 200, page.body
        assert "m-good" in page.body and '/dead-letters/default/m-garbled">charge</a>' in page.body
        one = browser.open("/dead-letters/default/m-garbled")
        assert one.status == 200 and f"<code>{mark}</code>" in html.unescape(one.body), one.body
        token = browser.csrf("/dead-letters/default")
        done = browser.open("/dead-letters/default/requeue", {"csrf": token, "id": "m-garbled", "confirmed": "yes"})
        assert "1 dead letter(s) of queue default requeued" in done.body
    assert rdb.zrange(keys.dead(namespace, "default"), 0, -1) == ["good"]
    assert rdb.llen(keys.queue(namespace, "default")) == 1


@pytest.mark.parametrize("case", BAD_SCHEDULER)
def test_one_bad_scheduler_record_is_marked_and_the_rest_of_the_scheduler_page_shows(case, clean_env, namespace, rdb):
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    shown = spoil_schedule(rdb, publish_schedule(rdb, namespace), case)
    with serving(create_app()) as base:
        page = Browser(base).open("/scheduler")
    assert page.status == 200, page.body
    body = html.unescape(page.body)
    assert shown in body
    assert 'data-entry="good"' in body and 'data-entry="odd"' in body and "epoch 7" in body


#: Recorded failures no worker of this version writes, and what the page shows for each.
BAD_FAILURES = {
    "not-json": (b"{not json", "(unreadable: not JSON)"),
    "not-an-object": (b"[1, 2]", "(unreadable: not a JSON object)"),
    "time-not-a-number": (
        json.dumps({"at_ms": "soon", "queue": "mail", "error": "KeyError: 'x'"}),
        "(unreadable: at_ms='soon')",
    ),
}


@pytest.mark.parametrize("case", BAD_FAILURES)
def test_one_bad_failure_record_is_marked_and_the_others_listed(case, clean_env, namespace, rdb):
    record, shown = BAD_FAILURES[case]
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    good = {
        "at_ms": dramatiq.common.current_millis(),
        "queue": "default",
        "task_type": "charge",
        "message_id": "m-good",
        "attempt": 1,
        "will_retry": True,
        "error": "RuntimeError: declined",
    }
    rdb.lpush(keys.failures(namespace), json.dumps(good), record)
    with serving(create_app()) as base:
        page = Browser(base).open("/failures")
    assert page.status == 200, page.body
    assert shown in html.unescape(page.body) and "m-good" in page.body and "RuntimeError: declined" in page.body


def test_a_throughput_field_of_another_kind_or_count_is_passed_over_and_the_rest_counted(clean_env, namespace, rdb):
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    now = dramatiq.common.current_millis()
    rdb.sadd(keys.declared_queues(namespace), "default")
    rdb.hset(
        keys.throughput(namespace, now // 60_000),
        mapping={
            "default:done": 30,
            "default:dead": 3,
            "default:skipped": 4,
            "default:retried": "abc",
            "nokind": 5,
        },
    )
    with serving(create_app()) as base:
        page = Browser(base).open("/")
    assert page.status == 200, page.body
    throughput = gp.dashboard.reader.Reader(gp.Settings.from_env(), rdb).throughput(now)
    assert throughput["per_queue"] == {"default": {"done": 30, "retried": 0, "dead": 3}}
    assert throughput["total"][-1] == {"done": 30, "retried": 0, "dead": 3}


#: Worker records no worker of this version writes, and what the overview shows for each.
BAD_WORKERS = {
    "not-json": ("w-bad", b"{not json", ["(unreadable: not JSON)"]),
    "not-an-object": ("w-bad", b"[1, 2]", ["(unreadable: not a JSON object)"]),
    "wrong-types": (
        "w-bad",
        json.dumps({"host": 7, "pid": "abc", "started_ms": "soon", "queues": 5, "weights": [1], "strict": "yes"}),
        [
            "(unreadable: host=7)",
            "(unreadable: pid='abc')",
            "(unreadable: started_ms='soon')",
            "(unreadable: queues=5)",
            "(unreadable: weights=[1])",
        ],
    ),
    "id-not-utf8": (b"w-\xff", json.dumps({"host": "odd", "pid": 9, "queues": ["default"]}), ["odd"]),
}


@pytest.mark.parametrize("case", BAD_WORKERS)
def test_one_bad_worker_record_is_marked_and_the_rest_of_the_overview_shows(case, clean_env, namespace, rdb):
    broker_id, record, shown = BAD_WORKERS[case]
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    now = dramatiq.common.current_millis()
    rdb.zadd(keys.heartbeats(namespace), {"w-good": now, broker_id: now})
    good = {"host": "good-host", "pid": 4242, "started_ms": now, "queues": ["default"], "weights": {"default": 3}}
    rdb.hset(keys.workers(namespace), mapping={"w-good": json.dumps(good), broker_id: record})
    rdb.sadd(keys.declared_queues(namespace), "default")
    with serving(create_app()) as base:
        page = Browser(base).open("/")
    assert page.status == 200, page.body
    body = html.unescape(page.body)
    assert 'data-queue="default"' in body and "good-host" in body and "default:3" in body
    for mark in shown:
        assert mark in body, mark


def test_a_recorded_queue_name_not_utf8_is_marked_one_with_a_slash_not_linked_and_the_others_shown(
    clean_env, namespace, rdb
):
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    rdb.sadd(keys.declared_queues(namespace), "default", b"caf\xe9", "a/b")
    bury(rdb, namespace, "default", "good", stored_dead_letter("good"))
    bury(rdb, namespace, "a/b", "other", stored_dead_letter("other"))
    mark = "(unreadable: name not UTF-8: b'caf\\xe9')"
    with serving(create_app()) as base:
        browser = Browser(base)
        overview, dead = browser.open("/"), browser.open("/dead-letters")
    assert overview.status == 200 and dead.status == 200, (overview.body, dead.body)
    row = re.search(r'<tr data-queue="default">(.*?)</tr>', overview.body, re.S)
    assert row and ">1</a>" in row.group(1), overview.body
    assert mark in html.unescape(overview.body) and mark in html.unescape(dead.body)
    assert '/dead-letters/default">default</a></td><td class="n">1</td>' in dead.body
    assert '<td>a/b</td><td class="n">1</td>' in dead.body


def test_each_worker_shows_its_health_a_stale_or_unreadable_record_as_not_alive(clean_env, namespace, rdb):
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    now = dramatiq.common.current_millis()
    record = {"alive": True, "ready": False, "failing": ["redis: Connection refused"], "interval_ms": 5000}
    workers = {
        "w-unready": {**record, "at_ms": now},
        "w-stale": {**record, "ready": True, "failing": [], "at_ms": now - 60_000},
        "w-garbled": "not json",
        "w-old-version": None,
    }
    for pid, (broker_id, health) in enumerate(workers.items(), start=1):
        rdb.zadd(keys.heartbeats(namespace), {broker_id: now})
        rdb.hset(keys.workers(namespace), broker_id, json.dumps({"host": broker_id, "pid": pid, "queues": []}))
        if health is not None:
            rdb.hset(keys.health(namespace), broker_id, health if isinstance(health, str) else json.dumps(health))
    with serving(create_app()) as base:
        page = Browser(base).open("/")
    rows = dict(re.findall(r"<tr><td>(w-[a-z-]+)</td>.*?<td class=\"health\">(.*?)</td></tr>", page.body, re.S))
    assert html.unescape(re.sub("<[^>]+>", "", rows["w-unready"])) == "not ready: redis: Connection refused"
    assert re.sub("<[^>]+>", "", rows["w-stale"]) == "not alive: no report for a while"
    assert re.sub("<[^>]+>", "", rows["w-garbled"]) == "not alive: unreadable health record"
    assert rows["w-old-version"] == "—"


def test_the_outbox_page_shows_delayed_events_not_yet_due_apart_from_the_backlog(clean_env, namespace, engine):
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    with engine.begin() as conn:
        gp.dispatch(conn, Numbered(1))
        gp.dispatch(conn, Numbered(2), delay=timedelta(days=2))
        gp.dispatch(conn, Numbered(3), delay=timedelta(hours=1))
    with serving(create_app(engine=engine)) as base:
        page = Browser(base).open("/outbox")
    backlog = re.sub(r"<[^>]+>", "", page.body.split('id="backlog"')[1].split("</section>")[0])
    assert "Pending: 1" in backlog
    assert "scheduled (delayed, not yet due): 2" in backlog


# -- stored schedule entries ------------------------------------------------------------------


@pytest.fixture
def targets(rdb, namespace) -> None:
    """The targets the stored-entry tests use, published as schedulable (as a worker whose code marks them)."""
    # A kit task type published all the same (by hand, into Redis) is still never a target.
    actors = {"cleanup": "maintenance", "report": "default", "listener:digest.due:send": "default"}
    publish_schedulable(rdb, namespace, actors=actors, events=("digest.due",))


def _stored_page(body: str) -> list[str]:
    return re.findall(r'<tr data-entry="([^"]+)">', body)


def test_stored_entries_are_listed_by_prefix_a_page_at_a_time_without_reading_them_all(
    clean_env, namespace, rdb, targets
):
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    schedules = gp.Schedules(rdb, namespace)
    for n in range(250):
        schedules.add(f"digest.{n:03}", "0 8 * * *", EventByName("digest.due", {"customer": n}), tz="Asia/Tokyo")
    schedules.add("cleanup", "@every 10m", "cleanup", args=["/tmp/ada@example.com"], queue="maintenance")
    with serving(create_app()) as base:
        browser = Browser(base)
        summary = browser.open("/scheduler").body
        assert "<strong>251</strong> stored at run time" in summary and "/scheduler/stored" in summary
        assert "Next to fire: <code>cleanup</code>" in summary  # every 10 minutes comes before 08:00 in Tokyo

        before = _commandstats(rdb)
        first = browser.open("/scheduler/stored?prefix=digest.")
        assert _commandstats(rdb) == before  # one page of an index, never a scan
        assert _stored_page(first.body) == [f"digest.{n:03}" for n in range(50)]
        row = re.search(r'<tr data-entry="digest.007">(.*?)</tr>', first.body, re.S)
        assert row and "<code>0 8 * * *</code></td><td>Asia/Tokyo</td>" in row.group(1)
        assert "event <code>digest.due</code>" in row.group(1) and "T08:00:00+09:00" in row.group(1)
        assert "[Filtered]" in row.group(1) and "active" in row.group(1)  # PII display is off
        pages, path = [], "/scheduler/stored?prefix=digest."
        while path:
            page = browser.open(path)
            pages.append(_stored_page(page.body))
            found = re.search(r'<a href="\?([^"]+)" rel="next">', page.body)
            path = "/scheduler/stored?" + html.unescape(found.group(1)) if found else ""
        assert [len(p) for p in pages] == [50, 50, 50, 50, 50]
        assert [name for p in pages for name in p] == [f"digest.{n:03}" for n in range(250)]
        assert _stored_page(browser.open("/scheduler/stored?prefix=digest.24").body) == [
            f"digest.{n}" for n in range(240, 250)
        ]
        assert _stored_page(browser.open("/scheduler/stored?after=digest.248").body) == ["digest.249"]
        assert "No stored entry starts with <code>nope</code>" in browser.open("/scheduler/stored?prefix=nope").body
        bad = browser.open("/scheduler/stored?prefix=%3Cb%3E")
        assert (
            bad.status == 400 and bad.body == "prefix='<b>': a schedule entry's name is letters, digits, '_', '.', '-'"
        )
    clean_env.setenv("SENTRY_SEND_DEFAULT_PII", "true")
    with serving(create_app()) as base:
        row = re.search(r'<tr data-entry="cleanup">(.*?)</tr>', Browser(base).open("/scheduler/stored").body, re.S)
    assert row and "actor <code>cleanup</code>" in row.group(1) and "<td>maintenance</td>" in row.group(1)
    assert html.unescape(row.group(1)).count('{"args": ["/tmp/ada@example.com"], "kwargs": {}}') == 1


def test_an_entry_stored_from_the_dashboard_is_confirmed_logged_with_who_and_fired_as_given(
    clean_env, namespace, rdb, caplog, targets
):
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    form = {"name": "digest.42", "spec": "0 8 * * *", "zone": "Europe/Budapest", "event": "digest.due"}
    form |= {"data": '{"customer": 42}', "back": "stored", "prefix": "digest."}
    with serving(create_app(store_entries=True)) as base:
        browser = Browser(base)
        token = browser.csrf("/scheduler/stored")
        assert browser.open("/scheduler/stored/add", form).status == 403  # no CSRF token
        assert browser.open("/scheduler/stored/add", {**form, "csrf": "forged", "confirmed": "yes"}).status == 403
        confirm = browser.open("/scheduler/stored/add", {**form, "csrf": token})
        assert "Store schedule entry digest.42?" in confirm.body
        assert "It fires at 0 8 * * * (Europe/Budapest): event digest.due with the data below" in confirm.body
        assert "<dt>data</dt><dd><code>{&#34;customer&#34;: 42}</code></dd>" in confirm.body  # shown in full
        assert not rdb.hlen(f"{namespace}:scheduler:dynamic")  # nothing done yet
        with caplog.at_level(logging.INFO, logger="dramatiq_gp.actions"):
            done = browser.open("/scheduler/stored/add", {**form, "csrf": token, "confirmed": "yes"})
            actor = {"name": "cleanup", "spec": "@every 10m", "actor": "cleanup", "args": '["/tmp"]'}
            browser.open("/scheduler/stored/add", {**actor, "csrf": token, "confirmed": "yes"})
            removed = browser.open("/scheduler/stored/cleanup/remove", {"csrf": token, "confirmed": "yes"})
        assert done.status == 200 and done.url.endswith("/scheduler/stored?prefix=digest.")
        assert re.search(r'<p class="flash" role="status">entry digest.42 stored: next fire \S+T08:00:00\+0', done.body)
        assert _stored_page(done.body) == ["digest.42"]
        assert removed.url.endswith("/scheduler/stored") and "entry cleanup removed" in removed.body
    stored = gp.Schedules(rdb, namespace).get("digest.42")
    assert (stored.kind, stored.target, stored.data, stored.zone) == (
        "event",
        "digest.due",
        {"customer": 42},
        "Europe/Budapest",
    )
    assert gp.Schedules(rdb, namespace).get("cleanup") is None
    assert [r.getMessage() for r in caplog.records if r.name == "dramatiq_gp.actions"] == [
        "schedule add by anonymous (dashboard, 127.0.0.1): entry digest.42 added: 0 8 * * * (Europe/Budapest), "
        'event digest.due on queue default, data {"customer": 42}, options {}',
        "schedule add by anonymous (dashboard, 127.0.0.1): entry cleanup added: @every 10m (UTC), actor cleanup "
        'on queue maintenance, args ["/tmp"], kwargs {}, options {}',
        "schedule remove by anonymous (dashboard, 127.0.0.1): entry cleanup removed",
    ]


@pytest.mark.parametrize(
    ("fields", "shown"),
    [
        ({"spec": "0 25 * * *"}, "refused: schedule entry 'bad': cron spec '0 25 * * *': hour value 25"),
        ({"zone": "Mars/Olympus"}, "refused: schedule entry 'bad': 'Mars/Olympus' is not an IANA time zone"),
        ({"name": "a b"}, "refused: schedule entry 'a b': a name is letters, digits"),
        ({"data": "{nope"}, "refused: data: not JSON (Expecting property name"),
        ({"actor": "job"}, "refused: give an event's wire name or an actor's name, not both"),
        ({"name": "nightly"}, "refused: schedule entry 'nightly' is a code entry a worker published"),
        ({"name": "taken"}, "refused: schedule entry 'taken' exists already: replace it to change it"),
        (
            {"event": "", "actor": "delete_account", "args": "[4242]"},
            "refused: schedule entry 'bad': no worker publishes an actor 'delete_account' as schedulable: mark it",
        ),
        (
            {"event": "", "actor": "listener:digest.due:send", "args": '[{"id": "x", "event": "digest.due"}]'},
            "refused: schedule entry 'bad': 'listener:digest.due:send' is one of the kit's own task types",
        ),
        ({"event": "", "actor": "event:digest.due"}, "refused: schedule entry 'bad': 'event:digest.due' is one of"),
        (
            {"event": "", "actor": "cleanup", "queue": "admin"},
            "refused: schedule entry 'bad': actor 'cleanup' runs from queue 'maintenance' only",
        ),
        ({"event": "order.placed"}, "refused: schedule entry 'bad': no worker publishes an event 'order.placed'"),
        # Deeper than the parser recurses (it was a 500 with a RecursionError), and one level past the limit.
        ({"data": "[" * 5000 + "]" * 5000}, "refused: data: nested deeper than 100 levels"),
        ({"event": "", "actor": "job", "args": "[" * 101 + "]" * 101}, "refused: args: nested deeper than 100 levels"),
        # Its next fire was past the year 9999: a 500 with an OverflowError.
        (
            {"spec": "@every 999999999d"},
            "refused: schedule entry 'bad': cron spec '@every 999999999d': @every takes an interval of at most 36525d",
        ),
    ],
    ids=[
        "bad-spec",
        "bad-zone",
        "bad-name",
        "bad-json",
        "both-targets",
        "code-name",
        "exists",
        "not-schedulable",
        "listener",
        "fan-out",
        "other-queue",
        "event-not-schedulable",
        "recursion",
        "deep",
        "every-too-long",
    ],
)
def test_a_refused_entry_shows_its_one_line_and_nothing_is_stored(fields, shown, clean_env, namespace, rdb, targets):
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    rdb.hset(keys.SchedulerKeys(namespace).entries, "nightly", "0 3 * * *|UTC")
    gp.Schedules(rdb, namespace).add("taken", "@daily", EventByName("digest.due", {}))
    stored_before = rdb.hgetall(f"{namespace}:scheduler:dynamic")
    form = {"name": "bad", "spec": "@daily", "event": "digest.due", "data": "{}", "back": "stored", **fields}
    with serving(create_app(store_entries=True)) as base:
        browser = Browser(base)
        token = browser.csrf("/scheduler/stored")
        done = browser.open("/scheduler/stored/add", {**form, "csrf": token, "confirmed": "yes"})
    assert done.status == 200 and done.url.endswith("/scheduler/stored")
    (flash,) = re.findall(r'<p class="flash bad" role="status">(.*?)</p>', done.body, re.S)
    assert html.unescape(flash).startswith(shown) and "\n" not in flash, flash
    assert rdb.hgetall(f"{namespace}:scheduler:dynamic") == stored_before
    assert rdb.zcard(f"{namespace}:scheduler:names") == 1


def test_a_stored_entry_nested_too_deep_by_hand_is_marked_on_its_page_and_refused_to_run_now(clean_env, namespace, rdb):
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    record = '{"zone": "UTC", "trigger": "@daily", "queue": "default", "actor": "job", "args": %s}'
    rdb.hset(f"{namespace}:scheduler:dynamic", "deep", record % ("[" * 5000 + "]" * 5000))
    rdb.zadd(f"{namespace}:scheduler:names", {"deep": 0})
    with serving(create_app()) as base:
        browser = Browser(base)
        token = browser.csrf("/scheduler/stored")
        ran = browser.open("/scheduler/deep/run", {"back": "stored", "csrf": token, "confirmed": "yes"})
        page = browser.open("/scheduler/stored")
    assert ran.status == 200 and ran.url.endswith("/scheduler/stored")
    assert page.status == 200 and "(unreadable: nested deeper than 100 levels)" in page.body
    (flash,) = re.findall(r'<p class="flash bad" role="status">(.*?)</p>', ran.body, re.S)
    refused = "refused: schedule entry 'deep': unreadable stored entry (nested deeper than 100 levels)"
    assert html.unescape(flash) == refused
    assert not rdb.exists(f"{namespace}:default.msgs")


def test_a_stored_entry_paused_and_resumed_from_its_page_returns_to_that_page(
    clean_env, namespace, rdb, targets, caplog
):
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    for n in range(3):
        gp.Schedules(rdb, namespace).add(f"digest.{n}", "@daily", EventByName("digest.due", {"customer": n}))
    keep = {"back": "stored", "prefix": "digest.", "after": "digest.0"}
    with serving(create_app()) as base:
        browser = Browser(base)
        token = browser.csrf("/scheduler/stored")
        with caplog.at_level(logging.INFO, logger="dramatiq_gp.actions"):
            paused = browser.open("/scheduler/digest.1/pause", {**keep, "csrf": token, "confirmed": "yes"})
            row = re.search(r'<tr data-entry="digest.1">(.*?)</tr>', paused.body, re.S)
            assert row and "paused</span> by anonymous (dashboard, 127.0.0.1)" in row.group(1)
            assert 'action="' in row.group(1) and ">Resume</button>" in row.group(1)
            resumed = browser.open("/scheduler/digest.1/resume", {**keep, "csrf": token, "confirmed": "yes"})
        assert paused.url.endswith("/scheduler/stored?prefix=digest.&after=digest.0")
        assert _stored_page(paused.body) == ["digest.1", "digest.2"]
        assert "entry digest.1 resumed" in resumed.body
        back = browser.open("/scheduler/digest.1/pause", {"back": "stored", "prefix": "<b>", "csrf": token})
        assert back.status == 400 and back.body.startswith("prefix='<b>'")
    assert not rdb.hlen(keys.SchedulerKeys(namespace).paused)
    assert [r.getMessage() for r in caplog.records if r.name == "dramatiq_gp.actions"] == [
        "schedule pause by anonymous (dashboard, 127.0.0.1): entry digest.1 paused",
        "schedule resume by anonymous (dashboard, 127.0.0.1): entry digest.1 resumed",
    ]


def test_a_stored_entry_runs_now_from_its_page_and_returns_to_it(clean_env, namespace, rdb, targets, caplog):
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    gp.Schedules(rdb, namespace, warn_leaderless=False).add("report.7", "@daily", "report", args=[7])
    with serving(create_app()) as base:
        browser = Browser(base)
        token = browser.csrf("/scheduler/stored")
        assert ">Run now</button>" in browser.open("/scheduler/stored").body
        with caplog.at_level(logging.INFO, logger="dramatiq_gp.actions"):
            ran = browser.open("/scheduler/report.7/run", {"back": "stored", "csrf": token, "confirmed": "yes"})
    assert ran.url.endswith("/scheduler/stored") and "entry report.7 run now: message " in ran.body
    (message,) = [json.loads(data) for data in rdb.hvals(f"{namespace}:default.msgs")]
    assert (message["actor_name"], message["args"]) == ("report", [7])
    assert next(r.getMessage() for r in caplog.records if r.name == "dramatiq_gp.actions").startswith(
        "schedule run by anonymous (dashboard, 127.0.0.1): entry report.7"
    )


def test_read_only_lists_the_stored_entries_and_refuses_to_store_or_remove_them(clean_env, namespace, rdb, targets):
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    gp.Schedules(rdb, namespace).add("digest.1", "@daily", EventByName("digest.due", {}))
    with serving(create_app(read_only=True, store_entries=True)) as base:
        browser = Browser(base)
        page = browser.open("/scheduler/stored")
        assert _stored_page(page.body) == ["digest.1"]
        assert page.body.count("<button") == 1 and 'id="add-entry"' not in page.body  # the search's alone
        for path in ("/scheduler/stored/add", "/scheduler/stored/digest.1/remove"):
            form = {"name": "x", "spec": "@daily", "event": "e", "confirmed": "yes"}
            refused = browser.open(path, form)
            assert refused.status == 403 and "read-only" in refused.body, path
    assert sorted(rdb.hkeys(f"{namespace}:scheduler:dynamic")) == ["digest.1"]


def test_storing_entries_is_a_privilege_of_its_own_off_by_default(clean_env, namespace, rdb, targets):
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    gp.Schedules(rdb, namespace).add("digest.1", "@daily", EventByName("digest.due", {}))
    with serving(create_app()) as base:
        browser = Browser(base)
        page = browser.open("/scheduler/stored")
        assert (
            'id="add-entry"' not in page.body and 'id="store-off"' in page.body and ">Remove</button>" not in page.body
        )
        assert ">Run now</button>" in page.body and ">Pause</button>" in page.body  # the other actions stay
        token = browser.csrf("/scheduler/stored")
        form = {"name": "x", "spec": "@daily", "event": "digest.due", "csrf": token, "confirmed": "yes"}
        for path, fields in (("/scheduler/stored/add", form), ("/scheduler/stored/digest.1/remove", form)):
            refused = browser.open(path, fields)
            assert refused.status == 403 and "--store-entries" in refused.body, path
    assert sorted(rdb.hkeys(f"{namespace}:scheduler:dynamic")) == ["digest.1"]
    with serving(create_app(store_entries=True)) as base:
        page = Browser(base).open("/scheduler/stored")
    # What the form may target, as the workers publish it: never a kit task type, even one published by hand.
    assert re.findall(r'<tr data-target="([^"]+)">', page.body) == ["actor:cleanup", "actor:report", "event:digest.due"]
    assert '<option value="cleanup">' in page.body and "listener:" not in page.body


def test_a_stored_entry_that_cannot_be_read_is_marked_and_the_rest_of_its_page_shows(
    clean_env, namespace, rdb, targets
):
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    schedules = gp.Schedules(rdb, namespace)
    for name in ("a.good", "b.bad"):
        schedules.add(name, "@daily", EventByName("digest.due", {}))
    rdb.hset(f"{namespace}:scheduler:dynamic", "b.bad", "{not json")
    with serving(create_app()) as base:
        page = Browser(base).open("/scheduler/stored")
    assert page.status == 200 and _stored_page(page.body) == ["a.good", "b.bad"]
    assert '<td colspan="6" class="error">(unreadable: not JSON)</td>' in page.body
