"""deploy/: the Kubernetes manifests, the Prometheus alert rules and the Grafana dashboard.

The built-in Kubernetes objects are validated offline against the Kubernetes schemas that
``kubernetes-validate`` ships (strict: an unknown field fails); KEDA's objects, a CRD, are
checked for the fields KEDA requires. The numbers that must agree with the kit (the grace
period against WORKER_SHUTDOWN_TIMEOUT, the probes' port against WORKER_HEALTH_PORT) are read
from the manifests and checked with the kit's own settings. Every metric the alert rules and
the dashboard name must be one the exporter serves or the worker processes export.
"""

from __future__ import annotations

import ast
import base64
import json
import os
import re
import shutil
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

import dramatiq_gp as gp
from dramatiq_gp.durations import parse_duration
from dramatiq_gp.prometheus import prometheus_name
from dramatiq_gp.settings import WorkerSettings, weak_secret
from helpers import KIT_PREFIXES

ROOT = Path(__file__).resolve().parent.parent
KUBERNETES = ROOT / "deploy" / "kubernetes"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
GRAFANA = ROOT / "deploy" / "grafana" / "dramatiq-gp.json"
PRODUCTION = ROOT / "docs" / "production.md"

#: What terminationGracePeriodSeconds must leave beyond WORKER_SHUTDOWN_TIMEOUT (docs/production.md):
#: the kit's own steps after the deadline (0.5 s), the dramatiq parent (1 s), the telemetry flush
#: (at most 5 s), the rest for the application's closers.
SHUTDOWN_MARGIN = timedelta(seconds=10)

#: The oldest Kubernetes the manifests are checked against, beside the newest the validator knows.
OLDEST_KUBERNETES = "1.30.0"


# -- the Kubernetes manifests ------------------------------------------------------------------


def _documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _objects() -> list[tuple[str, dict[str, Any]]]:
    """Every object of every manifest but the kustomization, with its file name."""
    found = []
    for path in sorted(KUBERNETES.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            found += [(path.name, doc) for doc in _documents(path)]
    return found


def _named(kind: str, name: str) -> dict[str, Any]:
    (found,) = [doc for _, doc in _objects() if doc["kind"] == kind and doc["metadata"]["name"] == name]
    return found


def _is_keda(doc: dict[str, Any]) -> bool:
    return str(doc["apiVersion"]).startswith("keda.sh/")


BUILT_IN = [(f"{file}:{doc['kind']}/{doc['metadata']['name']}", doc) for file, doc in _objects() if not _is_keda(doc)]


@pytest.mark.parametrize("version", [OLDEST_KUBERNETES, kubernetes_validate.latest_version()])
@pytest.mark.parametrize(("name", "doc"), BUILT_IN, ids=[name for name, _ in BUILT_IN])
def test_every_built_in_object_is_valid_against_the_kubernetes_schema(name, doc, version):
    kubernetes_validate.validate(doc, version, strict=True)


def test_the_validator_rejects_what_kubernetes_would():
    # The check above checks something: a misspelt field and a string port fail.
    worker = _named("Deployment", "dramatiq-gp-worker")
    bad = json.loads(json.dumps(worker))
    bad["spec"]["template"]["spec"]["terminationGracePeriod"] = 70
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, kubernetes_validate.latest_version(), strict=True)
    bad = json.loads(json.dumps(worker))
    bad["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "8080"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, kubernetes_validate.latest_version(), strict=True)


def test_the_kustomization_lists_every_manifest_and_only_those():
    kustomization = (KUBERNETES / "kustomization.yaml").read_text()
    listed = _documents(KUBERNETES / "kustomization.yaml")[0]["resources"]
    files = {path.name for path in KUBERNETES.glob("*.yaml")} - {"kustomization.yaml"}
    keda = {name for name in files if name.startswith("keda-")}
    assert set(listed) == files - keda
    # KEDA's are offered commented out: applying a CRD's object fails where KEDA is not installed.
    for name in keda:
        assert re.search(rf"^\s*# - {re.escape(name)}\b", kustomization, re.M), name
    assert all(not _is_keda(doc) for file, doc in _objects() if file in listed)


def test_every_object_is_labelled_and_every_selector_selects_its_pods():
    for file, doc in _objects():
        assert doc["metadata"]["labels"]["app.kubernetes.io/name"] == "dramatiq-gp", file
        if doc["kind"] == "Deployment":
            selector = doc["spec"]["selector"]["matchLabels"]
            assert selector.items() <= doc["spec"]["template"]["metadata"]["labels"].items(), file
        if doc["kind"] == "Service":
            (target,) = [
                d
                for _, d in _objects()
                if d["kind"] == "Deployment"
                and doc["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()
            ]
            named = {p["name"] for c in target["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
            assert {p["targetPort"] for p in doc["spec"]["ports"]} <= named, file


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def _environment(container: dict[str, Any], created: dict[str, dict[str, str]] | None = None) -> dict[str, str]:
    """The container's environment as Kubernetes builds it: envFrom first, then env over it.

    ``created``: the Secrets the user creates (not shipped), by name.
    """
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(_named("ConfigMap", source["configMapRef"]["name"])["data"])
        elif source["secretRef"]["name"] in (created or {}):
            env.update((created or {})[source["secretRef"]["name"]])
        else:
            env.update(_named("Secret", source["secretRef"]["name"])["stringData"])
    env.update({item["name"]: item["value"] for item in container.get("env", [])})
    return env


@pytest.fixture
def manifest_env(monkeypatch):
    """Sets a container's environment, and only it, as the kit's settings read it."""

    def apply(container: dict[str, Any], created: dict[str, dict[str, str]] | None = None) -> dict[str, str]:
        for name in list(os.environ):
            if name.startswith(KIT_PREFIXES):
                monkeypatch.delenv(name)
        env = _environment(container, created)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        return env

    return apply


def test_the_worker_settings_in_the_manifests_are_ones_the_kit_accepts(manifest_env):
    manifest_env(_container(_named("Deployment", "dramatiq-gp-worker")))
    settings = gp.Settings.from_env()
    assert settings.worker.shutdown_timeout is not None
    assert settings.worker.health_port is not None


def test_the_grace_period_covers_the_shutdown_timeout_and_the_margin(manifest_env):
    worker = _named("Deployment", "dramatiq-gp-worker")
    container = _container(worker)
    manifest_env(container)
    timeout = WorkerSettings().shutdown_timeout
    assert timeout is not None, "WORKER_SHUTDOWN_TIMEOUT must be set: the CLI's default is 10 minutes"
    # A preStop hook spends the same grace period before SIGTERM reaches the worker.
    pre_stop = container.get("lifecycle", {}).get("preStop")
    assert pre_stop is None or set(pre_stop) == {"sleep"}, "only a preStop whose length is known can be counted"
    spent_before = timedelta(seconds=pre_stop["sleep"]["seconds"]) if pre_stop else timedelta()
    grace = timedelta(seconds=worker["spec"]["template"]["spec"]["terminationGracePeriodSeconds"])
    assert grace >= spent_before + timeout + SHUTDOWN_MARGIN
    # The page that explains the numbers states the same margin.
    assert f"`WORKER_SHUTDOWN_TIMEOUT` + {SHUTDOWN_MARGIN.seconds} s" in PRODUCTION.read_text()


def test_the_probes_ask_the_worker_health_port(manifest_env):
    container = _container(_named("Deployment", "dramatiq-gp-worker"))
    manifest_env(container)
    port = WorkerSettings().health_port
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["health"] == port
    paths = {}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        get = container[probe]["httpGet"]
        assert ports.get(get["port"], get["port"]) == port, probe
        paths[probe] = get["path"]
    assert paths == {"startupProbe": "/livez", "livenessProbe": "/livez", "readinessProbe": "/readyz"}


def test_the_worker_runs_the_dramatiq_command_and_drains_before_old_pods_go():
    worker = _named("Deployment", "dramatiq-gp-worker")
    container = _container(worker)
    assert container["command"] == ["dramatiq"]
    assert container["args"][-1] == "app.worker"  # the placeholder module of the README
    rolling = worker["spec"]["strategy"]["rollingUpdate"]
    assert rolling["maxUnavailable"] == 0
    # KEDA owns the replica count: a value here would reset it at every apply.
    assert "replicas" not in worker["spec"]


def test_the_exporter_runs_once_and_every_component_reads_the_same_settings():
    exporter = _named("Deployment", "dramatiq-gp-exporter")
    assert exporter["spec"]["replicas"] == 1
    assert exporter["spec"]["strategy"]["type"] == "Recreate"  # never two, not even during a rollout
    command = _container(exporter)["command"]
    assert command[:2] == ["dramatiq-gp", "exporter"]
    port = int(command[command.index("--port") + 1])
    assert {p["containerPort"] for p in _container(exporter)["ports"]} == {port}
    shared = {"configMapRef": {"name": "dramatiq-gp"}}, {"secretRef": {"name": "dramatiq-gp"}}
    for name in ("worker", "exporter", "dashboard"):
        assert all(s in _container(_named("Deployment", f"dramatiq-gp-{name}"))["envFrom"] for s in shared), name
    job = _named("Job", "dramatiq-gp-migrate")
    (migrate,) = job["spec"]["template"]["spec"]["containers"]
    assert migrate["command"] == ["dramatiq-gp", "migrate", "up"]
    assert all(s in migrate["envFrom"] for s in shared)


#: The command docs/production.md and secret.yaml give to create the dashboard's Secret, continued lines and all.
CREATE_DASHBOARD_SECRET = re.compile(r"kubectl create secret generic dramatiq-gp-dashboard(?:[^\n]*\\\n)+[^\n]*")


def _created_secret(command: str) -> dict[str, str]:
    """The Secret ``command`` creates: each ``--from-literal``, a ``$(...)`` run as the shell would."""
    data = {}
    for name, value in re.findall(r"--from-literal=(\w+)=(\"\$\(.*?\)\"|\S+)", command.replace("#", "")):
        if value.startswith('"$('):
            inner = value[3:-2].replace("python3 ", f"{sys.executable} ", 1)
            value = subprocess.run(inner, shell=True, check=True, capture_output=True, text=True).stdout.strip()
        data[name] = value
    return data


def test_the_dashboard_secret_is_created_by_the_user_with_a_password_the_dashboard_accepts(manifest_env):
    # secret.yaml once shipped DASHBOARD_PASSWORD: CHANGE-ME, which the dashboard accepted off loopback.
    container = _container(_named("Deployment", "dramatiq-gp-dashboard"))
    assert {"secretRef": {"name": "dramatiq-gp-dashboard"}} in container["envFrom"]
    assert not [
        doc for _, doc in _objects() if doc["kind"] == "Secret" and doc["metadata"]["name"].endswith("dashboard")
    ]
    assert container["command"][container["command"].index("--host") + 1] == "0.0.0.0"  # off loopback
    commands = [
        c
        for page in (PRODUCTION, KUBERNETES / "secret.yaml")
        for c in CREATE_DASHBOARD_SECRET.findall(page.read_text())
    ]
    assert len(commands) == 3  # the page's first steps, its dashboard part, and the manifest's comment
    for command in commands:
        created = _created_secret(command)
        assert set(created) == {"DASHBOARD_USER", "DASHBOARD_PASSWORD"}, command
        manifest_env(container, {"dramatiq-gp-dashboard": created})
        dashboard = gp.Settings.from_env().dashboard
        assert dashboard.credentials and dashboard.weak() is None, command
    worker = _environment(_container(_named("Deployment", "dramatiq-gp-worker")))
    assert not any(name.startswith("DASHBOARD_") for name in worker)


def test_no_secret_ships_a_usable_password():
    secrets = [(file, doc) for file, doc in _objects() if doc["kind"] == "Secret"]
    assert secrets
    for file, doc in secrets:
        values = {**doc.get("stringData", {})}
        values.update({k: base64.b64decode(v).decode() for k, v in doc.get("data", {}).items()})
        assert not [name for name in values if name.startswith("DASHBOARD_")], file
        for name, value in values.items():
            found = [urlsplit(url).password for url in re.split(r"[;,]", value) if "://" in url]
            if re.search("PASSWORD|TOKEN|SECRET", name):
                found.append(value)
            # Each a placeholder the dashboard would refuse: what cannot be mistaken for a real one.
            for secret in filter(None, found):
                assert "placeholder" in (weak_secret("DASHBOARD_PASSWORD", secret) or ""), (file, name)


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a label selector (``matchLabels`` and ``matchExpressions``) selects ``labels``."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for term in selector.get("matchExpressions", []):
        key, values, present = term["key"], term.get("values", []), term["key"] in labels
        if not {
            "In": present and labels.get(key) in values,
            "NotIn": labels.get(key) not in values,
            "Exists": present,
            "DoesNotExist": not present,
        }[term["operator"]]:
            return False
    return True


def _pod_templates() -> list[tuple[str, dict[str, Any]]]:
    """Every pod template of the shipped manifests (KEDA's objects have none), by file and name."""
    found = []
    for file, doc in _objects():
        spec = doc.get("spec", {})
        template = spec.get("template") or spec.get("jobTemplate", {}).get("spec", {}).get("template")
        if template:
            found.append((f"{file}:{doc['kind']}/{doc['metadata']['name']}", template))
    # Every object with containers is among them.
    assert len(found) == len([1 for _, doc in _objects() if "containers" in json.dumps(doc)])
    return found


#: The ports each component's pods open, and to whom (the health port: only the kubelet, which is always let in).
OPENED = {
    "worker": {"metrics": "prometheus"},
    "exporter": {"metrics": "prometheus"},
    "dashboard": {"http": "ingress-nginx"},
    "migrate": {},
}


def test_a_network_policy_covers_every_port_the_pods_expose():
    policies = [doc for _, doc in _objects() if doc["kind"] == "NetworkPolicy"]
    assert policies
    for name, template in _pod_templates():
        labels = template["metadata"]["labels"]
        ports = {p["name"]: p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports", [])}
        applying = [p["spec"] for p in policies if _selects(p["spec"]["podSelector"], labels)]
        # Selected by an Ingress policy: a connection no rule allows is refused.
        assert any("Ingress" in spec["policyTypes"] for spec in applying), name
        opened: dict[str, str] = {}
        for rule in [rule for spec in applying for rule in spec.get("ingress", [])]:
            # Never from anywhere, never every port: each source a pod selector in a namespace.
            assert rule.get("from") and rule.get("ports"), name
            for peer in rule["from"]:
                assert set(peer) == {"namespaceSelector", "podSelector"}, name
                assert peer["namespaceSelector"]["matchLabels"] and peer["podSelector"]["matchLabels"], name
            for port in rule["ports"]:
                (port_name,) = [n for n, number in ports.items() if port["port"] in (n, number)]
                for peer in rule["from"]:
                    opened[port_name] = peer["podSelector"]["matchLabels"]["app.kubernetes.io/name"]
        assert opened == OPENED[labels["app.kubernetes.io/component"]], name
        # Closed to all but the node: the health port, which the kubelet's probes ask.
        closed = set(ports) - set(opened)
        assert closed <= {"health"}, name
        probes = [c.get(p, {}) for c in template["spec"]["containers"] for p in ("livenessProbe", "readinessProbe")]
        probed = {probe["httpGet"]["port"] for probe in probes if "httpGet" in probe}
        assert {ports[port] for port in closed} <= {ports.get(port, port) for port in probed}, name


def test_no_pod_gets_a_kubernetes_api_token():
    (account,) = [doc for _, doc in _objects() if doc["kind"] == "ServiceAccount"]
    assert account["automountServiceAccountToken"] is False
    for name, template in _pod_templates():
        assert template["spec"]["automountServiceAccountToken"] is False, name
        assert template["spec"]["serviceAccountName"] == account["metadata"]["name"], name


KEDA = [(file, doc) for file, doc in _objects() if _is_keda(doc)]


def test_the_keda_objects_have_what_keda_requires():
    scaled = [(file, doc) for file, doc in KEDA if doc["kind"] == "ScaledObject"]
    assert {file for file, _ in scaled} == {"keda-redis.yaml", "keda-rabbitmq.yaml"}
    authentications = {doc["metadata"]["name"]: doc for _, doc in KEDA if doc["kind"] == "TriggerAuthentication"}
    assert {doc["kind"] for _, doc in KEDA} <= {"ScaledObject", "TriggerAuthentication"}
    for file, doc in scaled:
        assert doc["apiVersion"] == "keda.sh/v1alpha1", file
        spec = doc["spec"]
        target = spec["scaleTargetRef"]
        assert target["name"] == "dramatiq-gp-worker", file
        assert target.get("kind", "Deployment") == "Deployment" and target.get("apiVersion", "apps/v1") == "apps/v1"
        # Never to zero: the scheduler and the outbox relay run in the workers.
        assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"], file
        assert spec["triggers"], file
        for trigger in spec["triggers"]:
            metadata = trigger["metadata"]
            assert all(isinstance(value, str) for value in metadata.values()), (file, trigger)
            assert trigger.get("metricType", "AverageValue") in {"AverageValue", "Value", "Utilization"}
            if trigger["type"] == "prometheus":
                assert {"serverAddress", "query", "threshold"} <= metadata.keys(), (file, trigger)
                float(metadata["threshold"])
            elif trigger["type"] == "rabbitmq":
                assert {"queueName", "mode", "value"} <= metadata.keys(), (file, trigger)
                assert metadata["mode"] in {"QueueLength", "MessageRate"}
                float(metadata["value"])
                # The host comes from the manifest, the environment or a TriggerAuthentication.
                auth = trigger.get("authenticationRef", {}).get("name")
                assert "host" in metadata or "hostFromEnv" in metadata or auth in authentications, (file, trigger)
                if auth:
                    parameters = {ref["parameter"] for ref in authentications[auth]["spec"]["secretTargetRef"]}
                    assert "host" in parameters
            else:
                pytest.fail(f"{file}: a trigger of type {trigger['type']}")
    for name, doc in authentications.items():
        for ref in doc["spec"]["secretTargetRef"]:
            assert {"parameter", "name", "key"} <= ref.keys(), name
            _named("Secret", ref["name"])  # a Secret the manifests define


def test_the_keda_prometheus_queries_use_the_exporters_metrics():
    triggers = [t for _, d in KEDA if d["kind"] == "ScaledObject" for t in d["spec"]["triggers"]]
    used = set().union(*(_metric_names(t["metadata"]["query"]) for t in triggers if t["type"] == "prometheus"))
    assert used and used <= _exporter_metrics()


# -- metric names ------------------------------------------------------------------------------

_INSTRUMENT_KINDS = {
    "create_counter": "counter",
    "create_histogram": "histogram",
    "create_up_down_counter": "gauge",
    "create_gauge": "gauge",
    "create_observable_gauge": "gauge",
    "create_observable_counter": "counter",
    "create_observable_up_down_counter": "gauge",
    "observe": "gauge",  # dramatiq_gp.metrics.observe registers an observable gauge
}


def _worker_metrics() -> set[str]:
    """The Prometheus names of every instrument the kit's code creates, as its /metrics shows them."""
    names = set()
    for path in (ROOT / "dramatiq_gp").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            kind = _INSTRUMENT_KINDS.get(str(called))
            name = node.args[0]
            if kind is None or not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
                continue  # metrics.observe's own create_observable_gauge(name, ...): its callers are found
            units = [k.value for k in node.keywords if k.arg == "unit"]
            if called == "observe" and len(node.args) > 1:
                units.append(node.args[1])
            unit = units[0].value if units and isinstance(units[0], ast.Constant) else ""
            base = prometheus_name(name.value, unit, kind)
            names |= {f"{base}_bucket", f"{base}_sum", f"{base}_count"} if kind == "histogram" else {base}
    return names


def _exporter_metrics() -> set[str]:
    from dramatiq_gp.exporter import METRICS

    return set(METRICS)


def test_the_worker_metrics_are_found_in_the_code():
    # The derivation above finds the instruments docs/observability.md lists (a spot check, not the list).
    found = _worker_metrics()
    assert {"dramatiq_gp_messages_total", "messaging_process_duration_seconds_bucket"} <= found
    assert "dramatiq_gp_outbox_oldest_age_seconds" in found  # an observed gauge, with its unit


_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "inf",
    "nan",
}


def _metric_names(expression: str) -> set[str]:
    """The metric names a PromQL expression reads: identifiers that are not functions, labels or keywords."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expression)  # string literals
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # ranges, subqueries
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)  # label lists
    text = re.sub(r"\$\w+", " ", text)  # Grafana variables
    names = set()
    for match in re.finditer(r"(?<![\w.])([a-zA-Z_:][\w:]*)(\s*\()?", text):
        if not match.group(2) and match.group(1).lower() not in _KEYWORDS:
            names.add(match.group(1))
    return names


def test_the_metric_name_parser_finds_names_and_skips_the_rest():
    expression = (
        'histogram_quantile(0.95, sum by (le, task_type) (rate(messaging_process_duration_seconds_bucket{a="b c"}'
        "[$__rate_interval]))) > 2 * on () group_left dramatiq_gp_x and time() - up offset 5m"
    )
    assert _metric_names(expression) == {"messaging_process_duration_seconds_bucket", "dramatiq_gp_x", "up"}


# -- the alert rules ---------------------------------------------------------------------------


def _rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def test_the_alert_rules_parse_and_each_has_expr_for_labels_and_annotations():
    rules = _rules()
    names = [rule["alert"] for rule in rules]
    assert len(names) == len(set(names))
    for rule in rules:
        assert {"alert", "expr", "for", "labels", "annotations"} <= rule.keys(), rule.get("alert")
        assert parse_duration(rule["for"]) > timedelta(), rule["alert"]
        assert rule["labels"]["severity"] in {"warning", "critical"}, rule["alert"]
        assert {"summary", "description"} <= rule["annotations"].keys(), rule["alert"]


def test_the_alert_rules_cover_what_issue_31_asks():
    used = {rule["alert"]: _metric_names(rule["expr"]) for rule in _rules()}
    every = set().union(*used.values())
    for metric in (
        "dramatiq_gp_scheduler_leaderless_seconds",
        "dramatiq_gp_scheduler_lease_ttl_seconds",
        "dramatiq_gp_outbox_lag_seconds",
        "dramatiq_gp_queue_oldest_ready_age_seconds",
        "dramatiq_gp_queue_messages",
        "dramatiq_gp_worker_ready",
    ):
        assert metric in every, metric
    (leaderless,) = [rule["expr"] for rule in _rules() if "dramatiq_gp_scheduler_leaderless_seconds" in rule["expr"]]
    two_ttls = r"dramatiq_gp_scheduler_leaderless_seconds\s*>\s*2\s*\*\s*dramatiq_gp_scheduler_lease_ttl_seconds"
    assert re.search(two_ttls, leaderless)


def test_every_metric_the_rules_and_the_dashboard_name_is_served():
    known = _exporter_metrics() | _worker_metrics()
    for rule in _rules():
        assert _metric_names(rule["expr"]) <= known, (rule["alert"], _metric_names(rule["expr"]) - known)
    for where, expression in _grafana_expressions():
        assert _metric_names(expression) <= known, (where, _metric_names(expression) - known)


def _promtool() -> str | None:
    local = ROOT / ".tools" / "promtool"  # where .ci/run unpacks Debian's prometheus package
    return str(local) if os.access(local, os.X_OK) else shutil.which("promtool")


def test_promtool_checks_the_alert_rules():
    promtool = _promtool()
    if promtool is None:
        pytest.skip("promtool not found (.ci/run unpacks it from Debian's prometheus package into .tools/)")
    done = subprocess.run([promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in done.stdout


# -- the Grafana dashboard ---------------------------------------------------------------------


def _grafana() -> dict[str, Any]:
    return json.loads(GRAFANA.read_text())


def _grafana_expressions() -> list[tuple[str, str]]:
    dashboard = _grafana()
    found = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            found.append((panel["title"], target["expr"]))
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            text = query["query"] if isinstance(query, dict) else query
            found.append((f"${variable['name']}", re.sub(r"^label_values\((.*),\s*\w+\)$", r"\1", text)))
    return found


def test_the_grafana_dashboard_is_well_formed():
    dashboard = _grafana()
    assert dashboard["uid"] and dashboard["title"]
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = {variable["name"] for variable in dashboard["templating"]["list"]}
    assert "datasource" in variables
    for panel in dashboard["panels"]:
        assert {"h", "w", "x", "y"} <= panel["gridPos"].keys(), panel["title"]
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, panel["title"]
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert panel["targets"], panel["title"]
            refs = [target["refId"] for target in panel["targets"]]
            assert len(refs) == len(set(refs)), panel["title"]
        for target in panel.get("targets", []):
            for used in re.findall(r"\$(\w+)", target["expr"]):
                assert used in variables or used.startswith("__"), (panel["title"], used)


def test_the_grafana_dashboard_shows_what_issue_31_asks():
    used = set().union(*(_metric_names(expression) for _, expression in _grafana_expressions()))
    expressions = " ".join(expression for _, expression in _grafana_expressions())
    for state in ("ready", "in_flight", "delayed", "dead"):
        assert f'state="{state}"' in expressions, state
    for metric in (
        "dramatiq_gp_queue_oldest_ready_age_seconds",
        "dramatiq_gp_outbox_lag_seconds",
        "dramatiq_gp_scheduler_leader_present",
        "dramatiq_gp_worker_ready",
    ):
        assert metric in used, metric
    assert used & _worker_metrics(), "throughput comes from the workers' own metrics"
