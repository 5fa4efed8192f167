"""A real Prometheus (Debian's 2.42) scrapes the real server every second: the counters it stores equal the traffic
sent, histogram_quantile over the latency buckets is finite, every PromQL expression of the Grafana dashboard
evaluates (Grafana's variables expanded)."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from metrics_helpers import ATTENTION, free_port, send_traffic, start_metrics_server

pytestmark = pytest.mark.e2e

REPO_ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = REPO_ROOT / "deploy" / "grafana" / "flashserve.json"
WAIT_S = 45.0  # for each condition below; scrapes are every second


def find_tool(tool: str):
    return shutil.which(tool) or (f"/usr/bin/{tool}" if os.access(f"/usr/bin/{tool}", os.X_OK) else None)


@pytest.fixture(scope="session")
def prometheus_bin() -> str:
    """The prometheus binary; installs the Debian package when missing and we are root, skips only when that fails."""
    path = find_tool("prometheus")
    if path:
        return path
    why = "prometheus is not installed"
    if hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("apt-get"):
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        try:
            r = subprocess.run(["apt-get", "install", "-y", "prometheus"], env=env, capture_output=True, text=True,
                               timeout=600)
            why += f"; apt-get install -y prometheus exited {r.returncode}: {(r.stderr or r.stdout)[-800:]}"
        except (OSError, subprocess.TimeoutExpired) as e:
            why += f"; apt-get install -y prometheus failed: {e}"
        path = find_tool("prometheus")
        if path:
            return path
    else:
        why += " and cannot be installed here (not root or no apt-get): apt-get install prometheus"
    pytest.skip(why)


class Prometheus:
    """One Prometheus on a free loopback port with its own data directory, scraping `target` every second."""

    def __init__(self, binary: str, workdir: Path, target: str, rule_files=()):
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = workdir / "prometheus.yml"
        rules = "".join(f"  - '{path}'\n" for path in rule_files)
        config.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            + (f"rule_files:\n{rules}" if rules else "")
            + "scrape_configs:\n  - job_name: flashserve\n    scrape_interval: 1s\n    scrape_timeout: 1s\n"
            f"    static_configs:\n      - targets: ['{target}']\n"
        )
        self.log = workdir / "prometheus.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [binary, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h",
                 "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def logs(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""

    def get(self, path: str, **params):
        url = f"{self.url}{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.read()

    def query(self, promql: str):
        """The result list of an instant query; raises on a PromQL error."""
        try:
            body = json.loads(self.get("/api/v1/query", query=promql))
        except urllib.error.HTTPError as e:
            if e.code == 503:  # not ready yet (its TSDB still opening): wait_until retries a URLError
                raise
            raise AssertionError(f"{promql!r}: HTTP {e.code}: {e.read()[:500]!r}") from None
        assert body["status"] == "success", (promql, body)
        return body["data"]["result"]

    def scalar(self, promql: str):
        """The single value of a query (None when it returns no series)."""
        result = self.query(promql)
        assert len(result) <= 1, (promql, result)
        return float(result[0]["value"][1]) if result else None

    def wait_until(self, what: str, condition, timeout: float = WAIT_S):
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"prometheus exited {self.proc.returncode}\n{self.logs()}"
            try:
                last = condition()
                if last is not None and last is not False:
                    return last
            except (urllib.error.URLError, ConnectionError, OSError) as e:
                last = e
            time.sleep(0.25)
        raise AssertionError(f"not within {timeout} s: {what} (last: {last!r})\n{self.logs()}")

    def wait_ready(self) -> None:
        """Until /-/ready answers 200: before that the API answers 503 (a CI run failed on one)."""
        self.wait_until("Prometheus ready", lambda: self.get("/-/ready") is not None)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def scraped_server(start_server, prometheus_bin, tmp_path):
    """(server, metrics url, Prometheus) with Prometheus already scraping the server successfully."""
    server, metrics_url = start_metrics_server(start_server)
    target = metrics_url.split("//", 1)[1].split("/", 1)[0]
    (tmp_path / "prometheus").mkdir()
    prom = Prometheus(prometheus_bin, tmp_path / "prometheus", target)
    try:
        prom.wait_ready()
        prom.wait_until("the flashserve target up",
                        lambda: prom.scalar('up{job="flashserve"}') == 1.0)
        yield server, metrics_url, prom
    finally:
        prom.stop()


def _count(prom, status):
    return prom.scalar(f'flashserve_requests_total{{job="flashserve",method="{ATTENTION}",status="{status}"}}')


def test_prometheus_stores_the_traffic_and_computes_quantiles(scraped_server, rng):
    server, _, prom = scraped_server
    # The series exist (at 0) before any traffic, so rate() sees the increase of the first burst.
    prom.wait_until("requests_total{status=OK} scraped at 0", lambda: _count(prom, "OK") == 0.0)

    first = send_traffic(server.address, rng, n_ok=6, n_info=1, bad_rounds=1)
    prom.wait_until(f"{first.ok()} OK requests in Prometheus", lambda: _count(prom, "OK") == first.ok())
    second = send_traffic(server.address, rng, n_ok=9, n_info=2, bad_rounds=1)
    sent = {}
    for t in (first, second):
        for key, n in t.counts.items():
            sent[key] = sent.get(key, 0) + n

    def stored():
        series = prom.query('flashserve_requests_total{job="flashserve"} > 0')
        got = {(s["metric"]["method"], s["metric"]["status"]): float(s["value"][1]) for s in series}
        return got == sent and got

    prom.wait_until(f"requests_total == {sent}", stored)

    p99 = prom.wait_until(
        "a finite p99 of request_duration_seconds",
        lambda: (lambda v: v if v is not None and math.isfinite(v) else None)(prom.scalar(
            "histogram_quantile(0.99, sum(rate(flashserve_request_duration_seconds_bucket[30s])) by (le))")))
    assert 0 < p99 <= 10, p99
    p50_compute = prom.scalar(
        'histogram_quantile(0.5, sum(rate(flashserve_phase_duration_seconds_bucket{phase="compute"}[30s])) by (le))')
    assert p50_compute is not None and math.isfinite(p50_compute) and 0 < p50_compute <= p99 * 1.01 + 1e-3, (
        p50_compute, p99)
    assert prom.scalar('flashserve_build_info{job="flashserve"}') == 1.0


def _dashboard_exprs():
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = []

    def walk(panels):
        for panel in panels:
            for target in panel.get("targets", []):
                if target.get("expr"):
                    exprs.append((panel.get("title", "?"), target["expr"]))
            walk(panel.get("panels", []))

    walk(dashboard.get("panels", []))
    return exprs


def _grafana_to_promql(expr: str) -> str:
    """Replaces the Grafana variables the dashboard uses with what they expand to."""
    for var, value in (("$__rate_interval", "30s"), ("$__interval", "15s"), ("$__range", "5m"),
                       ("${instance:regex}", ".*"), ("$instance", ".*"), ("${job}", "flashserve"),
                       ("$job", "flashserve")):
        expr = expr.replace(var, value)
    assert "$" not in expr, f"unhandled Grafana variable in {expr!r}"
    return expr


def test_every_dashboard_expression_evaluates(scraped_server, rng):
    server, _, prom = scraped_server
    send_traffic(server.address, rng, n_ok=3, n_info=1, bad_rounds=1)
    exprs = _dashboard_exprs()
    assert exprs, f"no PromQL in {DASHBOARD}"
    for title, expr in exprs:
        prom.query(_grafana_to_promql(expr))  # raises with Prometheus' message on a PromQL error
