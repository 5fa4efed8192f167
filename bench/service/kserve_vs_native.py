#!/usr/bin/env python3
"""Issue 8's speed check: the medium request (B1 S2048 H32 d128 bf16) over the native gRPC API, the KServe binary
REST path and the Open Inference Protocol gRPC path, side by side against one running server, from one Python
process (same machine, loopback). Prints a markdown table: p50/p99 latency, goodput = (request + response tensor
bytes) / p50, and each path's p50 relative to native gRPC.

    python3 bench/service/kserve_vs_native.py --grpc 127.0.0.1:8001 --http 127.0.0.1:8000 [--reps 30] [--warmup 3]

Each path sends pre-built request bytes where the protocol allows (REST body, OIP protobuf), so what is timed is the
transfer, the server and the response decode; the native client builds its protobuf per call (flashserve.Client),
as users do. Numbers are in-process Python clients: compare the paths with each other, not with the C++ loadgen.
"""
from __future__ import annotations

import argparse
import http.client
import importlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import ml_dtypes
import numpy as np

import flashserve

REPO = Path(__file__).resolve().parents[2]
PROTO = REPO / "proto" / "inference" / "open_inference_grpc.proto"
BIG = 2**31 - 1
HEADER = "Inference-Header-Content-Length"


def oip_stubs():
    out = Path(tempfile.mkdtemp(prefix="oip_"))
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO.parents[1]}", f"--python_out={out}",
                    f"--grpc_python_out={out}", str(PROTO)], check=True)
    sys.path.insert(0, str(out))
    return (importlib.import_module("inference.open_inference_grpc_pb2"),
            importlib.import_module("inference.open_inference_grpc_pb2_grpc"))


def timed(fn, reps, warmup):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return statistics.median(times), times[min(len(times) - 1, int(0.99 * len(times)))]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--grpc", required=True)
    ap.add_argument("--http", required=True)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    shape = (1, 2048, 32, 128)
    q, k, v = (rng.standard_normal(shape).astype(ml_dtypes.bfloat16) for _ in range(3))
    tensor_bytes = 4 * q.nbytes  # Q, K, V in + O out

    client = flashserve.Client(args.grpc, timeout=120)
    reference = np.asarray(client.attention(q, k, v), dtype=np.float32)

    def native():
        client.attention(q, k, v)

    # KServe REST with the binary tensor extension; body built once.
    head = json.dumps({"inputs": [{"name": n, "datatype": "BF16", "shape": list(shape),
                                   "parameters": {"binary_data_size": x.nbytes}} for n, x in (("Q", q), ("K", k), ("V", v))],
                       "outputs": [{"name": "O", "parameters": {"binary_data": True}}]}).encode()
    body = head + q.tobytes() + k.tobytes() + v.tobytes()
    host, port = args.http.rsplit(":", 1)

    def rest():
        # A connection per call: the server may close idle keep-alive connections between calls.
        conn = http.client.HTTPConnection(host, int(port), timeout=120)
        conn.request("POST", "/v2/models/attention/infer", body=body,
                     headers={HEADER: str(len(head)), "Content-Type": "application/octet-stream"})
        r = conn.getresponse()
        data = r.read()
        conn.close()
        assert r.status == 200, data[:300]
        split = int(r.getheader(HEADER))
        return np.frombuffer(data[split:], dtype=ml_dtypes.bfloat16)

    pb2, pb2_grpc = oip_stubs()
    channel = grpc.insecure_channel(args.grpc, options=[("grpc.max_receive_message_length", BIG),
                                                        ("grpc.max_send_message_length", BIG)])
    stub = pb2_grpc.GRPCInferenceServiceStub(channel)
    request = pb2.ModelInferRequest(model_name="attention")
    for name, x in (("Q", q), ("K", k), ("V", v)):
        request.inputs.add(name=name, datatype="BF16", shape=list(shape))
        request.raw_input_contents.append(x.tobytes())

    def oip():
        response = stub.ModelInfer(request, timeout=120)
        return np.frombuffer(response.raw_output_contents[0], dtype=ml_dtypes.bfloat16)

    # Same answers on every path before timing anything.
    for name, fn in (("rest", rest), ("oip", oip)):
        got = np.asarray(fn(), dtype=np.float32).reshape(shape)
        assert np.array_equal(got, reference), f"{name} differs from the native answer"

    rows = []
    results = {}
    for name, fn in (("native gRPC (AttentionService/Attention)", native),
                     ("KServe REST, binary tensor extension", rest),
                     ("OIP gRPC (GRPCInferenceService/ModelInfer)", oip)):
        p50, p99 = timed(fn, args.reps, args.warmup)
        results[name] = p50
        rows.append((name, p50, p99))
    base = rows[0][1]
    print(f"medium request B1 S2048 H32 d128 bf16: {tensor_bytes / 2**20:.0f} MiB of tensors per call, "
          f"c=1, {args.reps} reps after {args.warmup} warm-up, one Python process\n")
    print("| path | p50 ms | p99 ms | goodput GB/s (p50) | p50 / native |")
    print("|---|---|---|---|---|")
    for name, p50, p99 in rows:
        print(f"| {name} | {p50 * 1e3:.1f} | {p99 * 1e3:.1f} | {tensor_bytes / p50 / 1e9:.2f} | {p50 / base:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
