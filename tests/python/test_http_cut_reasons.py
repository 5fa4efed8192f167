"""Why an unanswered HTTP request ended, as flashserve_requests_total counts it (server/edge/http/README.md: a
connection cut off before its answer counts as DEADLINE_EXCEEDED (timeout) or CANCELLED (closed)).

The listener's sweeper cuts a body off under --http_min_body_bytes_per_s (one that never starts included) and, at
--http_max_connections, evicts connections that make no progress. Neither recorded why, so the request was counted
CANCELLED, "connection closed", as if its client had left, while a trickled body cut off in Body() counted
DEADLINE_EXCEEDED (audit). Both are the server's cut-offs: DEADLINE_EXCEEDED (HTTP's 408 reason, "request
timeout"). A client that really leaves still counts CANCELLED.
"""

from __future__ import annotations

import socket
import time

import pytest

from metrics_helpers import scrape
from test_http_hostile import INFER, MiB, _closed_by_server, connect, post_head, status_of

pytestmark = pytest.mark.e2e

REQUESTS = "flashserve_requests_total"


def _counts(server) -> dict:
    s = scrape(f"http://127.0.0.1:{server.metrics_port}/metrics")
    return {code: s.value(REQUESTS, method="KServeInfer", status=code)
            for code in ("DEADLINE_EXCEEDED", "CANCELLED", "OK")}


def _delta(server, before: dict, want_total: int, timeout: float = 10.0) -> dict:
    """The counts' change since `before`, once `want_total` requests were counted (or at `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        now = _counts(server)
        delta = {k: now[k] - before[k] for k in now}
        if sum(delta.values()) >= want_total or time.monotonic() > deadline:
            return delta
        time.sleep(0.05)


def test_a_body_that_never_starts_cut_off_at_the_rate_floor_counts_deadline_exceeded(start_server):
    """Complete headers, then silence: the sweeper cuts the connection off 5 s after the headers (the rate floor).
    That was counted CANCELLED; it is the server's timeout."""
    server = start_server("--http_idle_timeout_s=60", "--log_level=debug", name="floor")
    before = _counts(server)
    s = connect(server.http_port)
    start = time.monotonic()
    s.sendall(post_head(INFER, {}, content_length=MiB))
    assert status_of(s, timeout=30) == 0  # closed, no answer (libmicrohttpd answers only before or after a body)
    held = time.monotonic() - start
    s.close()
    delta = _delta(server, before, 1)
    print(f"closed after {held:.1f} s; requests_total{{method=KServeInfer}} change: {delta}")
    assert delta == {"DEADLINE_EXCEEDED": 1, "CANCELLED": 0, "OK": 0}, (delta, held, server.logs())
    assert "under --http_min_body_bytes_per_s=1048576; connection closed" in server.logs(limit=100_000)


def test_stalled_bodies_evicted_at_the_connection_cap_count_deadline_exceeded(start_server):
    """At --http_max_connections, connections whose body never started are closed after 0.5 s without progress to
    make room (with the rate floor off, so that only the eviction cuts them). Counted CANCELLED before; it is a
    server cut-off -- a timeout shortened at the cap -- so DEADLINE_EXCEEDED, one per evicted request."""
    server = start_server("--http_max_connections=32", "--http_min_body_bytes_per_s=0", "--http_idle_timeout_s=60",
                          "--log_level=debug", name="evict")
    before = _counts(server)
    held = [connect(server.http_port) for _ in range(32)]
    for s in held:
        s.sendall(post_head(INFER, {}, content_length=MiB))
    time.sleep(2.0)  # past the 0.5 s without progress, several sweeps (every 250 ms)
    closed = _closed_by_server(held)  # closes every socket: the survivors count CANCELLED from here on
    assert 1 <= closed < 32, closed
    delta = _delta(server, before, 32)
    print(f"{closed} of 32 evicted; requests_total{{method=KServeInfer}} change: {delta}")
    assert delta["OK"] == 0, delta
    assert delta["DEADLINE_EXCEEDED"] >= closed, (closed, delta, server.logs())
    assert delta["DEADLINE_EXCEEDED"] + delta["CANCELLED"] == 32, (closed, delta)
    assert "at --http_max_connections=32 (closed to make room); connection closed" in server.logs(limit=100_000)


def test_a_client_that_leaves_mid_body_still_counts_cancelled(start_server):
    """The other side: a client that closes its connection mid-body is the client's doing, CANCELLED."""
    server = start_server(name="leaves")
    before = _counts(server)
    s = connect(server.http_port)
    s.sendall(post_head(INFER, {}, content_length=4096) + b"{" * 100)
    time.sleep(0.3)
    s.close()
    delta = _delta(server, before, 1)
    assert delta == {"DEADLINE_EXCEEDED": 0, "CANCELLED": 1, "OK": 0}, delta
