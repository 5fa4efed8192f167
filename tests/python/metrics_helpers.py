"""Helpers for the metrics tests: a server with a known metrics port, scraping and parsing /metrics, and
traffic with known outcomes (successes and server-side failures of chosen gRPC codes)."""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass, field
from typing import Dict, FrozenSet, List, Optional, Tuple

import grpc
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

import flashserve
from conftest import free_port  # noqa: F401  (re-exported: one port ledger per process)
from flashserve import attention_pb2 as pb

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
ATTENTION = "Attention"  # the `method` label of AttentionService.Attention
SERVER_INFO = "GetServerInfo"
# --max_tensor_elements for metrics servers: small, so RESOURCE_EXHAUSTED is cheap to provoke.
MAX_TENSOR_ELEMENTS = 4096

# DESIGN.md §6: family name (as written in the exposition) -> type.
DESIGN_FAMILIES = {
    "flashserve_requests_total": "counter",
    "flashserve_request_duration_seconds": "histogram",
    "flashserve_phase_duration_seconds": "histogram",
    "flashserve_request_bytes_total": "counter",
    "flashserve_inflight_requests": "gauge",
    "flashserve_queue_depth": "gauge",
    "flashserve_kernel_tflops": "histogram",  # DESIGN allows gauge or histogram; the server exports a histogram
    "flashserve_device_memory_pool_bytes": "gauge",
    "flashserve_pinned_memory_pool_bytes": "gauge",
    "flashserve_autotune_total": "counter",
    "flashserve_build_info": "gauge",
}

Labels = FrozenSet[Tuple[str, str]]


def start_metrics_server(start_server, *extra_args):
    """A private CPU server (conftest's start_server) with its metrics on a known free port; returns
    (server, metrics_url)."""
    port = free_port()
    server = start_server(f"--metrics_port={port}", f"--max_tensor_elements={MAX_TENSOR_ELEMENTS}", *extra_args,
                          name="metrics")
    return server, f"http://127.0.0.1:{port}/metrics"


@dataclass
class Scrape:
    text: str
    content_type: str
    families: Dict[str, object] = field(default_factory=dict)  # exposition name -> prometheus_client Metric
    samples: Dict[Tuple[str, Labels], float] = field(default_factory=dict)

    def value(self, name: str, **labels) -> float:
        """A sample's value; 0 when the series does not exist (yet)."""
        return self.samples.get((name, frozenset(labels.items())), 0.0)

    def series(self, name: str) -> List[Tuple[Dict[str, str], float]]:
        return [(dict(labels), v) for (n, labels), v in self.samples.items() if n == name]

    def sample_names(self) -> set:
        return {n for n, _ in self.samples}


def parse(text: str, content_type: str = CONTENT_TYPE) -> Scrape:
    scrape = Scrape(text, content_type)
    for family in text_string_to_metric_families(text):
        # The parser drops a counter's _total from the family name; keep the name as exposed.
        exposed = family.name + "_total" if family.type == "counter" else family.name
        scrape.families[exposed] = family
        for s in family.samples:
            key = (s.name, frozenset(s.labels.items()))
            assert key not in scrape.samples, f"duplicate series {s.name}{s.labels}"
            scrape.samples[key] = s.value
    return scrape


def scrape(url: str, timeout: float = 5.0) -> Scrape:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        assert r.status == 200, r.status
        return parse(r.read().decode("utf-8"), r.headers.get("Content-Type", ""))


def histogram_base(name: str, histograms: set) -> str:
    """flashserve_x_bucket/_sum/_count -> flashserve_x when flashserve_x is one of `histograms`; else name."""
    for suffix in ("_bucket", "_sum", "_count"):
        if name.endswith(suffix) and name[: -len(suffix)] in histograms:
            return name[: -len(suffix)]
    return name


# --- traffic ---------------------------------------------------------------------------------------------------------


@dataclass
class Traffic:
    """What was sent, by (method, status) and bytes of the successful Attention calls."""

    counts: Dict[Tuple[str, str], int] = field(default_factory=dict)
    ok_tensor_bytes_in: int = 0
    ok_tensor_bytes_out: int = 0
    kernels: Dict[str, int] = field(default_factory=dict)

    def add(self, method: str, status: str, n: int = 1) -> None:
        self.counts[(method, status)] = self.counts.get((method, status), 0) + n

    def total(self, method: str) -> int:
        return sum(n for (m, _), n in self.counts.items() if m == method)

    def ok(self, method: str = ATTENTION) -> int:
        return self.counts.get((method, "OK"), 0)


def _tensor(shape, dtype=pb.FLOAT32, data: Optional[bytes] = None) -> pb.Tensor:
    n = int(np.prod(shape))
    return pb.Tensor(dtype=dtype, shape=list(shape), data=data if data is not None else b"\0" * (4 * n))


# Requests the server must refuse, with the code it must refuse them with. The client checks inputs itself, so these
# go through the raw stub.
BAD_REQUESTS = [
    # rank 3 q
    ("INVALID_ARGUMENT", lambda: pb.AttentionRequest(q=_tensor([1, 4, 8]), k=_tensor([1, 4, 1, 8]),
                                                      v=_tensor([1, 4, 1, 8]))),
    # wrong byte length
    ("INVALID_ARGUMENT", lambda: pb.AttentionRequest(q=_tensor([1, 4, 1, 8], data=b"\0" * 7),
                                                      k=_tensor([1, 4, 1, 8]), v=_tensor([1, 4, 1, 8]))),
    # no dtype
    ("INVALID_ARGUMENT", lambda: pb.AttentionRequest(q=_tensor([1, 4, 1, 8], dtype=pb.DTYPE_UNSPECIFIED),
                                                      k=_tensor([1, 4, 1, 8]), v=_tensor([1, 4, 1, 8]))),
    # a zero dimension
    ("INVALID_ARGUMENT", lambda: pb.AttentionRequest(q=_tensor([1, 0, 1, 8]), k=_tensor([1, 4, 1, 8]),
                                                      v=_tensor([1, 4, 1, 8]))),
    # over --max_tensor_elements (checked by the server, not by gRPC's message size limit)
    ("RESOURCE_EXHAUSTED", lambda: pb.AttentionRequest(q=_tensor([1, 2 * MAX_TENSOR_ELEMENTS // 8, 1, 8]),
                                                        k=_tensor([1, 4, 1, 8]), v=_tensor([1, 4, 1, 8]))),
]


def send_traffic(address: str, rng, n_ok: int = 12, n_info: int = 3, bad_rounds: int = 2,
                 threads: int = 4) -> Traffic:
    """Sends n_ok good Attention calls (from `threads` threads), n_info GetServerInfo calls and every BAD_REQUEST
    `bad_rounds` times; checks each outcome and returns what was sent."""
    from concurrent.futures import ThreadPoolExecutor

    traffic = Traffic()
    # (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim); every tensor within MAX_TENSOR_ELEMENTS.
    shapes = [(1, 17, 17, 2, 1, 64), (2, 8, 31, 4, 2, 32), (1, 32, 32, 1, 1, 128)]
    inputs = []
    for i in range(n_ok):
        b, sq, sk, hq, hkv, d = shapes[i % len(shapes)]
        inputs.append(tuple(rng.standard_normal(s).astype(np.float32)
                            for s in ((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, d))))
    with flashserve.Client(address, timeout=60) as client:
        def one(qkv):
            return client.attention_with_metadata(*qkv)

        with ThreadPoolExecutor(max_workers=threads) as pool:
            results = list(pool.map(one, inputs))
        for (q, k, v), result in zip(inputs, results):
            traffic.add(ATTENTION, "OK")
            traffic.ok_tensor_bytes_in += q.nbytes + k.nbytes + v.nbytes
            traffic.ok_tensor_bytes_out += result.out.nbytes
            traffic.kernels[result.kernel] = traffic.kernels.get(result.kernel, 0) + 1
        for _ in range(n_info):
            client.server_info()
            traffic.add(SERVER_INFO, "OK")
        for _ in range(bad_rounds):
            for code, make in BAD_REQUESTS:
                try:
                    client.stub.Attention(make(), timeout=30)
                except grpc.RpcError as e:
                    assert e.code().name == code, f"expected {code}, got {e.code().name}: {e.details()}"
                    traffic.add(ATTENTION, code)
                else:
                    raise AssertionError(f"a request that must fail with {code} succeeded")
    return traffic
