"""The code samples in README.md and docs/ run as written.

A ``python`` block whose first line is ``# file: <path>`` is written to that path
in a scratch directory; the other ``python`` blocks of the page run, in order, as
one script there, against the test Redis, in this test's namespace.

The ``bash`` blocks of docs/cli.md run line by line in a scratch directory, against
a Redis and a database of the test's own; a ``text`` block right after one shows
what its first command prints, and the output must look like it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from zoneinfo import ZoneInfo

import dramatiq
import pytest
import sqlalchemy as sa

import dramatiq_gp as gp
from dramatiq_gp import keys
from helpers import own_database, publish_schedulable, wait_for
from servers import OwnRedis

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _path(tmp_path: Path) -> str:
    """The scratch directory, then this checkout: the samples run against the code under test, not an install."""
    return f"{tmp_path}{os.pathsep}{ROOT}"


def _samples(page: Path) -> tuple[dict[str, str], str]:
    files, script = {}, []
    for block in BLOCK.findall(page.read_text()):
        first, _, rest = block.partition("\n")
        if first.startswith("# file: "):
            files[first.removeprefix("# file: ").strip()] = rest
        else:
            script.append(block)
    return files, "\n".join(script)


@pytest.mark.parametrize("page", [p for p in PAGES if _samples(p)[1]], ids=lambda p: p.name)
def test_samples_run(page, tmp_path, clean_env, namespace, rdb):
    files, script = _samples(page)
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    env = {**os.environ, "VALKEY_NAMESPACE": namespace, "PYTHONPATH": _path(tmp_path)}
    command = [sys.executable, "-c", script]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr, done.stderr


def test_the_readme_sample_dispatches_to_the_mail_queue(tmp_path, clean_env, namespace, rdb):
    files, script = _samples(ROOT / "README.md")
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    env = {**os.environ, "VALKEY_NAMESPACE": namespace, "PYTHONPATH": _path(tmp_path)}
    subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, check=True, capture_output=True)
    assert rdb.llen(f"{namespace}:mail") == 1


def test_the_readme_worker_module_sends_nothing_when_a_worker_imports_it(tmp_path, clean_env, namespace, rdb):
    # Every worker process imports it: two processes must not mean two mails.
    files, _ = _samples(ROOT / "README.md")
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "worker.py").write_text(files["app/worker.py"])
    env = {**os.environ, "VALKEY_NAMESPACE": namespace, "PYTHONPATH": _path(tmp_path)}
    for _ in range(2):
        subprocess.run([sys.executable, "-c", "import app.worker"], cwd=tmp_path, env=env, check=True)
    assert not [key for key in rdb.scan_iter(f"{namespace}:*") if not key.startswith(f"{namespace}:gp:")]


def test_the_readme_names_the_two_commands_near_the_top():
    top = (ROOT / "README.md").read_text().splitlines()[:15]
    assert any(line.startswith("make demo") for line in top)
    assert any(line.startswith("make test") for line in top)


# -- docs/cli.md: the shell examples ----------------------------------------------------------

CLI_PAGE = ROOT / "docs" / "cli.md"
FENCED = re.compile(r"^```(\w+)\n(.*?)^```\n", re.S | re.M)
STAMP = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?[+-]\d\d:\d\d")


def _shell_blocks(page: Path) -> list[tuple[list[str], str | None]]:
    """Each ``bash`` block's command lines, with the ``text`` block right after it (what it prints), if any."""
    text = page.read_text()
    found = list(FENCED.finditer(text))
    blocks = []
    for i, block in enumerate(found):
        if block.group(1) != "bash":
            continue
        following = found[i + 1] if i + 1 < len(found) else None
        shown = None
        if following and following.group(1) == "text" and not text[block.end() : following.start()].strip():
            shown = following.group(2)
        blocks.append(([line for line in block.group(2).splitlines() if line.strip()], shown))
    return blocks


def _run_block(lines: list[str], cwd: Path, env: dict[str, str]) -> tuple[list[subprocess.CompletedProcess[str]], Path]:
    """Each line in bash, one after another, as a reader would type them (``cd`` carries over)."""
    done = []
    for line in lines:
        if line.startswith("cd "):
            cwd = cwd / line.removeprefix("cd ").strip()
            continue
        done.append(subprocess.run(["bash", "-c", line], cwd=cwd, env=env, capture_output=True, text=True, timeout=60))
    return done, cwd


def _shape(line: str) -> str:
    """A line of output with its values (times, counts, the namespace, the host) blanked out."""
    line = STAMP.sub("<time>", line)
    line = re.sub(r"^scheduler \S+: leader \S+ ", "scheduler <namespace>: leader <host> ", line)
    return re.sub(r"\b(\d+(\.\d+)?|None)\b", "<n>", line)


def _succeeded(done: list[subprocess.CompletedProcess[str]]) -> None:
    """Each exited 0 and wrote nothing on stderr but the line an action logs (who did what)."""
    for process in done:
        assert process.returncode == 0, (process.args, process.stdout, process.stderr)
        others = [line for line in process.stderr.splitlines() if "[dramatiq_gp.actions] [INFO]" not in line]
        assert others == [], (process.args, process.stderr)


@pytest.fixture
def empty_database(service_env):
    """A database of this test's own with no outbox table yet."""
    with own_database(service_env["DB_URL"]) as url:
        yield url


@pytest.fixture
def shell_env(tmp_path, clean_env, namespace, empty_database):
    """The reader's shell: ``dramatiq-gp`` on PATH, this test's namespace and database, and a Redis of its own.

    Its own Redis, because ``status`` lists every scheduler on the server, other tests' too.
    """
    server = OwnRedis(tmp_path / "redis")
    server.start()
    for name, value in {"REDIS_URL": server.url, "VALKEY_NAMESPACE": namespace, "DB_URL": empty_database}.items():
        clean_env.setenv(name, value)
    clean_env.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    clean_env.setenv("PYTHONPATH", str(ROOT))  # the command of this checkout, not of an install
    yield dict(os.environ)
    server.stop()


def test_the_cli_pages_generator_commands_run_as_shown_and_again_change_nothing(tmp_path, shell_env):
    generators = _shell_blocks(CLI_PAGE)[0][0]
    work = tmp_path / "work"
    work.mkdir()
    done, project = _run_block(generators, work, shell_env)
    _succeeded(done)
    register = (project / "shop" / "modules" / "billing" / "register.py").read_text()
    shown = next(b for lang, b in FENCED.findall(CLI_PAGE.read_text()) if lang == "text" and "def register(" in b)
    assert shown in register

    files = {path: path.read_bytes() for path in work.rglob("*") if path.is_file()}
    again, _ = _run_block(generators, work, shell_env)
    _succeeded(again)
    assert {path: path.read_bytes() for path in work.rglob("*") if path.is_file()} == files


def test_the_cli_pages_operator_commands_run_against_real_servers_as_shown(tmp_path, shell_env, make_kit):
    # The page's order; a block added to the page fails here until this test runs it too.
    blocks = _shell_blocks(CLI_PAGE)
    _generators, (migrate, _), (status, status_shown), (schedule, schedule_shown), (stored, stored_shown), *rest = (
        blocks
    )
    (outbox, _), (dlq, _) = rest

    missing = subprocess.run(["dramatiq-gp", "migrate", "status"], env=shell_env, capture_output=True, text=True)
    assert missing.returncode == 1 and "outbox table 'outbox_events' is missing" in missing.stdout
    done, _ = _run_block(migrate, tmp_path, shell_env)
    _succeeded(done)
    assert "is up to date" in done[-1].stdout

    # What the page's status shows: a leader with the page's entry, an event set aside, messages in two queues.
    kit = make_kit(
        lambda registry, schedule: schedule.job(
            "shop.nightly_sales_report", "0 3 * * *", lambda: None, tz="Europe/Budapest"
        ),
        env={"SCHEDULER_LEASE_TTL": "5s", "OUTBOX_MAX_ATTEMPTS": "1"},
    )
    with kit.engine.begin() as conn:
        set_aside = gp.dispatch(conn, Retired(1))
        conn.execute(sa.text("UPDATE outbox_events SET event = 'test.docs.gone'"))
    assert kit.relay.relay_once() == 1
    for queue in ("default", "mail"):
        kit.broker.enqueue(dramatiq.Message(queue_name=queue, actor_name="send", args=(), kwargs={}, options={}))
    kit.scheduler.start()
    try:
        wait_for(kit.scheduler.lease.is_held)
        done, _ = _run_block(status, tmp_path, shell_env)
        _succeeded(done)
        assert [_shape(line) for line in done[0].stdout.splitlines()] == [
            _shape(line) for line in status_shown.splitlines()
        ]

        done, _ = _run_block(schedule, tmp_path, shell_env)
        _succeeded(done)
        previews = [[datetime.fromisoformat(t) for t in d.stdout.splitlines()] for d in done]
        page = [datetime.fromisoformat(t) for t in schedule_shown.splitlines()]
        budapest = ZoneInfo("Europe/Budapest")
        assert [t.astimezone(budapest).strftime("%H:%M") for t in previews[0]] == [t.strftime("%H:%M") for t in page]
        assert all(t.astimezone(budapest).isoweekday() <= 5 for t in previews[0] + page)
        assert len(previews[1]) == 5 and {t.astimezone(budapest).strftime("%H:%M") for t in previews[1]} == {"03:00"}
    finally:
        kit.scheduler.stop()
        kit.engine.dispose()

    # Stored entries, with no leader running now (the page shows what that says), for what a worker published.
    publish_schedulable(kit.broker.client, kit.broker.namespace, actors={"cleanup": "default"}, events=("digest.due",))
    done, _ = _run_block(stored, tmp_path, shell_env)
    _succeeded(done)
    assert [_shape(line) for line in done[0].stdout.splitlines()] == [
        _shape(line) for line in stored_shown.splitlines()
    ]
    listed = done[2].stdout.splitlines()
    assert listed[0].startswith("cleanup.tmp  @every 10m (UTC)  actor cleanup  next ") and listed[-1] == (
        "2 stored entries in all"
    )
    assert done[3].stdout.strip() == "entry cleanup.tmp removed"

    bad = re.search(r"A bad spec names its culprit: `(Error: cron spec '([^']+)'[^`]*)`", CLI_PAGE.read_text())
    assert bad is not None
    refused = subprocess.run(["dramatiq-gp", "schedule", "next", bad[2]], env=shell_env, capture_output=True, text=True)
    assert refused.returncode == 1 and refused.stderr == bad[1] + "\n"

    # ID [ID ...] stands for the ids `outbox failed` lists.
    done, _ = _run_block([line.replace("ID [ID ...]", set_aside) for line in outbox], tmp_path, shell_env)
    _succeeded(done)
    listed, retried = done
    assert listed.stdout.startswith(f"{set_aside}  test.docs.gone  attempts=1  failed=")
    assert retried.stdout == "1 event(s) pending again\n"

    # Two dead letters, as a failed message leaves them; ID stands for one `dlq list` shows.
    client = kit.broker.client
    for n in (1, 2):
        dead = dramatiq.Message(
            queue_name="default",
            actor_name="send",
            args=(n,),
            kwargs={},
            options={"redis_message_id": f"dead-{n}", "retries": 20},
        )
        client.zadd(keys.dead(kit.broker.namespace, "default"), {f"dead-{n}": 1_700_000_000_000 + n})
        client.hset(keys.dead_messages(kit.broker.namespace, "default"), f"dead-{n}", dead.encode())
    done, _ = _run_block(
        [line.replace("ID [ID ...]", "dead-1").replace("ID", "dead-1") for line in dlq], tmp_path, shell_env
    )
    _succeeded(done)
    listed, shown, requeued, purged = done
    assert listed.stdout.splitlines()[0] == "queue default: 2 dead letter(s)"
    assert listed.stdout.splitlines()[1].startswith("dead-2  send  message ")  # the most recent first
    assert json.loads(shown.stdout)["args"] == "[Filtered]"
    assert requeued.stdout == "1 dead letter(s) of queue default requeued\n"
    assert purged.stdout == "1 dead letter(s) of queue default deleted\n"


@gp.event("test.docs.retired")
@dataclass(frozen=True)
class Retired:
    n: int


def test_the_outbox_pages_async_checkout_writes_its_row_in_the_callers_transaction(tmp_path, database_url, monkeypatch):
    import asyncio

    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    files, _ = _samples(ROOT / "docs" / "outbox.md")
    (tmp_path / "checkout.py").write_text(files["checkout.py"])
    monkeypatch.syspath_prepend(str(tmp_path))
    import checkout

    sync_engine = sa.create_engine(database_url)
    gp.outbox.migrate(sync_engine)
    events = gp.outbox.OUTBOX_EVENTS

    async def main() -> tuple[str, list[str]]:
        engine = create_async_engine(database_url)
        try:
            async with AsyncSession(engine) as session:
                event_id = await checkout.pay(session, 41)
            with pytest.raises(RuntimeError):  # the caller's transaction fails after the dispatch
                async with AsyncSession(engine) as session, session.begin():
                    await gp.dispatch_async(session, checkout.OrderPaid(42))
                    raise RuntimeError("payment declined")
        finally:
            await engine.dispose()
        with sync_engine.connect() as conn:
            ids = conn.execute(sa.select(events.c.id).where(events.c.event == "docs.checkout.order_paid")).scalars()
            return event_id, [str(i) for i in ids]

    try:
        event_id, written = asyncio.run(main())
    finally:
        sync_engine.dispose()
    # The committed one is there under its id; the one whose transaction failed never was.
    assert written == [event_id]
