"""VALKEY_TLS, VALKEY_TLS_CA_FILE and VALKEY_TLS_INSECURE against a real Redis that speaks only TLS."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest
import redis
import trustme

import dramatiq_gp as gp
from devtools.services import free_port
from helpers import wait_for


@dataclass(frozen=True)
class TLSRedis:
    port: int
    ca_file: str

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(f"rediss://127.0.0.1:{self.port}/0", ssl_ca_certs=self.ca_file)


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory):
    """The system redis-server on a free loopback port, TLS only, its certificate from a CA made here."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("no redis-server on PATH to serve TLS")
    directory = tmp_path_factory.mktemp("tls-redis")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    ca.cert_pem.write_to_path(str(directory / "ca.pem"))
    cert.cert_chain_pems[0].write_to_path(str(directory / "cert.pem"))
    cert.private_key_pem.write_to_path(str(directory / "key.pem"))
    server = TLSRedis(port=free_port(), ca_file=str(directory / "ca.pem"))
    log = directory / "redis.log"
    command = [
        binary,
        "--port",
        "0",
        "--tls-port",
        str(server.port),
        "--bind",
        "127.0.0.1",
        "--tls-cert-file",
        str(directory / "cert.pem"),
        "--tls-key-file",
        str(directory / "key.pem"),
        "--tls-ca-cert-file",
        server.ca_file,
        "--tls-auth-clients",
        "no",
        "--dir",
        str(directory),
        "--logfile",
        str(log),
        "--save",
        "",
        "--appendonly",
        "no",
    ]
    with open(directory / "redis.out", "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    client = server.client()
    try:
        for _ in range(200):
            if process.poll() is not None:
                said = (directory / "redis.out").read_text() + (log.read_text() if log.exists() else "")
                if "tls" in said.lower():
                    pytest.skip(f"{binary} has no TLS support")
                raise RuntimeError(f"{binary} exited with {process.returncode}: {said}")
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        else:
            raise RuntimeError(f"{binary} did not answer on TLS port {server.port}: {log.read_text()}")
        yield server
    finally:
        client.close()
        process.terminate()
        process.wait(10)


@pytest.fixture
def tls_env(clean_env, tls_redis):
    """The VALKEY_* parts for the TLS server (REDIS_URL would override them)."""
    clean_env.delenv("REDIS_URL")
    clean_env.setenv("VALKEY_ADDR", f"127.0.0.1:{tls_redis.port}")
    clean_env.setenv("VALKEY_TLS", "true")
    return clean_env


@gp.event("test.tls.ping")
@dataclass(frozen=True)
class Ping:
    n: int


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "dramatiq_gp", *args], capture_output=True, text=True, timeout=60)


def test_a_kit_runs_its_work_over_tls_with_the_ca_file(tls_env, tls_redis, make_kit, start_worker, namespace):
    tls_env.setenv("VALKEY_TLS_CA_FILE", tls_redis.ca_file)
    seen: list[int] = []
    kit = make_kit(lambda registry, schedule: registry.listen(Ping, lambda event: seen.append(event.n), name="seen"))
    assert kit.settings.redis.display() == f"rediss://127.0.0.1:{tls_redis.port}/0"
    kit.check_connection()
    kit.dispatch(Ping(1))
    assert tls_redis.client().llen(f"{namespace}:default") == 1  # the only port this server has is TLS
    start_worker(kit)
    kit.dispatch(Ping(2))
    wait_for(lambda: sorted(seen) == [1, 2])


def test_the_cli_reads_a_tls_redis_with_the_ca_file(tls_env, tls_redis, namespace):
    tls_env.setenv("VALKEY_TLS_CA_FILE", tls_redis.ca_file)
    tls_env.setenv("VALKEY_NAMESPACE", namespace)
    client = tls_redis.client()
    client.rpush(f"{namespace}:mail", "m1")
    client.hset(f"{namespace}:mail.msgs", "m1", "{}")
    done = _cli("status")
    assert done.returncode == 0, done.stderr
    assert "queue mail: 1 ready, 0 in flight, 0 delayed, 0 dead" in done.stdout.splitlines()


def test_without_the_ca_file_the_servers_certificate_is_refused_in_one_line(tls_env, tls_redis, make_kit):
    where = f"rediss://127.0.0.1:{tls_redis.port}/0"
    done = _cli("status")
    assert done.returncode == 1 and done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"Error: Redis/Valkey unreachable at {where}: ") and "certificate verify failed" in line
    kit = make_kit()
    with pytest.raises(gp.BrokerUnreachable, match="certificate verify failed"):
        kit.check_connection()


def test_valkey_tls_insecure_connects_without_checking_the_certificate(tls_env, tls_redis, make_kit, namespace):
    tls_env.setenv("VALKEY_TLS_INSECURE", "true")
    tls_env.setenv("VALKEY_NAMESPACE", namespace)
    kit = make_kit(lambda registry, schedule: registry.listen(Ping, lambda event: None, name="noop"))
    kit.check_connection()
    kit.dispatch(Ping(1))
    assert tls_redis.client().llen(f"{namespace}:default") == 1
    done = _cli("status")
    assert done.returncode == 0, done.stderr
    assert "queue default: 1 ready, 0 in flight, 0 delayed, 0 dead" in done.stdout.splitlines()


def test_plain_text_to_a_tls_only_port_is_refused_in_one_line(clean_env, tls_redis):
    clean_env.delenv("REDIS_URL")
    clean_env.setenv("VALKEY_ADDR", f"127.0.0.1:{tls_redis.port}")
    done = _cli("status")
    assert done.returncode == 1 and done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"Error: Redis/Valkey unreachable at redis://127.0.0.1:{tls_redis.port}/0: ")
