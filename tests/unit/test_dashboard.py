"""The Grafana dashboard and the alert rules name only metrics the code exports, in shapes Grafana loads."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import REGISTRY, CollectorRegistry

from taskq.cli.operate import tier_depth_gauge
from taskq.consumer.dlq import dlq_depth_gauge
from taskq.consumer.metrics import PrometheusHook
from taskq.producer.metrics import producer_metrics
from taskq.producer.outbox import relay_metrics

COMPOSE = Path(__file__).resolve().parents[2] / "compose"
DASHBOARD = COMPOSE / "grafana" / "dashboards" / "taskq.json"
METRIC = re.compile(r"\btaskq_[a-z0-9_]+")
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count")}


def exported() -> set[str]:
    """Every series name the code's registries export, collected from the real metric objects."""
    # Created as the processes that export them create them: the worker's hook in a registry of its own,
    # the producer's, the relay's and the stats command's gauges in the default registry.
    producer_metrics(), relay_metrics(), dlq_depth_gauge(), tier_depth_gauge()
    names: set[str] = set()
    for registry in (PrometheusHook(CollectorRegistry()).registry, REGISTRY):
        for family in registry.collect():
            names.add(family.name)
            names.update(family.name + s for s in SUFFIXES.get(family.type, ()))
    return names


def test_every_dashboard_expression_names_exported_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    names = exported()
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert exprs
    for expr in exprs:
        used = METRIC.findall(expr)
        assert used, f"no taskq metric in {expr!r}"
        assert set(used) <= names, f"{expr!r} names {sorted(set(used) - names)}, not exported"


def test_dashboard_is_a_grafana_dashboard() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert isinstance(dashboard["uid"], str) and dashboard["uid"]
    assert dashboard["title"] and isinstance(dashboard["schemaVersion"], int)
    # The datasource the dashboard names is the one compose/grafana/provisioning provisions.
    datasources = (COMPOSE / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text()
    uid = re.search(r"uid:\s*(\S+)", datasources)
    assert uid is not None
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    titles = {p["title"] for p in dashboard["panels"]}
    wanted = ["Depth per tier", "Throughput", "Enqueue to completion, p50 and p99", "Retries and failures"]
    wanted += ["DLQ depth", "Slot utilisation", "Consumer lag", "Workers"]
    assert set(wanted) <= titles
    for panel in dashboard["panels"]:
        assert panel["type"] in {"timeseries", "stat", "gauge", "bargauge", "table"}
        assert set(panel["gridPos"]) == {"x", "y", "w", "h"}
        assert 0 <= panel["gridPos"]["x"] and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        assert panel["datasource"] == {"type": "prometheus", "uid": uid.group(1)}
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs))
    # The dashboards provider reads the folder docker-compose.yml mounts this directory at.
    provider = (COMPOSE / "grafana" / "provisioning" / "dashboards" / "taskq.yml").read_text()
    path = re.search(r"path:\s*(\S+)", provider)
    assert path is not None
    assert f"./grafana/dashboards:{path.group(1)}:ro" in (COMPOSE / "docker-compose.yml").read_text()


def test_every_alert_expression_names_exported_metrics() -> None:
    names = exported()
    exprs = re.findall(r"^\s*expr:\s*(.+)$", (COMPOSE / "alerts.yml").read_text(), re.MULTILINE)
    assert exprs
    for expr in exprs:
        used = METRIC.findall(expr)
        assert used and set(used) <= names, f"{expr!r} names {sorted(set(used) - names)}, not exported"
