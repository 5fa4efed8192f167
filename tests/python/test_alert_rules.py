"""deploy/prometheus/alerts.yml: promtool accepts it and its unit tests pass (tests/prometheus/alerts_test.yml: when
each alert fires, and look-alikes that must not); every metric and label value it names is one the server exports
(a renamed metric would leave an alert that can never fire); the Kubernetes PrometheusRule carries the same groups;
a real Prometheus loads the rules and evaluates each without error against a live server, with none pending or
firing while it is healthy."""

from __future__ import annotations

import datetime
import json
import re
import subprocess
from pathlib import Path

import pytest

from metrics_helpers import scrape, start_metrics_server
from test_prometheus_scrape import Prometheus, find_tool, prometheus_bin  # noqa: F401  (fixture)

REPO_ROOT = Path(__file__).resolve().parents[2]
ALERTS = REPO_ROOT / "deploy" / "prometheus" / "alerts.yml"
ALERTS_TEST = REPO_ROOT / "tests" / "prometheus" / "alerts_test.yml"
SCRAPE_CONFIG = REPO_ROOT / "deploy" / "prometheus" / "prometheus.yml"
PROMETHEUS_RULE = REPO_ROOT / "deploy" / "kubernetes" / "prometheusrule.yaml"
KV_FLAGS = ("--kv_cache_bytes=16777216", "--kv_page_tokens=16")
RULES = 10


@pytest.fixture(scope="module")
def promtool(prometheus_bin) -> str:  # noqa: F811 - Debian's prometheus package (installed by that fixture) has it
    path = find_tool("promtool")
    if not path:
        pytest.skip(f"promtool is not installed beside {prometheus_bin} (Debian's prometheus package has both)")
    return path


def _run(*cmd) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))} exited {r.returncode}:\n{r.stdout}\n{r.stderr}"
    return r.stdout + r.stderr


def test_promtool_accepts_the_rules_and_the_scrape_config(promtool):
    assert f"SUCCESS: {RULES} rules found" in _run(promtool, "check", "rules", str(ALERTS))
    out = _run(promtool, "check", "config", str(SCRAPE_CONFIG))  # follows its rule_files to alerts.yml
    assert f"SUCCESS: {RULES} rules found" in out, out


def test_the_rules_unit_tests_pass(promtool):
    assert "SUCCESS" in _run(promtool, "test", "rules", str(ALERTS_TEST))


def test_the_prometheus_rule_carries_the_same_groups():
    """prometheusrule.yaml's spec is alerts.yml's groups, indented: compared as text (comments included)."""
    rule = PROMETHEUS_RULE.read_text()
    spec = rule[rule.index("\nspec:\n") + len("\nspec:\n"):]
    dedented = "".join(line[2:] if line.startswith("  ") else line for line in spec.splitlines(True))
    alerts = ALERTS.read_text()
    assert dedented == alerts[alerts.index("groups:"):], "deploy/kubernetes/prometheusrule.yaml drifted from alerts.yml"
    assert "kind: PrometheusRule" in rule and "apiVersion: monitoring.coreos.com/v1" in rule


def _names_and_label_values(text: str):
    names = set(re.findall(r"\b(flashserve_[a-z_]+)\b", text))
    values = {}
    for label, quoted in re.findall(r"\b(state|reason)=~?\"([^\"]+)\"", text):
        values.setdefault(label, set()).update(quoted.split("|"))
    return names, values


def test_every_metric_the_rules_name_is_exported(start_server):
    server, url = start_metrics_server(start_server, *KV_FLAGS)
    exported = scrape(url)
    families = set(exported.families)
    samples = exported.sample_names()
    names, values = _names_and_label_values(ALERTS.read_text())
    assert len(names) >= 9, names
    missing = {n for n in names if n not in families and n not in samples}
    assert not missing, f"alerts.yml names metrics the server does not export: {sorted(missing)}"
    for label, wanted in values.items():
        seen = {dict(labels).get(label) for (_, labels) in exported.samples}
        assert wanted <= seen, f"alerts.yml names {label} values {sorted(wanted - seen)} the server never exports"
    assert exported.value("flashserve_backend_healthy") == 1.0
    assert exported.value("flashserve_queue_capacity") > 0


def _epoch(rfc3339: str) -> float:
    """Seconds since the epoch of Prometheus' RFC 3339 time (nanoseconds cut to microseconds); 0 for its zero time."""
    head, _, frac = rfc3339.rstrip("Z").partition(".")
    when = datetime.datetime.fromisoformat(head).replace(tzinfo=datetime.timezone.utc)
    return max(0.0, when.timestamp() + float(f"0.{frac or 0}"))


def test_a_real_prometheus_evaluates_every_rule_against_a_live_server(start_server, prometheus_bin, tmp_path):
    server, url = start_metrics_server(start_server, *KV_FLAGS)
    target = url.split("//", 1)[1].split("/", 1)[0]
    (tmp_path / "prometheus").mkdir()
    prom = Prometheus(prometheus_bin, tmp_path / "prometheus", target, rule_files=[ALERTS])
    try:
        prom.wait_ready()
        prom.wait_until("the flashserve target up", lambda: prom.scalar('up{job="flashserve"}') == 1.0)

        prom.wait_until("the KV series stored",
                        lambda: prom.scalar('count(flashserve_kv_pool_bytes{job="flashserve"})') == 3.0)
        stored_at = prom.scalar("vector(time())")

        def evaluated_since_stored():
            rules = [r for g in json.loads(prom.get("/api/v1/rules"))["data"]["groups"] for r in g["rules"]]
            return rules if len(rules) == RULES and all(_epoch(r["lastEvaluation"]) > stored_at for r in rules) \
                else None

        rules = prom.wait_until(f"{RULES} rules evaluated after the server's series were stored",
                                evaluated_since_stored)
        bad = [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]
        assert not bad, f"rules that failed to evaluate: {bad}"
        active = json.loads(prom.get("/api/v1/alerts"))["data"]["alerts"]
        assert not active, f"alerts pending or firing on a healthy server: {active}"
    finally:
        prom.stop()
