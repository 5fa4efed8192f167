"""The real server's /metrics, read by the official Prometheus Python parser: every DESIGN.md §6 family is there with
its type, and real traffic (successes and refusals with known gRPC codes) moves the counters and histograms by exactly
what was sent."""

from __future__ import annotations

import math
import urllib.error
import urllib.request

import pytest

import flashserve
from metrics_helpers import (ATTENTION, CONTENT_TYPE, DESIGN_FAMILIES, SERVER_INFO, scrape, send_traffic,
                             start_metrics_server)

pytestmark = pytest.mark.e2e


@pytest.fixture
def metrics_server(start_server):
    return start_metrics_server(start_server)


def test_every_design_family_is_exported_with_its_type(metrics_server):
    server, url = metrics_server
    s = scrape(url)
    assert s.content_type == CONTENT_TYPE
    for name, kind in DESIGN_FAMILIES.items():
        assert name in s.families, f"{name} missing from /metrics:\n{s.text[:3000]}"
        assert s.families[name].type == kind, (name, s.families[name].type)
        assert s.families[name].documentation, f"{name} has no HELP text"
    extra = {n for n in s.families if not n.startswith("flashserve_")}
    assert not extra, f"families without the flashserve_ prefix: {sorted(extra)}"

    # build_info: one series, value 1, its version the one GetServerInfo reports.
    build = s.series("flashserve_build_info")
    assert len(build) == 1, build
    labels, value = build[0]
    assert value == 1 and set(labels) == {"version", "cuda", "arch"}, build
    with flashserve.Client(server.address, timeout=30) as client:
        assert labels["version"] == client.server_info().version

    # Latency buckets span 10 µs .. 10 s.
    les = sorted(float(l["le"]) for l, _ in s.series("flashserve_request_duration_seconds_bucket")
                 if l.get("method") == ATTENTION)
    assert les[0] <= 1e-5 and 10 <= les[-2] and math.isinf(les[-1]), les
    phases = {l["phase"] for l, _ in s.series("flashserve_phase_duration_seconds_count")}
    assert {"queue", "compute"} <= phases <= {"queue", "h2d", "compute", "d2h"}, phases


def test_metrics_endpoint_serves_only_metrics(metrics_server):
    _, url = metrics_server
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(url.replace("/metrics", "/nope"), timeout=5)
    assert e.value.code == 404


def test_traffic_moves_counters_and_histograms_exactly(metrics_server, rng):
    server, url = metrics_server
    before = scrape(url)
    traffic = send_traffic(server.address, rng)
    after = scrape(url)

    def delta(name, **labels):
        return after.value(name, **labels) - before.value(name, **labels)

    # requests_total per (method, status): exactly what was sent, and nothing else moved.
    seen = {}
    for labels, _ in after.series("flashserve_requests_total"):
        d = delta("flashserve_requests_total", **labels)
        if d:
            seen[(labels["method"], labels["status"])] = d
    assert seen == traffic.counts, f"requests_total moved by {seen}, sent {traffic.counts}"

    # The end-to-end histogram counts every finished call, failed or not; its buckets stay cumulative.
    for method in (ATTENTION, SERVER_INFO):
        assert delta("flashserve_request_duration_seconds_count", method=method) == traffic.total(method), method
        assert delta("flashserve_request_duration_seconds_bucket", method=method, le="+Inf") == traffic.total(method)
        assert delta("flashserve_request_duration_seconds_sum", method=method) > 0, method
        buckets = sorted(((float(l["le"]), v) for l, v in after.series("flashserve_request_duration_seconds_bucket")
                          if l["method"] == method))
        counts = [v for _, v in buckets]
        assert counts == sorted(counts), f"{method} buckets not cumulative: {buckets}"
        assert counts[-1] == after.value("flashserve_request_duration_seconds_count", method=method)

    # Only requests that passed validation reach the queue and the backend (CPU backend: no h2d/d2h copies).
    for phase in ("queue", "compute"):
        assert delta("flashserve_phase_duration_seconds_count", phase=phase) == traffic.ok(), phase
        assert delta("flashserve_phase_duration_seconds_bucket", phase=phase, le="+Inf") == traffic.ok(), phase

    # kernel_tflops: one observation per successful call, under the kernel name the response carried.
    for kernel, n in traffic.kernels.items():
        assert delta("flashserve_kernel_tflops_count", kernel=kernel) == n, (kernel, after.series(
            "flashserve_kernel_tflops_count"))

    # Bytes: at least the tensor payloads of the successful calls (the server may count whole messages).
    bytes_in = delta("flashserve_request_bytes_total", direction="in")
    bytes_out = delta("flashserve_request_bytes_total", direction="out")
    assert bytes_in >= traffic.ok_tensor_bytes_in, (bytes_in, traffic.ok_tensor_bytes_in)
    assert bytes_out >= traffic.ok_tensor_bytes_out, (bytes_out, traffic.ok_tensor_bytes_out)
    assert bytes_in < 4 * traffic.ok_tensor_bytes_in + 1_000_000, "request bytes counted more than once?"

    # Nothing is in flight or queued once every call has been answered.
    assert after.value("flashserve_inflight_requests") == 0
    assert after.value("flashserve_queue_depth") == 0
