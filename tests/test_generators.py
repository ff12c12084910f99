"""The generators: a project that passes its own tests and runs, idempotent re-runs, errors that change nothing."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner

from dramatiq_gp.cli import main
from helpers import wait_for

ROOT = Path(__file__).resolve().parent.parent


def gp(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def project(tmp_path: Path) -> tuple[Path, str]:
    name = f"app_{uuid.uuid4().hex[:6]}"
    root = tmp_path / name
    code, output = gp("new", "project", str(root))
    assert code == 0, output
    steps = [
        ["new", "module", "billing"],
        ["add", "event", "billing", "InvoicePaid"],
        ["add", "listener", "billing", "InvoicePaid", "send_receipt", "--queue", "mail"],
        ["add", "job", "billing", "heartbeat", "--cron", "@every 1s"],
        ["add", "listener", "billing", "InvoicePaid", "notify_crm", "--async"],
        ["add", "job", "billing", "async_heartbeat", "--cron", "@every 1s", "--async"],
    ]
    for step in steps:
        code, output = gp(*step, "-C", str(root))
        assert code == 0, (step, output)
    return root, name


def test_a_generated_project_installs_in_a_fresh_venv_and_passes_its_own_tests(project, tmp_path):
    root, _name = project
    venv = tmp_path / "venv"
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    # dramatiq-gp from this checkout (it is not on the package index under test), then the project.
    for target in (str(ROOT), f"{root}[dev]"):
        done = subprocess.run([str(python), "-m", "pip", "install", "-q", "-e", target], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    done = subprocess.run(
        [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=root, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout


def test_the_generated_worker_runs_the_listener_and_the_job(project, clean_env, redis_url, database_url, namespace):
    root, name = project
    effects = root / "effects.txt"
    # The handler bodies are the user's: make them leave a trace.
    stubs = [
        ("listeners/send_receipt.py", "receipt"),
        ("jobs/heartbeat.py", "heartbeat"),
        ("listeners/notify_crm.py", "crm"),
        ("jobs/async_heartbeat.py", "async_heartbeat"),
    ]
    for stub, line in stubs:
        path = root / name / "modules" / "billing" / stub
        text = path.read_text()
        body_marker = '"""\n\n    return'
        path.write_text(
            text.replace(body_marker, f'"""\n        open({str(effects)!r}, "a").write("{line}\\n")\n\n    return', 1)
        )
    env = {
        **os.environ,
        "PYTHONPATH": str(root),
        "REDIS_URL": redis_url,
        "DB_URL": database_url,
        "VALKEY_NAMESPACE": namespace,
        "SCHEDULER_LEASE_TTL": "2s",
    }
    subprocess.run([sys.executable, "-m", f"{name}.migrate"], cwd=root, env=env, check=True, capture_output=True)
    log = (root / "worker.log").open("w")
    worker = subprocess.Popen(
        [sys.executable, "-m", "dramatiq", f"{name}.worker", "-p", "1", "-t", "2"],
        cwd=root,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        dispatch = (
            "import sqlalchemy as sa, dramatiq_gp as gp\n"
            f"from {name}.modules.billing.events import InvoicePaid\n"
            "engine = sa.create_engine(__import__('os').environ['DB_URL'])\n"
            "with engine.begin() as conn:\n"
            "    gp.dispatch(conn, InvoicePaid())\n"
        )
        subprocess.run([sys.executable, "-c", dispatch], cwd=root, env=env, check=True, capture_output=True)
        expected = {"receipt", "heartbeat", "crm", "async_heartbeat"}
        wait_for(lambda: effects.exists() and expected <= set(effects.read_text().split()), timeout=30)
    finally:
        os.killpg(worker.pid, signal.SIGTERM)
        worker.wait(30)
        log.close()
    assert effects.read_text().split().count("receipt") == 1
    assert effects.read_text().split().count("crm") == 1
    assert (
        "async def handle(event: InvoicePaid)" in (root / name / "modules/billing/listeners/notify_crm.py").read_text()
    )


def test_every_generator_run_again_changes_nothing(project):
    root, _name = project
    before = tree(root)
    for step in (
        ["new", "module", "billing"],
        ["add", "event", "billing", "InvoicePaid"],
        ["add", "listener", "billing", "InvoicePaid", "send_receipt", "--queue", "mail"],
        ["add", "job", "billing", "heartbeat", "--cron", "@every 1s"],
        ["add", "worker"],
    ):
        code, output = gp(*step, "-C", str(root))
        assert code == 0, output
    assert tree(root) == before


def test_a_file_the_user_edited_is_never_overwritten(project):
    root, name = project
    stub = root / name / "modules" / "billing" / "listeners" / "send_receipt.py"
    stub.write_text(stub.read_text() + "\n# mine\n")
    code, output = gp("add", "listener", "billing", "InvoicePaid", "send_receipt", "--queue", "mail", "-C", str(root))
    assert code == 0 and "kept" in output
    assert stub.read_text().endswith("# mine\n")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["add", "event", "shipping", "Sent"], "no module 'shipping'"),
        (["add", "listener", "billing", "Unknown", "x"], "no event 'Unknown'"),
        (["add", "listener", "billing", "InvoicePaid", "send_receipt", "--queue", "other"], "already registered"),
        (["add", "job", "billing", "report", "--cron", "0 25 * * *"], "cron spec '0 25 * * *'"),
        (["add", "job", "billing", "heartbeat", "--cron", "@every 5s"], "already scheduled"),
        (["add", "event", "billing", "invoice_paid"], "must be CamelCase"),
        (["add", "listener", "billing", "InvoicePaid", "Send-Receipt"], "must be snake_case"),
        (["new", "module", "Bad Name"], "must be snake_case"),
    ],
)
def test_errors_change_no_file(project, args, message):
    root, _name = project
    before = tree(root)
    code, output = gp(*args, "-C", str(root))
    assert code == 1 and message in output, output
    assert tree(root) == before


def test_a_missing_anchor_is_named_and_changes_nothing(project):
    root, name = project
    register = root / name / "modules" / "billing" / "register.py"
    register.write_text(register.read_text().replace("    # gpsystem:listeners\n", ""))
    before = tree(root)
    code, output = gp("add", "listener", "billing", "InvoicePaid", "audit", "-C", str(root))
    assert code == 1 and "has no '# gpsystem:listeners' anchor" in output
    assert tree(root) == before


def test_new_project_run_again_says_so_and_changes_nothing(tmp_path):
    root = tmp_path / "shop"
    assert gp("new", "project", str(root))[0] == 0
    before = tree(root)
    code, output = gp("new", "project", str(root))
    assert (code, output) == (0, "nothing to do: it is all there already\n")
    assert tree(root) == before


def test_new_project_run_again_over_a_project_in_use_changes_nothing(project):
    root, name = project
    # Stubs filled in, modules added (the worker changed with them), files of the user's own beside.
    stub = root / name / "modules" / "billing" / "jobs" / "heartbeat.py"
    stub.write_text(stub.read_text().replace('"""\n\n    return', '"""\n        print("beat")\n\n    return'))
    (root / "NOTES.md").write_text("mine\n")
    before = tree(root)
    code, output = gp("new", "project", str(root))
    assert code == 0, output
    assert output == f"kept {name}/worker.py (it is yours now)\n"
    assert tree(root) == before


@pytest.mark.parametrize(
    ("make", "args", "message"),
    [
        ({"notes.txt": "x"}, [], "is not empty and is not a dramatiq-gp project"),
        ({"pyproject.toml": "[project]\nname = 'other'\n"}, [], "is not a dramatiq-gp project"),
        ({"README.md": "# another project\n"}, [], "is not a dramatiq-gp project"),
        (None, ["--name", "other"], "holds the project 'shop', not 'other'; run with --name shop"),
        ("README.md", [], "README.md is a directory where a file goes"),
        ("shop", [], "shop is a file where a directory goes"),
    ],
    ids=[
        "unrelated-files",
        "foreign-pyproject",
        "foreign-readme",
        "another-name",
        "directory-for-file",
        "file-for-directory",
    ],
)
def test_new_project_refuses_a_directory_holding_something_else(tmp_path, make, args, message):
    root = tmp_path / "shop"
    if isinstance(make, dict):
        root.mkdir()
        for relative, text in make.items():
            (root / relative).write_text(text)
    else:
        assert gp("new", "project", str(root))[0] == 0
        if make is not None:
            # Something of the user's where the generator would write: a directory for a file, a file for a directory.
            target = root / make
            if target.is_dir():
                shutil.rmtree(target)
                target.write_text("mine\n")
            else:
                target.unlink()
                target.mkdir()
    before = tree(root)
    code, output = gp("new", "project", str(root), *args)
    assert code == 1 and len(output.splitlines()) == 1 and message in output, output
    assert tree(root) == before


def test_new_project_run_again_without_no_worker_adds_a_worker_for_its_modules(tmp_path):
    root = tmp_path / "shop"
    assert gp("new", "project", str(root), "--no-worker")[0] == 0
    assert gp("new", "module", "billing", "-C", str(root))[0] == 0
    assert gp("new", "project", str(root), "--no-worker") == (0, "nothing to do: it is all there already\n")
    code, output = gp("new", "project", str(root))
    assert (code, output) == (0, "created shop/worker.py\n")
    assert "register_billing(registry, schedule, deps)" in (root / "shop" / "worker.py").read_text()


def test_add_worker_registers_the_modules_of_a_project_made_without_one(tmp_path):
    root = tmp_path / "noworker"
    assert gp("new", "project", str(root), "--no-worker")[0] == 0
    assert gp("new", "module", "billing", "-C", str(root))[0] == 0
    assert not (root / "noworker" / "worker.py").exists()
    code, output = gp("add", "worker", "-C", str(root))
    assert code == 0, output
    worker = (root / "noworker" / "worker.py").read_text()
    assert "register_billing(registry, schedule, deps)" in worker
