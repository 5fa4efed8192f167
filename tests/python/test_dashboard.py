"""The Grafana dashboard and the Prometheus deploy config: the dashboard queries only metrics the live server exports,
covers every DESIGN.md §6 family, and points at the provisioned datasource; prometheus.yml passes promtool."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from metrics_helpers import DESIGN_FAMILIES, histogram_base, scrape, send_traffic, start_metrics_server

REPO_ROOT = Path(__file__).resolve().parents[2]
DEPLOY = REPO_ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "flashserve.json"
DATASOURCES = DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
METRIC_NAME = re.compile(r"\bflashserve_[a-zA-Z0-9_:]*")


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def all_panels(dashboard: dict):
    def walk(panels):
        for panel in panels:
            yield panel
            yield from walk(panel.get("panels", []))

    return list(walk(dashboard.get("panels", [])))


def queries(dashboard: dict):
    """(where, PromQL) for every panel target and every query variable."""
    out = []
    for panel in all_panels(dashboard):
        for target in panel.get("targets", []):
            out.append((f"panel {panel.get('title')!r} target {target.get('refId')}", target.get("expr", "")))
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            query = var.get("query")
            out.append((f"variable {var.get('name')}", query.get("query", "") if isinstance(query, dict) else query))
    return out


def metric_names(dashboard: dict) -> dict:
    """Every flashserve_* name the dashboard's PromQL mentions -> where."""
    names = {}
    for where, expr in queries(dashboard):
        for name in METRIC_NAME.findall(expr):
            names.setdefault(name, where)
    return names


def test_dashboard_is_well_formed():
    dashboard = load_dashboard()
    assert dashboard["uid"] and dashboard["title"]
    panels = all_panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {ids}"
    ds_uid = re.search(r"^\s*uid:\s*(\S+)", DATASOURCES.read_text(), re.M).group(1)
    for panel in panels:
        if panel["type"] == "row":
            continue
        assert panel.get("targets"), f"panel {panel['title']!r} has no query"
        assert panel["datasource"]["uid"] == ds_uid, panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip(), f"empty expr in {panel['title']!r}"
            assert METRIC_NAME.search(target["expr"]), f"{panel['title']!r} queries no flashserve metric"
            assert target.get("datasource", {}).get("uid", ds_uid) == ds_uid, panel["title"]


def test_dashboard_covers_every_design_family():
    histograms = {n for n, kind in DESIGN_FAMILIES.items() if kind == "histogram"}
    used = {histogram_base(n, histograms) for n in metric_names(load_dashboard())}
    missing = set(DESIGN_FAMILIES) - used
    assert not missing, f"no dashboard panel shows {sorted(missing)}"


def test_deploy_prometheus_config_is_valid():
    text = PROMETHEUS_CONFIG.read_text()
    assert "flashserve:8002" in text
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool (Debian package prometheus) is not installed")
    r = subprocess.run([promtool, "check", "config", "--syntax-only", str(PROMETHEUS_CONFIG)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.e2e
def test_dashboard_queries_only_exported_metrics(start_server, rng):
    # With a KV cache: its families (the dashboard's Sequences panels) exist only on such servers.
    server, url = start_metrics_server(start_server, "--kv_cache_bytes=67108864")
    send_traffic(server.address, rng, n_ok=2, n_info=1, bad_rounds=1)
    exposition = scrape(url)
    # What PromQL can select: a histogram family only through its _bucket/_sum/_count series, every other family by
    # its name (even with no series yet, e.g. device pools on the CPU backend).
    queryable = exposition.sample_names()
    for name, family in exposition.families.items():
        if family.type == "histogram":
            queryable |= {name + suffix for suffix in ("_bucket", "_sum", "_count")}
        else:
            queryable.add(name)
    missing = {name: where for name, where in metric_names(load_dashboard()).items() if name not in queryable}
    assert not missing, f"the dashboard queries metrics the server does not export: {missing}"
