"""Telemetry: logs from the moment a Kit is built, traces, metrics, OTLP logs and Sentry in each worker process.

Logging is configured when the :class:`~dramatiq_gp.Kit` is built, so start-up
lines already have their final format. Exporters, the meter and Sentry start in
``after_process_boot`` (:meth:`Telemetry.start`): the dramatiq CLI imports the
application in each worker process, after the fork, so no exporter thread or
socket is ever inherited across one. They are flushed as the last shutdown step
(:meth:`Telemetry.flush`), and also when the process ends any other way that
still runs Python (a second SIGTERM): Dramatiq's worker processes leave with
``os._exit``, which skips ``atexit``, so the flush is registered as a
multiprocessing finalizer, which ``Process`` runs on its way out.

The kit never replaces what the application set up itself: a tracer or meter
provider already installed, or a Sentry client already initialised, is used as is.

Under the ``dramatiq`` command, a worker process writes its log lines to the
command's destination itself (:class:`DirectStream`), not through the pipe the CLI
relays them through. Dramatiq internals this relies on (docs/internals.md, 14): the
CLI's handler writes to a ``dramatiq.compat.StreamablePipe``, and the frame of
``dramatiq.cli.worker_process`` (or ``fork_process``) holds the parsed ``args``,
``args.log_file`` among them.
"""

from __future__ import annotations

import collections
import contextlib
import importlib
import logging
import multiprocessing.util
import os
import select
import stat
import sys
import threading
import time
import warnings
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

from dramatiq import Message
from dramatiq.broker import MessageProxy
from opentelemetry import metrics, trace
from pythonjsonlogger.json import JsonFormatter

from .errors import ConfigError
from .errortext import MAX_ERROR_CHARS, MAX_TRACEBACK_CHARS, capped, stack_without_messages, without_messages
from .settings import LogSettings, Settings

if TYPE_CHECKING:
    from opentelemetry.sdk._logs import LoggerProvider
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import MetricExporter, MetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

logger = logging.getLogger(__name__)

#: The dramatiq CLI's format, so programmatic and CLI workers read alike.
LOG_FORMAT = "[%(asctime)s] [PID %(process)d] [%(threadName)s] [%(name)s] [%(levelname)s] %(message)s"

#: How long the last flush may wait for the exporters, all together.
FLUSH_TIMEOUT_MS = 5_000

_OTLP_EXTRA = "pip install 'dramatiq-gp[otlp]'"
_SENTRY_EXTRA = "pip install 'dramatiq-gp[sentry]'"


# -- logs -------------------------------------------------------------------------


class TraceIds(logging.Filter):
    """Adds ``trace_id`` and ``span_id`` to a record logged inside an active span."""

    def __init__(self) -> None:
        super().__init__()
        # The ids of the span a thread logged in last: a task logs two lines or more in one span.
        self._last = threading.local()

    def filter(self, record: logging.LogRecord) -> bool:
        span = trace.get_current_span()
        last = getattr(self._last, "ids", None)
        if last is None or last[0] is not span:
            context = span.get_span_context()
            ids = (format(context.trace_id, "032x"), format(context.span_id, "016x")) if context.is_valid else None
            last = self._last.ids = (span, ids)
        if last[1] is not None:
            record.trace_id, record.span_id = last[1]
        return True


_MESSAGES = (Message, MessageProxy)


class NoPayloads(logging.Filter):
    """Keeps message arguments out of log lines: a message is named by task type and id.

    Some of Dramatiq's own lines format the whole message (``Received message
    send_mail('ada@example.com') with id ...``), and an actor logs its arguments
    at DEBUG. Installed on the root handlers, this filter rewrites the record
    before any handler, and before Sentry's breadcrumbs (which read the record
    after the handlers), sees it.
    """

    #: Dramatiq lines whose arguments are a message's arguments.
    ARGUMENT_LINES = frozenset({"Received args=%r kwargs=%r."})

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not isinstance(args, tuple) or not args:
            return True
        if record.msg in self.ARGUMENT_LINES:
            record.args = ("[Filtered]",) * len(args)
            return True
        for arg in args:
            if isinstance(arg, _MESSAGES):
                record.args = tuple(
                    f"{arg.actor_name}/{arg.message_id}" if isinstance(arg, _MESSAGES) else arg for arg in args
                )
                break
        return True


def printable(text: str) -> str:
    """``text`` with its control characters written as escapes (``\\n``, ``\\x1b``), for a log line: a name from a
    message or from Redis (an event's, a schedule entry's) with a newline in it would otherwise write a line of
    its own."""
    return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class TextFormatter(logging.Formatter):
    """The dramatiq CLI's line, with the trace ids appended when there are some; a traceback capped."""

    def __init__(self) -> None:
        super().__init__(LOG_FORMAT)
        self._second: tuple[int, str] = (-1, "")

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        if datefmt:
            return super().formatTime(record, datefmt)
        # A worker writes thousands of lines a second: format each second once.
        second, text = self._second
        if int(record.created) != second:
            second = int(record.created)
            text = time.strftime(self.default_time_format, self.converter(record.created))
            self._second = (second, text)
        return f"{text},{int(record.msecs):03d}"

    def formatException(self, ei: Any) -> str:
        return capped(super().formatException(ei), MAX_TRACEBACK_CHARS)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        trace_id = getattr(record, "trace_id", None)
        if trace_id is None:
            return line
        head, newline, tail = line.partition("\n")  # keep ids on the first line, before a traceback
        return f"{head} trace_id={trace_id} span_id={getattr(record, 'span_id', '')}{newline}{tail}"


class _CappedJsonFormatter(JsonFormatter):
    def formatException(self, ei: Any) -> str | list[str]:  # type: ignore[override]
        text = super().formatException(ei)
        return capped(text, MAX_TRACEBACK_CHARS) if isinstance(text, str) else text


def json_formatter() -> logging.Formatter:
    """One JSON object per line: time, level, logger, message, pid, thread and every ``extra`` field."""
    return _CappedJsonFormatter(
        "%(asctime)s %(levelname)s %(name)s %(message)s %(process)d %(threadName)s",
        rename_fields={
            "asctime": "time",
            "levelname": "level",
            "name": "logger",
            "process": "pid",
            "threadName": "thread",
            "exc_info": "error.stack",
        },
        json_ensure_ascii=False,
    )


def configure_logging(settings: LogSettings, *, send_default_pii: bool = False) -> None:
    """Give every root handler the ``LOG_FORMAT`` formatter and the trace-id filter; set ``LOG_LEVEL``.

    Unless ``send_default_pii`` is on, the handlers also get :class:`NoPayloads`,
    so no line carries a message's arguments.

    The dramatiq CLI has already installed a handler writing to its log pipe by
    the time the kit is built; it is kept and reformatted, so Dramatiq's own lines
    come out in the same format. Without one (programmatic use, or the CLI's
    ``--skip-logging``), a handler on stderr is added. pika's loggers go to
    CRITICAL, as Dramatiq's CLI sets them in its workers, unless their level was set.
    """
    root = logging.getLogger()
    # As Dramatiq's CLI does in its worker processes: pika logs each connection's opening and
    # closing at INFO and every failed attempt at ERROR with a traceback (a producer printed
    # 125 lines, `status` with RabbitMQ down 7 and a traceback before its own one line).
    # The kit says what failed itself; a level set before the kit is built is kept.
    pika = logging.getLogger("pika")
    if pika.level == logging.NOTSET:
        pika.setLevel(logging.CRITICAL)
    if not root.handlers:
        root.addHandler(logging.StreamHandler(sys.stderr))
        root.setLevel(settings.level_number)
    elif settings.level_was_set:
        root.setLevel(settings.level_number)
    for handler in root.handlers:
        if handler.name == OTLP_HANDLER_NAME:
            continue  # records, not lines: a formatter would make the body a whole line, time and all
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, _DirectHandler):
            direct = direct_stream(handler.stream)
            if direct is not None:
                handler.setStream(direct)
                handler.__class__ = _DirectHandler
        handler.setFormatter(json_formatter() if settings.format == "json" else TextFormatter())
        if not any(isinstance(f, TraceIds) for f in handler.filters):
            handler.addFilter(TraceIds())
        payloads = [f for f in handler.filters if isinstance(f, NoPayloads)]
        if send_default_pii:
            for f in payloads:
                handler.removeFilter(f)
        elif not payloads:
            handler.addFilter(NoPayloads())


#: How long a ``dramatiq`` worker process holds its INFO and DEBUG lines before writing them, at most.
LOG_FLUSH_INTERVAL_S = 0.05


class DirectStream:
    """Where a ``dramatiq`` worker process writes its log lines: straight to the command's log destination.

    The CLI hands each worker process a pipe to its parent (``StreamablePipe``),
    whose thread reads every line back and writes it to ``--log-file`` or to
    stderr: with the task log's two lines per message, the parent used as much CPU
    as a fifth of the worker's, and each line cost the worker a write to the pipe,
    taken under the handler's lock by eight threads on one core. Here a line is
    queued, and a thread of this stream's writes what is queued every
    :data:`LOG_FLUSH_INTERVAL_S` in one ``write`` on ``fd``: the file opened for
    appending (lines of several processes never cut into each other) or the stderr
    the worker inherited. A WARNING or worse (:meth:`write_now`) is written at once,
    after what was queued before it. What is queued is written when the process
    exits (a ``multiprocessing`` finalizer: Dramatiq's worker processes leave through
    ``os._exit``, which skips ``atexit``), after a graceful stop or a second SIGTERM;
    a ``kill -9`` loses at most the last interval's INFO lines. When the destination
    is not a file (a pipe or a terminal), each ``write`` is cut to at most
    ``PIPE_BUF`` bytes at line ends, so another process's lines do not cut into
    these, and a longer line goes through the CLI's pipe, as before.
    """

    def __init__(self, fd: int, relay: Any, *, atomic: bool) -> None:
        self.fd = fd
        self.relay = relay
        self.limit = sys.maxsize if atomic else select.PIPE_BUF
        self._queued: collections.deque[bytes] = collections.deque()
        self._writing = threading.Lock()
        self._pid: int | None = None
        self._exiting = False

    def write(self, text: str) -> None:
        if self._pid != os.getpid():
            self._start()
        data = text.encode("utf-8", errors="replace")
        if len(data) > self.limit:
            self.flush()
            self.relay.write(text)
            return
        self._queued.append(data)
        if self._exiting:
            self.flush()

    def write_now(self, text: str) -> None:
        self.write(text)
        self.flush()

    def flush(self) -> None:
        """Write everything queued, in order, in as few ``write`` calls as the destination allows."""
        with self._writing:
            queued, chunk, size = self._queued, list[bytes](), 0
            while queued:
                data = queued.popleft()
                if size + len(data) > self.limit:
                    self._write(b"".join(chunk))
                    chunk, size = [], 0
                chunk.append(data)
                size += len(data)
            if chunk:
                self._write(b"".join(chunk))

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view) :]

    def _start(self) -> None:
        """Start this process's writer thread and exit flush (again in a process forked from one that wrote)."""
        if self._pid is not None:
            self._queued.clear()  # the forking process's lines: it writes them itself
            self._writing = threading.Lock()
        self._pid = os.getpid()
        threading.Thread(target=self._run, name="dramatiq_gp.log_writer", daemon=True).start()
        # After telemetry's flush (exitpriority 100), which logs.
        multiprocessing.util.Finalize(None, self._flush_at_exit, exitpriority=-100)

    def _run(self) -> None:
        while True:
            time.sleep(LOG_FLUSH_INTERVAL_S)
            # A destination gone (a full disk, a closed pipe) leaves logging nowhere to say so.
            with contextlib.suppress(OSError):
                self.flush()

    def _flush_at_exit(self) -> None:
        self._exiting = True
        with contextlib.suppress(OSError):
            self.flush()

    def isatty(self) -> bool:
        return False


class _DirectHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A ``StreamHandler`` on a :class:`DirectStream`: a WARNING or worse is written at once."""

    stream: DirectStream

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record) + self.terminator
            if record.levelno >= logging.WARNING:
                self.stream.write_now(line)
            else:
                self.stream.write(line)
        except RecursionError:
            raise
        except Exception:
            self.handleError(record)


def _cli_arguments() -> Any:
    """The parsed arguments of the ``dramatiq`` command whose worker (or fork) process this is, or None.

    Read from the frame of Dramatiq's ``cli.worker_process`` (or ``cli.fork_process``),
    a Dramatiq internal: its ``args`` local. The kit's module is imported inside it.
    """
    cli = sys.modules.get("dramatiq.cli")
    if cli is None:
        return None
    codes = {cli.worker_process.__code__, cli.fork_process.__code__}
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in codes:
            return frame.f_locals.get("args")
        frame = frame.f_back  # type: ignore[assignment]
    return None


def direct_stream(stream: Any) -> DirectStream | None:
    """A :class:`DirectStream` for a handler writing to the ``dramatiq`` CLI's log pipe (``stream``), or None.

    None when ``stream`` is not that pipe (``dramatiq.compat.StreamablePipe``, a
    Dramatiq internal) or the command's arguments cannot be found. With
    ``--log-file`` the file is opened for appending; without, the lines go to the
    stderr the worker process inherited from the command.
    """
    from dramatiq.compat import StreamablePipe

    if not isinstance(stream, StreamablePipe):
        return None
    args = _cli_arguments()
    if args is None:
        return None
    log_file = getattr(args, "log_file", None)
    if log_file:
        fd = os.open(log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o666)
        return DirectStream(fd, stream, atomic=True)
    fd = os.dup(2)
    os.set_inheritable(fd, False)
    return DirectStream(fd, stream, atomic=stat.S_ISREG(os.fstat(fd).st_mode))


# -- exporters --------------------------------------------------------------------


def _entry_point(group: str, name: str, variable: str) -> Callable[[], Any]:
    found = {ep.name: ep for ep in entry_points(group=group)}
    if name not in found:
        known = ", ".join(sorted({"otlp", "none", *found}))
        raise ConfigError(f"{variable}={name!r}: unknown exporter; installed: {known}")
    loaded: Callable[[], Any] = found[name].load()
    return loaded


def _protocol(signal: str) -> str:
    value = os.environ.get(f"OTEL_EXPORTER_OTLP_{signal}S_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    return (value or "http/protobuf").strip().lower()


#: Each signal's module under ``opentelemetry.exporter.otlp.proto.<transport>``: the logs one is still underscored.
_OTLP_MODULES = {"trace": "trace_exporter", "metric": "metric_exporter", "log": "_log_exporter"}


def _otlp(signal: str, class_name: str, variable: str) -> Callable[[], Any]:
    transport = "grpc" if _protocol(signal.upper()) == "grpc" else "http"
    module = f"opentelemetry.exporter.otlp.proto.{transport}.{_OTLP_MODULES[signal]}"
    try:
        factory: Callable[[], Any] = getattr(importlib.import_module(module), class_name)
    except ImportError:
        extra = _OTLP_EXTRA if transport == "http" else "pip install opentelemetry-exporter-otlp-proto-grpc"
        raise ConfigError(f"{variable}=otlp needs the OTLP exporter ({transport}): {extra}") from None
    return factory


def span_exporter_factory(name: str) -> Callable[[], SpanExporter]:
    """What builds the span exporter called ``name``.

    Raises:
        ConfigError: unknown name, or its package is not installed.
    """
    if name == "otlp":
        return _otlp("trace", "OTLPSpanExporter", "OTEL_TRACES_EXPORTER")
    return _entry_point("opentelemetry_traces_exporter", name, "OTEL_TRACES_EXPORTER")


def metric_exporter_factory(name: str) -> Callable[[], MetricExporter]:
    """What builds the metric exporter called ``name`` (``prometheus`` is handled apart).

    Raises:
        ConfigError: unknown name, or its package is not installed.
    """
    if name == "otlp":
        return _otlp("metric", "OTLPMetricExporter", "OTEL_METRICS_EXPORTER")
    return _entry_point("opentelemetry_metrics_exporter", name, "OTEL_METRICS_EXPORTER")


def log_exporter_factory(name: str, variable: str = "OTEL_LOGS_EXPORTER") -> Callable[[], Any]:
    """What builds the log record exporter called ``name``; ``variable`` is the one that named it.

    Raises:
        ConfigError: unknown name, or its package is not installed.
    """
    if name == "otlp":
        return _otlp("log", "OTLPLogExporter", variable)
    return _entry_point("opentelemetry_logs_exporter", name, variable)


#: The name of the root handler :func:`otlp_log_handler` builds.
OTLP_HANDLER_NAME = "dramatiq_gp.otlp_logs"


def otlp_log_handler(provider: LoggerProvider, *, send_default_pii: bool = False) -> logging.Handler:
    """The SDK's logging handler for the root logger, with the kit's limits: what goes over OTLP logs.

    A record keeps its level, its message as the body, the trace and span of
    the span it was logged in, and its ``extra`` fields as attributes (the task
    log's ``task_type``, ``task_id``, ``attempt``...), as ``LOG_FORMAT=json``
    writes them. On top of the SDK's own rules:

    - the ``trace_id``/``span_id`` the text and JSON lines get are left out of
      the attributes: the record's own fields carry them;
    - an exception's message and stack trace are capped as the log lines' are
      (:data:`MAX_ERROR_CHARS`, :data:`MAX_TRACEBACK_CHARS`): one 10 MB message
      would make the batch too big to send, and lose the records around it;
    - unless ``send_default_pii``, :class:`NoPayloads` keeps message arguments
      out, and an exception is its type and frames, never its message
      (:func:`~dramatiq_gp.errortext.without_messages`): in the body, the
      ``error`` field, ``exception.stacktrace``; ``exception.message`` is left out;
    - the OpenTelemetry SDK's own records stay out: an export failure sent over
      the exporter that failed would feed itself, one record per failed batch.
    """
    import warnings

    from opentelemetry.sdk._logs import LoggingHandler

    class OtlpLogHandler(LoggingHandler):
        @staticmethod
        def _get_attributes(record: logging.LogRecord) -> Any:
            attributes = dict(LoggingHandler._get_attributes(record) or {})
            attributes.pop("trace_id", None)
            attributes.pop("span_id", None)
            if not send_default_pii:
                attributes.pop("exception.message", None)
                if "exception.stacktrace" in attributes and record.exc_info and record.exc_info[1] is not None:
                    attributes["exception.stacktrace"] = stack_without_messages(record.exc_info[1])
            for key, limit in (("exception.message", MAX_ERROR_CHARS), ("exception.stacktrace", MAX_TRACEBACK_CHARS)):
                value = attributes.get(key)
                if isinstance(value, str):
                    attributes[key] = capped(value, limit)
            return attributes

        def emit(self, record: logging.LogRecord) -> None:
            super().emit(record if send_default_pii else without_messages(record))

    with warnings.catch_warnings():
        # The SDK points to opentelemetry-instrumentation-logging's handler instead, one more
        # package for the same translation; this one is there in every SDK the kit supports.
        warnings.simplefilter("ignore", DeprecationWarning)
        handler = OtlpLogHandler(logger_provider=provider)
    handler.name = OTLP_HANDLER_NAME
    handler.addFilter(lambda record: record.name != "opentelemetry" and not record.name.startswith("opentelemetry."))
    if not send_default_pii:
        handler.addFilter(NoPayloads())
    return handler


def application_tracer_provider() -> bool:
    """Whether a real (SDK) tracer provider is already installed in this process."""
    if "opentelemetry.sdk.trace" not in sys.modules:
        return False  # nobody built one, and a worker without telemetry never loads the SDK
    from opentelemetry.sdk.trace import TracerProvider

    return isinstance(trace.get_tracer_provider(), TracerProvider)


def application_meter_provider() -> bool:
    """Whether a real (SDK) meter provider is already installed in this process."""
    if "opentelemetry.sdk.metrics" not in sys.modules:
        return False
    from opentelemetry.sdk.metrics import MeterProvider

    return isinstance(metrics.get_meter_provider(), MeterProvider)


# -- the per-process telemetry ------------------------------------------------------


class Telemetry:
    """What one worker process exports, checked when the Kit is built and started after the fork.

    Building it configures logging (:func:`configure_logging`), so every later
    start-up line has its final format.

    Parameters:
        settings: the ``LOG_*``, ``OTEL_*`` and ``SENTRY_*`` groups are read.
        namespace: names the Prometheus snapshot directory, so two apps on one host keep theirs
            apart; ``VALKEY_NAMESPACE`` by default.
        tracer_provider: the application's provider for the kit's spans, instead of the global one.

    Raises:
        ConfigError: an exporter name is unknown or its package missing, or
            ``SENTRY_DSN`` is set without sentry-sdk installed.
    """

    def __init__(
        self, settings: Settings, *, namespace: str | None = None, tracer_provider: trace.TracerProvider | None = None
    ) -> None:
        self.settings = settings
        configure_logging(settings.log, send_default_pii=settings.sentry.send_default_pii)
        #: The application's own provider for the kit's spans; ``None`` means the global one.
        self.tracer_provider = tracer_provider
        self.namespace = namespace or settings.redis.namespace
        otel = settings.otel
        self._span_exporters = [span_exporter_factory(name) for name in otel.traces()]
        self._metric_exporters = [metric_exporter_factory(name) for name in otel.metrics() if name != "prometheus"]
        variable = "LOG_EXPORTER" if settings.log.exporter is not None else "OTEL_LOGS_EXPORTER"
        self._log_exporters = [log_exporter_factory(name, variable) for name in otel.logs(settings.log.exporter)]
        self.prometheus = "prometheus" in otel.metrics()
        if settings.sentry.dsn is not None:
            try:
                import sentry_sdk  # noqa: F401
            except ImportError:
                raise ConfigError(f"SENTRY_DSN is set but sentry-sdk is not installed: {_SENTRY_EXTRA}") from None
        #: Whether messages get spans: exporters configured here, or a provider set up by the application.
        self.tracing = tracer_provider is not None or bool(self._span_exporters) or application_tracer_provider()
        self.metrics = bool(self._metric_exporters) or self.prometheus or application_meter_provider()
        self.sentry = settings.sentry.dsn is not None or _sentry_active()
        self._tracer_provider: TracerProvider | None = None
        self._meter_provider: MeterProvider | None = None
        self._logger_provider: LoggerProvider | None = None
        self._log_handler: logging.Handler | None = None
        self._started_pid: int | None = None
        self._flushed = False
        self._endpoint: Any = None
        logger.info(
            "start-up: logging ready (level %s, %s); tracing %s, metrics %s, Sentry %s",
            logging.getLevelName(logging.getLogger().level),
            settings.log.format,
            *("on" if on else "off" for on in (self.tracing, self.metrics, self.sentry)),
        )

    def start(self) -> None:
        """Install this process's exporters, meter and Sentry client; once per process."""
        if self._started_pid == os.getpid():
            return
        self._started_pid, self._flushed = os.getpid(), False
        started = []
        if self._span_exporters and self.tracer_provider is None and not application_tracer_provider():
            self._tracer_provider = self._start_tracing()
            started.append(f"traces to {', '.join(self.settings.otel.traces())}")
        if (self._metric_exporters or self.prometheus) and not application_meter_provider():
            self._meter_provider = self._start_metrics()
            started.append(f"metrics to {', '.join(self.settings.otel.metrics())}")
        if self._log_exporters:
            self._start_logs()
            started.append(f"logs to {', '.join(self.settings.otel.logs(self.settings.log.exporter))}")
        if self.settings.sentry.dsn is not None:
            if _sentry_active():
                logger.info("start-up: Sentry was initialised by the application; using its client")
            else:
                self._start_sentry()
                started.append("errors to Sentry")
        multiprocessing.util.Finalize(None, self._flush_at_exit, exitpriority=100)
        if started:
            logger.info("start-up: telemetry exports %s", "; ".join(started))

    def flush(self) -> None:
        """Export what is still buffered: spans, metrics, Sentry events, log lines. Safe to call twice.

        The exporters flush side by side, and the whole flush waits at most
        ``FLUSH_TIMEOUT_MS``: an unreachable collector or Sentry delays shutdown
        by that much, never more (what has not left by then is dropped, and said so).
        """
        if self._flushed:
            return
        self._flushed = True
        steps: list[tuple[str, Callable[[], object]]] = []
        if self._tracer_provider is not None:
            steps.append(("spans", self._tracer_provider.shutdown))
        else:
            provider = self.tracer_provider or trace.get_tracer_provider()
            if hasattr(provider, "force_flush"):
                steps.append(("spans", lambda: provider.force_flush(FLUSH_TIMEOUT_MS)))
        if self._meter_provider is not None:
            meter_provider = self._meter_provider
            steps.append(("metrics", lambda: meter_provider.shutdown(FLUSH_TIMEOUT_MS)))
        if self._logger_provider is not None:
            # Off the root logger first: a record after the shutdown would only be dropped, with a line saying so.
            if self._log_handler is not None:
                logging.getLogger().removeHandler(self._log_handler)
            steps.append(("log records", self._logger_provider.shutdown))
        if self._endpoint is not None:
            self._endpoint.close()
        if self.sentry:
            import sentry_sdk

            steps.append(("Sentry events", lambda: sentry_sdk.flush(timeout=FLUSH_TIMEOUT_MS / 1000)))
        threads = [
            threading.Thread(target=_logged(name, step), name=f"flush {name}", daemon=True) for name, step in steps
        ]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + FLUSH_TIMEOUT_MS / 1000
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        late = [thread.name.removeprefix("flush ") for thread in threads if thread.is_alive()]
        if late:
            logger.warning(
                "shutdown: telemetry flush gave up after %d ms; %s may be lost (exporter unreachable?)",
                FLUSH_TIMEOUT_MS,
                ", ".join(late),
            )
        for handler in logging.getLogger().handlers:
            # A closed or vanished stream: nothing can be written there any more.
            with contextlib.suppress(ValueError, OSError):
                handler.flush()

    def _flush_at_exit(self) -> None:
        """:meth:`flush`, as the process exits: it must not print a traceback, whatever it meets.

        By then a log handler's stream may be closed (pytest closes its capture
        streams before the interpreter's exit hooks run); logging would report each
        line it cannot write with a traceback of its own.
        """
        raise_exceptions, logging.raiseExceptions = logging.raiseExceptions, False
        try:
            self.flush()
        finally:
            logging.raiseExceptions = raise_exceptions

    def _start_tracing(self) -> TracerProvider:
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        provider = TracerProvider()  # reads OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_SAMPLER*
        for make in self._span_exporters:
            provider.add_span_processor(BatchSpanProcessor(make()))
        trace.set_tracer_provider(provider)
        return provider

    def _start_metrics(self) -> MeterProvider:
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

        interval = self.settings.otel.metric_export_interval
        readers: list[MetricReader] = [
            PeriodicExportingMetricReader(make(), export_interval_millis=interval) for make in self._metric_exporters
        ]
        if self.prometheus:
            from .prometheus import SnapshotReader, endpoint, snapshot_dir

            otel = self.settings.otel
            directory = snapshot_dir(self.namespace, otel.exporter_prometheus_port)
            readers.append(SnapshotReader(directory, interval_ms=interval))
            self._endpoint = endpoint(directory, otel.exporter_prometheus_host, otel.exporter_prometheus_port)
            self._endpoint.start()
        provider = MeterProvider(metric_readers=readers)
        metrics.set_meter_provider(provider)
        return provider

    def _start_logs(self) -> None:
        """Every record the root logger handles, at ``LOG_LEVEL``, also goes to the log exporters.

        The root logger, not the task log's alone: an application's lines inside
        a task are what the task log's lines are read beside, and carry the same
        trace id. The provider is the kit's own, not installed as the global one,
        so an application's own logging setup is left as it was.
        """
        from opentelemetry.sdk._logs import LoggerProvider
        from opentelemetry.sdk._logs.export import BatchLogRecordProcessor

        provider = LoggerProvider()  # reads OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES
        for make in self._log_exporters:
            provider.add_log_record_processor(BatchLogRecordProcessor(make()))  # reads OTEL_BLRP_*
        self._logger_provider = provider
        root = logging.getLogger()
        if self._log_handler is not None:  # started before a fork: the parent's exporter thread is not here
            root.removeHandler(self._log_handler)
        self._log_handler = otlp_log_handler(provider, send_default_pii=self.settings.sentry.send_default_pii)
        root.addHandler(self._log_handler)

    def _start_sentry(self) -> None:
        import sentry_sdk
        from sentry_sdk.integrations import logging as sentry_logging
        from sentry_sdk.integrations.dramatiq import DramatiqIntegration
        from sentry_sdk.integrations.logging import LoggingIntegration, ignore_logger
        from sentry_sdk.integrations.redis import RedisIntegration

        sentry = self.settings.sentry
        assert sentry.dsn is not None
        # Left out when off, which is the SDK's own default. sentry-sdk 2.75 deprecates the option for
        # `data_collection`, whose settings have no one-to-one match with older releases, so the option
        # the setting names is still passed when on, without the warning (pinned by test_sentry.py).
        pii: dict[str, Any] = {"send_default_pii": True} if sentry.send_default_pii else {}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "The send_default_pii option is deprecated", DeprecationWarning)
            sentry_sdk.init(
                dsn=sentry.dsn.get_secret_value(),
                environment=sentry.environment,
                release=sentry.release,
                traces_sample_rate=sentry.traces_sample_rate,
                **pii,
                # Frame locals hold the message and the event it carries: payloads, like the arguments.
                include_local_variables=sentry.send_default_pii,
                # The kit's Sentry middleware does what Sentry's Dramatiq integration
                # would (per message, without its duplicate events); the Redis one would
                # record every poll of the consumers as a breadcrumb.
                disabled_integrations=[DramatiqIntegration(), RedisIntegration()],
                # Sentry Logs is not enabled; without this its handler would still take
                # a lock for every log line of every task.
                integrations=[LoggingIntegration(sentry_logs_level=None)],
            )
        # The task log logs each failed attempt at ERROR; the Sentry middleware reports the final one.
        for name in ("dramatiq_gp.tasks", "dramatiq.worker.WorkerThread"):
            ignore_logger(name)
            # Sentry Logs is off (above), yet since sentry-sdk has had a separate ignore list for it
            # (ignore_logger_for_sentry_logs), each record not on that list costs a client look-up: two a task.
            # Before, ignore_logger covered both. Pinned by test_sentry.py.
            getattr(sentry_logging, "ignore_logger_for_sentry_logs", ignore_logger)(name)


def _logged(name: str, step: Callable[[], object]) -> Callable[[], None]:
    def run() -> None:
        try:
            step()
        except Exception:
            logger.exception("shutdown: flushing %s failed", name)

    return run


def _sentry_active() -> bool:
    try:
        import sentry_sdk
    except ImportError:
        return False
    return sentry_sdk.get_client().is_active()
