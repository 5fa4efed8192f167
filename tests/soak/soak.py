#!/usr/bin/env python3
"""Soak: mixed traffic against a flashserve server for N minutes while its RSS is sampled; fails on memory growth
after warm-up, on any wrong answer or unexpected error, or if the server dies or does not exit 0 on SIGTERM.

    .venv/bin/python tests/soak/soak.py --minutes 10                 # starts build/server/flashserve (CPU backend)
    .venv/bin/python tests/soak/soak.py --minutes 1 --warmup 0.25 --binary build-rel/server/flashserve

Traffic, from --clients threads, each request drawn at random:
  * good requests: fp16 / bf16 / fp32, small to medium shapes (GQA, causal, LSE, explicit softmax_scale), every answer
    checked against the fp64 reference of its problem (a fixed pool of problems, references computed once);
  * bad requests the server must refuse (malformed shapes, over --max_tensor_elements, garbage bytes);
  * cancellations (a call cancelled after a random delay) and deadlines too short to be met;
  * GetServerInfo, gRPC health and /metrics scrapes.
RSS (VmRSS) and the high-water mark (VmHWM) are read from /proc/<pid>/status every --sample-seconds into a CSV with the
traffic counters. The verdict (see `judge_growth`): growth = (median RSS of the last quarter after warm-up - the 90th
percentile of the first half's samples) / the first quarter's median; it must be below --max-growth (5%). Measured
from the top of the band RSS already swings in (not its median), so that glibc's multi-MiB steps (its per-thread
arenas keep and return freed memory in jumps: 4-10 MiB between samples here) do not decide the verdict, while a leak,
which raises the level in proportion to the calls served, still does. The robust (Theil-Sen) trend of the second half
after warm-up is printed too. RESULTS.md has the rule's record on earlier runs and what leak it detects.

RSS is not the live heap: with glibc's default (dynamic) mmap threshold the server's RSS climbs for minutes under mixed
tensor sizes while the live heap stays small (RESULTS.md); the server therefore fixes the threshold itself
(--malloc_mmap_threshold_bytes, default 128 KiB). Pass --server-arg=--malloc_mmap_threshold_bytes=0 to see glibc's
default behaviour.
"""

from __future__ import annotations

import argparse
import csv
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "client" / "python"))

import flashserve  # noqa: E402
from flashserve import attention_pb2 as pb  # noqa: E402
from flashserve import reference, tensors  # noqa: E402

MAX_TENSOR_ELEMENTS = 1 << 22
# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal, return_lse, softmax_scale)
SHAPES = [
    (1, 1, 512, 8, 1, 128, False, True, None),     # decode, MQA
    (2, 17, 33, 4, 2, 64, True, True, None),       # odd sizes, GQA
    (1, 128, 128, 8, 8, 64, True, False, 0.1),
    (1, 256, 1024, 4, 4, 128, False, False, None),
    (3, 64, 48, 6, 3, 32, True, True, 0.25),       # seqlen_q > seqlen_k, causal: fully masked rows
    (1, 1024, 1024, 2, 1, 64, True, False, None),
]
DTYPES = ["float16", "bfloat16", "float32"]


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


def read_status(pid: int):
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "Threads"):
            fields[key] = int(value.split()[0])
    return fields


class Server:
    def __init__(self, binary: Path, log_dir: Path, extra, env=None):
        self.grpc_port, self.http_port, self.metrics_port = free_ports(3)
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / "soak-server.log"
        args = [str(binary), "--backend=cpu", "--host=127.0.0.1", f"--grpc_port={self.grpc_port}",
                f"--http_port={self.http_port}", f"--metrics_port={self.metrics_port}",
                f"--max_tensor_elements={MAX_TENSOR_ELEMENTS}", *extra]
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**os.environ, **(env or {})})
        self.address = f"127.0.0.1:{self.grpc_port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"server exited with {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/v2/health/ready", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise SystemExit("server not ready within 30 s")

    def stop(self, timeout: float = 60) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return -9


class Problem:
    def __init__(self, rng, shape, dtype):
        batch, sq, sk, hq, hkv, d, causal, lse, scale = shape
        dt = tensors.numpy_dtype(dtype)
        self.q = rng.standard_normal((batch, sq, hq, d)).astype(dt)
        self.k = rng.standard_normal((batch, sk, hkv, d)).astype(dt)
        self.v = rng.standard_normal((batch, sk, hkv, d)).astype(dt)
        self.causal, self.lse, self.scale, self.dtype = causal, lse, scale, dtype
        self.ref, self.ref_lse = reference.attention(self.q, self.k, self.v, causal=causal, softmax_scale=scale,
                                                     return_lse=True)
        self.tol = reference.output_tolerance(self.ref, dtype, float(np.abs(self.v.astype(np.float64)).max()),
                                              reference.max_abs_logit(self.q, self.k, scale))
        self.request = pb.AttentionRequest(q=tensors.to_proto(self.q, "q"), k=tensors.to_proto(self.k, "k"),
                                           v=tensors.to_proto(self.v, "v"), causal=causal, return_lse=lse)
        if scale is not None:
            self.request.softmax_scale = scale

    def check(self, response) -> str:
        out = tensors.from_proto(response.out).astype(np.float64)
        if out.shape != self.ref.shape:
            return f"shape {out.shape} != {self.ref.shape}"
        err = float(np.abs(out - self.ref).max())
        if not err <= self.tol:
            return f"{self.dtype} max err {err:.3e} > {self.tol:.3e}"
        if self.lse:
            lse_err, ok = reference.compare_lse(tensors.from_proto(response.lse), self.ref_lse)
            if not ok:
                return f"lse err {lse_err:.3e}"
        return ""


def bad_requests():
    def t(shape, dtype=pb.FLOAT32, n=None):
        count = int(np.prod(shape)) if n is None else n
        return pb.Tensor(dtype=dtype, shape=list(shape), data=b"\0" * (4 * max(count, 0)))

    return [
        ("INVALID_ARGUMENT", pb.AttentionRequest(q=t([1, 4, 8]), k=t([1, 4, 1, 8]), v=t([1, 4, 1, 8]))),
        ("INVALID_ARGUMENT", pb.AttentionRequest(q=t([1, 4, 3, 8]), k=t([1, 4, 2, 8]), v=t([1, 4, 2, 8]))),
        ("INVALID_ARGUMENT", pb.AttentionRequest(q=t([1, 4, 1, 8], n=3), k=t([1, 4, 1, 8]), v=t([1, 4, 1, 8]))),
        ("RESOURCE_EXHAUSTED", pb.AttentionRequest(q=t([1, MAX_TENSOR_ELEMENTS, 1, 8], n=0), k=t([1, 4, 1, 8]),
                                                   v=t([1, 4, 1, 8]))),
        ("INVALID_ARGUMENT", pb.AttentionRequest(q=t([1, 4, 1, 8]), k=t([1, 4, 1, 8]), v=t([1, 4, 1, 8]),
                                                 softmax_scale=-1.0)),
    ]


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.counts = {}
        self.errors = []

    def add(self, key: str, error: str = ""):
        with self.lock:
            self.counts[key] = self.counts.get(key, 0) + 1
            if error and len(self.errors) < 50:
                self.errors.append(f"{key}: {error}")

    def snapshot(self):
        with self.lock:
            return dict(self.counts)


def client_loop(server: Server, problems, bad, stats: Stats, stop: threading.Event, seed: int):
    rng = random.Random(seed)
    options = [("grpc.max_receive_message_length", 2**31 - 1), ("grpc.max_send_message_length", 2**31 - 1)]
    with grpc.insecure_channel(server.address, options=options) as channel:
        stub = flashserve.attention_pb2_grpc.AttentionServiceStub(channel)
        raw = channel.unary_unary("/flashserve.v1.AttentionService/Attention", request_serializer=None,
                                  response_deserializer=None)
        health = flashserve.Client(server.address)
        while not stop.is_set():
            roll = rng.random()
            try:
                if roll < 0.70:  # a good request
                    problem = rng.choice(problems)
                    response = stub.Attention(problem.request, timeout=60)
                    wrong = problem.check(response)
                    stats.add("ok" if not wrong else "wrong", wrong)
                elif roll < 0.80:  # a bad request
                    expected, request = rng.choice(bad)
                    try:
                        stub.Attention(request, timeout=30)
                        stats.add("bad_accepted", "a bad request succeeded")
                    except grpc.RpcError as e:
                        stats.add("bad_refused" if e.code().name == expected else "bad_wrong_code",
                                  "" if e.code().name == expected else f"{e.code().name} {e.details()}")
                elif roll < 0.83:  # garbage bytes
                    try:
                        raw(bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 64))) + b"\xff", timeout=30)
                        stats.add("garbage_ok")  # random bytes can parse as a (then invalid) request
                    except grpc.RpcError:
                        stats.add("garbage_refused")
                elif roll < 0.90:  # cancelled after a random delay
                    problem = rng.choice(problems)
                    future = stub.Attention.future(problem.request, timeout=60)
                    time.sleep(rng.uniform(0, 0.02))
                    future.cancel()
                    try:
                        wrong = problem.check(future.result())
                        stats.add("cancel_too_late" if not wrong else "wrong", wrong)
                    except grpc.FutureCancelledError:
                        stats.add("cancelled")
                elif roll < 0.95:  # a deadline too short to meet
                    problem = rng.choice(problems)
                    try:
                        wrong = problem.check(stub.Attention(problem.request, timeout=rng.uniform(0.0005, 0.005)))
                        stats.add("deadline_met" if not wrong else "wrong", wrong)
                    except grpc.RpcError as e:
                        code = e.code().name
                        stats.add("deadline_exceeded" if code == "DEADLINE_EXCEEDED" else "deadline_other",
                                  "" if code == "DEADLINE_EXCEEDED" else f"{code} {e.details()}")
                elif roll < 0.98:
                    health.server_info(timeout=10)
                    stats.add("info" if health.health(timeout=10) else "not_serving", "")
                else:
                    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10) as r:
                        r.read()
                    stats.add("metrics")
            except grpc.RpcError as e:
                stats.add("unexpected", f"{e.code().name} {e.details()}")
            except flashserve.FlashserveError as e:
                stats.add("unexpected", str(e))
            except OSError as e:
                stats.add("unexpected", repr(e))
        health.close()


def rss_between(rows, t0, t1):
    return [r["rss_kib"] for r in rows if t0 <= r["t_s"] <= t1]


def theil_sen_per_minute(points) -> float:
    """The median of the pairwise slopes of (t_s, value) points, per minute: a trend that a few jumps do not bend."""
    slopes = [(b[1] - a[1]) / (b[0] - a[0]) for i, a in enumerate(points) for b in points[i + 1:] if b[0] > a[0]]
    return statistics.median(slopes) * 60 if slopes else 0.0


def judge_growth(rows, warm: float):
    """(growth, first quarter's median, first half's 90th percentile, last quarter's median, quarter) after warm-up;
    growth is measured from the first half's 90th percentile (module docstring)."""
    duration = rows[-1]["t_s"] if rows else 0.0
    window = max(10.0, (duration - warm) / 4)
    first, last = rss_between(rows, warm, warm + window), rss_between(rows, duration - window, duration)
    first_half = rss_between(rows, warm, warm + 2 * window)
    if not first or not last:
        nan = float("nan")
        return nan, nan, nan, nan, window
    base = statistics.median(first)
    band = statistics.quantiles(first_half, n=10, method="inclusive")[-1] if len(first_half) > 1 else first[0]
    end = statistics.median(last)
    return (end - band) / base, base, band, end, window


def run(args) -> int:
    binary = Path(args.binary or os.environ.get("FLASHSERVE_BIN", REPO / "build" / "server" / "flashserve"))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path = out_dir / "soak_rss.csv"
    rng = np.random.default_rng(args.seed)
    print(f"soak: {binary}, {args.minutes} min ({args.warmup} min warm-up), {args.clients} clients; "
          f"CSV {csv_path}" + (f"; server env {args.server_env}" if args.server_env else ""), flush=True)
    problems = [Problem(rng, shape, DTYPES[i % len(DTYPES)]) for i, shape in enumerate(SHAPES * 2)]
    server_env = dict(item.split("=", 1) for item in args.server_env)
    server = Server(binary, out_dir, ["--worker_threads=2", "--queue_capacity=64", *args.server_arg], server_env)
    stats, stop = Stats(), threading.Event()
    threads = [threading.Thread(target=client_loop, args=(server, problems, bad_requests(), stats, stop, args.seed + i),
                                daemon=True) for i in range(args.clients)]
    start = time.monotonic()
    for t in threads:
        t.start()
    rows = []
    fieldnames = ["t_s", "rss_kib", "hwm_kib", "threads", "ok", "failed_expected", "unexpected", "wrong"]
    try:
        with open(csv_path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fieldnames)
            writer.writeheader()
            next_print = 0.0
            while (elapsed := time.monotonic() - start) < args.minutes * 60:
                if server.proc.poll() is not None:
                    print(f"server died with {server.proc.returncode}", flush=True)
                    break
                status = read_status(server.proc.pid)
                c = stats.snapshot()
                row = {"t_s": round(elapsed, 1), "rss_kib": status["VmRSS"], "hwm_kib": status["VmHWM"],
                       "threads": status["Threads"], "ok": c.get("ok", 0),
                       "failed_expected": sum(v for k, v in c.items() if k not in ("ok", "unexpected", "wrong")),
                       "unexpected": c.get("unexpected", 0), "wrong": c.get("wrong", 0)}
                rows.append(row)
                writer.writerow(row)
                f.flush()
                if elapsed >= next_print:
                    print(f"  t={elapsed:6.0f} s  rss {status['VmRSS'] / 1024:7.1f} MiB  hwm "
                          f"{status['VmHWM'] / 1024:7.1f} MiB  threads {status['Threads']}  {c}", flush=True)
                    next_print += 60
                time.sleep(args.sample_seconds)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
    alive = server.proc.poll() is None
    exit_code = server.stop() if alive else server.proc.returncode

    duration = rows[-1]["t_s"] if rows else 0.0
    warm = args.warmup * 60
    growth, base, band, end, window = judge_growth(rows, warm)
    second_half = [(r["t_s"], r["rss_kib"] / 1024) for r in rows if r["t_s"] >= (warm + duration) / 2]
    slope = theil_sen_per_minute(second_half)
    counts = stats.snapshot()
    print(f"soak done: {duration:.0f} s, {sum(counts.values())} calls {counts}")
    print(f"RSS after warm-up: median {base / 1024:.1f} MiB ({warm:.0f}-{warm + window:.0f} s), 90th percentile "
          f"{band / 1024:.1f} MiB ({warm:.0f}-{warm + 2 * window:.0f} s); at the end (median of the last {window:.0f} s): {end / 1024:.1f} MiB; growth "
          f"{growth * 100:+.2f}% from the 90th percentile (limit {args.max_growth * 100:.0f}%), "
          f"{(end - base) / base * 100:+.2f}% from the median; second-half trend (Theil-Sen) {slope:+.3f} MiB/min; "
          f"peak (VmHWM) {rows[-1]['hwm_kib'] / 1024 if rows else 0:.1f} MiB")
    print(f"server: {'alive' if alive else 'DIED'} at the end, exit code {exit_code} after SIGTERM; log "
          f"{server.log_path}")
    failures = []
    if not alive:
        failures.append("the server died")
    if exit_code != 0:
        failures.append(f"exit code {exit_code} after SIGTERM")
    if counts.get("wrong") or counts.get("unexpected") or counts.get("bad_accepted") or counts.get("bad_wrong_code") \
            or counts.get("deadline_other") or counts.get("not_serving"):
        failures.append(f"wrong answers or unexpected errors: {stats.errors[:10]}")
    if not counts.get("ok"):
        failures.append("no request succeeded")
    if not growth < args.max_growth:
        failures.append(f"RSS grew {growth * 100:.2f}% after warm-up (limit {args.max_growth * 100:.0f}%)")
    for failure in failures:
        print(f"FAIL: {failure}")
    print("soak: PASS" if not failures else "soak: FAIL", flush=True)
    return 0 if not failures else 1


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--warmup", type=float, default=1.0, help="minutes before the RSS baseline")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--sample-seconds", type=float, default=2.0)
    p.add_argument("--max-growth", type=float, default=0.05)
    p.add_argument("--binary", help="server binary (default $FLASHSERVE_BIN, else build/server/flashserve)")
    p.add_argument("--out", default=str(REPO / "build-soak"), help="CSV and server log directory")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--server-arg", action="append", default=[], help="extra server flag (repeatable)")
    p.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment variable for the server (repeatable), e.g. "
                        "GLIBC_TUNABLES=glibc.malloc.mmap_threshold=131072 (see RESULTS.md)")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(run(parse_args()))
