#!/usr/bin/env python3
"""Where a small call's microseconds go on the local socket (CPU backend; the GPU run is separate).

Starts the server binary once per --local_spin_us value, and measures from one Python client, at concurrency 1:
  echo      Echo of a 64-byte payload over the local socket (the transport's floor: frame in, frame out)
  echo_req  Echo of the Attention request's own bytes (the same frame sizes as the call below)
  local     Attention over the local socket, Q/K/V/O in a system shared-memory region (only references in the frame)
  grpc      the same request over gRPC (native Attention, same region), for comparison
  attend    Attend over the local socket: one query row (inline) on a 64-token sequence (Sequences API)
and the server's own Timing of each call (queue_us: submit -> a scheduler worker starts it; compute_us; total_us:
the payload complete -> the runtime's answer). Frames are built once; the loop only sends, receives and parses the
response (so Python's share is small and the same in every row).

    .venv/bin/python bench/local_socket_latency.py --binary build-cpu/server/flashserve --out table.md
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "client", "python"))
import flashserve  # noqa: E402
from flashserve import attention_pb2 as pb  # noqa: E402
from flashserve import sequences_pb2 as spb  # noqa: E402
from flashserve.local import ATTEND, ATTENTION, ECHO, HEADER, MAGIC  # noqa: E402
from flashserve.shm import SystemRegion  # noqa: E402


def free_ports(n: int):
    """n distinct free ports: all bound at once, so the kernel cannot hand the same one out twice."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def start(binary, path, spin_us, workers):
    ports = free_ports(3)
    proc = subprocess.Popen([binary, "--backend=cpu", f"--worker_threads={workers}", f"--grpc_port={ports[0]}",
                             f"--http_port={ports[1]}", f"--metrics_port={ports[2]}", f"--local_socket={path}",
                             f"--local_spin_us={spin_us}", "--allow_client_shm", "--log_level=warn",
                             "--kv_cache_bytes=16777216", "--kv_page_tokens=16"])
    deadline = time.monotonic() + 30
    while not os.path.exists(path):
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError("server did not start")
        time.sleep(0.02)
    return proc, f"127.0.0.1:{ports[0]}"


def roundtrip(sock, frame: bytes, buf: bytearray):
    sock.sendall(frame)
    view = memoryview(buf)
    got = 0
    while got < HEADER.size:
        got += sock.recv_into(view[got:HEADER.size])
    _, status, _, size, _ = HEADER.unpack(bytes(buf[:HEADER.size]))
    got = 0
    while got < size:
        got += sock.recv_into(view[HEADER.size + got:HEADER.size + size])
    assert status == 0, bytes(buf[HEADER.size:HEADER.size + size])
    return bytes(buf[HEADER.size:HEADER.size + size])


def measure(fn, n):
    for _ in range(n // 10):
        fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return np.percentile(np.array(times) * 1e6, [50, 99])


def measure_attend(address, sock, buf, rng, n):
    with flashserve.SequenceClient(address, timeout=30, reprefill=False) as client:
        k = rng.standard_normal((64, 2, 64)).astype(np.float16)
        seq = client.create(num_layers=1, heads_q=4, heads_kv=2, head_dim=64, dtype="float16", prefix={0: (k, k)})
        q = rng.standard_normal((1, 4, 64)).astype(np.float16)
        payload = spb.AttendRequest(sequence_id=seq.id, layer=0,
                                    q=flashserve.tensors.to_proto_rows(q, "q")).SerializeToString()
        attend = HEADER.pack(MAGIC, ATTEND, 0, len(payload), 0) + payload
        return measure(lambda: roundtrip(sock, attend, buf), n)


def run(binary, spin_us, n, shape, workers):
    directory = tempfile.mkdtemp(prefix="fsl", dir="/tmp")
    path = f"{directory}/fs.sock"
    proc, address = start(binary, path, spin_us, workers)
    rows = {}
    try:
        rng = np.random.default_rng(0)
        q, k, v = (rng.standard_normal(s).astype(np.float16) for s in shape)
        with flashserve.Client(address, timeout=30) as grpc_client, \
                SystemRegion(grpc_client, "bench", SystemRegion.bytes_for(q, k, v)) as region:
            request = pb.AttentionRequest(q=flashserve.tensors.to_proto(q, "q"), k=flashserve.tensors.to_proto(k, "k"),
                                          v=flashserve.tensors.to_proto(v, "v"), request_id="b")
            region.place(request, False)
            payload = request.SerializeToString()
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(path)
            buf = bytearray(1 << 20)
            attention = HEADER.pack(MAGIC, ATTENTION, 0, len(payload), 0) + payload
            timings = []

            def local_call():
                timings.append(pb.AttentionResponse.FromString(roundtrip(sock, attention, buf)).timing)

            echo64 = HEADER.pack(MAGIC, ECHO, 0, 64, 0) + bytes(64)
            echo_req = HEADER.pack(MAGIC, ECHO, 0, len(payload), 0) + payload
            rows["echo"] = measure(lambda: roundtrip(sock, echo64, buf), n)
            rows["echo_req"] = measure(lambda: roundtrip(sock, echo_req, buf), n)
            rows["local"] = measure(local_call, n)
            stub = grpc_client.stub
            rows["grpc"] = measure(lambda: stub.Attention(request, timeout=30), n)
            rows["attend"] = measure_attend(address, sock, buf, rng, n)
            tail = timings[-n:]
            rows["server"] = {f: float(np.median([getattr(t, f) for t in tail])) for f in
                              ("queue_us", "compute_us", "total_us")}
            sock.close()
    finally:
        proc.terminate()
        proc.wait(30)
        os.rmdir(directory) if os.path.isdir(directory) and not os.listdir(directory) else None
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--binary", required=True)
    parser.add_argument("--n", type=int, default=3000)
    parser.add_argument("--spins", default="0,100,1000")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--out")
    args = parser.parse_args()
    shape = [(1, 1, 4, 64), (1, 32, 2, 64), (1, 32, 2, 64)]  # one decode-like query over 32 keys
    lines = [f"CPU backend, `--worker_threads={args.workers}`, one Python client at concurrency 1, {args.n} calls "
             f"after {args.n // 10} warm-up; fp16 q {shape[0]}, k/v {shape[1]} in a system shm region; "
             f"host: {os.cpu_count()} CPUs ({os.uname().nodename}).", "",
             "| --local_spin_us | echo 64 B p50/p99 us | echo of the request p50/p99 | local Attention p50/p99 | "
             "gRPC Attention p50/p99 | server queue_us | compute_us | total_us | local Attend p50/p99 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for spin in [int(x) for x in args.spins.split(",")]:
        r = run(args.binary, spin, args.n, shape, args.workers)
        s = r["server"]
        cell = lambda key: f"{r[key][0]:.1f} / {r[key][1]:.1f}"  # noqa: E731
        lines.append(f"| {spin} | {cell('echo')} | {cell('echo_req')} | {cell('local')} | {cell('grpc')} | "
                     f"{s['queue_us']:.0f} | {s['compute_us']:.0f} | {s['total_us']:.0f} | {cell('attend')} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
