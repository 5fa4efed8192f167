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


class _FrameWalker:
    """Follows the HTTP/2 frames of a server's byte stream (9-byte headers: 24-bit length, type, flags, stream) across
    chunks of any size."""

    HEADERS = 0x1

    def __init__(self):
        self.header = b""  # the bytes of a frame header not yet complete
        self.payload_left = 0

    def walk(self, data: bytes) -> None:
        self.until_headers(data, stop=False)

    def until_headers(self, data: bytes, stop: bool = True):
        """(the bytes of `data` before the first HEADERS frame whose header completes in it, whether there was one);
        with stop=False it walks through every frame. A header split across two reads has its first part passed."""
        at = 0
        while at < len(data):
            if self.payload_left:
                step = min(self.payload_left, len(data) - at)
                self.payload_left -= step
                at += step
                continue
            start = at - len(self.header)  # where this frame's header began (negative: in an earlier chunk)
            take = min(9 - len(self.header), len(data) - at)
            self.header += data[at:at + take]
            at += take
            if len(self.header) < 9:
                break
            length, kind = int.from_bytes(self.header[:3], "big"), self.header[3]
            self.header, self.payload_left = b"", length
            if stop and kind == self.HEADERS:
                return data[:max(0, start)], True
        return data, False


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
    is closed both ways (the server ran the call; the client never gets its answer). cut_next_answer(at_headers=True)
    cuts at frames instead (gRPC over TCP): the next HTTP/2 HEADERS frame the server sends -- a unary answer's first
    frame, sent once the call has run -- and all after it are lost (but for the first bytes of its header when a read
    ended inside it), while the control frames before it (settings and
    ping acks, window updates, whatever their number) pass. `cut` counts the cuts.
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

    def cut_next_answer(self, keep: int = 0, wait_for: int = 0, at_headers: bool = False) -> None:
        with self.lock:
            self.armings += 1
            self.armed = ("headers", 0, self.armings) if at_headers else (keep, wait_for, self.armings)

    def _connect(self):
        if self.unix_target is None:
            return socket.create_connection(("127.0.0.1", self.port))
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        upstream.connect(self.unix_target)
        return upstream

    def _pump(self, src, dst, to_client):
        seen, arming = 0, 0  # answer bytes of this connection since the cut numbered `arming` was armed
        frames = _FrameWalker()  # the server's HTTP/2 frames, from the connection's first byte
        try:
            while data := src.recv(1 << 16):
                if to_client:
                    with self.lock:
                        armed, cut = self.armed, False
                        if armed is not None and armed[0] == "headers":
                            data, cut = frames.until_headers(data)
                        elif armed is not None:
                            keep, wait_for, number = armed
                            if number != arming:
                                seen, arming = 0, number
                            passed, seen = data[:max(0, keep - seen)], seen + len(data)
                            cut = seen >= max(keep, wait_for)
                            data = passed
                        else:
                            frames.walk(data)
                        if cut:
                            self.armed, self.cut = None, self.cut + 1
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
