"""The test proxies themselves (tcp_proxy.py): ThrottlingProxy's slow reader stays slow after the server was idle,
as the drain tests need (an answer written after seconds of compute must still take its time to pass)."""

from __future__ import annotations

import socket
import threading
import time

from tcp_proxy import ThrottlingProxy


def _server_sending_after(idle_s: float, payload: bytes) -> socket.socket:
    """A listener whose one connection gets `payload` after `idle_s` seconds, then is closed."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve():
        conn, _ = listener.accept()
        time.sleep(idle_s)
        conn.sendall(payload)
        conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return listener


def test_throttled_answer_after_idle_passes_at_the_rate():
    rate, size = 2 << 20, 1 << 20  # 1 MiB at 2 MiB/s: 0.5 s
    listener = _server_sending_after(1.0, b"x" * size)
    proxy = ThrottlingProxy(listener.getsockname()[1], rate=rate)
    try:
        with socket.create_connection(("127.0.0.1", int(proxy.address.split(":")[1]))) as client:
            first = client.recv(1)
            started = time.monotonic()
            received = len(first)
            while chunk := client.recv(1 << 16):
                received += len(chunk)
            took = time.monotonic() - started
    finally:
        proxy.close()
        listener.close()
    assert received == size
    # The second before the answer earns no credit: the MiB takes its 0.5 s (not a burst at full speed).
    assert took > 0.8 * size / rate, f"1 MiB passed in {took:.3f} s at a rate of 2 MiB/s"
