"""The Grafana dashboard and the Prometheus/Grafana provisioning agree with each other and with what
the server exports: every PromQL expression names only series that specd's /metrics has."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from prometheus_client.metrics_core import Metric

from server.metrics import Metrics

DOCKER = Path(__file__).resolve().parents[2] / "docker"
GRAFANA = DOCKER / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "specd.json"
METRIC = re.compile(r"\bspecd:[A-Za-z0-9_:]+")
PANELS = {  # what the dashboard must show, by panel title
    "Acceptance rate", "Acceptance by method", "Acceptance by draft position", "Mean accepted length",
    "Tokens per second",
    "Time to first token", "Inter-token latency", "Queue depth", "KV cache usage", "Adaptive k",
    "Prefix cache hit rate", "Where step time goes",
}
SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def exported_names() -> set[str]:
    """Sample names the server exports (from its registry, so label sets not yet seen count too)."""
    families: list[Metric] = list(Metrics("m").registry.collect())
    return {f.name + suffix for f in families for suffix in SUFFIXES[f.type]}


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(dash: dict) -> list[dict]:
    out = []
    for p in dash["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # collapsed rows keep their panels inside
    return [p for p in out if p["type"] != "row"]


def expressions(dash: dict) -> list[str]:
    exprs = [t["expr"] for p in panels(dash) for t in p["targets"]]
    for var in dash["templating"]["list"]:
        exprs.append(var["definition"])
    return exprs


def test_every_promql_expression_names_only_exported_series():
    exported = exported_names()
    referenced = {name for expr in expressions(dashboard()) for name in METRIC.findall(expr)}
    assert referenced, "the dashboard queries specd's series"
    assert referenced <= exported, f"not exported: {sorted(referenced - exported)}"


def test_the_dashboard_has_the_panels_it_promises_and_valid_layout():
    dash = dashboard()
    ps = panels(dash)
    assert PANELS <= {p["title"] for p in ps}
    ids = [p["id"] for p in dash["panels"]] + [q["id"] for p in dash["panels"] for q in p.get("panels", [])]
    assert len(ids) == len(set(ids))
    for p in ps:
        assert p["targets"] and all(t["expr"].strip() for t in p["targets"]), p["title"]
        assert all('model_name=~"$model_name"' in t["expr"] for t in p["targets"]), p["title"]
    latency = [p for p in ps if p["title"] in ("Time to first token", "Inter-token latency")]
    for p in latency:
        assert sorted(re.findall(r"histogram_quantile\((0\.\d+)", " ".join(t["expr"] for t in p["targets"]))) == [
            "0.5", "0.99"
        ]


def test_the_acceptance_rate_panel_reads_the_overall_gauge_and_the_method_panel_splits_by_method():
    ps = {p["title"]: p for p in panels(dashboard())}
    overall = [t["expr"] for t in ps["Acceptance rate"]["targets"]]
    assert any(e.startswith("specd:spec_decode_acceptance_rate_overall{") for e in overall)
    assert all("specd:spec_decode_acceptance_rate{" not in e for e in overall), "one series per method there"
    by_method = ps["Acceptance by method"]["targets"]
    assert all("{{method}}" in t["legendFormat"] for t in by_method)
    assert any(t["expr"].startswith("specd:spec_decode_acceptance_rate{") for t in by_method)
    assert any("sum by (method)" in t["expr"] for t in by_method)


def test_provisioning_paths_and_datasource_agree():
    datasources = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    [ds] = datasources["datasources"]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090"
    dash = dashboard()
    used = {json.dumps(p["datasource"], sort_keys=True) for p in panels(dash)}
    used |= {json.dumps(t["datasource"], sort_keys=True) for p in panels(dash) for t in p["targets"]}
    used |= {json.dumps(v["datasource"], sort_keys=True) for v in dash["templating"]["list"]}
    assert used == {json.dumps({"type": "prometheus", "uid": ds["uid"]}, sort_keys=True)}

    providers = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "dashboards.yml").read_text())
    [provider] = providers["providers"]
    assert provider["type"] == "file"
    provider_path = provider["options"]["path"]
    assert provider_path == "/var/lib/grafana/dashboards"
    assert DASHBOARD.parent.is_dir() and list(DASHBOARD.parent.glob("*.json")) == [DASHBOARD]

    prometheus = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    [job] = [j for j in prometheus["scrape_configs"] if j["job_name"] == "specd"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    assert job["static_configs"][0]["targets"] == ["specd:8000"]
