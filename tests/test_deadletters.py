"""Dead letters (``dramatiq-gp dlq``): listed by page, shown, requeued with their ids, purged; on Redis and RabbitMQ."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass
from typing import Any

import dramatiq
import markupsafe
import pika
import pytest
import redis
from click.testing import CliRunner, Result
from dramatiq.common import xq_name

import dramatiq_gp as gp
from devtools.asgi import serving
from dramatiq_gp import keys
from dramatiq_gp.brokers import rabbitmq_view
from dramatiq_gp.brokers.kinds import view_for
from dramatiq_gp.brokers.redis_view import RedisQueueView
from dramatiq_gp.brokers.view import QueueView
from dramatiq_gp.cli import main
from dramatiq_gp.dashboard import create_app
from helpers import BAD_DEAD_LETTERS, RABBITMQ_URL, bury, stored_dead_letter, wait_for


def run(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


@dataclass
class Declined:
    """A worker whose actor ``charge`` failed twice (retried once) while ``fail`` was set: one dead letter."""

    kit: gp.Kit
    message: dramatiq.Message[Any]
    fail: threading.Event
    ran: list[str]  #: the ids of the messages that ran through


def _declined(make_kit, start_worker, namespace: str, customer: str) -> Declined:
    fail, ran = threading.Event(), []
    fail.set()

    class Succeeded(dramatiq.Middleware):
        def after_process_message(self, broker, message, *, result=None, exception=None):
            if exception is None:
                ran.append(message.message_id)

    env = {"VALKEY_NAMESPACE": namespace, "WORKER_MIN_BACKOFF": "10ms", "WORKER_MAX_BACKOFF": "20ms"}
    kit = make_kit(env=env, middleware=[Succeeded()])

    @dramatiq.actor(broker=kit.broker, actor_name="charge", max_retries=1)
    def charge(customer: str) -> None:
        if fail.is_set():
            raise RuntimeError("the card was declined")

    message = charge.send(customer)
    start_worker(kit)
    wait_for(lambda: _queues(kit).dead_count("default") == 1)
    return Declined(kit, message, fail, ran)


def _queues(kit: gp.Kit) -> QueueView:
    """The view of the kit's queues ``dramatiq-gp dlq`` reads, wherever they are (its settings name its namespace)."""
    return view_for(kit.settings, kit.broker.client)


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"], indirect=True)
def test_a_dead_letter_is_listed_with_why_it_died_and_its_arguments_only_with_pii_on(
    broker, make_kit, start_worker, clean_env, namespace
):
    message = _declined(make_kit, start_worker, namespace, "ada@example.com").message
    clean_env.setenv("VALKEY_NAMESPACE", namespace)

    listed = run("dlq", "list", "default")
    assert listed.exit_code == 0, listed.output
    lines = listed.stdout.splitlines()
    assert lines[0] == "queue default: 1 dead letter(s)"
    assert f"charge  message {message.message_id}  attempts=2" in lines[1]  # both failed
    assert lines[2].strip() == "RuntimeError: the card was declined"
    assert "ada@example.com" not in listed.output

    (letter,) = [json.loads(line) for line in run("dlq", "list", "default", "--json").stdout.splitlines()]
    assert (letter["message_id"], letter["task_type"], letter["args"]) == (message.message_id, "charge", "[Filtered]")
    shown = json.loads(run("dlq", "show", "default", letter["id"]).stdout)
    assert shown["args"] == "[Filtered]" and shown["reason"] == "RuntimeError: the card was declined"
    clean_env.setenv("SENTRY_SEND_DEFAULT_PII", "true")
    assert json.loads(run("dlq", "show", "default", letter["id"]).stdout)["args"] == ["ada@example.com"]

    missing = run("dlq", "show", "default", "no-such-id")
    assert (missing.exit_code, missing.output) == (1, "Error: no dead letter no-such-id in queue default\n")


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"], indirect=True)
def test_a_requeued_dead_letter_runs_again_with_its_message_id(broker, make_kit, start_worker, clean_env, namespace):
    declined = _declined(make_kit, start_worker, namespace, "c1")
    declined.fail.clear()  # the card works now
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    (letter,) = _queues(declined.kit).dead_letters("default")
    done = run("dlq", "requeue", "default", letter.id)
    assert (done.exit_code, done.stdout) == (0, "1 dead letter(s) of queue default requeued\n")
    wait_for(lambda: declined.ran == [declined.message.message_id])
    assert _queues(declined.kit).dead_count("default") == 0


def test_a_dead_letter_is_shown_and_requeued_by_the_message_id_its_producer_got_back(
    make_kit, start_worker, clean_env, namespace
):
    """Held for an unknown task type, it died as a copy under a new Redis id: its message id finds it."""
    kit = make_kit(env={"WORKER_UNKNOWN_TASK_GRACE": "300ms"})
    dramatiq.actor(lambda: None, broker=kit.broker, actor_name="known")
    sent = kit.broker.enqueue(
        dramatiq.Message(queue_name="default", actor_name="gone", args=(1,), kwargs={}, options={})
    )
    start_worker(kit)
    wait_for(lambda: RedisQueueView(kit.broker.client, namespace).dead_count("default") == 1)
    _bury(kit.broker.client, namespace, "default", 3)  # others, for the lookup to pass over
    clean_env.setenv("VALKEY_NAMESPACE", namespace)

    shown = run("dlq", "show", "default", sent.message_id)
    assert shown.exit_code == 0, shown.output
    letter = json.loads(shown.stdout)
    assert letter["message_id"] == sent.message_id and letter["task_type"] == "gone"
    assert letter["id"] != sent.options["redis_message_id"]  # the copy that died
    assert run("dlq", "show", "default", letter["id"]).stdout == shown.stdout
    missing = run("dlq", "show", "default", str(uuid.uuid4()))
    assert missing.exit_code == 1 and "no dead letter" in missing.output
    done = run("dlq", "requeue", "default", sent.message_id)
    assert (done.exit_code, done.stdout) == (0, "1 dead letter(s) of queue default requeued\n")
    assert RedisQueueView(kit.broker.client, namespace).dead_letter("default", sent.message_id) is None


def _bury(client: redis.Redis, namespace: str, queue: str, count: int) -> list[str]:
    """``count`` dead letters in ``queue``'s dead-letter set as Dramatiq leaves them, the oldest first."""
    ids = [f"dead-{n:05d}-{uuid.uuid4().hex[:6]}" for n in range(count)]
    with client.pipeline(transaction=False) as pipe:
        for n, id in enumerate(ids):
            message = dramatiq.Message(
                queue_name=queue,
                actor_name="charge",
                args=(n,),
                kwargs={},
                options={"redis_message_id": id, "retries": 3},
            )
            pipe.zadd(keys.dead(namespace, queue), {id: 1_700_000_000_000 + n})
            pipe.hset(keys.dead_messages(namespace, queue), id, message.encode())
        pipe.execute()
    return ids


def test_pages_come_most_recent_first_and_requeue_all_keeps_the_order(rdb, namespace, clean_env):
    ids = _bury(rdb, namespace, "default", 2500)
    first = RedisQueueView(rdb, namespace).dead_letters("default", offset=0, limit=3)
    assert [letter.id for letter in first] == ids[::-1][:3]
    assert [
        letter.id for letter in RedisQueueView(rdb, namespace).dead_letters("default", offset=2499, limit=50)
    ] == ids[:1]
    assert first[0].attempts == 3 and first[0].reason is None
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    done = run("dlq", "requeue", "default", "--all")
    assert done.stdout == "2500 dead letter(s) of queue default requeued\n"
    assert rdb.lrange(keys.queue(namespace, "default"), 0, -1) == ids  # the oldest first
    assert rdb.hlen(keys.messages(namespace, "default")) == 2500
    assert RedisQueueView(rdb, namespace).dead_count("default") == 0


def test_purge_deletes_them_only_when_told_so(rdb, namespace, clean_env):
    _bury(rdb, namespace, "mail", 5)
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    refused = run("dlq", "purge", "mail")
    assert refused.exit_code == 1
    assert refused.output == "Error: purging deletes every dead letter of queue mail for good: add --yes\n"
    assert RedisQueueView(rdb, namespace).dead_count("mail") == 5
    assert run("dlq", "purge", "mail", "--yes").stdout == "5 dead letter(s) of queue mail deleted\n"
    assert not rdb.exists(keys.dead(namespace, "mail"), keys.dead_messages(namespace, "mail"))


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["dlq", "requeue", "default"], {}, "give the dead letter ids to requeue"),
        (["dlq", "list", "default"], {"BROKER_URL": "amqp://guest:guest@127.0.0.1:1/%2F"}, "RabbitMQ unreachable at"),
    ],
)
def test_a_dlq_command_it_cannot_carry_out_is_one_line(args, env, message, clean_env):
    for name, value in env.items():
        clean_env.setenv(name, value)
    done = run(*args)
    assert done.exit_code == 1
    assert message in done.output and done.output.count("\n") == 1


def test_a_command_closes_its_redis_connection_even_when_it_fails(rdb, namespace, clean_env):
    """A client left to the garbage collector warns of its open socket in whichever test collects it."""
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    before = {client["id"] for client in rdb.client_list()}
    missing = run("dlq", "show", "default", "no-such-id")  # the result keeps the command's frames
    assert missing.exit_code == 1

    def opened_by_the_command() -> list[dict[str, str]]:
        return [client for client in rdb.client_list() if client["id"] not in before]

    wait_for(lambda: opened_by_the_command() == [], timeout=2)


def _command(*args: str) -> subprocess.CompletedProcess[str]:
    """``dramatiq-gp`` in a process of its own: what a shell sees, tracebacks included."""
    return subprocess.run([sys.executable, "-m", "dramatiq_gp", *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("case", BAD_DEAD_LETTERS)
def test_one_bad_dead_letter_is_marked_in_list_and_show_and_the_others_listed(case, rdb, namespace, clean_env):
    id, stored, score, shown = BAD_DEAD_LETTERS[case]
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    bury(rdb, namespace, "default", "good", stored_dead_letter("good"))
    bury(rdb, namespace, "default", id, stored, score)
    rdb.sadd(keys.declared_queues(namespace), "default")
    listed, as_json = _command("dlq", "list"), _command("dlq", "list", "default", "--json")
    one = _command("dlq", "show", "default", id)
    for done in (listed, as_json, one):
        assert (done.returncode, done.stderr) == (0, ""), done.stderr
    assert "queue default: 2 dead letter(s)" in listed.stdout and "message m-good" in listed.stdout
    assert f"{id}  " in listed.stdout and shown in listed.stdout
    letters = {letter["id"]: letter for letter in map(json.loads, as_json.stdout.splitlines())}
    assert sorted(letters) == sorted(["good", id]) and letters["good"]["reason"].startswith("RuntimeError")
    assert shown in json.dumps(letters[id]) and json.loads(one.stdout) == letters[id]


def test_a_dead_letter_whose_redis_id_is_not_utf8_is_listed_marked_and_shown_and_requeued_by_its_message_id(
    rdb, namespace, clean_env
):
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    bury(rdb, namespace, "default", "good", stored_dead_letter("good"))
    bury(rdb, namespace, "default", b"d\xff", stored_dead_letter("garbled"))
    rdb.sadd(keys.declared_queues(namespace), "default")
    mark = "(unreadable: id not UTF-8: b'd\\xff')"
    listed, as_json = _command("dlq", "list"), _command("dlq", "list", "default", "--json")
    one, requeued = _command("dlq", "show", "default", "m-garbled"), _command("dlq", "requeue", "default", "m-garbled")
    for done in (listed, as_json, one):
        assert (done.returncode, done.stderr) == (0, ""), done.stderr
    assert requeued.returncode == 0 and "Traceback" not in requeued.stderr, requeued.stderr  # it logs what it did
    assert f"{mark}  charge  message m-garbled" in listed.stdout and "message m-good" in listed.stdout
    letters = {letter["message_id"]: letter for letter in map(json.loads, as_json.stdout.splitlines())}
    assert letters["m-garbled"]["id"] == mark and letters["m-good"]["id"] == "good"
    assert json.loads(one.stdout) == letters["m-garbled"]
    assert requeued.stdout == "1 dead letter(s) of queue default requeued\n"
    assert rdb.zrange(keys.dead(namespace, "default"), 0, -1) == ["good"]


def _bury_on_rabbitmq(queue: str, bodies: list[bytes]) -> None:
    """``bodies`` published to ``queue``'s dead-letter queue, as the kit's dead letters are (persistent)."""
    connection = pika.BlockingConnection(pika.URLParameters(RABBITMQ_URL))
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        for body in bodies:
            channel.basic_publish("", xq_name(queue), body, pika.BasicProperties(delivery_mode=2), mandatory=True)
    finally:
        connection.close()


def _waiting(queue: str) -> list[Any]:
    """The messages waiting on ``queue``, taken off it (a test's last look)."""
    connection = pika.BlockingConnection(pika.URLParameters(RABBITMQ_URL))
    try:
        channel, taken = connection.channel(), []
        while (got := channel.basic_get(queue, auto_ack=True))[0] is not None:
            taken.append(got)
        return taken
    finally:
        connection.close()


def _deliveries(queue: str, message_id: str) -> int:
    """How often RabbitMQ has delivered the message ``message_id`` of the quorum queue ``queue``."""
    connection = pika.BlockingConnection(pika.URLParameters(RABBITMQ_URL))
    try:
        channel = connection.channel()
        while True:
            method, properties, body = channel.basic_get(queue, auto_ack=False)
            assert method is not None, f"no {message_id} in {queue}"
            if dramatiq.Message.decode(body).message_id == message_id:
                return int(properties.headers["x-delivery-count"])
    finally:
        connection.close()  # puts back what it took


@pytest.mark.parametrize("broker", ["rabbitmq"], indirect=True)
def test_on_rabbitmq_dead_letters_page_oldest_first_survive_being_looked_at_and_requeue_and_purge(
    broker, make_kit, clean_env, namespace
):
    kit = make_kit(env={"VALKEY_NAMESPACE": namespace})
    dramatiq.actor(lambda n: None, broker=kit.broker, actor_name="charge", queue_name="letters")
    kit.broker.declare_queue("letters", ensure=True)  # the queue, its .DQ and its .XQ
    letters = [
        dramatiq.Message(
            queue_name="letters.XQ", actor_name="charge", args=(n,), kwargs={}, options={}, message_id=f"m-{n:02d}"
        )
        for n in range(30)
    ]
    _bury_on_rabbitmq("letters", [m.encode() for m in letters] + [b"\xff not a message"])
    view = _queues(kit)

    assert view.dead_count("letters") == 31
    assert [d.id for d in view.dead_letters("letters", limit=3)] == ["m-00", "m-01", "m-02"]
    last = view.dead_letters("letters", offset=29, limit=5)
    assert [d.message_id for d in last] == ["m-29", None]
    assert last[1].reason == "cannot decode it (set aside as it came)"
    for _ in range(rabbitmq_view.REFRESH_AT * 3):  # each look is a delivery: past RabbitMQ 4's limit of 20
        assert view.dead_letter("letters", "m-00") is not None
    assert _deliveries("letters.XQ", "m-00") < rabbitmq_view.REFRESH_AT  # written anew, its count back at 0
    assert view.dead_count("letters") == 31 and len(view.dead_letters("letters", limit=100)) == 31

    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    done = run("dlq", "requeue", "letters", "m-05", "m-07")
    assert (done.exit_code, done.stdout) == (0, "2 dead letter(s) of queue letters requeued\n"), done.output
    requeued = [dramatiq.Message.decode(body) for _, _, body in _waiting("letters")]
    assert [(m.message_id, m.queue_name, m.args) for m in requeued] == [
        ("m-05", "letters", (5,)),
        ("m-07", "letters", (7,)),
    ]
    assert view.dead_count("letters") == 29 and view.dead_letter("letters", "m-05") is None

    assert run("dlq", "purge", "letters", "--yes").stdout == "29 dead letter(s) of queue letters deleted\n"
    assert view.dead_count("letters") == 0 and view.dead_letters("letters") == []


def _dead_letters_of_default(make_kit, start_worker, namespace: str, count: int) -> gp.Kit:
    """A worker whose ``charge`` fails for good at once: ``count`` dead letters in ``default``."""
    kit = make_kit(env={"VALKEY_NAMESPACE": namespace})

    @dramatiq.actor(broker=kit.broker, actor_name="charge", max_retries=0)
    def charge(n: int) -> None:
        raise RuntimeError("the card was declined")

    for n in range(count):
        charge.send(n)
    start_worker(kit)
    wait_for(lambda: _queues(kit).dead_count("default") == count)
    return kit


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"], indirect=True)
def test_a_dlq_command_on_a_queues_delay_or_dead_letter_queue_is_refused_in_one_line_and_changes_nothing(
    broker, make_kit, start_worker, clean_env, namespace, caplog
):
    # On Redis each `requeue default.XQ` lost a dead letter and said "unreachable"; on RabbitMQ it said
    # "5 requeued" and moved none, and `purge default.XQ` deleted the queue's dead letters.
    kit = _dead_letters_of_default(make_kit, start_worker, namespace, 5)
    before = sorted(d.message_id or "" for d in _queues(kit).dead_letters("default"))
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    for queue, kind in (("default.XQ", "dead-letter"), ("default.DQ", "delay")):
        refused = (
            f"Error: {queue!r} is the {kind} queue of queue 'default': dead letters are kept under their "
            "queue's own name, so give 'default'\n"
        )
        for args in (
            *[["requeue", queue, "--all"]] * 3,
            ["requeue", queue, before[0]],
            ["list", queue],
            ["list", queue, "--json"],
            ["show", queue, before[0]],
            ["purge", queue, "--yes"],
        ):
            with caplog.at_level(logging.INFO, logger="dramatiq_gp.actions"):
                done = run("dlq", *args)
            assert (done.exit_code, done.output) == (1, refused), args
    assert sorted(d.message_id or "" for d in _queues(kit).dead_letters("default")) == before
    assert [r for r in caplog.records if r.name == "dramatiq_gp.actions"] == []  # nothing was done
    assert run("dlq", "list", "default").stdout.startswith("queue default: 5 dead letter(s)\n")


class _Vetoes(dramatiq.Middleware):
    """Fails ``vetoed`` before it runs, as any middleware may (``message.fail()``), giving no reason."""

    def before_process_message(self, broker, message):
        if message.actor_name == "vetoed":
            message.fail()


def _send_raw(kit: gp.Kit, queue: str, redis_id: str, body: bytes) -> None:
    """``body`` on ``queue`` as some producer wrote it, not through the kit."""
    if isinstance(kit.broker, gp.RabbitmqBroker):
        connection = pika.BlockingConnection(pika.URLParameters(RABBITMQ_URL))
        try:
            connection.channel().basic_publish("", queue, body, pika.BasicProperties(delivery_mode=2))
        finally:
            connection.close()
        return
    client, ns = kit.broker.client, kit.broker.namespace
    client.hset(keys.messages(ns, queue), redis_id, body)
    client.rpush(keys.queue(ns, queue), redis_id)


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"], indirect=True)
def test_every_dead_letter_says_why_it_was_set_aside_in_the_cli_and_on_the_page(
    broker, make_kit, start_worker, clean_env, namespace
):
    # `"reason": null` for an exception the actor throws, a message past its max_age, a malformed
    # message, and one a middleware failed; the refusal of a message on another actor's queue is new.
    env = {"VALKEY_NAMESPACE": namespace, "WORKER_UNKNOWN_TASK_GRACE": "200ms", "WORKER_MIN_BACKOFF": "10ms"}
    kit = make_kit(env=env, middleware=[_Vetoes()])

    def declined() -> None:
        raise RuntimeError("the card was declined")

    def out_of_stock() -> None:
        raise ValueError("out of stock")

    dramatiq.actor(declined, broker=kit.broker, actor_name="charge", max_retries=1)
    dramatiq.actor(out_of_stock, broker=kit.broker, actor_name="reserve", throws=(ValueError,))
    dramatiq.actor(lambda: None, broker=kit.broker, actor_name="stale", max_age=60_000)
    dramatiq.actor(lambda: None, broker=kit.broker, actor_name="vetoed")
    dramatiq.actor(lambda: None, broker=kit.broker, actor_name="elsewhere", queue_name="other")
    long_ago = int(time.time() * 1000) - 3_600_000

    def message(actor: str, id: str, queue: str = "default", **fields: Any) -> dramatiq.Message[Any]:
        return dramatiq.Message(
            queue_name=queue, actor_name=actor, args=(), kwargs={}, options={}, message_id=id, **fields
        )

    for sent in (
        message("charge", "m-retried"),
        message("reserve", "m-throws"),
        message("stale", "m-old", message_timestamp=long_ago),
        message("vetoed", "m-vetoed"),
        message("gone", "m-unknown"),
        message("charge", "m-misrouted", queue="other"),
    ):
        kit.broker.enqueue(sent)
    malformed = {**message("charge", "m-malformed").asdict(), "kwargs": [1]}
    malformed["options"] = {"redis_message_id": "r-malformed"}
    _send_raw(kit, "default", "r-malformed", json.dumps(malformed).encode())
    _send_raw(kit, "default", "r-garbled", b"\xff not a message")
    start_worker(kit)
    view = _queues(kit)
    wait_for(lambda: (view.dead_count("default"), view.dead_count("other")) == (7, 1), timeout=20)

    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    listed = run("dlq", "list", "--json")
    assert listed.exit_code == 0, listed.output
    reasons = {d["message_id"]: d["reason"] for d in map(json.loads, listed.stdout.splitlines())}
    decode = "cannot decode it (UnicodeDecodeError)"
    assert reasons == {
        "m-retried": "RuntimeError: the card was declined",
        "m-throws": "ValueError: out of stock (one its actor throws: not retried)",
        "m-old": reasons["m-old"],  # its age, below
        "m-vetoed": "failed for good by a middleware (message.fail()), with no exception",
        "m-unknown": "no handler for task type 'gone' within 200ms (WORKER_UNKNOWN_TASK_GRACE)",
        "m-malformed": "malformed, set aside as it came: its kwargs is not a dict",
        None: f"malformed, set aside as it came: {decode}",
        "m-misrouted": "task type 'charge' is declared on queue 'default', not on 'other' where it came: "
        "a worker runs a message only from its actor's queue",
    }
    assert re.fullmatch(
        r"3,6\d\d,\d{3} ms old when it came to run, past its max_age of 60,000 ms \(AgeLimit\)", reasons["m-old"]
    )

    with serving(create_app()) as base:
        pages = "".join(
            urllib.request.urlopen(f"{base}/dead-letters/{q}", timeout=10).read().decode() for q in ("default", "other")
        )
    for reason in reasons.values():
        assert str(markupsafe.escape(reason)) in pages, reason


def test_a_requeue_onto_a_key_that_is_no_queue_refuses_before_it_moves_or_loses_any(rdb, namespace, clean_env):
    # The requeue script once took a dead letter off its set, then failed on the queue's key: lost.
    _bury(rdb, namespace, "mail", 3)
    rdb.set(keys.queue(namespace, "mail"), "not a list")  # written by something else
    clean_env.setenv("VALKEY_NAMESPACE", namespace)
    done = run("dlq", "requeue", "mail", "--all")
    assert done.exit_code == 1 and done.output.count("\n") == 1 and "ResponseError" in done.output
    assert (rdb.zcard(keys.dead(namespace, "mail")), rdb.hlen(keys.dead_messages(namespace, "mail"))) == (3, 3)
