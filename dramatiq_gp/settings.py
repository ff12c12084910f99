"""Configuration from environment variables, one group per prefix (docs/configuration.md).

Each group is a pydantic-settings class. Nothing reads the environment at import
time: :meth:`Settings.from_env` does, and turns validation failures into one
:class:`~dramatiq_gp.errors.ConfigError` that names every bad variable and its
value, with secrets redacted.
"""

from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar
from urllib.parse import quote, urlsplit, urlunsplit
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import AfterValidator, BeforeValidator, Field, SecretStr, ValidationError, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from .durations import format_duration, parse_duration
from .errors import ConfigError

if TYPE_CHECKING:
    import redis
    import sqlalchemy as sa

#: Dramatiq's own rule for queue names.
QUEUE_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9._-]*")

Duration = Annotated[timedelta, BeforeValidator(parse_duration)]


def parse_queues(value: object) -> dict[str, int] | None:
    """Parse ``default:3,mail:1`` into ``{"default": 3, "mail": 1}``; a bare name weighs 1.

    A weight is a whole number >= 0 (0: only when the other queues are empty); at
    least one must be above 0.
    """
    if value is None or isinstance(value, dict):
        return value
    if not isinstance(value, str) or not value.strip():
        raise ValueError("expected name:weight pairs separated by commas, e.g. default:3,mail:1")
    queues: dict[str, int] = {}
    for item in value.split(","):
        entry = item.strip()
        name, sep, weight_text = (part.strip() for part in item.partition(":"))
        if not QUEUE_NAME.fullmatch(name):
            raise ValueError(f"entry {entry!r}: {name!r} is not a queue name (letters, digits, '.', '_', '-')")
        if name in queues:
            raise ValueError(f"entry {entry!r}: queue {name!r} is listed twice")
        if sep and not weight_text.isdigit():
            raise ValueError(f"entry {entry!r}: weight {weight_text!r} is not a whole number >= 0")
        queues[name] = int(weight_text) if sep else 1
    if not any(queues.values()):
        raise ValueError("every weight is 0; at least one queue needs a weight above 0")
    return queues


def _log_level(value: object) -> str:
    level = str(value).strip().upper()
    level = {"WARN": "WARNING", "FATAL": "CRITICAL"}.get(level, level)
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ValueError("expected one of DEBUG, INFO, WARN, ERROR")
    return level


def _existing_file(path: str | None) -> str | None:
    # Checked here: the TLS library's own error names neither the variable nor the file.
    if path is not None and not Path(path).is_file():
        raise ValueError("no such file")
    return path


#: Query parameters that carry a secret (``?password=``, libpq's ``sslpassword``, ``?token=``...): shown as ``***``.
SECRET_QUERY = re.compile(r"pass|pwd|secret|token|key|auth|credential", re.IGNORECASE)


def _readable_url(variable: str, url: str) -> Any:
    """``url`` split, with its port read; a ValueError naming ``variable`` (never the password) if it cannot be."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 -- reading it checks it
    except ValueError as exc:
        raise ValueError(f"{variable}={redact_url(url)!r} cannot be read: {exc}") from None
    return parts


def _secrets_hidden(text: str, url: str) -> str:
    """``text`` (a library's error about ``url``) with the password and secret query values of ``url`` as ``***``."""
    try:
        parts = urlsplit(url)
        secrets = [parts.password or ""]
    except ValueError:
        return text
    secrets += [v for k, _, v in (p.partition("=") for p in parts.query.split("&")) if SECRET_QUERY.search(k)]
    for secret in filter(None, secrets):
        text = text.replace(secret, "***")
    return text


def _unknown_redis_options(url: str) -> list[str]:
    """The query parameters of ``url`` that redis-py passes on to a connection that takes none of that name (it
    fails then, at the first command, on every try)."""
    import inspect

    import redis
    import redis.connection

    options = redis.connection.parse_url(url)  # type: ignore[no-untyped-call]
    kind = options.pop("connection_class", redis.connection.Connection)
    known = set(inspect.signature(redis.ConnectionPool.__init__).parameters)
    for klass in kind.__mro__:
        if "__init__" in vars(klass):
            known |= set(inspect.signature(klass.__init__).parameters)
    return sorted(set(options) - known)


def redact_url(url: str) -> str:
    """``redis://user:secret@host/0?password=x`` -> ``redis://user:***@host/0?password=***``.

    The password in the address and every query parameter whose name says it is
    a secret (:data:`SECRET_QUERY`): libpq and redis-py both read one from the query.
    """
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:  # not even a URL (a bad port, a stray bracket): show none of it
        return "***"
    redacted = parts
    if password is not None:
        redacted = redacted._replace(netloc=f"{parts.username or ''}:***@{parts.netloc.rpartition('@')[2]}")
    if parts.query:
        pairs = (pair.partition("=") for pair in parts.query.split("&"))
        query = "&".join(f"{k}{eq}{'***' if eq and SECRET_QUERY.search(k) else v}" for k, eq, v in pairs)
        redacted = redacted._replace(query=query)
    # Rebuilt only when something was hidden: urlunsplit writes unix:///x.sock as unix:/x.sock.
    return url if redacted == parts else urlunsplit(redacted)


class WorkerSettings(BaseSettings):
    """``WORKER_*``: how the worker consumes, retries and shuts down."""

    model_config = SettingsConfigDict(env_prefix="WORKER_", extra="ignore")

    #: Queues to consume as ``name:weight`` pairs; unset means every declared queue.
    queues: Annotated[dict[str, int] | None, NoDecode, BeforeValidator(parse_queues)] = None
    strict_priority: bool = False
    #: How long in-flight tasks may run on after SIGTERM; unset means the dramatiq
    #: CLI's ``--worker-shutdown-timeout``.
    shutdown_timeout: Duration | None = None
    max_retries: int = Field(default=25, ge=0)
    min_backoff: Duration = timedelta(seconds=15)
    #: Caps each retry's delay, so 25 retries span about two days, not two months.
    max_backoff: Duration = timedelta(hours=4)
    #: How long a completed message id is remembered, so a duplicate is skipped.
    dedup_retention: Duration = timedelta(hours=24)
    #: How long messages for a task type nobody here handles are held (a newer
    #: worker may know it) before they are skipped.
    unknown_task_grace: Duration = timedelta(minutes=5)
    #: How long the acks of finished messages are collected to be written in one
    #: Redis call; a worker killed outright may run that window's messages again. 0: one call per message.
    settle_window: Duration = Field(default=timedelta(milliseconds=1), ge=timedelta(0), le=timedelta(seconds=1))
    #: Leave what the worker holds at boot out of every later garbage collection (``gp.GcFreeze``).
    gc_freeze: bool = True
    #: A listener no live worker has declared for this long is retired from every fan-out.
    listener_retirement: Duration = Field(default=timedelta(minutes=10), ge=timedelta(seconds=1))
    #: Serve ``/livez`` and ``/readyz`` on this port (one per process group: whichever process binds it
    #: answers for all of them); unset: no HTTP endpoint (``dramatiq-gp health`` still answers).
    health_port: int | None = Field(default=None, gt=0, lt=65536)
    #: Where the health endpoint listens: every interface by default, since the kubelet probes the pod's address.
    health_host: str = "0.0.0.0"
    #: How often each worker process judges and records its health (dependencies pinged, user checks run).
    health_interval: Duration = Field(default=timedelta(seconds=5), ge=timedelta(milliseconds=100))

    @model_validator(mode="after")
    def _backoff_order(self) -> WorkerSettings:
        if self.strict_priority and not self.queues:
            raise ValueError(
                "WORKER_STRICT_PRIORITY=true needs WORKER_QUEUES to rank the queues (e.g. critical:3,default:1)"
            )
        if self.max_backoff < self.min_backoff:
            raise ValueError("WORKER_MAX_BACKOFF must not be shorter than WORKER_MIN_BACKOFF")
        if self.max_backoff > timedelta(days=7):
            raise ValueError("WORKER_MAX_BACKOFF must be at most 7d (Dramatiq's longest delay)")
        return self


def parse_sentinels(value: object) -> tuple[tuple[str, int], ...] | None:
    """Parse ``sentinel-1:26379,sentinel-2:26379`` into ``(("sentinel-1", 26379), ("sentinel-2", 26379))``.

    An IPv6 address goes in brackets (``[::1]:26379``): unbracketed, its last colon
    could be the port's or the address's own.
    """
    if value is None or isinstance(value, tuple):
        return value
    if not isinstance(value, str) or not value.strip():
        raise ValueError("expected host:port pairs separated by commas, e.g. sentinel-1:26379,sentinel-2:26379")
    sentinels: list[tuple[str, int]] = []
    for item in value.split(","):
        entry = item.strip()
        if "@" in entry or "://" in entry:
            # Said without the entry: it may hold a password (the error line shows the variable redacted).
            raise ValueError(
                "give host:port pairs only: the Sentinels' credentials are VALKEY_SENTINEL_USERNAME and "
                "VALKEY_SENTINEL_PASSWORD, the data's VALKEY_USERNAME and VALKEY_PASSWORD"
            )
        host, sep, port = entry.rpartition(":")
        bracketed = host.startswith("[") and host.endswith("]")
        host = host[1:-1] if bracketed else host
        if ":" in host and not bracketed:
            raise ValueError(f"entry {entry!r}: put an IPv6 address in brackets, e.g. [::1]:26379")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or re.search(r"[\s/@]", host):
            raise ValueError(f"entry {entry!r} is not host:port (e.g. sentinel-1:26379)")
        if (host, int(port)) in sentinels:
            raise ValueError(f"entry {entry!r} is listed twice")
        sentinels.append((host, int(port)))
    return tuple(sentinels)


def _master_name(name: str) -> str:
    if not name or re.search(r"\s", name):
        raise ValueError("expected the name the Sentinels monitor the primary under (no spaces), e.g. mymaster")
    return name


#: How long a Sentinel may take to accept a connection or answer, unless the caller gave a timeout: it
#: is asked for the primary at every new connection, and one that hangs would stall each of them.
SENTINEL_TIMEOUT_S = 2.0
#: How much of one Sentinel's error its answer shows (redis-py's error texts are one sentence).
MAX_ANSWER = 120


@functools.cache
def _sentinel_pool_class() -> type:
    """redis-py's Sentinel pool, whose full disconnect also closes its connections to the Sentinels.

    The kit closes a client by disconnecting its pool; the Sentinels' own clients
    would otherwise keep their sockets until the garbage collector finds them.
    Built on first use, so that reading the settings does not import redis.
    """
    from redis.sentinel import SentinelConnectionPool

    class KitSentinelPool(SentinelConnectionPool):
        def disconnect(self, inuse_connections: bool = True) -> None:
            super().disconnect(inuse_connections)
            # A partial disconnect is redis-py's own, on a change of primary: the Sentinels stay.
            if inuse_connections:
                for sentinel in self.sentinel_manager.sentinels:
                    sentinel.connection_pool.disconnect()

    return KitSentinelPool


def _sentinel_class() -> type:
    """redis-py's ``Sentinel``, whose failure to find the primary says briefly which Sentinels it asked and what
    each answered: redis-py's own message holds the full repr of each Sentinel's client (some 1 KB each).
    Built on first use, as :func:`_sentinel_pool_class`."""
    from redis.sentinel import MasterNotFoundError, Sentinel

    class KitSentinel(Sentinel):
        def discover_master(self, service_name: str) -> Any:
            try:
                return super().discover_master(service_name)
            except MasterNotFoundError as exc:
                raise MasterNotFoundError(_sentinel_answers(str(exc), self.sentinels, service_name)) from None

    return KitSentinel


def _sentinel_answers(text: str, sentinels: list[Any], service_name: str) -> str:
    """What each Sentinel answered, from redis-py's message, which lists ``<client repr> - <error>`` for each one
    that failed, and none that answered without a primary that is up."""
    heads = {id(client): f"{client} - " for client in sentinels}
    found = sorted(((text.find(head), key) for key, head in heads.items() if head in text), key=lambda f: f[0])
    if not found and " : " in text:  # errors, but not in the form known: redis-py's words, cut short
        return text[: MAX_ANSWER * 2]
    failed = {}
    for n, (at, key) in enumerate(found):
        end = found[n + 1][0] if n + 1 < len(found) else len(text)
        error = text[at + len(heads[key]) : end].removesuffix(", ")
        failed[key] = (error.partition(": ")[2] or error)[:MAX_ANSWER]  # its text, without the error's class
    answers = []
    for client in sentinels:
        kwargs = client.connection_pool.connection_kwargs
        host, port = kwargs.get("host"), kwargs.get("port")
        where = f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
        answers.append(f"{where}: {failed.get(id(client), f'answered, with no primary {service_name!r} that is up')}")
    return f"no primary {service_name!r} found: " + "; ".join(answers)


class RedisSettings(BaseSettings):
    """``VALKEY_*`` (or ``REDIS_URL``): the Redis/Valkey server the queues live on.

    One server at ``VALKEY_ADDR`` or ``REDIS_URL``, or a primary found through
    Sentinel (``VALKEY_SENTINELS``): then every connection asks the Sentinels
    where the primary is, so a client follows a failover on its next connection,
    without a restart.
    """

    model_config = SettingsConfigDict(env_prefix="VALKEY_", extra="ignore", populate_by_name=True)

    addr: str = "127.0.0.1:6379"
    username: str | None = None
    password: SecretStr | None = None
    db: int = Field(default=0, ge=0)
    tls: bool = False
    tls_ca_file: Annotated[str | None, AfterValidator(_existing_file)] = None
    #: Skip TLS certificate verification (never in production).
    tls_insecure: bool = False
    #: A full URL instead of the parts above: ``redis://``, ``rediss://``, ``unix://``, ``valkey://``.
    url: SecretStr | None = Field(default=None, validation_alias="REDIS_URL")
    #: Prefix of every key (Dramatiq's queues and the kit's own), so apps can share a server.
    namespace: str = Field(default="dramatiq", pattern=r"^[A-Za-z0-9_.\-]+$")
    #: The Sentinels to ask for the primary, instead of ``addr``/``url``; the data connection
    #: takes ``username``, ``password``, ``db`` and the TLS options above.
    sentinels: Annotated[tuple[tuple[str, int], ...] | None, NoDecode, BeforeValidator(parse_sentinels)] = None
    #: The name the Sentinels monitor the primary under (``sentinel monitor <name> ...``).
    sentinel_master: Annotated[str, AfterValidator(_master_name)] = "mymaster"
    #: The Sentinels' own credentials (``requirepass``/ACL of the Sentinels), not the data's.
    sentinel_username: str | None = None
    sentinel_password: SecretStr | None = None

    @model_validator(mode="after")
    def _one_address(self) -> RedisSettings:
        if self.sentinels is not None:
            self._sentinel_only()
        elif self.url is not None:
            if "addr" in self.model_fields_set:
                raise ValueError("set either REDIS_URL or VALKEY_ADDR, not both")
            url = self.url.get_secret_value()
            scheme = _readable_url("REDIS_URL", url).scheme
            if scheme not in ("redis", "rediss", "unix", "valkey", "valkeys"):
                raise ValueError(
                    f"REDIS_URL={redact_url(url)!r} has scheme {scheme!r}; expected redis://, rediss://, unix:// or valkey://"
                )
            try:  # what redis-py will make of it: a port, a db, the options it takes
                unknown = _unknown_redis_options(
                    url.replace("valkey", "redis", 1) if scheme.startswith("valkey") else url
                )
            except ValueError as exc:
                raise ValueError(f"REDIS_URL={redact_url(url)!r} cannot be read: {exc}") from None
            if unknown:
                names = ", ".join(map(repr, unknown))
                raise ValueError(f"REDIS_URL={redact_url(url)!r} cannot be read: unknown URL parameter {names}")
        else:
            host, sep, port = self.addr.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"VALKEY_ADDR={self.addr!r} is not host:port")
        if self.sentinels is None:
            # Without Sentinels they would be ignored without a word: a password that is never sent, say.
            orphans = [
                f"VALKEY_{name.upper()}"
                for name in ("sentinel_master", "sentinel_username", "sentinel_password")
                if name in self.model_fields_set
            ]
            if orphans:
                raise ValueError(
                    f"{', '.join(orphans)} set without VALKEY_SENTINELS: give the Sentinels too, or unset them"
                )
        tls_options = [
            f"VALKEY_{name.upper()}" for name in ("tls_ca_file", "tls_insecure") if name in self.model_fields_set
        ]
        if tls_options and not self._uses_tls():
            # They only apply to a TLS connection; on any other they would be ignored without a word.
            raise ValueError(
                f"{', '.join(tls_options)} set but the connection is not TLS: set VALKEY_TLS=true (or use rediss://)"
            )
        return self

    def _sentinel_only(self) -> None:
        """Behind Sentinel the Sentinels say where the primary is: an address of its own would contradict them."""
        if self.url is not None:
            raise ValueError(
                "set either VALKEY_SENTINELS or REDIS_URL, not both "
                "(behind Sentinel the password and database are VALKEY_PASSWORD and VALKEY_DB)"
            )
        if "addr" in self.model_fields_set:
            raise ValueError("set either VALKEY_SENTINELS or VALKEY_ADDR, not both (the Sentinels name the primary)")

    def _uses_tls(self) -> bool:
        if self.url is not None and self.sentinels is None:
            return self.connection_url().startswith("rediss://")
        return self.tls

    def connection_url(self) -> str:
        """The URL to connect with, password included: never log it, use :meth:`display`.

        Raises:
            ConfigError: behind Sentinel, where no one URL reaches the primary (:meth:`client` asks the Sentinels).
        """
        if self.sentinels is not None:
            raise ConfigError("VALKEY_SENTINELS is set: the primary has no fixed URL; use RedisSettings.client()")
        if self.url is not None:
            url = self.url.get_secret_value()
            for old, new in (("valkeys://", "rediss://"), ("valkey://", "redis://")):
                if url.startswith(old):
                    url = new + url[len(old) :]
            return url
        scheme = "rediss" if self.tls else "redis"
        return f"{scheme}://{self._auth(self.password)}{self.addr}/{self.db}"

    def _auth(self, password: SecretStr | None) -> str:
        if not (self.username or password):
            return ""
        secret = password.get_secret_value() if password else ""
        return f"{quote(self.username or '', safe='')}:{quote(secret, safe='')}@"

    def display(self) -> str:
        """Where we connect, safe for logs: the URL with the password replaced by ``***``.

        Behind Sentinel, ``redis+sentinel://<sentinels>/<master name>/<db>``: the
        Sentinels' password is left out, the data's shown as ``***``.
        """
        if self.sentinels is not None:
            scheme = "rediss+sentinel" if self.tls else "redis+sentinel"
            hosts = ",".join(f"[{host}]:{port}" if ":" in host else f"{host}:{port}" for host, port in self.sentinels)
            user = quote(self.username or "", safe="")
            auth = f"{user}:***@" if self.password else f"{user}@" if user else ""
            return f"{scheme}://{auth}{hosts}/{self.sentinel_master}/{self.db}"
        return redact_url(self.connection_url())

    def client_options(self) -> dict[str, Any]:
        """Options for :func:`redis.Redis.from_url` that a URL cannot carry (TCP keepalive, TLS)."""
        unix = self.sentinels is None and self.connection_url().startswith("unix://")
        options: dict[str, Any] = {} if unix else {"socket_keepalive": True}
        if self._uses_tls():
            if self.tls_ca_file:
                options["ssl_ca_certs"] = self.tls_ca_file
            if self.tls_insecure:
                options["ssl_cert_reqs"] = "none"
        return options

    def client(self, **options: Any) -> redis.Redis:
        """A client for this server; ``options`` (timeouts, say) go to :func:`redis.Redis.from_url`.

        Behind Sentinel, a client of the primary from ``Sentinel.master_for``: each
        new connection asks the Sentinels where the primary is, and a connection to
        a primary that is gone or demoted is dropped (redis-py retries the command on
        a new one), so the client follows a failover by itself. The Sentinels take
        the caller's socket timeouts, or :data:`SENTINEL_TIMEOUT_S`.
        """
        import redis

        if self.sentinels is None:
            return redis.Redis.from_url(self.connection_url(), **{**self.client_options(), **options})
        tls = {"ssl": True, **self.client_options()} if self.tls else self.client_options()
        timeouts = {
            name: options.get(name, SENTINEL_TIMEOUT_S) for name in ("socket_connect_timeout", "socket_timeout")
        }
        secret = self.sentinel_password.get_secret_value() if self.sentinel_password else None
        sentinel = _sentinel_class()(
            self.sentinels,
            sentinel_kwargs={**tls, **timeouts, "username": self.sentinel_username, "password": secret},
        )
        password = self.password.get_secret_value() if self.password else None
        data = {**tls, "db": self.db, "username": self.username, "password": password}
        return sentinel.master_for(  # type: ignore[no-untyped-call,no-any-return,unused-ignore]
            self.sentinel_master, connection_pool_class=_sentinel_pool_class(), **{**data, **options}
        )


class RabbitmqSettings(BaseSettings):
    """``BROKER_URL`` and ``RABBITMQ_*``: RabbitMQ for the queues instead of Redis/Valkey.

    Unset, the queues live on the Redis/Valkey of :class:`RedisSettings`. Set, they
    live on RabbitMQ, and that Redis/Valkey keeps only the coordination state (the
    scheduler's lease and ticks, the idempotency claims and done marks).
    """

    model_config = SettingsConfigDict(env_prefix="RABBITMQ_", extra="ignore")

    #: ``amqp://`` or ``amqps://``; several nodes of a cluster separated by ``;``.
    url: SecretStr | None = Field(default=None, validation_alias="BROKER_URL")
    #: ``quorum`` (replicated over the cluster; the default) or ``classic``.
    queue_type: Literal["quorum", "classic"] = "quorum"
    #: How long a send waits for RabbitMQ's confirm before it fails with ``ConfirmTimeout``.
    confirm_timeout: Duration = Field(default=timedelta(seconds=10), ge=timedelta(milliseconds=100))

    @model_validator(mode="after")
    def _amqp(self) -> RabbitmqSettings:
        for url in self.urls():
            parts = _readable_url("BROKER_URL", url)
            scheme = parts.scheme
            if scheme not in ("amqp", "amqps"):
                raise ValueError(
                    f"BROKER_URL={redact_url(url)!r} has scheme {scheme!r}; expected amqp:// or amqps:// "
                    "(unset it to keep the queues on Redis/Valkey, at REDIS_URL)"
                )
            if parts.username and parts.password is None:  # pika fails on it with a TypeError
                raise ValueError(
                    f"BROKER_URL={redact_url(url)!r} names a user without a password: amqp://user:password@host/"
                )
            try:
                import pika
            except ImportError:  # the rabbitmq extra is missing: the broker says so when it is built
                continue
            try:  # what pika will make of it: the query parameters it takes, and their values
                pika.URLParameters(url)
            # ssl_options is a Python literal (SyntaxError) naming files it opens at once (OSError)
            except (ValueError, SyntaxError, OSError) as exc:
                reason = _secrets_hidden(str(exc), url)
                raise ValueError(f"BROKER_URL={redact_url(url)!r} cannot be read: {reason}") from None
        return self

    def urls(self) -> list[str]:
        """The nodes to connect to, passwords included: never log them, use :meth:`display`."""
        return [u.strip() for u in self.url.get_secret_value().split(";") if u.strip()] if self.url else []

    def display(self) -> str:
        return ";".join(redact_url(u) for u in self.urls())


class DatabaseSettings(BaseSettings):
    """``DB_*``: the application's database, where the outbox lives."""

    model_config = SettingsConfigDict(env_prefix="DB_", extra="ignore")

    #: A SQLAlchemy URL; ``postgresql://`` means psycopg 3. Or give the parts below.
    url: SecretStr | None = None
    host: str | None = None
    port: int = Field(default=5432, gt=0, lt=65536)
    user: str = "postgres"
    password: SecretStr | None = None
    name: str = "postgres"
    pool_size: int = Field(default=5, ge=1)

    @model_validator(mode="after")
    def _one_address(self) -> DatabaseSettings:
        # A part beside DB_URL would be silently ignored: a password that is never used, say.
        parts = [
            f"DB_{name.upper()}"
            for name in ("host", "port", "user", "password", "name")
            if name in self.model_fields_set
        ]
        if self.url is not None and parts:
            raise ValueError(f"set either DB_URL or {', '.join(parts)}, not both")
        if self.url is None and self.host is None and parts:
            # Without a host there is no database, and the parts would be ignored without a word.
            raise ValueError(f"{', '.join(parts)} set without DB_HOST: give DB_HOST (or DB_URL) too")
        if self.url is not None:
            import sqlalchemy.exc
            from sqlalchemy.engine import make_url

            url = self.url.get_secret_value()
            try:  # what SQLAlchemy will make of it (imported only when DB_URL is set)
                parsed = make_url(self.sqlalchemy_url())
            except (ValueError, sqlalchemy.exc.ArgumentError) as exc:
                raise ValueError(
                    f"DB_URL={redact_url(url)!r} cannot be read: {exc} "
                    "(%-escape a password's special characters: @ is %40, / is %2F)"
                ) from None
            backend = parsed.get_backend_name()
            if backend not in ("postgresql", "sqlite"):
                raise ValueError(f"DB_URL={redact_url(url)!r}: the outbox needs PostgreSQL (or SQLite), not {backend}")
            try:  # its driver: a missing one was a traceback from the first connection
                parsed.get_dialect().import_dbapi()
            except (ImportError, sqlalchemy.exc.ArgumentError) as exc:
                raise ValueError(f"DB_URL={redact_url(url)!r}: its driver cannot be loaded ({exc})") from None
        return self

    @property
    def configured(self) -> bool:
        return self.url is not None or self.host is not None

    def sqlalchemy_url(self) -> str:
        """The URL to connect with, password included: never log it, use :meth:`display`."""
        if self.url is not None:
            url = self.url.get_secret_value()
            for plain in ("postgresql://", "postgres://"):
                if url.startswith(plain):
                    return "postgresql+psycopg://" + url[len(plain) :]
            return url
        password = quote(self.password.get_secret_value(), safe="") if self.password else ""
        auth = f"{quote(self.user, safe='')}:{password}@" if password else f"{quote(self.user, safe='')}@"
        return f"postgresql+psycopg://{auth}{self.host}:{self.port}/{self.name}"

    def display(self) -> str:
        return redact_url(self.sqlalchemy_url())

    def engine(self, **options: Any) -> sa.Engine:
        """An engine for this database, its pool checked before use; ``options`` go to ``create_engine``."""
        import sqlalchemy as sa

        return sa.create_engine(
            self.sqlalchemy_url(), **{"pool_size": self.pool_size, "pool_pre_ping": True, **options}
        )


class OutboxSettings(BaseSettings):
    """``OUTBOX_*``: how the relay moves committed events to the queue."""

    model_config = SettingsConfigDict(env_prefix="OUTBOX_", extra="ignore")

    #: Run a relay in this worker (when a database is configured).
    relay: bool = True
    #: Rows claimed and enqueued per round trip.
    batch_size: int = Field(default=500, ge=1, le=10_000)
    #: Polling backs off from the minimum to the maximum while idle.
    poll_interval_min: Duration = timedelta(milliseconds=50)
    poll_interval_max: Duration = timedelta(seconds=1)
    #: LISTEN/NOTIFY wake-up; switch off where NOTIFY's commit lock hurts.
    notify: bool = True
    #: How long published rows are kept; ``0`` deletes them as they are published.
    retention: Duration = timedelta(hours=1)
    #: Attempts before a row that cannot be enqueued is set aside.
    max_attempts: int = Field(default=10, ge=1)
    #: How long the inbox remembers a message whose effect committed; unset means
    #: :func:`inbox_retention_floor` rounded up to whole days, plus a day.
    inbox_retention: Duration | None = None

    @model_validator(mode="after")
    def _interval_order(self) -> OutboxSettings:
        if self.poll_interval_max < self.poll_interval_min:
            raise ValueError("OUTBOX_POLL_INTERVAL_MAX must not be shorter than OUTBOX_POLL_INTERVAL_MIN")
        return self


def longest_retry_span(worker: WorkerSettings) -> timedelta:
    """The longest time between a message's first attempt and its last retry under the worker's budget.

    Dramatiq waits ``min_backoff * 2**n``, capped at ``max_backoff``, before retry
    ``n + 1`` (jitter only shortens it).
    """
    low, high = worker.min_backoff.total_seconds(), worker.max_backoff.total_seconds()
    return timedelta(seconds=sum(min(low * 2 ** min(n, 32), high) for n in range(worker.max_retries)))


def inbox_retention_floor(worker: WorkerSettings) -> timedelta:
    """The shortest inbox retention that still catches every duplicate the kit can make.

    A copy of a message may wait out its whole retry budget while another copy
    commits the effect, and the Redis side remembers a completed id for
    ``WORKER_DEDUP_RETENTION``: the inbox must remember at least as long as both.
    """
    return max(worker.dedup_retention, longest_retry_span(worker))


def resolve_inbox_retention(worker: WorkerSettings, outbox: OutboxSettings) -> OutboxSettings:
    """``outbox`` with its inbox retention set: unset, the floor rounded up to whole days plus a day.

    Raises:
        ConfigError: ``OUTBOX_INBOX_RETENTION`` is below :func:`inbox_retention_floor`.
    """
    floor = inbox_retention_floor(worker)
    if outbox.inbox_retention is None:
        days = -(-floor // timedelta(days=1))
        return outbox.model_copy(update={"inbox_retention": timedelta(days=days + 1)})
    if outbox.inbox_retention < floor:
        raise ConfigError(
            f"invalid configuration: OUTBOX_INBOX_RETENTION={format_duration(outbox.inbox_retention)!r}: "
            f"must be at least {format_duration(floor)} (WORKER_DEDUP_RETENTION and the longest retry span of "
            "WORKER_MAX_RETRIES/_MIN_BACKOFF/_MAX_BACKOFF), or a late copy of a message could apply its effect twice"
        )
    return outbox


def _zone_name(value: object) -> str:
    name = str(value).strip()
    try:
        ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ValueError(f"{name!r} is not an IANA time zone (e.g. UTC, Europe/Budapest)") from None
    return name


class SchedulerSettings(BaseSettings):
    """``SCHEDULER_*``: the time zone of the schedule, the leader lease, the catch-up policy."""

    model_config = SettingsConfigDict(env_prefix="SCHEDULER_", extra="ignore")

    #: IANA zone in which cron specs are evaluated.
    timezone: Annotated[str, BeforeValidator(_zone_name)] = "UTC"
    #: How long a leader's lease lasts without renewal; it renews every third of it.
    lease_ttl: Duration = timedelta(seconds=15)
    #: Prefix of the scheduler's keys; unset means ``VALKEY_NAMESPACE``.
    namespace: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.\-:]+$")
    #: What a new leader does with ticks missed during a takeover.
    catchup: Literal["none", "latest", "all"] = "latest"
    #: Missed ticks older than this are never fired late.
    catchup_grace: Duration = timedelta(hours=1)
    #: With ``all``, at most this many missed ticks per entry are fired.
    catchup_max: int = Field(default=100, ge=1)
    #: A tick fired less than this late is on time, not missed: it fires whatever the
    #: catch-up policy (Quartz's ``misfireThreshold``). At most the catch-up grace.
    misfire_threshold: Duration = timedelta(seconds=60)
    #: How many replicas must hold a tick's claim before its message is sent, so that a
    #: failover cannot lose the claim and fire the tick again; unset: 1 behind Sentinel
    #: (``VALKEY_SENTINELS``), else 0 (no wait: a lone server has no replica to wait for).
    claim_replicas: int | None = Field(default=None, ge=0)
    #: How long a claim waits for them; past it, the tick is kept and sent once they have it.
    claim_timeout: Duration = Field(default=timedelta(seconds=1), ge=timedelta(milliseconds=10))
    #: Take part in the election with an empty code schedule, to fire the entries stored at
    #: run time (``kit.schedules``); a worker with code entries fires those in any case.
    dynamic: bool = False
    #: How long the lease of a running ``overlap=`` job outlives its last renewal (it renews every
    #: third of it): a crashed run (``kill -9``) holds the entry at most this long.
    overlap_lease: Duration = Field(default=timedelta(seconds=30), ge=timedelta(seconds=1))

    @model_validator(mode="after")
    def _lease_bounds(self) -> SchedulerSettings:
        if self.lease_ttl < timedelta(seconds=1):
            raise ValueError("SCHEDULER_LEASE_TTL must be at least 1s")
        if self.misfire_threshold < timedelta(seconds=1):
            raise ValueError(
                "SCHEDULER_MISFIRE_THRESHOLD must be at least 1s, so a graceful hand-over is never a misfire"
            )
        if self.misfire_threshold > self.catchup_grace:
            if "misfire_threshold" in self.model_fields_set:
                raise ValueError(
                    f"SCHEDULER_MISFIRE_THRESHOLD ({format_duration(self.misfire_threshold)}) must not be longer "
                    f"than SCHEDULER_CATCHUP_GRACE ({format_duration(self.catchup_grace)}): "
                    "no tick older than the grace fires"
                )
            self.misfire_threshold = self.catchup_grace
        return self


class LogSettings(BaseSettings):
    """``LOG_*``: level and format of every log line the worker writes, and whether it also goes over OTLP."""

    model_config = SettingsConfigDict(env_prefix="LOG_", extra="ignore")

    level: Annotated[str, BeforeValidator(_log_level)] = "INFO"
    #: ``text`` for a terminal, ``json`` (one object per line) for a log pipeline.
    format: Annotated[Literal["text", "json"], BeforeValidator(lambda v: str(v).strip().lower())] = "text"
    #: ``otlp`` also sends every record to the OpenTelemetry collector; unset defers to ``OTEL_LOGS_EXPORTER``.
    exporter: Annotated[Literal["otlp", "none"] | None, BeforeValidator(lambda v: v and str(v).strip().lower())] = None

    @property
    def level_number(self) -> int:
        return logging.getLevelNamesMapping()[self.level]

    @property
    def level_was_set(self) -> bool:
        """Whether ``LOG_LEVEL`` was given, so the CLI's ``-v`` is not overridden by a default."""
        return "level" in self.model_fields_set


def _exporters(value: object) -> tuple[str, ...] | None:
    if value is None or isinstance(value, tuple):
        return value
    names = tuple(name.strip().lower() for name in str(value).split(",") if name.strip())
    if not names:
        raise ValueError("expected exporter names separated by commas, e.g. otlp or console or none")
    if "none" in names and len(names) > 1:
        raise ValueError("'none' cannot be combined with other exporters")
    return () if names == ("none",) else names


Exporters = Annotated[tuple[str, ...] | None, NoDecode, BeforeValidator(_exporters)]


class OtelSettings(BaseSettings):
    """The standard ``OTEL_*`` variables the kit reads itself.

    The SDK reads the rest (``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``,
    ``OTEL_TRACES_SAMPLER*``, ``OTEL_BSP_*``, ``OTEL_BLRP_*``, ``OTEL_EXPORTER_OTLP_*``).
    """

    model_config = SettingsConfigDict(env_prefix="OTEL_", extra="ignore")

    sdk_disabled: bool = False
    #: ``otlp``, ``console``, ``none`` or any installed ``opentelemetry_traces_exporter``
    #: entry point; unset means ``otlp`` when an OTLP endpoint is set, else ``none``.
    traces_exporter: Exporters = None
    #: As above, plus ``prometheus`` (the multi-process endpoint).
    metrics_exporter: Exporters = None
    #: ``otlp``, ``console``, ``none`` or an ``opentelemetry_logs_exporter`` entry point; unset means
    #: ``none`` whatever the endpoint, unlike the SDK's default: turning traces on must not start shipping logs.
    logs_exporter: Exporters = None
    exporter_otlp_endpoint: str | None = None
    exporter_otlp_traces_endpoint: str | None = None
    exporter_otlp_metrics_endpoint: str | None = None
    #: Where ``prometheus`` serves ``/metrics`` (OpenTelemetry's defaults).
    exporter_prometheus_host: str = "localhost"
    exporter_prometheus_port: int = Field(default=9464, gt=0, lt=65536)
    #: How often metrics are exported (and the Prometheus snapshot refreshed), in ms.
    metric_export_interval: int = Field(default=60_000, ge=100)

    def traces(self) -> tuple[str, ...]:
        if self.sdk_disabled:
            return ()
        if self.traces_exporter is not None:
            return self.traces_exporter
        return ("otlp",) if self.exporter_otlp_endpoint or self.exporter_otlp_traces_endpoint else ()

    def metrics(self) -> tuple[str, ...]:
        if self.sdk_disabled:
            return ()
        if self.metrics_exporter is not None:
            return self.metrics_exporter
        return ("otlp",) if self.exporter_otlp_endpoint or self.exporter_otlp_metrics_endpoint else ()

    def logs(self, log_exporter: str | None = None) -> tuple[str, ...]:
        """Where log records go: ``LOG_EXPORTER`` (``log_exporter``) when set, else ``OTEL_LOGS_EXPORTER``.

        The kit's own variable wins: it is the one written for this application,
        where ``OTEL_*`` may come from the platform's defaults for every service.
        """
        if self.sdk_disabled:
            return ()
        if log_exporter is not None:
            return () if log_exporter == "none" else (log_exporter,)
        return self.logs_exporter or ()


class SentrySettings(BaseSettings):
    """``SENTRY_*``: error reporting, and Crons check-ins for scheduled jobs."""

    model_config = SettingsConfigDict(env_prefix="SENTRY_", extra="ignore")

    #: Unset: no Sentry (unless the application initialised it itself).
    dsn: SecretStr | None = None
    environment: str | None = None
    release: str | None = None
    #: Share of messages that get a Sentry transaction; unset means none.
    traces_sample_rate: float | None = Field(default=None, ge=0, le=1)
    #: Send message arguments (they may hold personal data) with events.
    send_default_pii: bool = False
    #: Report a check-in for every scheduled job run.
    crons: bool = True

    @model_validator(mode="after")
    def _readable_dsn(self) -> SentrySettings:
        if self.dsn is None:
            return self
        text = self.dsn.get_secret_value().strip()
        if not text:  # sentry-sdk's own rule: an empty DSN turns it off
            self.dsn = None
            return self
        try:
            from sentry_sdk.utils import BadDsn, Dsn
        except ImportError:  # said at start-up, by Telemetry, with how to install it
            return self
        try:
            Dsn(text)
        except BadDsn as exc:
            # Not only a log line at the first event: Sentry would be off while the start-up said "on".
            # The DSN itself stays out of the line: its user part is the project's key.
            raise ValueError(f"SENTRY_DSN is not a valid Sentry DSN ({exc})") from None
        return self


#: The shortest ``DASHBOARD_TOKEN`` accepted: a bearer token is the whole secret, with no user name to guess too.
MIN_TOKEN_LENGTH = 16
#: The shortest ``DASHBOARD_PASSWORD`` the dashboard accepts off loopback.
MIN_PASSWORD_LENGTH = 12
#: Written where a secret is to go (this repository's manifests say CHANGE-ME): refused off loopback inside any secret.
PLACEHOLDER_MARKS = ("changeme", "replaceme", "placeholder", "yourpassword", "yoursecret")
#: Refused off loopback as a whole secret, in any case, with any punctuation and trailing digits (``Password-123``).
PLACEHOLDER_WORDS = frozenset(
    {"password", "passw0rd", "admin", "administrator", "secret", "default", "dashboard", "dramatiq", "dramatiqgp"}
    | {"letmein", "qwerty", "welcome", "example", "test", "root", "ops", "guest", "token"}
)


def weak_secret(name: str, value: str, user: str | None = None) -> str | None:
    """Why the dashboard's ``name`` (``DASHBOARD_PASSWORD``/``_TOKEN``) is too weak to listen off loopback, or None.

    A guesser tries the placeholders first: the manifests' ``CHANGE-ME`` was
    accepted, and so was a one-character password.
    """
    text = value.strip()
    bare = re.sub(r"[^a-z0-9]", "", text.lower())
    shortest = MIN_PASSWORD_LENGTH if name == "DASHBOARD_PASSWORD" else MIN_TOKEN_LENGTH
    if any(mark in bare for mark in PLACEHOLDER_MARKS) or bare.rstrip("0123456789") in PLACEHOLDER_WORDS:
        return f"{name} is a placeholder (CHANGE-ME, password, admin...)"
    if len(text) < shortest:
        return f"{name} is shorter than {shortest} characters"
    if user is not None and text.lower() == user.strip().lower():
        return f"{name} is the user name"
    if len(set(text)) < 4:
        return f"{name} has fewer than 4 distinct characters"
    return None


class DashboardSettings(BaseSettings):
    """``DASHBOARD_*``: who may use ``dramatiq-gp dashboard`` (required off loopback)."""

    model_config = SettingsConfigDict(env_prefix="DASHBOARD_", extra="ignore")

    #: HTTP Basic credentials, both or neither.
    user: str | None = None
    password: SecretStr | None = None
    #: A bearer token (``Authorization: Bearer <token>``), with or instead of the user and password.
    token: SecretStr | None = None
    #: The host names it answers to, comma-separated (``*``: any); unset, the command's loopback address and localhost.
    allowed_hosts: str | None = None
    #: The proxies whose ``X-Forwarded-For``/``-Proto`` the command believes, comma-separated; unset, none.
    trusted_proxies: str | None = None

    def hosts(self) -> list[str] | None:
        """``allowed_hosts`` as a list, or None when unset."""
        return None if self.allowed_hosts is None else [h.strip() for h in self.allowed_hosts.split(",") if h.strip()]

    @model_validator(mode="after")
    def _both(self) -> DashboardSettings:
        # Set but empty must not read as unset: that turned the login off (and passed the off-loopback check).
        for name, value in (("USER", self.user), ("PASSWORD", self.password), ("TOKEN", self.token)):
            text = value.get_secret_value() if isinstance(value, SecretStr) else value
            if text is not None and not text.strip():
                raise ValueError(f"DASHBOARD_{name} is set but empty: give a real one, or unset it")
        if (self.user is None) != (self.password is None):
            raise ValueError("DASHBOARD_USER and DASHBOARD_PASSWORD go together: set both or neither")
        if self.token is not None and len(self.token.get_secret_value().strip()) < MIN_TOKEN_LENGTH:
            raise ValueError(f"DASHBOARD_TOKEN is shorter than {MIN_TOKEN_LENGTH} characters: use a random one")
        return self

    @property
    def credentials(self) -> bool:
        return self.user is not None or self.token is not None

    def weak(self) -> str | None:
        """Why a secret is too weak for a dashboard off loopback (:func:`weak_secret`), or None."""
        for name, secret in (("DASHBOARD_PASSWORD", self.password), ("DASHBOARD_TOKEN", self.token)):
            problem = None if secret is None else weak_secret(name, secret.get_secret_value(), self.user)
            if problem is not None:
                return problem
        return None


G = TypeVar("G", bound=BaseSettings)


@dataclass(frozen=True)
class Settings:
    """Every group the worker reads. Later capabilities add their groups here."""

    worker: WorkerSettings = field(default_factory=lambda: WorkerSettings())
    redis: RedisSettings = field(default_factory=lambda: RedisSettings())
    log: LogSettings = field(default_factory=lambda: LogSettings())
    db: DatabaseSettings = field(default_factory=lambda: DatabaseSettings())
    outbox: OutboxSettings = field(default_factory=lambda: OutboxSettings())
    scheduler: SchedulerSettings = field(default_factory=lambda: SchedulerSettings())
    otel: OtelSettings = field(default_factory=lambda: OtelSettings())
    sentry: SentrySettings = field(default_factory=lambda: SentrySettings())
    rabbitmq: RabbitmqSettings = field(default_factory=lambda: RabbitmqSettings())
    dashboard: DashboardSettings = field(default_factory=lambda: DashboardSettings())

    @classmethod
    def from_env(cls) -> Settings:
        """Read every group from the environment.

        Raises:
            ConfigError: naming each invalid variable and its (redacted) value.
        """
        problems: list[str] = []

        def load(group: type[G]) -> G | None:
            try:
                return group()
            except ValidationError as exc:
                problems.extend(_describe(group, exc))
                return None

        worker, redis, log = load(WorkerSettings), load(RedisSettings), load(LogSettings)
        db, outbox, scheduler = load(DatabaseSettings), load(OutboxSettings), load(SchedulerSettings)
        otel, sentry, rabbitmq = load(OtelSettings), load(SentrySettings), load(RabbitmqSettings)
        dashboard = load(DashboardSettings)
        groups = (worker, redis, log, db, outbox, scheduler, otel, sentry, rabbitmq, dashboard)
        if problems or any(group is None for group in groups):
            raise ConfigError("invalid configuration: " + "; ".join(problems))
        assert worker is not None and outbox is not None
        outbox = resolve_inbox_retention(worker, outbox)
        return cls(worker, redis, log, db, outbox, scheduler, otel, sentry, rabbitmq, dashboard)  # type: ignore[arg-type]


def settle_window_ms_from_env() -> float:
    """``WORKER_SETTLE_WINDOW`` in ms, for a broker built directly rather than by the Kit (which passes it).

    Raises:
        ConfigError: a ``WORKER_*`` variable is invalid; the message names it.
    """
    try:
        return WorkerSettings().settle_window.total_seconds() * 1000
    except ValidationError as exc:
        raise ConfigError("invalid configuration: " + "; ".join(_describe(WorkerSettings, exc))) from None


def _describe(group: type[BaseSettings], exc: ValidationError) -> list[str]:
    prefix = group.model_config.get("env_prefix") or ""
    lines = []
    for error in exc.errors():
        reason = error["msg"].removeprefix("Value error, ")
        if not error["loc"]:
            lines.append(reason)
            continue
        name = str(error["loc"][0])
        info = group.model_fields.get(name)
        if info is None:  # reported under its alias
            info = next((f for f in group.model_fields.values() if f.validation_alias == name), None)
            env = name
        else:
            env = info.validation_alias if isinstance(info.validation_alias, str) else prefix + name
        value = error.get("input")
        if info is not None and info.annotation is not None and "SecretStr" in str(info.annotation):
            shown = redact_url(str(value)) if "://" in str(value) else "***"
        elif isinstance(value, str) and "@" in value:  # credentials written into an address list (VALKEY_SENTINELS)
            shown = re.sub(r"[^,@]*@", "***@", value)
        elif isinstance(value, timedelta):  # a duration is checked once parsed: show it as it was written
            shown = format_duration(value)
        else:
            shown = str(value)
        lines.append(f"{env.upper()}={shown!r}: {reason}")
    return lines
