"""SIGTERM while a large answer is still being written to a slow reader: every API (native Attention, KServe
ModelInfer, striped download, KServe REST) must finish writing it within the grace period, not cut it off when
gRPC's own shutdown deadline (1 s) passes. The reader is slowed by a TCP proxy that passes the server's bytes on at a
few MB/s. The other side of that wait: a client that stalls mid-upload holds the exit until the grace period ends,
and no longer."""

from __future__ import annotations

import signal
import socket
import threading
import time

import numpy as np
import pytest

import flashserve
from test_kserve_grpc import infer_request, oip, outputs_of, stub_for  # noqa: F401 - oip is a fixture
from test_kserve_rest import binary_request, decode

pytestmark = pytest.mark.e2e

RATE_BYTES_PER_S = 4 << 20
# 16 MiB of output (q's size) for very little compute: seqlen_k is tiny.
Q_SHAPE, KV_SHAPE = (1, 8192, 4, 128), (1, 8, 4, 128)


class ThrottlingProxy:
    """Loopback TCP proxy to 127.0.0.1:port. Server -> client bytes pass at RATE_BYTES_PER_S, read through a small
    receive buffer, so the server's writes back up behind it. Client -> server bytes pass at full speed, or, with
    upload_limit, only the first upload_limit bytes of each connection (then the upload stalls)."""

    def __init__(self, port: int, upload_limit: int | None = None):
        self.port_to = port
        self.upload_limit = upload_limit
        self.to_client = 0  # bytes passed server -> client, all connections
        self.to_server = 0  # bytes passed client -> server, all connections
        self._lock = threading.Lock()
        self._sockets = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.socket()
            upstream.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)  # before connect: sets the window
            upstream.connect(("127.0.0.1", self.port_to))
            with self._lock:
                self._sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, src, dst, throttled):
        started, passed = time.monotonic(), 0
        try:
            while True:
                data = src.recv(16 << 10)
                if not data:
                    break
                if not throttled and self.upload_limit is not None:
                    data = data[:max(0, self.upload_limit - passed)]
                    passed += len(data)
                    with self._lock:
                        self.to_server += len(data)
                    if not data:  # the upload stalls here; keep the connection open
                        time.sleep(0.05)
                        continue
                dst.sendall(data)
                if throttled:
                    passed += len(data)
                    with self._lock:
                        self.to_client += len(data)
                    ahead = passed / RATE_BYTES_PER_S - (time.monotonic() - started)
                    if ahead > 0:
                        time.sleep(ahead)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self):
        self._listener.close()
        with self._lock:
            for s in self._sockets:
                s.close()


def _inputs():
    rng = np.random.default_rng()
    return (rng.standard_normal(Q_SHAPE).astype(np.float32), rng.standard_normal(KV_SHAPE).astype(np.float32),
            rng.standard_normal(KV_SHAPE).astype(np.float32))


def _call_native(address, q, k, v):
    with flashserve.Client(address, timeout=120) as c:
        return c.attention(q, k, v)


def _call_kserve(oip_stubs, address, q, k, v):
    channel, stub = stub_for(oip_stubs, address)
    try:
        return outputs_of(stub.ModelInfer(infer_request(oip_stubs[0], q, k, v), timeout=120))["O"]
    finally:
        channel.close()


def _call_rest(address, q, k, v):
    import requests

    body, headers = binary_request(q, k, v, parameters={"binary_data_output": True})
    response = requests.post(f"http://{address}/v2/models/attention/infer", data=body, headers=headers, timeout=120)
    return decode(response)[1]["O"]


def _call_striped(address, q, k, v):
    with flashserve.StripedClient(address, stripes=2, timeout=120) as c:
        return c.attention(q, k, v)


@pytest.mark.parametrize("api", ["native", "kserve", "striped", "rest"])
def test_sigterm_while_a_large_answer_is_written_to_a_slow_reader(api, start_server, request):
    server = start_server("--shutdown_grace_seconds=60", name=f"drain_{api}")
    proxy = ThrottlingProxy(server.http_port if api == "rest" else server.grpc_port)
    q, k, v = _inputs()
    call = {"native": _call_native, "striped": _call_striped, "rest": _call_rest,
            "kserve": lambda *a: _call_kserve(request.getfixturevalue("oip"), *a)}[api]
    result = {}

    def run():
        try:
            result["out"] = call(proxy.address, q, k, v)
            result["at"] = time.monotonic()
        except BaseException as e:  # noqa: BLE001 - reported below
            result["error"] = e

    thread = threading.Thread(target=run)
    try:
        thread.start()
        # SIGTERM once the answer is flowing: its computation is over, gRPC is writing it.
        deadline = time.monotonic() + 60
        while proxy.to_client < (1 << 20) and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert thread.is_alive(), f"answered before SIGTERM: {result.get('error')}; slow the proxy down"
        assert proxy.to_client >= (1 << 20), "the answer never started flowing"
        sigterm_at = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        thread.join(timeout=120)
        assert not thread.is_alive(), "the call hung after SIGTERM"
        code = server.proc.wait(timeout=60)
    finally:
        proxy.close()
    assert "error" not in result, f"{api}: the answer was cut off: {result.get('error')}\n{server.logs()}"
    assert code == 0, f"exit code {code}\n{server.logs()}"
    # The write went on well past the 1 s gRPC gives its calls at shutdown: the drain waited for it.
    assert result["at"] - sigterm_at > 1.5, f"answer complete {result['at'] - sigterm_at:.2f} s after SIGTERM"
    ref = flashserve.reference.attention(q[:, :64], k, v)
    np.testing.assert_allclose(result["out"][:, :64], ref, atol=1e-5, rtol=0)
    assert np.isfinite(result["out"]).all()


def test_sigterm_with_a_stalled_upload_waits_out_the_grace_period(start_server):
    """A native call admitted from its first byte whose client then stops sending: SIGTERM waits for it up to
    --shutdown_grace_seconds, then cancels it and exits 0 -- neither sooner (that request would be dropped while it
    might still arrive) nor later."""
    grace_s = 3
    server = start_server(f"--shutdown_grace_seconds={grace_s}", name="drain_stalled")
    proxy = ThrottlingProxy(server.grpc_port, upload_limit=2 << 20)
    q, k, v = _inputs()  # 16 MiB of q: the proxy passes 2 MiB of it
    result = {}

    def run():
        try:
            result["out"] = _call_native(proxy.address, q, k, v)
        except BaseException as e:  # noqa: BLE001 - checked below
            result["error"] = e

    thread = threading.Thread(target=run)
    try:
        thread.start()
        deadline = time.monotonic() + 30
        while proxy.to_server < (2 << 20) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proxy.to_server == 2 << 20, "the upload never reached the stall point"
        time.sleep(0.3)  # the server reads what the proxy passed on
        sigterm_at = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        code = server.proc.wait(timeout=60)
        exited_after = time.monotonic() - sigterm_at
    finally:
        proxy.close()
    thread.join(timeout=60)
    assert code == 0, f"exit code {code}\n{server.logs()}"
    assert grace_s - 0.5 <= exited_after <= grace_s + 3, f"exited {exited_after:.2f} s after SIGTERM\n{server.logs()}"
    assert "grace period over" in server.logs(), server.logs()
    assert "error" in result, "a request that never arrived whole was answered?"
