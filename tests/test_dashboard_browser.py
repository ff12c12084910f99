"""The dashboard in headless Chromium, against a real worker running the shop (``dramatiq examples.shop.worker``).

A user's path through it: the leader and the next fires, a dead letter requeued
and run, a set-aside event replayed, a job paused and resumed; and the refusals
(``--read-only``, credentials off loopback). With ``GP_SCREENSHOTS=<dir>`` each
page is saved there too (``docs/img`` holds the ones ``docs/dashboard.md`` shows).
"""

from __future__ import annotations

import contextlib
import html
import http.server
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from sqlalchemy.orm import Session

from devtools.services import free_port
from dramatiq_gp.brokers.redis_view import RedisQueueView
from helpers import Browser, own_database, wait_for

ROOT = Path(__file__).resolve().parent.parent
REPORT = "shop.nightly_sales_report"
#: Off loopback the dashboard refuses a short or placeholder password.
PASSWORD = "s3cret-of-a-fair-length"
SHOTS = os.environ.get("GP_SCREENSHOTS")


@dataclass
class Shop:
    env: dict[str, str]
    engine: sa.Engine
    client: redis.Redis
    namespace: str
    url: str
    tmp: Path

    def report_mails(self) -> int:
        with self.engine.connect() as conn:
            query = "SELECT count(*) FROM shop_sent_emails WHERE subject LIKE 'Sales report%'"
            return int(conn.execute(sa.text(query)).scalar_one())

    def sale(self, order_id: int) -> bool:
        with self.engine.connect() as conn:
            found = conn.execute(sa.text("SELECT 1 FROM shop_sales WHERE order_id = :id"), {"id": order_id})
            return found.first() is not None

    def place_order(self, order_id: int, *, set_aside: bool = False) -> str:
        """An order and its event, in one transaction; with ``set_aside``, the event as the relays give one up."""
        from examples.shop.place_orders import place_order

        with Session(self.engine) as session, session.begin():
            event_id = place_order(session, order_id, f"customer{order_id}@example.com", 1999)
            if set_aside:
                session.execute(
                    sa.text(
                        "UPDATE outbox_events SET failed_at = now(), attempts = 10, "
                        "last_error = 'ConnectionError: broker unreachable' WHERE id = :id"
                    ),
                    {"id": event_id},
                )
        return event_id


def _start(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _answers(url: str, headers: dict[str, str] | None = None) -> bool:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=2):
            return True
    except OSError as exc:
        return getattr(exc, "code", None) is not None  # an HTTP error: it is up


@contextlib.contextmanager
def dashboard(shop: Shop, *args: str, env: dict[str, str] | None = None) -> Iterator[tuple[str, Path]]:
    """``dramatiq-gp dashboard`` in a process of its own; yields its URL and its log."""
    port = free_port()
    log = shop.tmp / f"dashboard-{port}.log"
    command = [sys.executable, "-m", "dramatiq_gp", "dashboard", "--port", str(port), *args]
    process = _start(command, {**shop.env, **(env or {})}, log)
    try:
        wait_for(lambda: _answers(f"http://127.0.0.1:{port}/") or process.poll() is not None, timeout=30)
        assert process.poll() is None, log.read_text()
        yield f"http://127.0.0.1:{port}", log
    finally:
        _stop(process)


@pytest.fixture(scope="module")
def shop(service_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shop]:
    """The shop's worker (the report every 2 s, no retries by default), its tables, and a dashboard on it."""
    tmp = tmp_path_factory.mktemp("shop")
    namespace = f"gpt-dash-{os.getpid()}"
    with own_database(service_env["DB_URL"]) as db_url:
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("WORKER_", "VALKEY_", "DB_", "DASHBOARD_"))},
            "REDIS_URL": service_env["REDIS_URL"],
            "DB_URL": db_url,
            "VALKEY_NAMESPACE": namespace,
            "SHOP_REPORT_CRON": "@every 2s",
            "WORKER_MAX_RETRIES": "0",
            "WORKER_QUEUES": "default:3,mail:1,reports:1",
        }
        env.pop("BROKER_URL", None)
        subprocess.run([sys.executable, "-m", "examples.shop.migrate"], cwd=ROOT, env=env, check=True, timeout=60)
        worker = _start(
            [sys.executable, "-m", "dramatiq", "examples.shop.worker", "-p", "1", "-t", "2"], env, tmp / "worker.log"
        )
        engine = sa.create_engine(db_url)
        client = redis.Redis.from_url(service_env["REDIS_URL"], decode_responses=True)
        shop = Shop(env, engine, client, namespace, "", tmp)
        try:
            with dashboard(shop) as (url, _):
                shop.url = url
                yield shop
        finally:
            _stop(worker)
            engine.dispose()
            found = list(client.scan_iter(f"{namespace}:*", count=1000))
            if found:
                client.delete(*found)
            client.close()


def _shot(page: Any, name: str) -> None:
    if SHOTS:
        Path(SHOTS).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(SHOTS) / f"{name}.png"), full_page=True)


def _confirm(page: Any, expected_title: str) -> None:
    """On the confirmation page an action leads to: check what it says, and say yes."""
    assert expected_title in page.locator("#confirm h1").inner_text()
    page.click("#confirm-button")


def test_the_scheduler_page_shows_the_leader_and_each_entrys_next_fires(shop, page):
    def leader_shown() -> bool:
        page.goto(f"{shop.url}/scheduler")
        return "Leader:" in page.locator("#leader").inner_text()

    wait_for(leader_shown, timeout=30, interval=0.5)
    leader = page.locator("#leader").inner_text()
    assert "epoch" in leader and "lease until" in leader
    assert "Catch-up after a takeover: latest, ticks missed within 1h" in leader
    report = page.locator(f'tr[data-entry="{REPORT}"]')
    assert "@every 2s" in report.inner_text()
    assert report.locator(".next-fires div").count() == 3
    digest = page.locator("#entries tbody tr", has_text="30 6 * * *")  # daily_at("06:30", DigestDue())
    assert digest.count() == 1 and digest.locator(".next-fires div").count() == 3
    _shot(page, "scheduler")


def test_a_dead_letter_requeued_from_the_dashboard_runs(shop, page):
    with shop.engine.begin() as conn:
        conn.execute(sa.text("ALTER TABLE shop_sales RENAME TO shop_sales_away"))
    try:
        shop.place_order(101)
        wait_for(lambda: RedisQueueView(shop.client, shop.namespace).dead_count("default") == 1, timeout=30)
    finally:
        with shop.engine.begin() as conn:
            conn.execute(sa.text("ALTER TABLE shop_sales_away RENAME TO shop_sales"))
    assert not shop.sale(101)

    page.goto(f"{shop.url}/dead-letters/default")
    row = page.locator("#dead-letters tbody tr").first
    assert "record_sale" in row.inner_text() and "UndefinedTable" in row.inner_text()
    _shot(page, "dead-letters")
    row.locator("a").first.click()
    assert '"args": "[Filtered]"' in page.locator("#body").inner_text()  # PII sending is off
    _shot(page, "dead-letter")
    page.go_back()
    page.locator("#dead-letters tbody tr").first.locator("button", has_text="Requeue").click()
    _shot(page, "confirm")
    _confirm(page, "Requeue 1 dead letter(s) of queue default?")
    assert "1 dead letter(s) of queue default requeued" in page.locator(".flash").inner_text()
    wait_for(lambda: shop.sale(101), timeout=30)  # it ran, under its message id
    assert RedisQueueView(shop.client, shop.namespace).dead_count("default") == 0


def test_a_set_aside_event_replayed_from_the_dashboard_is_relayed(shop, page):
    event_id = shop.place_order(202, set_aside=True)
    page.goto(f"{shop.url}/outbox")
    row = page.locator(f'tr[data-event="{event_id}"]')
    assert "ConnectionError: broker unreachable" in row.inner_text()
    assert "set aside: 1" in page.locator("#backlog").inner_text()
    _shot(page, "outbox")
    row.locator("button", has_text="Replay").click()
    _confirm(page, f"Replay event {event_id}?")
    assert f"event {event_id} pending again" in page.locator(".flash").inner_text()
    wait_for(lambda: shop.sale(202), timeout=30)  # relayed, and its listener ran


def test_a_job_paused_from_the_dashboard_stops_firing_until_resumed(shop, page):
    wait_for(lambda: shop.report_mails() >= 2, timeout=30)
    page.goto(f"{shop.url}/scheduler")
    report = page.locator(f'tr[data-entry="{REPORT}"]')
    report.locator("button", has_text="Pause").click()
    _confirm(page, f"Pause {REPORT}?")
    assert f"entry {REPORT} paused" in page.locator(".flash").inner_text()
    assert "paused by anonymous (dashboard, 127.0.0.1)" in report.locator(".state").inner_text()
    time.sleep(1)  # a fire already under way when the pause landed still sends its mail
    paused_at = shop.report_mails()
    time.sleep(5)  # two and a half periods
    assert shop.report_mails() == paused_at

    report.locator("button", has_text="Resume").click()
    _confirm(page, f"Resume {REPORT}?")
    assert "active" in report.locator(".state").inner_text()
    wait_for(lambda: shop.report_mails() > paused_at, timeout=10)


def test_the_overview_and_the_recent_failures_show_the_running_shop(shop, page):
    for order_id in range(301, 306):
        shop.place_order(order_id)
    wait_for(lambda: all(shop.sale(i) for i in range(301, 306)), timeout=30)
    page.goto(f"{shop.url}/")
    for queue in ("default", "mail", "reports"):
        assert page.locator(f'#queues tr[data-queue="{queue}"]').count() == 1, queue
    workers = page.locator("#workers tbody tr")
    assert workers.count() == 1 and "default, mail, reports" in workers.inner_text()
    assert "default:3, mail:1, reports:1" in workers.inner_text()
    assert page.locator('#queues tr[data-queue="default"] td').nth(5).inner_text() == "3"  # its weight
    assert page.locator("#throughput rect.ok").count() == 15
    _shot(page, "overview")
    page.goto(f"{shop.url}/failures")
    failure = page.locator("#failures tbody tr", has_text="record_sale").first
    assert "UndefinedTable" in failure.inner_text() and "failed for good" in failure.inner_text()
    _shot(page, "failures")


def test_a_read_only_dashboard_shows_no_action_and_refuses_them(shop, page):
    with dashboard(shop, "--read-only") as (url, _):
        page.goto(f"{url}/scheduler")
        assert page.locator("#read-only").is_visible()
        assert page.locator(f'tr[data-entry="{REPORT}"]').count() == 1
        assert page.locator("button").count() == 0
        refused = page.request.post(f"{url}/scheduler/{REPORT}/pause", form={"confirmed": "yes"})
        assert refused.status == 403 and "read-only" in refused.text()
    assert not shop.client.hlen(f"{shop.namespace}:scheduler:paused")


def test_off_loopback_it_needs_credentials_and_logs_who_acted(shop, browser):
    refused = subprocess.run(
        [sys.executable, "-m", "dramatiq_gp", "dashboard", "--host", "0.0.0.0", "--port", str(free_port())],
        cwd=ROOT,
        env=shop.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 1 and "is not loopback: set DASHBOARD_USER" in refused.stderr

    credentials = {"DASHBOARD_USER": "alice", "DASHBOARD_PASSWORD": PASSWORD}
    with dashboard(shop, "--host", "0.0.0.0", env=credentials) as (url, log):
        anonymous = browser.new_context()
        try:
            # Through the context's requests: headless Chromium turns a 401 page load into an error of its own.
            assert anonymous.request.get(f"{url}/scheduler").status == 401
            refused = anonymous.request.post(f"{url}/scheduler/{REPORT}/pause", form={"confirmed": "yes"})
            assert refused.status == 401
        finally:
            anonymous.close()
        alice = browser.new_context(http_credentials={"username": "alice", "password": PASSWORD})
        try:
            page = alice.new_page()
            assert page.goto(f"{url}/scheduler").status == 200
            page.locator(f'tr[data-entry="{REPORT}"]').locator("button", has_text="Pause").click()
            _confirm(page, f"Pause {REPORT}?")
            assert "paused by alice (dashboard, 127.0.0.1)" in page.locator(f'tr[data-entry="{REPORT}"]').inner_text()
            page.locator(f'tr[data-entry="{REPORT}"]').locator("button", has_text="Resume").click()
            _confirm(page, f"Resume {REPORT}?")
        finally:
            alice.close()
        wait_for(lambda: "schedule resume by alice (dashboard, 127.0.0.1)" in log.read_text())
    assert f"[dramatiq_gp.actions] [INFO] schedule pause by alice (dashboard, 127.0.0.1): entry {REPORT} paused" in (
        log.read_text()
    )


def test_an_entry_stored_through_the_form_is_listed_with_its_next_fire(shop, page):
    import dramatiq_gp as gp
    from dramatiq_gp.scheduler.dynamic import EventByName

    schedules = gp.Schedules(shop.client, shop.namespace)
    for name, zone in (("digest.apac", "Asia/Tokyo"), ("digest.us-east", "America/New_York")):
        schedules.add(name, "0 8 * * *", EventByName("shop.digest_due", {}), tz=zone, replace=True)
    with dashboard(shop, "--store-entries") as (url, _):
        _store_through_the_form(page, url)
    assert schedules.get("digest.eu-central").zone == "Europe/Budapest"
    for name in ("digest.apac", "digest.us-east", "digest.eu-central"):
        schedules.remove(name)


def _store_through_the_form(page: Any, url: str) -> None:
    page.goto(f"{url}/scheduler")
    assert "2 stored at run time" in page.locator("#stored-summary").inner_text()
    page.locator("#stored-summary a").click()
    form = page.locator("#add-entry")
    form.locator('input[name="name"]').fill("digest.eu-central")
    form.locator('input[name="spec"]').fill("0 8 * * *")
    form.locator('input[name="zone"]').fill("Europe/Budapest")
    form.locator('input[name="event"]').fill("shop.digest_due")
    form.locator("#add-button").click()
    _shot(page, "confirm-store")
    _confirm(page, "Store schedule entry digest.eu-central?")
    assert "entry digest.eu-central stored: next fire" in page.locator(".flash").inner_text()
    row = page.locator('#stored tr[data-entry="digest.eu-central"]')
    assert "Europe/Budapest" in row.inner_text() and "event shop.digest_due" in row.inner_text()
    assert "T08:00:00+01:00" in row.inner_text() or "T08:00:00+02:00" in row.inner_text()
    assert page.locator("#stored tbody tr").count() == 3
    _shot(page, "stored")
    page.fill('input[name="prefix"]', "digest.us")
    page.click("#search button")
    assert [r.get_attribute("data-entry") for r in page.locator("#stored tbody tr").all()] == ["digest.us-east"]


def test_only_a_dashboard_allowed_to_store_entries_stores_one_and_only_for_a_schedulable_target(shop):
    # The shop's worker publishes what its code marks schedulable: the digest event, nothing else.
    published = f"{shop.namespace}:scheduler:schedulable"
    wait_for(lambda: shop.client.hkeys(published) == ["event:shop.digest_due"], timeout=30)
    form = {"name": "digest.night", "spec": "0 22 * * *", "event": "shop.digest_due", "data": "{}"}
    default = Browser(shop.url)
    token = default.csrf("/scheduler")
    refused = default.open("/scheduler/stored/add", {**form, "csrf": token, "confirmed": "yes"})
    assert refused.status == 403 and "--store-entries" in refused.body
    listener = "listener:shop.order_placed:send_confirmation"
    envelope = json.dumps([{"id": "00000000-0000-0000-0000-000000000001", "event": "shop.order_placed", "data": {}}])
    with dashboard(shop, "--store-entries") as (url, log):
        allowed = Browser(url)
        token = allowed.csrf("/scheduler/stored")
        for fields, why in (
            ({"event": "shop.order_placed"}, "no worker publishes an event 'shop.order_placed' as schedulable"),
            ({"event": "", "actor": listener, "args": envelope}, f"{listener!r} is one of the kit's own task types"),
            ({"event": "", "actor": "event:shop.order_placed"}, "'event:shop.order_placed' is one of the kit's own"),
            ({"data": '{"customer": 7}'}, "event 'shop.digest_due' has no field(s) customer"),
        ):
            page = allowed.open("/scheduler/stored/add", {**form, **fields, "csrf": token, "confirmed": "yes"})
            (flash,) = re.findall(r'<p class="flash bad" role="status">(.*?)</p>', page.body, re.S)
            assert why in html.unescape(flash), (fields, flash)
        assert not shop.client.hlen(f"{shop.namespace}:scheduler:dynamic")
        stored = allowed.open("/scheduler/stored/add", {**form, "csrf": token, "confirmed": "yes"})
        assert "entry digest.night stored: next fire" in stored.body
        wait_for(lambda: "entry digest.night added" in log.read_text())
    assert (
        "schedule add by anonymous (dashboard, 127.0.0.1): entry digest.night added: 0 22 * * * (UTC), "
        "event shop.digest_due on queue default, data {}, options {}" in log.read_text()
    )
    assert shop.client.hdel(f"{shop.namespace}:scheduler:dynamic", "digest.night")


#: A page of another origin (another port of 127.0.0.1): it sets the dashboard's CSRF cookie (cookies are not
#: isolated by port) and posts the form that token fits, as the review did.
ATTACK = """<form id="f" method="post" action="{url}/scheduler/stored/add">
<input name="csrf" value="forged"><input name="confirmed" value="yes"><input name="name" value="evil">
<input name="spec" value="@every 2s"><input name="event" value="shop.digest_due"><input name="data" value="{{}}">
</form>
<script>document.cookie = "gp_csrf=forged; path=/"; document.getElementById("f").submit();</script>"""


@contextlib.contextmanager
def _attacker(page_html: str) -> Iterator[str]:
    """A page served on another port of 127.0.0.1; yields its URL."""
    body = page_html.encode()

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def test_a_page_on_another_port_cannot_post_to_the_dashboard_with_the_cookie_it_set(shop, page):
    with dashboard(shop, "--store-entries") as (url, log), _attacker(ATTACK.format(url=url)) as evil:
        with page.expect_response(lambda r: r.url.endswith("/scheduler/stored/add")) as posted:
            page.goto(evil)
        assert posted.value.status == 403
        assert posted.value.text() == "refused: this request comes from a page of another origin"
        wait_for(lambda: "sent by a page of another origin" in log.read_text())
    assert not shop.client.hexists(f"{shop.namespace}:scheduler:dynamic", "evil")
    (line,) = [line for line in log.read_text().splitlines() if "another origin" in line]
    assert (
        f"POST /scheduler/stored/add from 127.0.0.1 refused: sent by a page of another origin (Origin '{evil[:-1]}'"
        in line
    )
