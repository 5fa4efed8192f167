"""Issue 17's acceptance: 64 concurrent hostile uploads of every kind at once against one server with a token --
gRPC messages that claim and stream 1 GiB without a token (or with a wrong one, or with the token but over
--max_request_bytes), and the HTTP kinds of test_http_hostile.py (oversized claims, trickled bodies, JSON bombs,
lying chunked bodies, valid bodies over the receive budget, 1 GiB without a token). Every one must get its status,
the server must live, its peak RSS (VmHWM) must stay under a bound derived from the flags (memory_bound_kib), and
it must still answer an authenticated inference correctly afterwards.

The gRPC bodies are generated lazily on raw HTTP/2 (hostile_grpc_stream.py); each stream's bytes handed to the
kernel are counted: an upper bound on what the server read of it, printed and checked against what the server may
read of a refused call (the stream's flow-control lookahead, 64 MiB: edge/grpc/grpc_auth.h).
"""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest
import requests

from flashserve import attention_pb2 as pb
from flashserve import attention_pb2_grpc as pb_grpc
from flashserve import reference, tensors
from hostile_grpc_stream import stream_claimed_message
from test_http_hostile import (HOSTILE_FLAGS, INFER, MiB, connect, json_bomb, json_dom_bytes,
                               lying_chunked, over_budget, oversized_claim, post_head, raise_open_file_limit, rss_kib,
                               run_upload, status_of, trickled_body)

pytestmark = pytest.mark.e2e

TOKEN = "hostile-token-0123456789abcdef"
GiB = 1 << 30
GRPC_FLAGS = {"grpc_memory_quota_bytes": HOSTILE_FLAGS["max_request_bytes"] + 64 * MiB}  # the auto quota's floor
STREAM_LOOKAHEAD = 64 * MiB  # GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES (edge/grpc/grpc_edge.cc)
GRPC_CONNECTION_KIB = 512  # per gRPC connection outside the quota: transport state, HPACK tables, channel args
PATHS = ["/flashserve.v1.AttentionService/Attention", "/inference.GRPCInferenceService/ModelInfer",
         "/flashserve.v1.AttentionStreamService/OpenSession", "/flashserve.v1.AttentionStreamService/Upload"]
HTTP_KINDS = [oversized_claim, trickled_body, json_bomb, lying_chunked, over_budget]
AUTH = (("Authorization", f"Bearer {TOKEN}"),)


def memory_bound_kib(base_kib: int, http_connections: int, grpc_connections: int) -> int:
    """What the flags let the server hold at once on top of its idle RSS (base_kib):
    - the HTTP edge (test_http_hostile.rss_bound_kib's terms): --http_max_receive_bytes of bodies, the JSON DOMs
      being built (json_dom_bytes), 96 KiB per connection, 64 MiB allocator slack;
    - gRPC: every buffer it holds (read slices, received messages) is charged to --grpc_memory_quota_bytes; plus
      GRPC_CONNECTION_KIB per connection outside it. (Refused calls are dropped as they arrive: they should cost
      almost nothing; the quota is what a client with the token can make gRPC hold.)
    The receive arena is 0 on the CPU backend (--receive_arena_bytes=-1); no request is computed (they are refused,
    or expire in the queue), so nothing for the backend."""
    f = HOSTILE_FLAGS
    http = f["http_max_receive_bytes"] + json_dom_bytes()
    http += http_connections * (96 << 10) + 64 * MiB
    grpc_held = GRPC_FLAGS["grpc_memory_quota_bytes"] + grpc_connections * (GRPC_CONNECTION_KIB << 10)
    return base_kib + (http + grpc_held) // 1024


def grpc_attack(address: str, i: int):
    """(kind, StreamResult, wanted statuses, most bytes the server may read of it)."""
    path = PATHS[i % len(PATHS)]
    if i % 7 == 5:
        metadata, kind, want = (("authorization", "Bearer wrong-token-0123456789ab"),), "grpc_wrong_token", \
            {"UNAUTHENTICATED"}
    elif i % 7 == 6:  # past the gate: over --max_request_bytes, refused by gRPC (size) or at the quota
        metadata, kind, want = (("authorization", f"Bearer {TOKEN}"),), "grpc_token_over_limit", \
            {"RESOURCE_EXHAUSTED"}
    else:
        metadata, kind, want = (), "grpc_no_token", {"UNAUTHENTICATED"}
    result = stream_claimed_message(address, path, GiB, metadata, deadline_s=45)
    limit = GRPC_FLAGS["grpc_memory_quota_bytes"] + STREAM_LOOKAHEAD if kind == "grpc_token_over_limit" else STREAM_LOOKAHEAD
    return f"{kind} {path.rsplit('/', 1)[1]}", result, want, limit


def http_no_token(port: int, i: int, auth=()):
    """A POST claiming 1 GiB without the token, its body streamed: 401 from the headers, nothing read of it."""
    s = connect(port)
    s.sendall(post_head(INFER, {"Inference-Header-Content-Length": 100}, content_length=GiB))
    s.settimeout(0.05)
    for _ in range(200):  # up to 200 x 64 KiB while the answer has not come
        try:
            s.sendall(bytes(64 << 10))
        except (BrokenPipeError, ConnectionResetError, TimeoutError, OSError):
            break
    return s, {401}


def authenticated_inference(server, rng) -> None:
    """The server still answers: a gRPC Attention call with the token, checked against the fp64 reference."""
    q = rng.standard_normal((1, 9, 2, 16)).astype(np.float32)
    k = rng.standard_normal((1, 13, 2, 16)).astype(np.float32)
    v = rng.standard_normal((1, 13, 2, 16)).astype(np.float32)
    request = pb.AttentionRequest(q=tensors.to_proto(q, "q"), k=tensors.to_proto(k, "k"), v=tensors.to_proto(v, "v"))
    with grpc.insecure_channel(server.address) as channel:
        response = pb_grpc.AttentionServiceStub(channel).Attention(
            request, metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=30)
    out = tensors.from_proto(response.out).astype(np.float64)
    assert not np.isnan(out).any()
    assert np.abs(out - reference.attention(q, k, v)).max() < 1e-5
    r = requests.get(f"{server.http}/v2/models/attention", headers=dict(AUTH), timeout=10)
    assert r.status_code == 200, r.text[:200]


def test_64_concurrent_hostile_uploads(start_server, tmp_path, rng):
    raise_open_file_limit(1024)
    (tmp_path / "token").write_text(TOKEN + "\n")
    flags = {**HOSTILE_FLAGS, **GRPC_FLAGS}
    server = start_server(*[f"--{k}={v}" for k, v in flags.items()], f"--auth_token_file={tmp_path / 'token'}")
    pid = server.proc.pid
    authenticated_inference(server, rng)  # warm
    base = rss_kib(pid, "VmRSS")
    n_grpc, n_http = 28, 36
    http_kinds = HTTP_KINDS + [http_no_token]
    results = [None] * (n_grpc + n_http)
    started = threading.Barrier(n_grpc + n_http)

    def attack(i):
        started.wait()
        if i < n_grpc:
            results[i] = grpc_attack(server.address, i)
        else:
            j = i - n_grpc
            results[i] = run_upload(http_kinds[j % len(http_kinds)], server.http_port, j // len(http_kinds), AUTH)

    begin = time.monotonic()
    threads = [threading.Thread(target=attack, args=(i,)) for i in range(n_grpc + n_http)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    elapsed = time.monotonic() - begin
    assert server.proc.poll() is None, server.logs()
    peak = rss_kib(pid, "VmHWM")
    bound = memory_bound_kib(base, n_http, n_grpc)
    report(results[:n_grpc], elapsed, base, peak, bound)
    wrong = [r for r in results[n_grpc:] if r is None or r[1] not in r[2]]
    wrong += [(kind, res, want) for kind, res, want, _ in filter(None, results[:n_grpc]) if res.status not in want]
    wrong += [(kind, res.sent, limit) for kind, res, _, limit in filter(None, results[:n_grpc]) if res.sent > limit]
    assert None not in results[:n_grpc] and not wrong, wrong
    assert peak < bound, f"peak RSS {peak} KiB over the bound {bound} KiB"
    authenticated_inference(server, rng)


def report(grpc_results, elapsed, base, peak, bound) -> None:
    by_kind = {}
    for kind, res, _, _ in filter(None, grpc_results):
        by_kind.setdefault(kind.split()[0], []).append(res)
    for kind, rs in sorted(by_kind.items()):
        sent = sorted(r.sent for r in rs)
        secs = sorted(r.seconds for r in rs)
        print(f"{kind}: {len(rs)} streams claiming 1 GiB, statuses {sorted({r.status for r in rs})} "
              f"({sorted({r.how for r in rs})}); bytes sent per stream median {sent[len(sent) // 2] / MiB:.2f} MiB, "
              f"max {sent[-1] / MiB:.2f} MiB; answered after median {secs[len(secs) // 2]:.2f} s, max {secs[-1]:.2f} s")
    print(f"{len(grpc_results)} gRPC of the uploads, all done in {elapsed:.1f} s: server RSS before {base / 1024:.0f} MiB, peak (VmHWM) "
          f"{peak / 1024:.0f} MiB, bound {bound / 1024:.0f} MiB")


def test_64_unauthenticated_1_gib_grpc_messages(start_server, tmp_path):
    """The acceptance's gRPC case alone, at full count: 64 connections at once, each a call without the token (or
    with a wrong one) whose message claims 1 GiB and is streamed as fast as the server lets it. Every one gets
    UNAUTHENTICATED from its headers; no stream gets more than a few MiB into the server; the peak RSS stays under
    the quota-derived bound, here with a small quota (--max_request_bytes 16 MiB: the auto quota's floor, 80 MiB)."""
    (tmp_path / "token").write_text(TOKEN + "\n")
    quota = 16 * MiB + 64 * MiB
    server = start_server("--max_request_bytes=16777216", f"--grpc_memory_quota_bytes={quota}",
                          f"--auth_token_file={tmp_path / 'token'}")
    pid = server.proc.pid
    base = rss_kib(pid, "VmRSS")
    n = 64
    results = [None] * n
    started = threading.Barrier(n)
    wrong_token = (("authorization", "Bearer wrong-token-0123456789ab"),)

    def attack(i):
        started.wait()
        path = PATHS[i % len(PATHS)]
        results[i] = (f"grpc_no_token {path.rsplit('/', 1)[1]}",
                      stream_claimed_message(server.address, path, GiB, wrong_token if i % 8 == 7 else (), 45),
                      {"UNAUTHENTICATED"}, STREAM_LOOKAHEAD)

    begin = time.monotonic()
    threads = [threading.Thread(target=attack, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert server.proc.poll() is None, server.logs()
    peak = rss_kib(pid, "VmHWM")
    bound = base + (64 * MiB + quota + n * (GRPC_CONNECTION_KIB << 10)) // 1024  # 64 MiB: allocator slack
    report(results, time.monotonic() - begin, base, peak, bound)
    assert None not in results
    wrong = [(kind, r) for kind, r, want, limit in results if r.status not in want or r.sent > limit]
    assert not wrong, wrong
    assert peak < bound, f"peak RSS {peak} KiB over the bound {bound} KiB"
    authenticated_inference(server, np.random.default_rng(17))
