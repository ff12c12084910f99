"""Configuration from the environment: defaults, parsing, errors that name the variable, and what settings do."""

from __future__ import annotations

import itertools
import json
import logging
import re
import subprocess
import sys
import time
import urllib.parse
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import dramatiq
import psycopg
import pytest
import sqlalchemy as sa

import dramatiq_gp as gp
from dramatiq_gp.durations import format_duration, parse_duration
from dramatiq_gp.settings import redact_url
from helpers import messages_of, wait_for
from servers import OwnPostgres


@pytest.fixture
def env(clean_env):
    clean_env.delenv("REDIS_URL")
    return clean_env


def test_defaults(env):
    settings = gp.Settings.from_env()
    assert settings.worker.queues is None
    assert settings.worker.max_retries == 25
    assert settings.worker.shutdown_timeout is None
    assert settings.worker.dedup_retention == timedelta(hours=24)
    assert settings.worker.settle_window == timedelta(milliseconds=1)
    assert settings.redis.display() == "redis://127.0.0.1:6379/0"
    assert settings.log.level == "INFO"


def test_worker_variables(env):
    env.setenv("WORKER_QUEUES", "default:3, mail:1,critical")
    env.setenv("WORKER_STRICT_PRIORITY", "true")
    env.setenv("WORKER_SHUTDOWN_TIMEOUT", "1m30s")
    env.setenv("WORKER_MAX_RETRIES", "5")
    env.setenv("LOG_LEVEL", "warn")
    settings = gp.Settings.from_env()
    assert settings.worker.queues == {"default": 3, "mail": 1, "critical": 1}
    assert settings.worker.strict_priority is True
    assert settings.worker.shutdown_timeout == timedelta(seconds=90)
    assert settings.worker.max_retries == 5
    assert settings.log.level == "WARNING"


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("WORKER_QUEUES", "default:x", "WORKER_QUEUES='default:x': entry 'default:x': weight 'x' is not a whole"),
        ("WORKER_QUEUES", "default:3,mail:-1", "entry 'mail:-1': weight '-1' is not a whole number >= 0"),
        ("WORKER_QUEUES", "default:0,mail:0", "every weight is 0"),
        ("WORKER_QUEUES", ":3", "entry ':3': '' is not a queue name"),
        ("WORKER_QUEUES", "a,a:2", "entry 'a:2': queue 'a' is listed twice"),
        ("WORKER_QUEUES", "bad name", "'bad name' is not a queue name"),
        ("WORKER_STRICT_PRIORITY", "true", "WORKER_STRICT_PRIORITY=true needs WORKER_QUEUES"),
        ("WORKER_SHUTDOWN_TIMEOUT", "soon", "WORKER_SHUTDOWN_TIMEOUT='soon': 'soon' is not a duration"),
        # Each was an OverflowError: longer than a timedelta holds.
        ("WORKER_MIN_BACKOFF", "1e20", "WORKER_MIN_BACKOFF='1e20': '1e20' is longer than a duration can be"),
        ("WORKER_SHUTDOWN_TIMEOUT", "9999999999d", "'9999999999d' is longer than a duration can be (999999999 days)"),
        ("WORKER_MAX_RETRIES", "-1", "WORKER_MAX_RETRIES='-1'"),
        ("WORKER_SETTLE_WINDOW", "2s", "WORKER_SETTLE_WINDOW='2s'"),
        ("WORKER_STRICT_PRIORITY", "maybe", "WORKER_STRICT_PRIORITY='maybe'"),
        ("VALKEY_ADDR", "localhost", "VALKEY_ADDR='localhost' is not host:port"),
        ("VALKEY_DB", "-2", "VALKEY_DB='-2'"),
        ("LOG_LEVEL", "loud", "LOG_LEVEL='loud': expected one of"),
        ("REDIS_URL", "http://bob:hunter2@cache/0", "REDIS_URL='http://bob:***@cache/0' has scheme 'http'"),
        ("LOG_FORMAT", "xml", "LOG_FORMAT='xml'"),
        ("LOG_EXPORTER", "loki", "LOG_EXPORTER='loki': Input should be 'otlp' or 'none'"),
        ("OTEL_LOGS_EXPORTER", "otlp,none", "OTEL_LOGS_EXPORTER='otlp,none': 'none' cannot be combined"),
        ("OTEL_TRACES_EXPORTER", "none,otlp", "OTEL_TRACES_EXPORTER='none,otlp': 'none' cannot be combined"),
        ("OTEL_EXPORTER_PROMETHEUS_PORT", "99999", "OTEL_EXPORTER_PROMETHEUS_PORT='99999'"),
        ("SENTRY_TRACES_SAMPLE_RATE", "2", "SENTRY_TRACES_SAMPLE_RATE='2'"),
        ("SENTRY_CRONS", "sometimes", "SENTRY_CRONS='sometimes'"),
        ("SCHEDULER_MISFIRE_THRESHOLD", "500ms", "SCHEDULER_MISFIRE_THRESHOLD must be at least 1s"),
        ("SCHEDULER_MISFIRE_THRESHOLD", "2h", "SCHEDULER_MISFIRE_THRESHOLD (2h) must not be longer than SCHED"),
    ],
)
def test_an_invalid_value_names_the_variable_and_the_value(env, name, value, message):
    env.setenv(name, value)
    with pytest.raises(gp.ConfigError) as raised:
        gp.Settings.from_env()
    assert message in str(raised.value)
    assert "hunter2" not in str(raised.value)


def test_the_misfire_threshold_defaults_to_a_minute_and_never_exceeds_the_catch_up_grace(env):
    assert gp.Settings.from_env().scheduler.misfire_threshold == timedelta(minutes=1)
    env.setenv("SCHEDULER_CATCHUP_GRACE", "30s")
    assert gp.Settings.from_env().scheduler.misfire_threshold == timedelta(seconds=30)


def test_every_problem_is_reported_at_once(env):
    env.setenv("WORKER_QUEUES", ":")
    env.setenv("VALKEY_DB", "x")
    with pytest.raises(gp.ConfigError, match=r"WORKER_QUEUES=.*; VALKEY_DB="):
        gp.Settings.from_env()


def test_redis_url_and_valkey_addr_together_are_ambiguous(env):
    env.setenv("REDIS_URL", "redis://cache:6379/0")
    env.setenv("VALKEY_ADDR", "other:6379")
    with pytest.raises(gp.ConfigError, match="set either REDIS_URL or VALKEY_ADDR, not both"):
        gp.Settings.from_env()


def test_passwords_never_show(env):
    env.setenv("VALKEY_USERNAME", "app")
    env.setenv("VALKEY_PASSWORD", "p@ss/word")
    env.setenv("VALKEY_TLS", "1")
    queue = gp.Settings.from_env().redis
    assert queue.display() == "rediss://app:***@127.0.0.1:6379/0"
    assert queue.connection_url() == "rediss://app:p%40ss%2Fword@127.0.0.1:6379/0"
    env.setenv("VALKEY_DB", "nope")
    with pytest.raises(gp.ConfigError) as raised:
        gp.Settings.from_env()
    assert "p@ss" not in str(raised.value)


def test_valkey_urls_are_accepted(env):
    env.setenv("REDIS_URL", "valkey://cache:6379/2")
    assert gp.Settings.from_env().redis.connection_url() == "redis://cache:6379/2"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("500ms", timedelta(milliseconds=500)),
        ("1h30m", timedelta(minutes=90)),
        ("45", timedelta(seconds=45)),
        ("7d", timedelta(days=7)),
        ("1.5s", timedelta(seconds=1.5)),
    ],
)
def test_durations(text, expected):
    assert parse_duration(text) == expected
    assert parse_duration(format_duration(expected)) == expected


@pytest.mark.parametrize("text", ["", "h", "1x", "-5s", "1h-30m"])
def test_bad_durations(text):
    with pytest.raises(ValueError):
        parse_duration(text)


def test_the_retry_budget_comes_from_the_environment_and_spans_days_not_months(make_kit, clean_env):
    kit = make_kit(env={"WORKER_MAX_RETRIES": "7"})
    (retries,) = [m for m in kit.broker.middleware if isinstance(m, dramatiq.middleware.Retries)]
    assert retries.max_retries == 7
    assert retries.max_backoff == 4 * 3600 * 1000
    clean_env.delenv("WORKER_MAX_RETRIES")
    default = make_kit()
    (retries,) = [m for m in default.broker.middleware if isinstance(m, dramatiq.middleware.Retries)]
    assert retries.max_retries == 25
    # Upper bound of the whole budget: every delay at its cap.
    worst_case_ms = sum(min(retries.min_backoff * 2**n * 2, retries.max_backoff) for n in range(25))
    assert timedelta(days=1) < timedelta(milliseconds=worst_case_ms) < timedelta(days=5)


def test_telemetry_variables(env):
    settings = gp.Settings.from_env()
    assert (settings.log.format, settings.otel.traces(), settings.otel.metrics()) == ("text", (), ())
    assert settings.sentry.dsn is None and settings.sentry.crons is True
    env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    env.setenv("LOG_FORMAT", "JSON")
    settings = gp.Settings.from_env()
    assert (settings.log.format, settings.otel.traces(), settings.otel.metrics()) == ("json", ("otlp",), ("otlp",))
    env.setenv("OTEL_METRICS_EXPORTER", "prometheus, console")
    env.setenv("OTEL_TRACES_EXPORTER", "none")
    settings = gp.Settings.from_env()
    assert (settings.otel.traces(), settings.otel.metrics()) == ((), ("prometheus", "console"))
    env.setenv("OTEL_SDK_DISABLED", "true")
    assert gp.Settings.from_env().otel.metrics() == ()


def test_a_sentry_dsn_never_shows(env):
    env.setenv("SENTRY_DSN", "https://secretkey@o1.ingest.sentry.io/2")
    env.setenv("SENTRY_TRACES_SAMPLE_RATE", "lots")
    with pytest.raises(gp.ConfigError) as raised:
        gp.Settings.from_env()
    assert "secretkey" not in str(raised.value) and "SENTRY_TRACES_SAMPLE_RATE='lots'" in str(raised.value)


def test_an_empty_sentry_dsn_is_sentry_off_as_sentry_sdk_reads_it(env):
    env.setenv("SENTRY_DSN", " ")
    assert gp.Settings.from_env().sentry.dsn is None


# -- DB_HOST, DB_PORT, DB_USER, DB_PASSWORD, DB_NAME ------------------------------------

#: Characters that a URL must escape, so a password that reaches the server proves the quoting.
DB_PASSWORD = "p@ss:w/rd %?#"


@pytest.fixture(scope="module")
def password_postgres(tmp_path_factory):
    """A PostgreSQL of this module's own where user ``shop`` must give its password to reach database ``shop``."""
    server = OwnPostgres(tmp_path_factory.mktemp("pg"))
    # First match wins: the superuser (and the start-up check) is trusted, everyone else needs a password.
    (server.data / "pg_hba.conf").write_text(
        "local all postgres trust\nhost all postgres 127.0.0.1/32 trust\nhost all all 127.0.0.1/32 scram-sha-256\n"
    )
    server.start()
    with psycopg.connect(server.url.replace("+psycopg", ""), autocommit=True) as conn:
        conn.execute(psycopg.sql.SQL("CREATE ROLE shop LOGIN PASSWORD {}").format(DB_PASSWORD))
        conn.execute("CREATE DATABASE shop OWNER shop")
    try:
        yield server
    finally:
        server.stop()
        server.remove()


def _db_parts(env, server, password=DB_PASSWORD):
    env.setenv("DB_HOST", "127.0.0.1")
    env.setenv("DB_PORT", str(server.port))
    env.setenv("DB_USER", "shop")
    env.setenv("DB_PASSWORD", password)
    env.setenv("DB_NAME", "shop")


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "dramatiq_gp", *args], capture_output=True, text=True, timeout=60)


@gp.event("test.settings.placed")
@dataclass(frozen=True)
class Placed:
    n: int


def test_the_cli_and_a_kit_reach_postgresql_through_the_db_parts(clean_env, password_postgres, make_kit):
    _db_parts(clean_env, password_postgres)
    shown = f"postgresql+psycopg://shop:***@127.0.0.1:{password_postgres.port}/shop"
    migrated = _cli("migrate", "up")
    assert migrated.returncode == 0, migrated.stderr
    assert migrated.stdout.splitlines() == [
        f"inbox table 'inbox_messages' is up to date in {shown}",
        f"outbox table 'outbox_events' is up to date in {shown}",
    ]

    kit = make_kit(lambda registry, schedule: registry.listen(Placed, lambda event: None, name="noop"))
    with kit.engine.connect() as conn:
        where = conn.execute(sa.text("SELECT current_user, current_database(), inet_server_port()")).one()
    assert tuple(where) == ("shop", "shop", password_postgres.port)
    event_id = kit.dispatch(Placed(1))  # through the outbox, in database shop
    kit.engine.dispose()
    status = _cli("status", "--json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["outbox"]["pending"] == 1
    as_superuser = sa.make_url(password_postgres.url).set(drivername="postgresql", database="shop")
    with psycopg.connect(as_superuser.render_as_string()) as conn:
        rows = conn.execute("SELECT id::text, event FROM outbox_events").fetchall()
    assert rows == [(event_id, "test.settings.placed")]


def test_a_wrong_db_password_is_refused_in_one_line_that_hides_it(clean_env, password_postgres):
    _db_parts(clean_env, password_postgres, password="hunter2")
    done = _cli("migrate", "status")
    assert done.returncode == 1 and done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith(
        f"Error: database error at postgresql+psycopg://shop:***@127.0.0.1:{password_postgres.port}/shop: "
    )
    assert 'password authentication failed for user "shop"' in line
    assert "hunter2" not in line


@pytest.mark.parametrize(
    ("part", "value"),
    [("DB_HOST", "db"), ("DB_PORT", "5433"), ("DB_USER", "app"), ("DB_PASSWORD", "hunter2"), ("DB_NAME", "app")],
)
def test_db_url_beside_any_db_part_is_one_line_naming_both(env, part, value):
    env.setenv("DB_URL", "postgresql://app@db/app")
    env.setenv(part, value)
    done = _cli("migrate", "status")
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr == f"Error: invalid configuration: set either DB_URL or {part}, not both\n"
    with pytest.raises(gp.ConfigError, match=f"set either DB_URL or {part}, not both"):
        gp.Settings.from_env()


@pytest.mark.parametrize(("part", "value"), [("DB_USER", "app"), ("DB_PASSWORD", "hunter2"), ("DB_NAME", "app")])
def test_a_db_part_without_db_host_is_one_line_not_silently_no_database(env, part, value):
    env.setenv(part, value)
    done = _cli("migrate", "status")
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr == f"Error: invalid configuration: {part} set without DB_HOST: give DB_HOST (or DB_URL) too\n"
    assert "hunter2" not in done.stderr


@pytest.mark.parametrize(
    ("env_vars", "named"),
    [
        ({"VALKEY_TLS_INSECURE": "true"}, "VALKEY_TLS_INSECURE"),
        ({"VALKEY_TLS_INSECURE": "true", "REDIS_URL": "redis://127.0.0.1:6379/0"}, "VALKEY_TLS_INSECURE"),
    ],
    ids=["addr", "plain-url"],
)
def test_tls_options_without_tls_are_one_line_not_silently_ignored(env, env_vars, named):
    for name, value in env_vars.items():
        env.setenv(name, value)
    with pytest.raises(gp.ConfigError, match=f"{named} set but the connection is not TLS"):
        gp.Settings.from_env()
    env.setenv("VALKEY_TLS", "true")
    if "REDIS_URL" not in env_vars:
        assert gp.Settings.from_env().redis.client_options()["ssl_cert_reqs"] == "none"


# -- SCHEDULER_CATCHUP_MAX ---------------------------------------------------------------


def test_scheduler_catchup_max_fires_only_the_latest_missed_ticks(make_kit, rdb, namespace, caplog):
    kit = make_kit(
        lambda registry, schedule: schedule.job("every_second", "@every 1s", lambda: None),
        env={
            "SCHEDULER_LEASE_TTL": "1500ms",
            "SCHEDULER_CATCHUP": "all",
            "SCHEDULER_CATCHUP_MAX": "3",
            "SCHEDULER_MISFIRE_THRESHOLD": "1s",
        },
    )
    # The last leader's last fired tick, 10.5 s before the current second began: 11 or more were missed since.
    last = datetime.now(UTC).replace(microsecond=0) - timedelta(seconds=10, milliseconds=500)
    rdb.hset(f"{namespace}:scheduler:last_fired", "every_second", int(last.timestamp() * 1000))
    caplog.set_level(logging.INFO, "dramatiq_gp.scheduler")
    kit.scheduler.start()
    try:
        wait_for(lambda: rdb.hlen(f"{namespace}:default.msgs") >= 5, timeout=5)
    finally:
        kit.scheduler.stop()
    logged = messages_of(caplog, "dramatiq_gp.scheduler")
    caught_up = [datetime.fromisoformat(re.search(r"scheduled_at=(\S+)", m)[1]) for m in logged if "(catch-up)" in m]
    # The three latest misfires, and the tick less than the 1 s threshold late, which is on time.
    assert len(caught_up) == 4
    assert [b - a for a, b in itertools.pairwise(caught_up)] == [timedelta(seconds=1)] * 3
    queued = sorted(
        datetime.fromisoformat(json.loads(m)["args"][0]["scheduled_at"]) for m in rdb.hvals(f"{namespace}:default.msgs")
    )
    assert queued[0] == caught_up[0]  # nothing older than the three misfires was fired
    skipped = int((caught_up[0] - (last + timedelta(milliseconds=500))).total_seconds())
    assert skipped >= 7
    assert (
        f"schedule runner: every_second: {skipped} missed tick(s) not fired "
        "(SCHEDULER_CATCHUP=all: more than SCHEDULER_MISFIRE_THRESHOLD late)"
    ) in logged


# -- OUTBOX_POLL_INTERVAL_MIN -------------------------------------------------------------


def test_an_idle_relay_polls_first_after_outbox_poll_interval_min_then_backs_off_to_the_max(make_kit, engine):
    polls: list[tuple[float, int]] = []  # when the relay looked for rows, and how many it got

    def looked(conn, cursor, statement, parameters, context, executemany):
        if statement.startswith("SELECT") and "FOR UPDATE SKIP LOCKED" in statement:
            polls.append((time.monotonic(), cursor.rowcount))

    sa.event.listen(engine, "after_cursor_execute", looked)
    env = {"OUTBOX_NOTIFY": "false", "OUTBOX_POLL_INTERVAL_MIN": "200ms", "OUTBOX_POLL_INTERVAL_MAX": "800ms"}
    kit = make_kit(env=env, engine=engine)
    kit.relay.start()
    try:
        wait_for(lambda: len(polls) >= 5, timeout=10)
        with engine.begin() as conn:
            gp.dispatch(conn, Placed(1))
        busy = wait_for(lambda: next((i for i, (_, rows) in enumerate(polls) if rows), None), timeout=10)
        wait_for(lambda: len(polls) >= busy + 4, timeout=10)
    finally:
        kit.relay.stop()
        kit.relay.close()

    def gaps(first, count):
        return [round(polls[i + 1][0] - polls[i][0], 2) for i in range(first, first + count)]

    for gap, expected in zip(gaps(0, 4), [0.2, 0.4, 0.8, 0.8], strict=True):
        assert expected <= gap <= expected + 0.25, gaps(0, 4)
    # After a round with rows it looks again at once, then pauses the minimum again.
    after = gaps(busy, 3)
    assert after[0] < 0.1, after
    assert 0.2 <= after[1] <= 0.45 and 0.4 <= after[2] <= 0.65, after


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://bob:hunter2@cache/0", "redis://bob:***@cache/0"),
        ("redis://cache/0?password=hunter2", "redis://cache/0?password=***"),
        (
            "postgresql://u@h/db?sslmode=require&password=hunter2&sslpassword=hunter2",
            "postgresql://u@h/db?sslmode=require&password=***&sslpassword=***",
        ),
        ("amqp://h/%2F?heartbeat=30&auth_token=hunter2", "amqp://h/%2F?heartbeat=30&auth_token=***"),
        ("redis://cache/0?PASSWD=hunter2&api_key=hunter2&db=1", "redis://cache/0?PASSWD=***&api_key=***&db=1"),
        ("redis://[::1/0?password=hunter2", "***"),  # not a URL at all: none of it shows
    ],
    ids=["userinfo", "query-password", "libpq-query", "token", "mixed-case-and-key", "unparseable"],
)
def test_redact_url_hides_the_password_in_the_address_and_in_the_query(url, shown):
    assert redact_url(url) == shown


def test_a_password_in_the_query_of_a_url_never_shows_where_the_url_is_printed(clean_env, password_postgres, caplog):
    # The CLI's errors, the dashboard command's, its banner and the worker's start-up line print the address.
    clean_env.setenv("REDIS_URL", "redis://127.0.0.1:1/0?password=hunter2")
    for command in (["status"], ["dashboard", "--port", "0"], ["dlq", "list", "default"]):
        done = _cli(*command)
        assert done.returncode != 0 and "hunter2" not in done.stdout + done.stderr, (command, done.stderr)
        assert "redis://127.0.0.1:1/0?password=***" in done.stderr, (command, done.stderr)
    with pytest.raises(SystemExit), caplog.at_level(logging.ERROR):
        gp.Kit(registry=gp.Registry()).broker.emit_after("process_boot")
    assert "Redis/Valkey unreachable at redis://127.0.0.1:1/0?password=***" in caplog.text
    assert "hunter2" not in caplog.text
    clean_env.delenv("REDIS_URL")
    url = f"postgresql+psycopg://shop@127.0.0.1:{password_postgres.port}/shop"
    clean_env.setenv("DB_URL", f"{url}?password={urllib.parse.quote(DB_PASSWORD, safe='')}")
    migrated = _cli("migrate", "up")
    assert migrated.returncode == 0, migrated.stderr
    assert f"is up to date in {url}?password=***" in migrated.stdout and DB_PASSWORD not in migrated.stdout
    clean_env.setenv("DB_URL", f"{url}?password=hunter2")
    refused = _cli("migrate", "status")
    assert refused.returncode == 1 and "hunter2" not in refused.stderr
    assert f"database error at {url}?password=***" in refused.stderr


@pytest.mark.parametrize(
    ("variable", "url", "error"),
    [
        ("REDIS_URL", "redis://u:hunter2@cache:abc/0", "REDIS_URL='redis://u:***@cache:abc/0' cannot be read: Port"),
        ("REDIS_URL", "redis://cache:99999/0", "REDIS_URL='redis://cache:99999/0' cannot be read: Port out of range"),
        ("REDIS_URL", "redis://[::1/0?password=hunter2", "REDIS_URL='***' cannot be read: Invalid IPv6 URL"),
        ("REDIS_URL", "unix:///tmp/r.sock?db=x", "REDIS_URL='unix:///tmp/r.sock?db=x' cannot be read: Invalid value"),
        ("BROKER_URL", "amqp://g:hunter2@rabbit:abc/", "BROKER_URL='amqp://g:***@rabbit:abc/' cannot be read: Port"),
        ("DB_URL", "postgresql://u:hunter2@db:x/shop", "DB_URL='postgresql://u:***@db:x/shop' cannot be read:"),
        ("DB_URL", "not a url", "DB_URL='not a url' cannot be read: Could not parse"),
        # These three were a traceback from the first connection.
        (
            "DB_URL",
            "mysql://u:hunter2@db/shop",
            "DB_URL='mysql://u:***@db/shop': the outbox needs PostgreSQL (or SQLite)",
        ),
        ("DB_URL", "postgresql+psycopg2://u:hunter2@db/s", "its driver cannot be loaded (No module named 'psycopg2')"),
        (
            "BROKER_URL",
            "amqp://g:hunter2@rabbit/%2F?password=hunter2",
            "BROKER_URL='amqp://g:***@rabbit/%2F?password=***' cannot be read: Unknown URL parameter: 'password'",
        ),
        ("BROKER_URL", "amqp://g@rabbit/?password=hunter2", "BROKER_URL='amqp://g@rabbit/?password=***' names a user"),
        (
            "REDIS_URL",
            "redis://:hunter2@cache/0?bogus=1&socket_timeout=2",
            "REDIS_URL='redis://:***@cache/0?bogus=1&socket_timeout=2' cannot be read: unknown URL parameter 'bogus'",
        ),
        ("SENTRY_DSN", "https://hunter2@o1.ingest.sentry.io/", "SENTRY_DSN is not a valid Sentry DSN (Invalid project"),
        ("SENTRY_DSN", "o1.ingest.sentry.io/2", "SENTRY_DSN is not a valid Sentry DSN (Unsupported scheme"),
    ],
    ids=[
        "redis-port",
        "redis-port-range",
        "redis-ipv6",
        "redis-db",
        "amqp-port",
        "db-port",
        "db-garbage",
        "db-mysql",
        "db-driver",
        "amqp-password-parameter",
        "amqp-no-password",
        "redis-unknown-parameter",
        "sentry-project",
        "sentry-scheme",
    ],
)
def test_a_malformed_url_is_one_configuration_error_naming_the_variable_never_the_password(env, variable, url, error):
    # These gave a 40-line traceback from the library that first read them, at start-up or in the CLI.
    env.setenv(variable, url)
    with pytest.raises(gp.ConfigError) as raised:
        gp.Settings.from_env()
    assert error in str(raised.value) and "hunter2" not in str(raised.value)
    assert len(str(raised.value).splitlines()) == 1
    done = _cli("status")
    assert done.returncode == 1 and len(done.stderr.splitlines()) == 1 and error in done.stderr, done.stderr
