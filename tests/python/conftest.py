"""Fixtures for the Python suite.

* ``fake`` / ``fake_address``: an in-process Python gRPC server implementing AttentionService with the fp64
  reference (rounded to the request's dtype) plus grpc.health.v1; tests tell it which error/delay/corruption to use.
* ``server``, ``limits_server``, ``start_server``: the real flashserve binary (CPU backend) on free loopback ports.
  The binary is $FLASHSERVE_BIN or <repo>/build/server/flashserve. If it is missing, e2e tests FAIL, unless
  FLASHSERVE_SKIP_E2E=1, which skips them.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
import zlib
from concurrent import futures
from pathlib import Path
from typing import List, Optional

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

import flashserve
from flashserve import reference, tensors
from flashserve import attention_pb2 as pb
from flashserve import attention_pb2_grpc as pb_grpc

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_BIN = REPO_ROOT / "build" / "server" / "flashserve"
READY_TIMEOUT_S = 30.0
BIG = 2**31 - 1


# --- in-process fake server ----------------------------------------------------------------------------------------


class FakeAttentionServicer(pb_grpc.AttentionServiceServicer):
    """Answers with the reference rounded to the dtype, or with the configured failure. Thread-safe enough for tests:
    the knobs are set before the call."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.abort_with = None  # (grpc.StatusCode, message)
        self.delay_s = 0.0
        self.out_offset = 0.0  # added to every output element: a wrong server
        self.drop_lse = False
        self.mask_offset = 0  # != 0: a causal mask that is off by this many keys (a plausible kernel bug)
        self.before = None  # callable(request, context), may abort
        self.after = None  # callable(response) -> response
        self.requests: List[pb.AttentionRequest] = []
        self.info = pb.ServerInfo(
            version="0.0.0-fake",
            backend="cpu",
            dtypes=[pb.FLOAT16, pb.BFLOAT16, pb.FLOAT32],
            head_dims=[],
            max_head_dim=256,
            limits=pb.Limits(max_request_bytes=1 << 30, max_tensor_elements=1 << 28, queue_capacity=64),
            worker_threads=2,
            build="fake",
        )

    def Attention(self, request, context):
        self.requests.append(request)
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.abort_with is not None:
            context.abort(*self.abort_with)
        if self.before is not None:
            self.before(request, context)
        q, k, v = (tensors.from_proto(t) for t in (request.q, request.k, request.v))
        scale = request.softmax_scale if request.HasField("softmax_scale") else None
        out, lse = reference.attention(q, k, v, causal=request.causal, softmax_scale=scale, return_lse=True)
        if request.causal and self.mask_offset:
            seqlen_q, seqlen_k = q.shape[1], k.shape[1]
            for i in range(seqlen_q):
                visible = min(max(i + seqlen_k - seqlen_q + self.mask_offset + 1, 0), seqlen_k)
                out[:, i] = 0.0
                lse[:, :, i] = -np.inf
                if visible:
                    out[:, i:i + 1], lse[:, :, i:i + 1] = reference.attention(
                        q[:, i:i + 1], k[:, :visible], v[:, :visible], softmax_scale=scale, return_lse=True)
        dtype = tensors.NAME_OF_PROTO_DTYPE[request.q.dtype]
        out = (out + self.out_offset).astype(tensors.numpy_dtype(dtype))
        response = pb.AttentionResponse(
            out=pb.Tensor(dtype=request.q.dtype, shape=list(out.shape), data=out.tobytes()),
            timing=pb.Timing(queue_us=1, compute_us=2, total_us=3),
            kernel="fake_reference",
            request_id=request.request_id,
        )
        if request.return_lse and not self.drop_lse:
            lse32 = lse.astype("<f4")
            response.lse.CopyFrom(pb.Tensor(dtype=pb.FLOAT32, shape=list(lse32.shape), data=lse32.tobytes()))
        return self.after(response) if self.after is not None else response

    def GetServerInfo(self, request, context):
        if self.abort_with is not None:
            context.abort(*self.abort_with)
        return self.info


class FakeServer:
    def __init__(self):
        self.servicer = FakeAttentionServicer()
        self.health = health.HealthServicer()
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=16),
            options=[("grpc.max_send_message_length", BIG), ("grpc.max_receive_message_length", BIG)],
        )
        pb_grpc.add_AttentionServiceServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{self.port}"
        self.server.start()

    def reset(self):
        self.servicer.reset()
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self.health.set("flashserve.v1.AttentionService", health_pb2.HealthCheckResponse.SERVING)


@pytest.fixture(scope="session")
def _fake_server():
    server = FakeServer()
    yield server
    server.server.stop(grace=None)


@pytest.fixture
def fake(_fake_server) -> FakeServer:
    _fake_server.reset()
    return _fake_server


# --- comparing answers ---------------------------------------------------------------------------------------------


def random_qkv(rng, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype):
    dt = tensors.numpy_dtype(dtype)
    q = rng.standard_normal((batch, seqlen_q, heads_q, head_dim)).astype(dt)
    k = rng.standard_normal((batch, seqlen_k, heads_kv, head_dim)).astype(dt)
    v = rng.standard_normal((batch, seqlen_k, heads_kv, head_dim)).astype(dt)
    return q, k, v


def zip_all(*lists):
    """zip() that first checks every list has the same length: answers a client or server dropped must fail the
    test, not shorten its check loop (zip stops at the shortest list)."""
    lists = [list(x) for x in lists]
    lengths = [len(x) for x in lists]
    assert len(set(lengths)) <= 1, f"lists of different lengths {lengths}: answers missing or extra"
    return zip(*lists)


def assert_matches_reference(out, lse, q, k, v, causal=False, softmax_scale=None):
    """Asserts out (and lse, if not None) match the fp64 reference within the dtype-derived tolerance."""
    dtype = tensors.dtype_name(q)
    ref, ref_lse = reference.attention(q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=True)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert tensors.dtype_name(out) == dtype
    out64 = np.asarray(out).astype(np.float64)
    assert not np.isnan(out64).any(), "NaN in output"
    tol = reference.output_tolerance(
        ref, dtype, float(np.abs(np.asarray(v).astype(np.float64)).max()),
        reference.max_abs_logit(q, k, softmax_scale),
    )
    err = float(np.abs(out64 - ref).max())
    assert err <= tol, f"{dtype} max abs err {err:.3e} > tol {tol:.3e}"
    if lse is not None:
        assert lse.shape == ref_lse.shape and tensors.dtype_name(lse) == "float32"
        lse_err, ok = reference.compare_lse(lse, ref_lse)
        assert ok, f"lse max abs err {lse_err:.3e}"


# --- the real server -----------------------------------------------------------------------------------------------


_PORTS_GIVEN: set = set()


def free_port() -> int:
    """A port free now and not handed out before in this process: the kernel may give a just-closed ephemeral
    port again, and a server started with --grpc_port equal to --http_port refuses to start (a CI flake)."""
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _PORTS_GIVEN:
            _PORTS_GIVEN.add(port)
            return port
    raise RuntimeError("no fresh free port in 100 tries")


def attention_in_background(address: str, q, k, v, timeout: float = 120):
    """Starts one Attention call on a thread of its own: (the started thread, a dict that gets "out" or "error")."""
    result = {}

    def call():
        try:
            with flashserve.Client(address, timeout=timeout) as c:
                result["out"] = c.attention(q, k, v)
        except BaseException as e:  # noqa: BLE001 - the caller checks it
            result["error"] = e

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    return thread, result


def http_get(url: str, timeout: float = 2.0):
    """(status, body) of a GET; status 0 when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (urllib.error.URLError, OSError):
        return 0, b""


_SERVERS: list = []  # every ServerProcess started in this process, for the logs of a failing test


class ServerProcess:
    """One flashserve process on free loopback ports; stdout/stderr go to files under log_dir."""

    def __init__(self, binary: Path, log_dir: Path, extra_args=(), name: str = "server"):
        self.binary = Path(binary)
        self.metrics_port = None
        self.log_dir = Path(log_dir)
        self.extra_args = list(extra_args)
        self.name = name
        self.proc: Optional[subprocess.Popen] = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def logs(self, limit: int = 6000) -> str:
        text = ""
        for stream in ("stderr", "stdout"):
            path = self.log_dir / f"{self.name}.{stream}"
            if path.exists():
                data = path.read_text(errors="replace")
                text += f"--- {stream} ---\n{data[-limit:]}\n"
        return text

    def start(self, attempts: int = 3) -> "ServerProcess":
        if self not in _SERVERS:  # a restart (same object) is listed once
            _SERVERS.append(self)
        for attempt in range(attempts):
            self.grpc_port, self.http_port = free_port(), free_port()
            args = [
                str(self.binary), "--backend=cpu", "--host=127.0.0.1", f"--grpc_port={self.grpc_port}",
                f"--http_port={self.http_port}", "--worker_threads=2", "--queue_capacity=64",
            ]
            given = [a for a in self.extra_args if a.startswith("--metrics_port=")]
            if given:
                self.metrics_port = int(given[-1].split("=", 1)[1])
            elif "--metrics_port" in binary_flags(self.binary):  # else a second instance collides on 8002
                self.metrics_port = free_port()
                args.append(f"--metrics_port={self.metrics_port}")
            args += self.extra_args
            self.log_dir.mkdir(parents=True, exist_ok=True)
            with open(self.log_dir / f"{self.name}.stdout", "wb") as out, \
                    open(self.log_dir / f"{self.name}.stderr", "wb") as err:
                self.proc = subprocess.Popen(args, stdout=out, stderr=err, stdin=subprocess.DEVNULL)
            deadline = time.monotonic() + READY_TIMEOUT_S
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    break
                status, _ = http_get(f"{self.http}/v2/health/ready", timeout=1.0)
                if status == 200:
                    return self
                time.sleep(0.05)
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
                pytest.fail(f"{' '.join(args)} not ready within {READY_TIMEOUT_S} s\n{self.logs()}")
            # Died: retry only if another process took one of our ports in the meantime.
            logs = self.logs()
            if attempt + 1 < attempts and ("in use" in logs.lower() or "cannot listen" in logs):
                continue
            pytest.fail(f"{' '.join(args)} exited with code {self.proc.returncode} before ready\n{logs}")
        raise AssertionError("unreachable")

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, wait; returns the exit code (kills and fails after ``timeout``)."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"{self.name} did not exit within {timeout} s of SIGTERM\n{self.logs()}")


_FLAGS_CACHE = {}


def binary_flags(binary: Path) -> str:
    """The binary's --help text (cached), to pass optional flags only to servers that know them."""
    if binary not in _FLAGS_CACHE:
        result = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=30)
        _FLAGS_CACHE[binary] = result.stdout + result.stderr
    return _FLAGS_CACHE[binary]


@pytest.fixture(scope="session")
def flashserve_bin() -> Path:
    path = Path(os.environ.get("FLASHSERVE_BIN", str(DEFAULT_BIN)))
    if not path.is_file() or not os.access(path, os.X_OK):
        message = (
            f"flashserve server binary not found at {path}: build it (cmake -B build && cmake --build build), "
            "point FLASHSERVE_BIN at it, or set FLASHSERVE_SKIP_E2E=1 to skip the end-to-end tests"
        )
        if os.environ.get("FLASHSERVE_SKIP_E2E") == "1":
            pytest.skip(message)
        pytest.fail(message)
    return path


def _stop_and_check(server: ServerProcess) -> None:
    code = server.stop()
    assert code == 0, f"{server.name} exited with code {code} after SIGTERM\n{server.logs()}"


@pytest.fixture(scope="session")
def server(flashserve_bin, tmp_path_factory):
    """The shared CPU-backend server with default limits."""
    s = ServerProcess(flashserve_bin, tmp_path_factory.mktemp("server"), name="server").start()
    yield s
    _stop_and_check(s)


LIMITS_MAX_REQUEST_BYTES = 1048576
LIMITS_MAX_TENSOR_ELEMENTS = 65536


@pytest.fixture(scope="session")
def limits_server(flashserve_bin, tmp_path_factory):
    """A server with small limits: 1 MiB requests, 65536 elements per tensor."""
    s = ServerProcess(
        flashserve_bin, tmp_path_factory.mktemp("limits_server"),
        [f"--max_request_bytes={LIMITS_MAX_REQUEST_BYTES}", f"--max_tensor_elements={LIMITS_MAX_TENSOR_ELEMENTS}"],
        name="limits_server",
    ).start()
    yield s
    _stop_and_check(s)


@pytest.fixture
def start_server(flashserve_bin, tmp_path):
    """Factory for a private server instance; stopped (not checked) at teardown if the test left it running."""
    started: List[ServerProcess] = []

    def start(*extra_args, name="private"):
        s = ServerProcess(flashserve_bin, tmp_path, extra_args, name=f"{name}{len(started)}").start()
        started.append(s)
        return s

    yield start
    for s in started:
        if s.proc is not None and s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait()


@pytest.fixture
def client(server):
    with flashserve.Client(server.address, timeout=60) as c:
        yield c


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test's report carries the logs of the servers running then: a flake on a fresh server (a gRPC
    handshake that timed out, say) is otherwise lost with its temporary directory."""
    outcome = yield
    report = outcome.get_result()
    if not report.failed:
        return
    for server in _SERVERS:
        if server.proc is not None and (server.proc.poll() is None or report.when == "setup"):
            report.sections.append((f"flashserve {server.name} ({server.log_dir})", server.logs(limit=3000)))


def pytest_configure(config):
    # Also declared in pytest.ini; repeated so the marker exists when the suite runs with another ini file.
    config.addinivalue_line("markers", "e2e: end-to-end test against the real flashserve binary")


@pytest.fixture
def rng(request):
    """A Generator seeded from the test's id (and $FLASHSERVE_TEST_SEED): different inputs per test, reproducible."""
    seed = zlib.crc32(request.node.nodeid.encode()) ^ int(os.environ.get("FLASHSERVE_TEST_SEED", "0"))
    return np.random.default_rng(seed)


@pytest.fixture
def make_qkv():
    return random_qkv


@pytest.fixture
def check_answer():
    return assert_matches_reference


def run_workers(worker, n: int, timeout: float = 240.0) -> None:
    """Runs worker(0) .. worker(n-1) on n threads at once; fails on a hang or on any worker's exception (all listed)."""
    errors = []

    def guarded(i):
        try:
            worker(i)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(f"worker {i}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    assert not any(t.is_alive() for t in threads), "a worker thread hung"
    assert not errors, "\n".join(errors)


@pytest.fixture
def concurrently():
    return run_workers
