"""Rolling deploys with real workers: old and new versions side by side, each on both brokers.

A worker of the old version and one of the new run at once, as during a rolling
deploy (``tests.apps.deploy_app``, each with its own listeners). Events are
committed through the outbox; whichever worker takes an ``event:`` message fans it
out, to the listeners every live worker declared.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

import dramatiq_gp as gp
from apps.app_events import Ordered
from apps.replica import Replica
from dramatiq_gp import keys
from dramatiq_gp.cli import main as cli_main
from helpers import ready, wait_for

pytestmark = pytest.mark.usefixtures("broker")

DEPLOY_RUNS = """
CREATE TABLE IF NOT EXISTS deploy_runs (
    namespace text NOT NULL, listener text NOT NULL, envelope text NOT NULL, order_id integer NOT NULL,
    pid integer NOT NULL
)"""

StartReplica = Callable[..., Replica]


@pytest.fixture
def replica(tmp_path: Path, namespace: str, database_url: str, engine: sa.Engine) -> Iterator[StartReplica]:
    """Start ``dramatiq tests.apps.deploy_app`` with the listeners named, consuming the queues named (only)."""
    with engine.begin() as conn:
        conn.execute(sa.text(DEPLOY_RUNS))
    started: list[Replica] = []

    def start(listeners: str, queues: str, **env: str) -> Replica:
        settings = {
            "VALKEY_NAMESPACE": namespace,
            "DB_URL": database_url,
            "GP_TEST_LISTENERS": listeners,
            "WORKER_QUEUES": queues,
            "OUTBOX_POLL_INTERVAL_MAX": "100ms",
            **env,
        }
        log, consumed = tmp_path / f"replica-{len(started)}.log", [q for q in queues.split(",") if q]
        started.append(Replica("tests.apps.deploy_app", settings, log, args=["--queues", *consumed]))
        wait_for(started[-1].started, timeout=30)
        return started[-1]

    yield start
    for each in started:
        each.kill()


def _commit(engine: sa.Engine, orders: range) -> None:
    for order_id in orders:
        with engine.begin() as conn:
            gp.dispatch(conn, Ordered(order_id))


def _runs(engine: sa.Engine, namespace: str) -> Counter[tuple[str, int]]:
    query = sa.text("SELECT listener, order_id FROM deploy_runs WHERE namespace = :namespace")
    with engine.connect() as conn:
        return Counter((listener, order_id) for listener, order_id in conn.execute(query, {"namespace": namespace}))


@pytest.mark.parametrize("fanned_out_by", ["old", "new"])
def test_every_event_committed_after_a_new_worker_started_reaches_its_new_listener_once(
    fanned_out_by, replica, engine, namespace
):
    # The old version has `mail` and `legacy`; the new one drops `legacy` and adds `archive_pdf`.
    # Only one of them consumes the `default` queue, so only it fans out.
    old_default, new_default = ("default,", "") if fanned_out_by == "old" else ("", "default,")
    replica("mail,legacy", f"{old_default}mail,legacy")
    replica("mail,archive_pdf", f"{new_default}mail,archive_pdf")
    orders = range(20)
    _commit(engine, orders)
    expected = {(name, order_id) for name in ("mail", "legacy", "archive_pdf") for order_id in orders}
    wait_for(lambda: set(_runs(engine, namespace)) >= expected, timeout=60)
    time.sleep(0.5)  # a duplicate would show up by now
    runs = _runs(engine, namespace)
    assert set(runs) == expected
    assert max(runs.values()) == 1, [key for key, count in runs.items() if count > 1]


def test_a_listener_no_worker_declares_any_more_is_retired_from_the_fan_out(replica, engine, namespace, rdb, make_kit):
    legacy = f"listener:{Ordered.__gp_event__.name}:legacy"
    old = replica("mail,legacy", "default,mail,legacy", WORKER_LISTENER_RETIREMENT="2s")
    _commit(engine, range(3))
    wait_for(lambda: len(_runs(engine, namespace)) == 6, timeout=30)
    assert rdb.hexists(keys.listeners(namespace), legacy)
    old.stop()
    # The new version has no `legacy`. Until the retirement its messages would still be sent, to
    # wait in its queue for a worker; once no worker has declared it for 2 s, it is retired.
    replica("mail", "default,mail", WORKER_LISTENER_RETIREMENT="2s")
    wait_for(lambda: not rdb.hexists(keys.listeners(namespace), legacy), timeout=10)
    _commit(engine, range(3, 6))
    wait_for(lambda: {o for (name, o) in _runs(engine, namespace) if name == "mail"} == set(range(6)), timeout=30)
    time.sleep(0.5)
    assert {o for (name, o) in _runs(engine, namespace) if name == "legacy"} == {0, 1, 2}
    assert ready(make_kit(), "legacy") == 0
    assert rdb.hkeys(keys.listeners(namespace)) == [f"listener:{Ordered.__gp_event__.name}:mail"]


def test_an_event_committed_while_a_listener_was_live_reaches_it_when_fanned_out_after_its_retirement(
    replica, engine, namespace, rdb, make_kit
):
    legacy = f"listener:{Ordered.__gp_event__.name}:legacy"
    # Nobody consumes `default` yet: the events' fan-out waits there, as one retried, or held
    # by a worker killed with it, waits until after the listener is retired.
    old = replica("mail,legacy", "mail,legacy", WORKER_LISTENER_RETIREMENT="2s")
    _commit(engine, range(3))
    wait_for(lambda: ready(make_kit(), "default") == 3, timeout=30)
    old.stop()
    replica("mail", "mail", WORKER_LISTENER_RETIREMENT="2s")
    wait_for(lambda: not rdb.hexists(keys.listeners(namespace), legacy), timeout=10)
    replica("mail", "default,mail", WORKER_LISTENER_RETIREMENT="2s")
    # Written while `legacy` was live: fanned out to it, to wait in its queue for a worker that has it.
    wait_for(lambda: ready(make_kit(), "legacy") == 3, timeout=30)
    _commit(engine, range(3, 6))
    wait_for(lambda: {o for (name, o) in _runs(engine, namespace) if name == "mail"} == set(range(6)), timeout=30)
    time.sleep(0.5)
    assert ready(make_kit(), "legacy") == 3  # not the events written after its retirement


def test_a_backfill_sends_a_new_listener_the_events_committed_before_it_was_live(
    make_kit, start_worker, engine, database_url, namespace, clean_env
):
    got: dict[str, list[int]] = {"mail": [], "archive": []}

    def listening(*names: str) -> gp.RegisterFunc:
        def register(registry: gp.Registry, schedule: gp.Schedule) -> None:
            for name in names:
                registry.listen(
                    Ordered, lambda event, name=name: got[name].append(event.order_id), name=name, queue=name
                )

        return register

    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    start_worker(make_kit(listening("mail"), env={"DB_URL": database_url}))
    _commit(engine, range(3))
    wait_for(lambda: sorted(got["mail"]) == [0, 1, 2])
    start_worker(make_kit(listening("mail", "archive")))
    time.sleep(0.5)
    assert got["archive"] == []  # their fan-out was done before it was live

    task_type = f"listener:{Ordered.__gp_event__.name}:archive"
    backfill = CliRunner().invoke(cli_main, ["outbox", "backfill", task_type, "--since", "1h"])
    assert backfill.exit_code == 0, backfill.output
    assert f"3 event(s) sent to {task_type}" in backfill.output
    wait_for(lambda: sorted(got["archive"]) == [0, 1, 2])
    again = CliRunner().invoke(cli_main, ["outbox", "backfill", task_type, "--since", "1h"])
    assert again.exit_code == 0, again.output
    time.sleep(0.5)
    assert sorted(got["archive"]) == [0, 1, 2]  # the copies of what it handled are skipped

    unknown = CliRunner().invoke(cli_main, ["outbox", "backfill", "listener:nope:x", "--since", "1h"])
    assert unknown.exit_code == 1
    assert unknown.output == "Error: no live worker declares listener:nope:x: start a worker that has it first\n"
