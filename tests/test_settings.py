"""Configuration from the environment: defaults, parsing, and errors that name the variable."""

from __future__ import annotations

from datetime import timedelta

import dramatiq
import pytest

import dramatiq_gp as gp
from dramatiq_gp.durations import format_duration, parse_duration


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
    assert settings.queue.display() == "redis://127.0.0.1:6379/0"
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
        ("WORKER_MAX_RETRIES", "-1", "WORKER_MAX_RETRIES='-1'"),
        ("WORKER_STRICT_PRIORITY", "maybe", "WORKER_STRICT_PRIORITY='maybe'"),
        ("VALKEY_ADDR", "localhost", "VALKEY_ADDR='localhost' is not host:port"),
        ("VALKEY_DB", "-2", "VALKEY_DB='-2'"),
        ("LOG_LEVEL", "loud", "LOG_LEVEL='loud': expected one of"),
        ("REDIS_URL", "http://bob:hunter2@cache/0", "REDIS_URL='http://bob:***@cache/0' has scheme 'http'"),
        ("LOG_FORMAT", "xml", "LOG_FORMAT='xml'"),
        ("OTEL_TRACES_EXPORTER", "none,otlp", "OTEL_TRACES_EXPORTER='none,otlp': 'none' cannot be combined"),
        ("OTEL_EXPORTER_PROMETHEUS_PORT", "99999", "OTEL_EXPORTER_PROMETHEUS_PORT='99999'"),
        ("SENTRY_TRACES_SAMPLE_RATE", "2", "SENTRY_TRACES_SAMPLE_RATE='2'"),
        ("SENTRY_CRONS", "sometimes", "SENTRY_CRONS='sometimes'"),
    ],
)
def test_an_invalid_value_names_the_variable_and_the_value(env, name, value, message):
    env.setenv(name, value)
    with pytest.raises(gp.ConfigError) as raised:
        gp.Settings.from_env()
    assert message in str(raised.value)
    assert "hunter2" not in str(raised.value)


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
    queue = gp.Settings.from_env().queue
    assert queue.display() == "rediss://app:***@127.0.0.1:6379/0"
    assert queue.connection_url() == "rediss://app:p%40ss%2Fword@127.0.0.1:6379/0"
    env.setenv("VALKEY_DB", "nope")
    with pytest.raises(gp.ConfigError) as raised:
        gp.Settings.from_env()
    assert "p@ss" not in str(raised.value)


def test_valkey_urls_are_accepted(env):
    env.setenv("REDIS_URL", "valkey://cache:6379/2")
    assert gp.Settings.from_env().queue.connection_url() == "redis://cache:6379/2"


@pytest.mark.parametrize(
    ("text", "expected"),
    [("500ms", timedelta(milliseconds=500)), ("1h30m", timedelta(minutes=90)), ("45", timedelta(seconds=45)),
     ("7d", timedelta(days=7)), ("1.5s", timedelta(seconds=1.5))],
)  # fmt: skip
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
