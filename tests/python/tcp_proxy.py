"""A loopback TCP proxy that slows one or both directions of a connection (tests of the shutdown drain)."""

from __future__ import annotations

import socket
import threading
import time


class ThrottlingProxy:
    """Loopback TCP proxy to 127.0.0.1:port. Server -> client bytes pass at `rate` bytes/s, read through a small
    receive buffer, so the server's writes back up behind it. Client -> server bytes pass at full speed, at
    `upload_rate` bytes/s if given, or, with upload_limit, only the first upload_limit bytes of each connection
    (then the upload stalls). to_client / to_server count the bytes passed."""

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
        started, passed = time.monotonic(), 0
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
                    ahead = passed / rate - (time.monotonic() - started)
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
