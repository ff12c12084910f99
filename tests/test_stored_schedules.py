"""Schedule entries stored at run time (``kit.schedules``, ``dramatiq-gp schedule add``), fired by the leader.

Real Redis throughout; the firing tests run real scheduler processes
(:mod:`devtools.scheduler_cluster`) and real ``dramatiq`` workers.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import dramatiq
import pytest
from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.date import DateTrigger
from apscheduler.triggers.interval import IntervalTrigger
from click.testing import CliRunner

import dramatiq_gp as gp
from devtools.scheduler_cluster import Cluster
from dramatiq_gp import keys
from dramatiq_gp.cli import main
from dramatiq_gp.names import tick_message_id
from dramatiq_gp.scheduler.dynamic import EventByName
from helpers import publish_schedulable, wait_for

TTL = 2.0


@gp.schedulable
@gp.event("test.stored.ping")
@dataclass(frozen=True)
class Ping:
    n: int


@pytest.fixture
def schedules(rdb, namespace) -> gp.Schedules:
    publish_schedulable(rdb, namespace, actors={"job": "default"}, events=("test.stored.ping", "digest.due"))
    return gp.Schedules(rdb, namespace, timezone="Europe/Budapest")


@pytest.fixture
def cluster(tmp_path, clean_env, redis_url, namespace):
    clusters: list[Cluster] = []

    def make(size: int = 3) -> Cluster:
        env = {
            "REDIS_URL": redis_url,
            "VALKEY_NAMESPACE": namespace,
            "SCHEDULER_LEASE_TTL": f"{TTL}s",
            "SCHEDULER_DYNAMIC": "true",
            "SCHEDULER_CATCHUP": "all",
            "GP_TEST_SPEC": "",
        }
        clusters.append(Cluster(env, tmp_path, size))
        clusters[-1].start()
        return clusters[-1]

    yield make
    for each in clusters:
        each.stop()


def _error(call) -> str:
    with pytest.raises(gp.ScheduleError) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_an_entry_is_checked_before_it_is_stored_and_refused_with_one_line(schedules, rdb, namespace):
    assert "hour value 25" in _error(lambda: schedules.add("a", "0 25 * * *", Ping(1)))
    assert "not an IANA time zone" in _error(lambda: schedules.add("a", "@daily", Ping(1), tz="Mars/Olympus"))
    assert "a name is letters" in _error(lambda: schedules.add("a b", "@daily", Ping(1)))
    assert "cannot be stored" in _error(lambda: schedules.add("a", CronTrigger(hour=3), Ping(1)))
    assert "jitter" in _error(lambda: schedules.add("a", IntervalTrigger(minutes=5, jitter=10), Ping(1)))
    assert "not the class" in _error(lambda: schedules.add("a", "@daily", Ping))
    assert "args= and kwargs= are for an actor" in _error(lambda: schedules.add("a", "@daily", Ping(1), args=[1]))
    assert "an event instance, an actor" in _error(lambda: schedules.add("a", "@daily", 42))
    assert "more than" in _error(lambda: schedules.add("a", "@daily", "job", args=["x" * 20_000]))
    # Each of these was an OverflowError: a tick, or the date, is past the year 9999 (or before the year 1).
    assert "at most 36525d (100 years)" in _error(lambda: schedules.add("a", "@every 999999999d", Ping(1)))
    for far in (datetime(9999, 12, 31, 23, tzinfo=timezone(timedelta(hours=-14))), datetime(1, 1, 1, tzinfo=UTC)):
        assert "date is from 1970 to 100 years ahead" in _error(lambda: schedules.add("a", DateTrigger(far), Ping(1)))  # noqa: B023
    assert len(schedules) == 0 and rdb.zcard(f"{namespace}:scheduler:due") == 0

    assert schedules.add("a", "@daily", Ping(1)) == "added"
    assert "exists already" in _error(lambda: schedules.add("a", "@hourly", Ping(2)))
    assert schedules.get("a").trigger == "@daily"
    assert schedules.add("a", "@hourly", Ping(2), replace=True) == "replaced"
    stored = schedules.get("a")
    assert (stored.trigger, stored.kind, stored.target, stored.data) == (
        "@hourly",
        "event",
        "test.stored.ping",
        {"n": 2},
    )
    assert stored.zone == "Europe/Budapest" and stored.next_fire.minute == 0


def test_only_what_the_code_marks_schedulable_is_a_target_and_only_as_it_takes_it(make_kit, rdb, namespace):
    kit = make_kit(lambda registry, _: registry.listen(Ping, lambda _: None, name="rec"), {"SCHEDULER_DYNAMIC": "true"})

    @gp.schedulable
    @dramatiq.actor(broker=kit.broker, actor_name="reindex", queue_name="search")
    def reindex(index: str, *, full: bool = False) -> None: ...

    @dramatiq.actor(broker=kit.broker, actor_name="delete_account")
    def delete_account(account: int) -> None: ...

    listener = next(a for a in kit.broker.actors.values() if a.actor_name.startswith("listener:"))
    assert "one of the kit's own task types" in _error(lambda: gp.schedulable(listener))
    assert "takes a Dramatiq actor or a class decorated" in _error(lambda: gp.schedulable(len))
    add = kit.schedules.add
    assert "actor 'delete_account' is not schedulable" in _error(lambda: add("e", "@daily", delete_account, args=[1]))
    assert "is one of the kit's own task types" in _error(lambda: add("e", "@daily", listener.actor_name))
    assert "got an unexpected keyword argument 'fast'" in _error(
        lambda: add("e", "@daily", reindex, args=["a"], kwargs={"fast": 1})
    )
    assert "too many positional arguments" in _error(lambda: add("e", "@daily", reindex, args=["a", "b"]))
    # Options that would run another actor, or send a message of the entry's making, when a run ends.
    for option in ("on_failure", "on_success", "pipe_target"):
        assert f"option(s) {option} cannot be stored" in _error(
            lambda o=option: add("e", "@daily", reindex, **{o: "x"})
        )
    assert add("e", "@daily", reindex, args=["orders"], kwargs={"full": True}, max_retries=1) == "added"

    # Where the code is not loaded, the same checks against what a worker published (its own runner, here).
    kit.scheduler.start()
    try:
        bare = gp.Schedules(rdb, namespace, warn_leaderless=False)
        assert "actor:reindex" in rdb.hkeys(f"{namespace}:scheduler:schedulable")
        assert "got an unexpected keyword argument" in _error(
            lambda: bare.add("f", "@daily", "reindex", args=["a"], kwargs={"x": 1})
        )
        assert "runs from queue 'search' only" in _error(
            lambda: bare.add("f", "@daily", "reindex", args=["a"], queue="x")
        )
        assert "no worker publishes an actor 'delete_account'" in _error(
            lambda: bare.add("f", "@daily", "delete_account")
        )
        bare.add("f", "@daily", "reindex", args=["users"])
        assert bare.get("f").queue == "search"  # the actor's own queue, not "default"
        assert "requires field(s) n" in _error(lambda: bare.add("g", "@daily", EventByName("test.stored.ping", {})))
        bad = EventByName("test.stored.ping", {"n": 1, "card": "4111"})
        assert "has no field(s) card (it has n)" in _error(lambda: bare.add("g", "@daily", bad))
    finally:
        kit.scheduler.stop()


def test_a_code_entry_keeps_its_name(make_kit):
    kit = make_kit(lambda registry, schedule: schedule.job("nightly", "0 3 * * *", lambda: None))
    assert "defined in code" in _error(lambda: kit.schedules.add("nightly", "@hourly", Ping(1)))
    # Where the code is not loaded (the CLI), the name a worker published is refused all the same.
    kit.scheduler.start()
    try:
        bare = gp.Schedules(kit.broker.client, kit.broker.namespace)
        assert "code entry a worker published" in _error(lambda: bare.add("nightly", "@hourly", Ping(1)))
    finally:
        kit.scheduler.stop()


def test_the_kit_checks_actors_queues_and_options_against_its_broker(make_kit):
    kit = make_kit()

    @gp.schedulable
    @dramatiq.actor(queue_name="reports", broker=kit.broker)
    def build_report(customer: int) -> None: ...

    assert "no worker publishes an actor 'nope' as schedulable" in _error(
        lambda: kit.schedules.add("r", "@daily", "nope")
    )
    assert "option(s) bogus cannot be stored" in _error(lambda: kit.schedules.add("r", "@daily", build_report, bogus=1))
    assert "runs from queue 'reports' only" in _error(
        lambda: kit.schedules.add("r", "@daily", build_report, args=[7], queue="default")
    )
    assert "cannot take these arguments: missing a required argument: 'customer'" in _error(
        lambda: kit.schedules.add("r", "@daily", build_report)
    )
    kit.schedules.add("r", "@daily", build_report, args=[7], max_retries=2)
    stored = kit.schedules.get("r")
    assert (stored.kind, stored.target, stored.queue, stored.options) == (
        "actor",
        "build_report",
        "reports",
        {"max_retries": 2},
    )
    assert stored.data == {"args": [7], "kwargs": {}}


def test_storable_apscheduler_triggers_keep_their_start(schedules):
    start = datetime(2026, 1, 1, 0, 0, 7, tzinfo=UTC)
    schedules.add("i", IntervalTrigger(minutes=5, start_date=start), Ping(1))
    next_fire = schedules.get("i").next_fire
    assert (next_fire - start) % timedelta(minutes=5) == timedelta(0) and next_fire > datetime.now(UTC)
    # Without a start_date, APScheduler picks one as the trigger is built: stored, so every leader counts from it.
    schedules.add("j", IntervalTrigger(seconds=90), Ping(1))
    schedules.add("d", DateTrigger(datetime.now(UTC) + timedelta(days=1)), Ping(1))
    assert {entry.name for entry in schedules.list()} == {"d", "i", "j"}
    assert schedules.get("d").trigger.startswith("date[")


def test_list_pages_by_prefix_and_remove_takes_every_trace(schedules, rdb, namespace):
    for n in range(30):
        schedules.add(f"digest.{n:02}", "0 8 * * *", EventByName("digest.due", {"customer": n}))
    schedules.add("other", "@daily", Ping(1))
    assert [e.name for e in schedules.list("digest.", limit=3)] == ["digest.00", "digest.01", "digest.02"]
    assert len(schedules.list("digest.")) == 30 and len(schedules) == 31
    # The next page starts after the last name of this one; a cursor before the prefix starts at the prefix.
    assert [e.name for e in schedules.list("digest.", limit=2, after="digest.02")] == ["digest.03", "digest.04"]
    assert [e.name for e in schedules.list("digest.1", limit=2, after="a")] == ["digest.10", "digest.11"]
    assert schedules.list("digest.", after="digest.29") == [] and schedules.list("digest.", after="z") == []
    assert [e.name for e in schedules.list("digest.", limit=1, after="digest.")] == ["digest.00"]
    assert [e.name for e in schedules.list(limit=100, after="digest.29")] == ["other"]
    assert [e.name for e in schedules.next_due(31)][-1] in {e.name for e in schedules.list()}
    rdb.hset(f"{namespace}:scheduler:last_fired", "other", 1)
    rdb.hset(f"{namespace}:scheduler:paused", "other", "{}")
    assert schedules.remove("other") and not schedules.remove("other")
    for key in ("dynamic", "last_fired", "paused"):
        assert not rdb.hexists(f"{namespace}:scheduler:{key}", "other")
    for key in ("due", "names"):
        assert rdb.zscore(f"{namespace}:scheduler:{key}", "other") is None
    assert rdb.zcard(f"{namespace}:scheduler:names") == 30


def test_a_stored_record_that_cannot_be_read_is_listed_with_its_mark_and_the_rest_still_shows(
    schedules, rdb, namespace
):
    schedules.add("a.good", "@daily", Ping(1))
    schedules.add("b.bad", "@daily", Ping(2))
    schedules.add("c.odd", "@daily", Ping(3))
    rdb.hset(f"{namespace}:scheduler:dynamic", mapping={"b.bad": "{not json", "c.odd": '{"zone": "UTC"}'})
    good, bad, odd = schedules.list()
    assert good.kind == "event" and good.trigger == "@daily"
    assert (bad.kind, bad.trigger) == ("unreadable", "(unreadable: not JSON)")
    assert (odd.kind, odd.trigger) == ("unreadable", "(unreadable: KeyError('trigger'))")


def test_arguments_nested_deeper_than_100_levels_are_refused_in_one_line_and_marked_when_read(
    schedules, rdb, namespace
):
    deep: list = []
    for _ in range(100):  # 101 levels in all
        deep = [deep]
    looped: list = []
    looped.append(looped)
    too_deep = "nested deeper than 100 levels"
    assert _error(lambda: schedules.add("a", "@daily", "job", args=[deep])) == f"schedule entry 'a': args: {too_deep}"
    assert _error(lambda: schedules.add("a", "@daily", "job", kwargs={"k": deep})).endswith(f"kwargs: {too_deep}")
    assert _error(lambda: schedules.add("a", "@daily", "job", args=[looped])).endswith(f"args: {too_deep}")
    assert _error(lambda: schedules.add("a", "@daily", EventByName("digest.due", deep))).endswith(f"data: {too_deep}")
    assert len(schedules) == 0
    assert schedules.add("a", "@daily", "job", args=deep[0]) == "added"  # 100 levels are kept
    for name, depth in (("b", 101), ("c", 5000)):  # written by hand: 5000 exhausts the parser's recursion
        record = f'{{"zone": "UTC", "trigger": "@daily", "queue": "default", "args": {"[" * depth + "]" * depth}}}'
        rdb.hset(f"{namespace}:scheduler:dynamic", name, record)
        rdb.zadd(f"{namespace}:scheduler:names", {name: 0})
    assert [(e.name, e.trigger) for e in schedules.list()] == [
        ("a", "@daily"),
        ("b", f"(unreadable: {too_deep})"),
        ("c", f"(unreadable: {too_deep})"),
    ]


def _stored_firings(cluster: Cluster) -> dict[str, list[tuple[datetime, str]]]:
    by_entry = defaultdict(list)
    for data in cluster.client.hvals(f"{cluster.namespace}:default.msgs"):
        message = json.loads(data)
        envelope = message["args"][0]
        by_entry[envelope["entry"]].append((datetime.fromisoformat(envelope["scheduled_at"]), message["message_id"]))
    return {name: sorted(firings) for name, firings in by_entry.items()}


def test_stored_entries_fire_every_tick_once_through_leader_kills(cluster, rdb, namespace):
    nodes = cluster(3)
    nodes.wait_for_leader()
    publish_schedulable(rdb, namespace, events=("test.stored.ping",))
    schedules = gp.Schedules(rdb, namespace)
    names = [f"digest.{n}" for n in range(20)]
    for n, name in enumerate(names):
        schedules.add(name, "@every 1s", Ping(n))
    for _ in range(2):
        wait_for(lambda: len(_stored_firings(nodes).get(names[-1], [])) >= 3, timeout=10)
        pid, _ = nodes.wait_for_leader()
        index = nodes.index_of(pid)
        nodes.kill(index, signal.SIGKILL)
        nodes.wait_for_leader(other_than=pid, timeout=4 * TTL)
        nodes.start(index)
    wait_for(lambda: len(_stored_firings(nodes).get(names[-1], [])) >= 12, timeout=20)
    firings = _stored_firings(nodes)
    assert set(firings) == set(names)
    for name, fired in firings.items():
        ticks = [tick for tick, _ in fired]
        assert Counter(message_id for _, message_id in fired).most_common(1)[0][1] == 1, name
        gaps = {b - a for a, b in itertools.pairwise(ticks)}
        assert gaps == {timedelta(seconds=1)}, (name, sorted(gaps))


def test_workers_run_stored_events_and_actors_paused_resumed_and_removed(run_worker_app, rdb, namespace):
    run_worker_app()
    schedules = gp.Schedules(rdb, namespace)
    schedules.add("ping", "@every 1s", EventByName("test.stored.digest", {"customer": 7}))
    schedules.add("mail", "@every 1s", "send_digest", args=[42], kwargs={"channel": "sms"}, queue="digests")
    runs = f"{namespace}:test:runs"

    def recorded() -> list[dict]:
        return [json.loads(line) for line in rdb.lrange(runs, 0, -1)]

    wait_for(lambda: sum("actor" in r for r in recorded()) >= 2 and sum("event" in r for r in recorded()) >= 2, 20)
    assert {r["channel"] for r in recorded() if "actor" in r} == {"sms"}
    assert {r["actor"] for r in recorded() if "actor" in r} == {42}
    events = [r for r in recorded() if "event" in r]
    assert {r["event"] for r in events} == {7}
    assert all(datetime.fromisoformat(r["scheduled_at"]).microsecond == 0 for r in events)

    result = CliRunner().invoke(main, ["schedule", "pause", "mail"], env={"VALKEY_NAMESPACE": namespace})
    assert result.exit_code == 0, result.output
    paused_at = sum("actor" in r for r in recorded())
    wait_for(lambda: sum("event" in r for r in recorded()) >= len(events) + 3, 10)
    assert sum("actor" in r for r in recorded()) <= paused_at + 1  # at most one tick in flight as it was paused
    assert schedules.remove("ping")
    rdb.delete(runs)
    result = CliRunner().invoke(main, ["schedule", "resume", "mail"], env={"VALKEY_NAMESPACE": namespace})
    assert result.exit_code == 0, result.output
    wait_for(lambda: sum("actor" in r for r in recorded()) >= 2, 10)
    assert not [r for r in recorded() if "event" in r][1:]  # one at most: the tick in flight as it was removed


def test_the_workers_publish_what_is_schedulable_and_the_leader_fires_nothing_else(run_worker_app, rdb, namespace):
    scheduler = keys.SchedulerKeys(namespace)
    # Published by an older deploy that marked it; this code declares it unmarked: withdrawn at start.
    rdb.hset(scheduler.schedulable, "actor:delete_account", '{"queue": "digests", "params": []}')
    run_worker_app()
    assert sorted(rdb.hkeys(scheduler.schedulable)) == ["actor:send_digest", "event:test.stored.digest"]
    # Written into Redis as no check lets them be stored now (by an older dashboard, say): an actor the code
    # does not mark, the listener itself on a hand-made envelope, and a marked actor sent to another queue.
    envelope = {"id": "00000000-0000-0000-0000-000000000001", "event": "test.stored.digest", "data": {"customer": 9}}
    raw = {
        "evil": {"actor": "delete_account", "args": [4242], "queue": "digests"},
        "forged": {"actor": "listener:test.stored.digest:record", "args": [envelope], "queue": "default"},
        "elsewhere": {"actor": "send_digest", "args": [5], "queue": "default"},
        "good": {"actor": "send_digest", "args": [1], "queue": "digests"},
    }
    now_ms = int(time.time() * 1000)
    for name, target in raw.items():
        record = {"trigger": "@every 1s", "zone": "UTC", "options": {}, "kwargs": {}, **target}
        rdb.hset(scheduler.dynamic, name, json.dumps(record))
        rdb.zadd(scheduler.due, {name: now_ms})
        rdb.zadd(scheduler.names, {name: 0})
    runs = f"{namespace}:test:runs"
    wait_for(lambda: sum(json.loads(r).get("actor") == 1 for r in rdb.lrange(runs, 0, -1)) >= 3, timeout=20)
    recorded = [json.loads(r) for r in rdb.lrange(runs, 0, -1)]
    assert {json.dumps(r) for r in recorded} == {json.dumps({"actor": 1, "channel": "mail"})}, recorded
    log = run_worker_app.log.read_text()
    for name, why in (
        ("evil", "actor 'delete_account' is not schedulable"),
        ("forged", "'listener:test.stored.digest:record' is one of the kit's own task types"),
        ("elsewhere", "goes to queue 'default', but actor 'send_digest' runs from 'digests'"),
    ):
        assert log.count(f"stored entry not fired: schedule entry '{name}': {why}") == 1, (name, log)
    # And run now refuses them as the leader does: nothing is enqueued.
    refused = CliRunner().invoke(main, ["schedule", "run", "evil"], env={"VALKEY_NAMESPACE": namespace})
    assert refused.exit_code == 1 and "actor 'delete_account' is not schedulable" not in refused.output
    assert "no worker publishes an actor 'delete_account' as schedulable" in refused.output


@pytest.fixture
def run_worker_app(tmp_path, clean_env, redis_url, namespace):
    root = Path(__file__).resolve().parent.parent
    processes = []

    def run() -> None:
        env = {**os.environ, "REDIS_URL": redis_url, "VALKEY_NAMESPACE": namespace, "SCHEDULER_DYNAMIC": "true"}
        log = tmp_path / "worker.log"
        with open(log, "w") as out:
            processes.append(
                subprocess.Popen(
                    [sys.executable, "-m", "dramatiq", "tests.apps.stored_app", "-p", "2", "-t", "2"],
                    cwd=root,
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        wait_for(lambda: "leadership acquired" in log.read_text(), timeout=30)

    run.log = tmp_path / "worker.log"  # type: ignore[attr-defined]
    yield run
    for process in processes:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(30)


def test_the_cli_adds_lists_previews_and_removes_stored_entries(clean_env, namespace, rdb):
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    publish_schedulable(rdb, namespace, actors={"cleanup": "default"}, events=("digest.due",))

    def cli(*args: str):
        return CliRunner().invoke(main, list(args))

    added = cli(
        "schedule",
        "add",
        "digest.42",
        "0 8 * * *",
        "--tz",
        "Asia/Tokyo",
        "--event",
        "digest.due",
        "--data",
        '{"customer": 42}',
    )
    assert added.exit_code == 0, added.output
    assert "entry digest.42 stored: next fire " in added.output and "+09:00" in added.output
    twice = cli("schedule", "add", "digest.42", "0 9 * * *", "--event", "digest.due")
    assert twice.exit_code == 1 and "exists already" in twice.output
    bad = cli("schedule", "add", "x", "0 8 * *", "--actor", "a")
    assert bad.exit_code == 1 and "has 4 fields" in bad.output and "Traceback" not in bad.output
    neither = cli("schedule", "add", "x", "@daily")
    assert neither.exit_code == 1 and "give one of --event and --actor" in neither.output
    assert cli("schedule", "add", "job.1", "@every 10m", "--actor", "cleanup", "--args", '["/tmp"]').exit_code == 0

    listed = cli("schedule", "list")
    assert listed.exit_code == 0 and "digest.42  0 8 * * * (Asia/Tokyo)  event digest.due" in listed.output
    assert "2 stored entries in all" in listed.output
    as_json = [json.loads(line) for line in cli("schedule", "list", "job.", "--json").output.splitlines()]
    assert [(e["name"], e["kind"], e["data"]) for e in as_json] == [
        ("job.1", "actor", {"args": ["/tmp"], "kwargs": {}})
    ]
    fires = cli("schedule", "next", "digest.42", "-n", "2").output.splitlines()
    assert [datetime.fromisoformat(f).hour for f in fires] == [8, 8] and all("+09:00" in f for f in fires)
    status = cli("status")
    assert "2 stored entries" in status.output
    assert cli("schedule", "remove", "digest.42").exit_code == 0
    gone = cli("schedule", "remove", "digest.42")
    assert gone.exit_code == 1 and "no stored schedule entry 'digest.42'" in gone.output


def test_the_cli_refuses_arguments_data_and_options_nested_too_deep_in_one_line(clean_env, namespace, rdb):
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    deep = "[" * 5000 + "]" * 5000  # deeper than the parser recurses
    given = {
        ("--actor", "--args"): deep,
        ("--actor", "--kwargs"): f'{{"k": {"[" * 100 + "]" * 100}}}',  # 101 levels
        ("--event", "--data"): deep,
        ("--actor", "--options"): f'{{"k": {deep}}}',
    }
    for (target, option), value in given.items():
        done = CliRunner().invoke(main, ["schedule", "add", "x", "@daily", target, "job", option, value])
        assert (done.exit_code, done.output) == (1, f"Error: {option}: nested deeper than 100 levels\n"), done.output
    assert not rdb.exists(f"{namespace}:scheduler:dynamic")


def test_a_stored_actor_entry_takes_overlap_and_its_runs_never_overlap(make_kit, start_worker):
    kit = make_kit(env={"SCHEDULER_DYNAMIC": "true", "SCHEDULER_LEASE_TTL": "1500ms"})
    runs: list[tuple[float, float]] = []

    @gp.schedulable
    @dramatiq.actor(broker=kit.broker, actor_name="slow_report")
    def slow_report(customer: int) -> None:
        started = time.monotonic()
        time.sleep(2.2)
        runs.append((started, time.monotonic()))

    assert "overlap= is for an actor" in _error(lambda: kit.schedules.add("e", "@every 1s", Ping(1), overlap="skip"))
    assert "is not one of" in _error(lambda: kit.schedules.add("s", "@every 1s", slow_report, overlap="never"))
    kit.schedules.add("slow", "@every 1s", slow_report, args=[1], overlap="skip")
    assert kit.schedules.get("slow").options == {"gp_overlap": {"key": "slow", "mode": "skip"}}
    start_worker(kit, threads=4)
    wait_for(lambda: len(runs) >= 3, timeout=20)
    kit.scheduler.stop()
    ordered = sorted(runs)
    assert all(earlier[1] <= later[0] for earlier, later in itertools.pairwise(ordered)), ordered


def test_a_stored_entry_runs_now_and_is_backfilled_under_its_ticks_ids(clean_env, namespace, rdb):
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    publish_schedulable(rdb, namespace, actors={"report": "default"})
    schedules = gp.Schedules(rdb, namespace, warn_leaderless=False)
    schedules.add(
        "report.5", IntervalTrigger(seconds=2, start_date=datetime(2026, 1, 1, tzinfo=UTC)), "report", args=[5]
    )

    def queued() -> list[dict]:
        return [json.loads(data) for data in rdb.hvals(f"{namespace}:default.msgs")]

    ran = CliRunner().invoke(main, ["schedule", "run", "report.5"])
    assert ran.exit_code == 0, ran.output
    (run,) = queued()
    assert (run["actor_name"], run["args"]) == ("report", [5])  # the actor's own arguments, no firing
    now = datetime.now(UTC)
    # A stored entry's trigger is in the store: its past ticks need no --trigger, even an IntervalTrigger's.
    done = CliRunner().invoke(main, ["schedule", "backfill", "report.5", "--from", "9s", "--to", "1s", "--yes"])
    assert done.exit_code == 0, done.output
    ticks = [m for m in queued() if m["message_id"] != run["message_id"]]
    assert len(ticks) in (4, 5) and all(m["args"] == [5] for m in ticks)
    near = range(int(now.timestamp()) - 10, int(now.timestamp()) + 2)
    even_seconds = {tick_message_id("report.5", datetime.fromtimestamp(s, UTC)) for s in near if s % 2 == 0}
    assert {m["message_id"] for m in ticks} <= even_seconds  # the ids the leader gives those ticks
    again = CliRunner().invoke(main, ["schedule", "backfill", "report.5", "--from", "9s", "--to", "1s", "--yes"])
    assert again.exit_code == 0 and "nothing to enqueue" in again.output
