"""Loopback proxies for tests: ThrottlingProxy slows one or both directions of a connection (the shutdown drain);
AnswerCutter loses one answer on its way back (retries of calls that ran); LateGreetingProxy holds back a
connection's first server bytes (a slow handshake)."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import threading
import time


def _serve(listener, connect, pump) -> None:
    """Accepts connections until the listener closes; each gets an upstream connect() and two threads:
    pump(client, upstream, False) and pump(upstream, client, True) (the second carries the server's bytes)."""
    def accept():
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            upstream = connect()
            threading.Thread(target=pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=pump, args=(upstream, client, True), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()


def _close_both(src, dst) -> None:
    """Shuts down and closes both sockets of a pump (its peer pump then ends too)."""
    for s in (src, dst):
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        s.close()


class ThrottlingProxy:
    """Loopback TCP proxy to 127.0.0.1:port. Server -> client bytes pass at `rate` bytes/s, read through a small
    receive buffer, so the server's writes back up behind it. Client -> server bytes pass at full speed, at
    `upload_rate` bytes/s if given, or, with upload_limit, only the first upload_limit bytes of each connection
    (then the upload stalls). A direction idle for a while passes no burst afterwards (10 ms of credit at most).
    to_client / to_server count the bytes passed."""

    _BURST_S = 0.01  # the most credit a direction saves up while idle, in seconds at its rate

    def __init__(self, port: int, upload_limit: int | None = None, rate: int = 4 << 20,
                 upload_rate: int | None = None):
        self.port_to = port
        self.upload_limit = upload_limit
        self.rate = rate
        self.upload_rate = upload_rate
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
        due, passed = time.monotonic(), 0  # when the bytes passed so far are paid for at the rate
        try:
            while True:
                data = src.recv(16 << 10)
                if not data:
                    break
                if not throttled and self.upload_limit is not None:
                    data = data[:max(0, self.upload_limit - passed)]
                    if not data:  # the upload stalls here; keep the connection open
                        time.sleep(0.05)
                        continue
                dst.sendall(data)
                passed += len(data)
                with self._lock:
                    if throttled:
                        self.to_client += len(data)
                    else:
                        self.to_server += len(data)
                rate = self.rate if throttled else self.upload_rate
                if rate is not None:
                    # Time left idle earns at most _BURST_S of credit: a reader slow from its first byte stays slow
                    # after the server computed for seconds (an average since the connection began let that much
                    # through at once).
                    now = time.monotonic()
                    due = max(due, now - self._BURST_S) + len(data) / rate
                    if due > now:
                        time.sleep(due - now)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def wait_to_server(self, n: int, timeout: float) -> bool:
        """Waits until at least n bytes have passed client -> server; False on timeout."""
        deadline = time.monotonic() + timeout
        while self.to_server < n:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self):
        self._listener.close()
        with self._lock:
            for s in self._sockets:
                s.close()


class AnswerCutter:
    """A proxy that loses one answer, as a proxy restart or a network cut between a client and its one endpoint would:
    after cut_next_answer(keep, wait_for), the next connection to carry server -> client bytes passes the first `keep`
    of them (inside a frame header or payload: half an answer) and, once max(keep, wait_for) of them have arrived,
    is closed both ways (the server ran the call; the client never gets its answer). `cut` counts the cuts.
    TCP to 127.0.0.1:`port` (address: "127.0.0.1:N"), or a Unix socket to `unix_target` (address: a socket path)."""

    def __init__(self, port: int | None = None, unix_target: str | None = None):
        self.port, self.unix_target = port, unix_target
        self.armed = None  # (keep, wait_for, arming number)
        self.armings = 0
        self.cut = 0
        self.lock = threading.Lock()
        if unix_target is None:
            self.listener = socket.create_server(("127.0.0.1", 0))
            self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        else:
            self.address = os.path.join(tempfile.mkdtemp(prefix="fsc", dir="/tmp"), "cut.sock")  # <= 107 bytes
            self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.listener.bind(self.address)
            self.listener.listen(16)
        _serve(self.listener, self._connect, self._pump)

    def cut_next_answer(self, keep: int = 0, wait_for: int = 0) -> None:
        with self.lock:
            self.armings += 1
            self.armed = (keep, wait_for, self.armings)

    def _connect(self):
        if self.unix_target is None:
            return socket.create_connection(("127.0.0.1", self.port))
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        upstream.connect(self.unix_target)
        return upstream

    def _pump(self, src, dst, to_client):
        seen, arming = 0, 0  # answer bytes of this connection since the cut numbered `arming` was armed
        try:
            while data := src.recv(1 << 16):
                if to_client:
                    with self.lock:
                        armed, cut = self.armed, False
                        if armed is not None:
                            keep, wait_for, number = armed
                            if number != arming:
                                seen, arming = 0, number
                            passed, seen = data[:max(0, keep - seen)], seen + len(data)
                            cut = seen >= max(keep, wait_for)
                            if cut:
                                self.armed, self.cut = None, self.cut + 1
                            data = passed
                    if data:
                        dst.sendall(data)
                    if cut:
                        break
                    continue
                dst.sendall(data)
        except OSError:
            pass
        _close_both(src, dst)

    def close(self):
        self.listener.close()
        if self.unix_target is not None:
            shutil.rmtree(os.path.dirname(self.address), ignore_errors=True)


class LateGreetingProxy:
    """Loopback TCP proxy to 127.0.0.1:port that holds back each connection's first server -> client bytes (gRPC's
    HTTP/2 SETTINGS frame) for `delay` seconds, as a TLS handshake over a long path or a loaded server would; then
    both directions pass unchanged."""

    def __init__(self, port: int, delay: float):
        self.port, self.delay = port, delay
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        _serve(self.listener, lambda: socket.create_connection(("127.0.0.1", self.port)), self._pump)

    def _pump(self, src, dst, to_client):
        first_delay = self.delay if to_client else 0.0
        try:
            while data := src.recv(1 << 16):
                time.sleep(first_delay)
                first_delay = 0.0
                dst.sendall(data)
        except OSError:
            pass
        _close_both(src, dst)

    def close(self):
        self.listener.close()
