"""The generators behind ``dramatiq-gp new`` and ``dramatiq-gp add``.

A generator writes a stub for the code that is yours (a listener's body, a job's
body, an event's fields) and registers it at an anchor comment (``# gpsystem:...``)
in a file it generated earlier. Every change is worked out in memory and checked
before anything is written, so an error (a missing anchor, an unknown module, a
name clash, a bad cron spec) leaves the tree as it was. A generator never
overwrites a file, and running one twice changes nothing.
"""

from __future__ import annotations

import keyword
import re
from dataclasses import dataclass, field
from pathlib import Path

from .errors import GPError
from .scheduler.cron import CronError, parse

_SNAKE = re.compile(r"[a-z][a-z0-9_]*")
_CAMEL = re.compile(r"[A-Z][A-Za-z0-9]*")


class GenerateError(GPError):
    """A generator cannot do what was asked; nothing was written."""


@dataclass
class Plan:
    """Files to create and files to change, applied only when every check passed."""

    root: Path
    create: dict[Path, str] = field(default_factory=dict)
    change: dict[Path, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def new_file(self, path: Path, text: str) -> None:
        if path.is_dir():
            raise GenerateError(f"{path.relative_to(self.root)} is a directory where a file goes; move it away")
        for parent in path.parents:
            if parent.is_file():
                shown = parent.relative_to(self.root) if parent.is_relative_to(self.root) else parent
                raise GenerateError(f"{shown} is a file where a directory goes; move it away")
        if path.exists():
            if path.read_text() != text:
                self.notes.append(f"kept {path.relative_to(self.root)} (it is yours now)")
            return
        self.create[path] = text

    def insert(self, path: Path, anchor: str, block: str) -> None:
        """Put ``block`` just above ``# gpsystem:<anchor>`` in ``path``, indented like it, unless it is there."""
        if path in self.create:
            text = self.create[path]
        elif path in self.change:
            text = self.change[path]
        elif path.exists():
            text = path.read_text()
        else:
            raise GenerateError(f"{path.relative_to(self.root)} does not exist")
        first = block.splitlines()[0].strip()
        if first in (existing.strip() for existing in text.splitlines()):
            return
        marker = f"# gpsystem:{anchor}"
        lines = text.splitlines(keepends=True)
        for i, existing in enumerate(lines):
            if existing.strip() == marker:
                indent = existing[: len(existing) - len(existing.lstrip())]
                lines[i:i] = [f"{indent}{line}\n" if line else "\n" for line in block.splitlines()]
                if path in self.create:
                    self.create[path] = "".join(lines)
                else:
                    self.change[path] = "".join(lines)
                return
        raise GenerateError(f"{path.relative_to(self.root)} has no '{marker}' anchor; add it where the line should go")

    def apply(self) -> list[str]:
        for path, text in self.create.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        for path, text in self.change.items():
            path.write_text(text)
        done = [f"created {p.relative_to(self.root)}" for p in self.create]
        done += [f"updated {p.relative_to(self.root)}" for p in self.change]
        return done + self.notes or ["nothing to do: it is all there already"]


def _snake(kind: str, value: str) -> str:
    if not _SNAKE.fullmatch(value) or keyword.iskeyword(value):
        raise GenerateError(f"{kind} {value!r} must be snake_case (letters, digits, '_'), e.g. send_receipt")
    return value


def _camel(kind: str, value: str) -> str:
    if not _CAMEL.fullmatch(value):
        raise GenerateError(f"{kind} {value!r} must be CamelCase, e.g. OrderPlaced")
    return value


def _to_snake(camel: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", camel).lower()


# -- the project -------------------------------------------------------------------


def project_package(root: Path) -> str:
    """The package name of a project made by ``new project`` (read from its pyproject)."""
    pyproject = root / "pyproject.toml"
    if not pyproject.is_file():
        raise GenerateError(f"{root} is not a dramatiq-gp project (no pyproject.toml); run `dramatiq-gp new project`")
    match = re.search(r"^# gpsystem:package (\w+)$", pyproject.read_text(), re.M)
    if not match:
        raise GenerateError(f"{pyproject} has no '# gpsystem:package <name>' line; was it made by dramatiq-gp?")
    return match.group(1)


def new_project(root: Path, name: str | None = None, *, worker: bool = True) -> Plan:
    package = _snake("project name", name or re.sub(r"[^a-z0-9_]", "_", root.name.lower()).strip("_") or "app")
    if root.exists() and any(root.iterdir()):
        # Only the same project may be there already: then this is a re-run, and the usual rules keep what is yours.
        try:
            existing = project_package(root)
        except GenerateError:
            raise GenerateError(
                f"{root} exists, is not empty and is not a dramatiq-gp project; give a new directory"
            ) from None
        if existing != package:
            raise GenerateError(
                f"{root} holds the project {existing!r}, not {package!r}; run with --name {existing} or give a new directory"
            )
    plan = Plan(root)
    for relative, text in _project_files(package).items():
        plan.new_file(root / relative, text)
    if worker:
        _plan_worker(plan, package)
    return plan


def add_worker(root: Path) -> Plan:
    package = project_package(root)
    plan = Plan(root)
    if (root / package / "worker.py").exists():
        plan.notes.append(f"{package}/worker.py exists already")
        return plan
    _plan_worker(plan, package)
    return plan


def _plan_worker(plan: Plan, package: str) -> None:
    path = plan.root / package / "worker.py"
    plan.new_file(path, _WORKER.format(package=package))
    modules = plan.root / package / "modules"
    # A module made before the worker registered itself nowhere; a worker already there is yours, left as it is.
    if path in plan.create and modules.is_dir():
        for module in sorted(p.name for p in modules.iterdir() if (p / "register.py").exists()):
            _register_module_in_worker(plan, package, module)


def new_module(root: Path, module: str) -> Plan:
    package = project_package(root)
    module = _snake("module name", module)
    plan = Plan(root)
    base = root / package / "modules" / module
    plan.new_file(base / "__init__.py", f'"""The {module} module."""\n')
    plan.new_file(base / "events.py", _EVENTS.format(module=module))
    plan.new_file(base / "register.py", _REGISTER.format(package=package, module=module))
    plan.new_file(base / "listeners" / "__init__.py", "")
    plan.new_file(base / "jobs" / "__init__.py", "")
    if (root / package / "worker.py").exists():
        _register_module_in_worker(plan, package, module)
    return plan


def _register_module_in_worker(plan: Plan, package: str, module: str) -> None:
    path = plan.root / package / "worker.py"
    plan.insert(
        path, "module-imports", f"from {package}.modules.{module}.register import register as register_{module}"
    )
    plan.insert(path, "modules", f"register_{module}(registry, schedule, deps)")


def _module_dir(root: Path, module: str) -> tuple[str, Path]:
    package = project_package(root)
    base = root / package / "modules" / _snake("module name", module)
    if not (base / "register.py").exists():
        raise GenerateError(f"no module {module!r} in {package}/modules; run `dramatiq-gp new module {module}`")
    return package, base


def add_event(root: Path, module: str, event: str) -> Plan:
    package, base = _module_dir(root, module)
    _camel("event name", event)
    plan = Plan(root)
    events = base / "events.py"
    if re.search(rf"^class {event}\b", events.read_text(), re.M):
        plan.notes.append(f"event {event} exists already in {module}/events.py")
        return plan
    wire = f"{package}.{module}.{_to_snake(event)}"
    block = (
        f'@gp.event("{wire}")\n@dataclass(frozen=True)\nclass {event}:\n    """Add the fields {event} carries."""\n\n\n'
    )
    plan.insert(events, "events", block)
    return plan


def _event_exists(base: Path, event: str) -> None:
    if not re.search(rf"^class {_camel('event name', event)}\b", (base / "events.py").read_text(), re.M):
        raise GenerateError(
            f"no event {event!r} in {base.name}/events.py; run `dramatiq-gp add event {base.name} {event}`"
        )


def _queue(queue: str) -> str:
    if not re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9._-]*", queue):
        raise GenerateError(f"queue {queue!r} is not a queue name (letters, digits, '.', '_', '-')")
    return queue


def add_listener(
    root: Path, module: str, event: str, name: str, *, queue: str = "default", is_async: bool = False
) -> Plan:
    package, base = _module_dir(root, module)
    _event_exists(base, event)
    name, queue = _snake("listener name", name), _queue(queue)
    plan = Plan(root)
    stub = base / "listeners" / f"{name}.py"
    register = base / "register.py"
    registration = f'registry.listen({event}, {name}(deps), name="{name}", queue="{queue}")'
    text = register.read_text()
    if f'name="{name}"' in text and registration not in text:
        raise GenerateError(f"listener {name!r} is already registered in {module}/register.py with other options")
    template = _ASYNC_LISTENER if is_async else _LISTENER
    plan.new_file(stub, template.format(package=package, module=module, event=event, name=name))
    plan.insert(register, "listener-imports", f"from {package}.modules.{module}.listeners.{name} import {name}")
    plan.insert(register, "event-imports", f"from {package}.modules.{module}.events import {event}")
    plan.insert(register, "listeners", registration)
    return plan


def add_job(root: Path, module: str, name: str, *, cron: str, queue: str = "default", is_async: bool = False) -> Plan:
    package, base = _module_dir(root, module)
    name, queue = _snake("job name", name), _queue(queue)
    try:
        parse(cron)
    except CronError as exc:
        raise GenerateError(str(exc)) from None
    plan = Plan(root)
    register = base / "register.py"
    entry = f"{module}.{name}"
    registration = f'schedule.job("{entry}", "{cron}", {name}(deps), queue="{queue}")'
    text = register.read_text()
    if f'schedule.job("{entry}",' in text and registration not in text:
        raise GenerateError(f"job {entry!r} is already scheduled in {module}/register.py with another spec or queue")
    template = _ASYNC_JOB if is_async else _JOB
    plan.new_file(base / "jobs" / f"{name}.py", template.format(package=package, name=name, entry=entry))
    plan.insert(register, "job-imports", f"from {package}.modules.{module}.jobs.{name} import {name}")
    plan.insert(register, "jobs", registration)
    return plan


# -- templates ---------------------------------------------------------------------

_WORKER = '''"""The worker: `dramatiq {package}.worker` runs every module's listeners and jobs."""

import dramatiq_gp as gp

from {package}.deps import Dependencies

# gpsystem:module-imports

deps = Dependencies.from_env()


def register(registry: gp.Registry, schedule: gp.Schedule) -> None:
    # gpsystem:modules
    pass


kit = gp.Kit(register, engine=deps.engine).with_closer("database", deps.close)
broker = kit.broker
'''

_EVENTS = '''"""The {module} module's events: each has a stable wire name; add the fields it carries."""

from dataclasses import dataclass

import dramatiq_gp as gp


# gpsystem:events
'''

_REGISTER = '''"""Registers the {module} module's listeners and jobs (the generators add lines at the anchors)."""

import dramatiq_gp as gp

from {package}.deps import Dependencies

# gpsystem:event-imports
# gpsystem:listener-imports
# gpsystem:job-imports


def register(registry: gp.Registry, schedule: gp.Schedule, deps: Dependencies) -> None:
    # gpsystem:listeners
    # gpsystem:jobs
    pass
'''

_LISTENER = '''"""The {name} listener of {event}."""

from collections.abc import Callable

from {package}.deps import Dependencies
from {package}.modules.{module}.events import {event}


def {name}(deps: Dependencies) -> Callable[[{event}], None]:
    def handle(event: {event}) -> None:
        """Handle one {event}; it may run more than once, so make it idempotent."""

    return handle
'''

_ASYNC_LISTENER = '''"""The {name} listener of {event}, async: it runs on the worker's event-loop thread."""

from collections.abc import Callable, Coroutine
from typing import Any

from {package}.deps import Dependencies
from {package}.modules.{module}.events import {event}


def {name}(deps: Dependencies) -> Callable[[{event}], Coroutine[Any, Any, None]]:
    async def handle(event: {event}) -> None:
        """Handle one {event}; it may run more than once, so make it idempotent.

        Await async clients here (httpx.AsyncClient, an async SDK); blocking calls would stall the loop.
        """

    return handle
'''

_ASYNC_JOB = '''"""The {entry} job, async: it runs on the worker's event-loop thread."""

from collections.abc import Callable, Coroutine
from typing import Any

from {package}.deps import Dependencies


def {name}(deps: Dependencies) -> Callable[[], Coroutine[Any, Any, None]]:
    async def run() -> None:
        """One run of {entry}; a failure is retried. Await async clients here; blocking calls stall the loop."""

    return run
'''

_JOB = '''"""The {entry} job."""

from collections.abc import Callable

from {package}.deps import Dependencies


def {name}(deps: Dependencies) -> Callable[[], None]:
    def run() -> None:
        """One run of {entry}; a failure is retried."""

    return run
'''


def _project_files(package: str) -> dict[str, str]:
    return {
        "pyproject.toml": f'''# gpsystem:package {package}
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "{package.replace("_", "-")}"
version = "0.1.0"
requires-python = ">=3.11"
dependencies = ["dramatiq-gp"]

[project.optional-dependencies]
dev = ["pytest>=8"]

[tool.setuptools.packages.find]
include = ["{package}*"]

[tool.pytest.ini_options]
testpaths = ["tests"]
''',
        "README.md": f"""# {package}

Background work on [dramatiq-gp](https://pypi.org/project/dramatiq-gp/): events,
listeners, an outbox and a schedule. Needs Redis (or Valkey) and PostgreSQL:
`docker compose up -d` starts both.

```sh
python -m venv .venv && .venv/bin/pip install -e '.[dev]' && .venv/bin/python -m {package}.migrate && .venv/bin/dramatiq {package}.worker
python -m venv .venv && .venv/bin/pip install -e '.[dev]' && .venv/bin/python -m pytest
```

Add code with the generators: `dramatiq-gp new module billing`,
`dramatiq-gp add event billing InvoicePaid`,
`dramatiq-gp add listener billing InvoicePaid send_receipt --queue mail`,
`dramatiq-gp add job billing nightly_report --cron "0 3 * * *"`.
""",
        "docker-compose.yml": """services:
  valkey:
    image: valkey/valkey:8
    ports: ["6379:6379"]
    healthcheck: {test: ["CMD", "valkey-cli", "ping"], interval: 2s, retries: 30}
  postgres:
    image: postgres:16
    environment: {POSTGRES_USER: app, POSTGRES_PASSWORD: app, POSTGRES_DB: app}
    ports: ["5432:5432"]
    healthcheck: {test: ["CMD", "pg_isready", "-U", "app"], interval: 2s, retries: 30}
""",
        f"{package}/__init__.py": f'"""{package}."""\n',
        f"{package}/modules/__init__.py": '"""One package per module: events, listeners, jobs and their register()."""\n',
        f"{package}/deps.py": '''"""What listeners and jobs need, built once per worker process from the environment."""

from __future__ import annotations

import os
from dataclasses import dataclass

import sqlalchemy as sa


@dataclass
class Dependencies:
    engine: sa.Engine | None

    @classmethod
    def from_env(cls) -> Dependencies:
        url = os.environ.get("DB_URL")
        if url and url.startswith("postgresql://"):
            url = "postgresql+psycopg://" + url.removeprefix("postgresql://")
        return cls(engine=sa.create_engine(url, pool_pre_ping=True) if url else None)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.dispose()
''',
        f"{package}/migrate.py": f'''"""Create the outbox table (and, as you add them, your own tables): `python -m {package}.migrate`."""

import dramatiq_gp as gp

from {package}.deps import Dependencies


def main() -> None:
    deps = Dependencies.from_env()
    if deps.engine is None:
        raise SystemExit("set DB_URL, e.g. postgresql://app:app@127.0.0.1:5432/app")
    gp.outbox.migrate(deps.engine)
    deps.close()
    print("migrated")


if __name__ == "__main__":
    main()
''',
        "tests/__init__.py": "",
        "tests/test_project.py": f'''"""The project's modules import, and every registration is a valid listener or schedule entry."""

import importlib
import pkgutil

import dramatiq_gp as gp

import {package}.modules
from {package}.deps import Dependencies


def test_every_module_registers_cleanly():
    registry, schedule = gp.Registry(), gp.Schedule()
    deps = Dependencies(engine=None)
    for module in pkgutil.iter_modules({package}.modules.__path__):
        register = importlib.import_module(f"{package}.modules.{{module.name}}.register").register
        register(registry, schedule, deps)
    names = [listener.actor_name for listener in registry.listeners()]
    assert len(names) == len(set(names))
    assert len({{entry.name for entry in schedule}}) == len(schedule)
''',
    }
