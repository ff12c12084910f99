"""A quorum queue on a 3-node RabbitMQ cluster of the test's own outlives kill -9 of its leader.

The nodes are :class:`servers.RabbitmqCluster`'s, on loopback next to the machine's own
``rabbit@localhost`` (never touched); without RabbitMQ, or as a user that cannot start
its nodes, the tests skip in one line.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import dramatiq
import dramatiq.errors
import pika
import pika.exceptions
import pytest
from click.testing import CliRunner

import dramatiq_gp as gp
from apps.app_events import Numbered
from dramatiq_gp.brokers.rabbitmq import RabbitmqBroker
from dramatiq_gp.cli import main as cli_main
from dramatiq_gp.names import EVENT_QUEUE
from helpers import wait_for
from servers import RabbitmqCluster, skip_without_rabbitmq

pytestmark = pytest.mark.slow

MESSAGES = 100


@pytest.fixture
def cluster() -> Iterator[RabbitmqCluster]:
    skip_without_rabbitmq()
    # Not tmp_path: as root that is under /tmp/pytest-of-root (0700), out of the user rabbitmq's reach.
    directory = Path(tempfile.mkdtemp(prefix="gp-rabbitmq-cluster-"))
    cluster: RabbitmqCluster | None = None
    try:
        cluster = RabbitmqCluster(directory)
        cluster.start()
        yield cluster
    finally:
        if cluster is not None:
            cluster.stop()  # every node, kill -9 of leftovers, and the directory
        shutil.rmtree(directory, ignore_errors=True)


def _publish(url: str, queue: str) -> set[bytes]:
    bodies = {f"message {n}".encode() for n in range(MESSAGES)}
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        channel = connection.channel()
        channel.queue_declare(queue, durable=True, arguments={"x-queue-type": "quorum"})
        channel.confirm_delivery()  # basic_publish raises unless the queue's quorum has the message
        persistent = pika.BasicProperties(delivery_mode=pika.DeliveryMode.Persistent)
        for body in sorted(bodies):
            channel.basic_publish("", queue, body, persistent, mandatory=True)
    finally:
        connection.close()
    return bodies


def _fetch_all(url: str, queue: str, timeout: float = 30) -> set[bytes]:
    """Every message of ``queue`` through ``url``, retrying while the queue has no leader yet."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            connection = pika.BlockingConnection(pika.URLParameters(url))
            try:
                channel = connection.channel()
                got: list[bytes] = []
                while True:
                    method, _, body = channel.basic_get(queue)
                    if method is None:
                        break
                    got.append(body)
                if len(got) < MESSAGES:  # not acked: they go back and a later pass counts them again
                    raise LookupError(f"{len(got)} of {MESSAGES} messages")
                channel.basic_ack(delivery_tag=0, multiple=True)
                assert len(got) == len(set(got)) == MESSAGES
                return set(got)
            finally:
                if connection.is_open:
                    connection.close()
        except (pika.exceptions.AMQPError, LookupError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _leader_if_listed(cluster: RabbitmqCluster, queue: str) -> str:
    """The queue's leader, or "" while an election leaves it out of ``list_queues``."""
    try:
        return cluster.leader(queue)
    except LookupError:
        return ""


def _online_if_listed(cluster: RabbitmqCluster, queue: str) -> list[str]:
    try:
        return list(cluster.queue_info(queue, "online")["online"])
    except LookupError:
        return []


def test_quorum_queue_survives_kill_of_its_leader(cluster: RabbitmqCluster) -> None:
    assert sorted(cluster.running_nodes()) == sorted(node.node for node in cluster.nodes)
    queue = f"gp-cluster-{uuid.uuid4().hex[:8]}"
    bodies = _publish(cluster.urls[1], queue)
    assert cluster.queue_info(queue, "type")["type"] == "quorum"

    leader = cluster.leader(queue)
    killed = cluster.index(leader)
    cluster.kill(killed)
    assert cluster.nodes[killed].beam_pid() is None

    # A new leader among the two left, then every message through one of them.
    wait_for(lambda: _leader_if_listed(cluster, queue) not in (leader, ""), timeout=30, interval=0.5)
    other = next(i for i in range(len(cluster.nodes)) if i != killed)
    assert _fetch_all(cluster.urls[other], queue) == bodies

    # Dramatiq's url=list connects past the dead node (listed first) to a live one.
    urls = [cluster.urls[killed], *(url for i, url in enumerate(cluster.urls) if i != killed)]
    broker = RabbitmqBroker(url=urls)
    try:
        name = f"{queue}-dramatiq"
        dramatiq.actor(lambda: None, actor_name="gp_cluster_noop", queue_name=name, broker=broker).send()
        assert broker.get_queue_message_counts(name)[0] == 1
    finally:
        broker.close()

    # The killed node comes back into the cluster and the queue's membership.
    cluster.start(killed)
    wait_for(lambda: cluster.nodes[killed].node in cluster.running_nodes(), timeout=30, interval=0.5)
    wait_for(lambda: leader in _online_if_listed(cluster, queue), timeout=30, interval=0.5)


def test_a_kit_on_the_cluster_loses_and_doubles_nothing_when_the_queue_leader_is_killed(
    cluster: RabbitmqCluster, make_kit, start_worker
) -> None:
    # The kit's queues on the cluster (quorum), listeners idempotent: events sent while the
    # node leading the queue dies are each handled once; a send that could not be
    # confirmed raised, and was sent again, as a caller would.
    seen: Counter[int] = Counter()
    lock = threading.Lock()

    def record(event: Numbered) -> None:
        with lock:
            seen[event.n] += 1

    kit = make_kit(
        lambda registry, schedule: registry.listen(Numbered, record, name="record"),
        env={"BROKER_URL": ";".join(cluster.urls)},
    )
    start_worker(kit, threads=4)
    count, resent = 300, 0
    for n in range(count):
        if n == 100:
            cluster.kill(cluster.index(cluster.leader(EVENT_QUEUE)))
        while True:
            try:
                kit.dispatch(Numbered(n))
                break
            except dramatiq.errors.ConnectionClosed:
                resent += 1
                time.sleep(0.2)
    wait_for(lambda: len(seen) == count, timeout=90, interval=0.2)
    time.sleep(2)  # give a stray duplicate the chance to run
    assert set(seen) == set(range(count))
    assert max(seen.values()) == 1, [n for n, runs in seen.items() if runs > 1]


def _stop_nodes(cluster: RabbitmqCluster, *indexes: int) -> None:
    threads = [threading.Thread(target=cluster.nodes[i].stop) for i in indexes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _start_nodes(cluster: RabbitmqCluster, *indexes: int) -> None:
    for i in indexes:
        cluster.nodes[i].spawn()
    for i in indexes:
        cluster.nodes[i].await_startup(90)


def test_with_the_majority_down_every_send_fails_within_the_confirm_limit_and_all_pending_goes_out_once_after(
    cluster: RabbitmqCluster, make_kit, start_worker, engine, clean_env, namespace, caplog
) -> None:
    # Two of three nodes down: a quorum queue takes a message and neither confirms nor
    # refuses it. Dramatiq's send waited as long as the outage lasted, silently.
    seen: Counter[int] = Counter()
    lock = threading.Lock()

    def record(event: Numbered) -> None:
        with lock:
            seen[event.n] += 1

    limit = 2.0
    env = {"BROKER_URL": cluster.urls[0], "RABBITMQ_CONFIRM_TIMEOUT": f"{limit:g}s", "VALKEY_NAMESPACE": namespace}
    kit = make_kit(lambda registry, schedule: registry.listen(Numbered, record, name="record"), env=env, engine=engine)
    assert kit.relay is not None
    probe = dramatiq.actor(lambda: None, actor_name="gp_cluster_probe", queue_name="probe", broker=kit.broker)
    probe.send()  # the queues exist, with a member on each node, before the outage
    kit.broker.declare_queue(EVENT_QUEUE, ensure=True)
    with engine.begin() as conn:
        gp.dispatch(conn, Numbered(0))
    assert kit.relay.relay_once() == 1

    _stop_nodes(cluster, 1, 2)
    caplog.set_level(logging.INFO)
    unconfirmed = r"did not confirm a send to queue .* within 2 s \(RABBITMQ_CONFIRM_TIMEOUT\): .*quorum"
    started = time.monotonic()
    with pytest.raises(gp.ConfirmTimeout, match=unconfirmed):
        probe.send()
    assert time.monotonic() - started < limit + 1.5
    batch = [
        dramatiq.Message(queue_name="probe", actor_name="gp_cluster_probe", args=(), kwargs={}, options={})
        for _ in range(2)
    ]
    started = time.monotonic()
    with pytest.raises(gp.ConfirmTimeout, match=unconfirmed):
        kit.broker.enqueue_many(batch)
    assert time.monotonic() - started < limit + 1.5
    for n in (1, 2, 3):
        with engine.begin() as conn:
            gp.dispatch(conn, Numbered(n))
    started = time.monotonic()
    with pytest.raises(gp.ConfirmTimeout, match=unconfirmed):
        kit.relay.relay_once()
    assert time.monotonic() - started < limit + 1.5
    assert kit.relay.backlog()[0] == 3  # kept for the next attempt

    lines = [r.getMessage() for r in caplog.records if r.name.startswith("dramatiq_gp")]
    assert len([line for line in lines if "'probe'" in line and "did not confirm" in line]) == 1, lines
    assert len([line for line in lines if "'default'" in line and "did not confirm" in line]) == 1, lines
    report = json.loads(CliRunner().invoke(cli_main, ["status", "--json"]).output)
    counts = {q["name"]: q for q in report["queues"]}
    for name in ("probe", "default"):
        assert counts[name]["ready"] is None and "quorum is likely lost" in counts[name]["unknown"], counts[name]

    _start_nodes(cluster, 1, 2)
    deadline = time.monotonic() + 60
    while kit.relay.backlog()[0]:
        assert time.monotonic() < deadline, "the relay did not send the pending events after the restart"
        try:
            kit.relay.relay_once()
        except dramatiq.errors.ConnectionClosed:
            time.sleep(0.5)
    while True:  # each queue's members come back on their own: `probe` may confirm a little after `default`
        try:
            probe.send()
            break
        except dramatiq.errors.ConnectionClosed:
            assert time.monotonic() < deadline, "no send to 'probe' was confirmed after the restart"
            time.sleep(0.5)
    start_worker(kit, threads=4)
    wait_for(lambda: set(seen) == {0, 1, 2, 3}, timeout=60, interval=0.2)
    time.sleep(2)  # a copy the outage left unconfirmed, delivered after all, would run by now
    assert max(seen.values()) == 1, seen
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("dramatiq_gp")]
    assert any("confirms sends to queue 'default' again" in line for line in lines), lines
    report = json.loads(CliRunner().invoke(cli_main, ["status", "--json"]).output)
    assert all(q["unknown"] is None for q in report["queues"]), report["queues"]
