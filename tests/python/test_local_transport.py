"""The local transport (--local_socket, server/edge/local): Attention, DecodeStep, Attend, Echo and Hello in frames
over a Unix socket, against the real binary (CPU backend). Answers against the fp64 reference (system shared memory and
inline tensors, odd shapes) and against gRPC's; bearer auth and region ownership; hostile clients (bad headers, huge
claimed lengths with the server's RSS flat, trickled headers, the connection cap, garbage, clients that leave mid-call);
the socket file's life (stale socket replaced, anything else refused, mode, removed at shutdown); metrics."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import tempfile
import threading
import time

import grpc
import numpy as np
import pytest

import flashserve
from flashserve import attention_pb2 as pb
from flashserve import sequences_pb2 as spb
from flashserve import tensors
from flashserve.local import HEADER, MAGIC, LocalClient
from flashserve.shm import SystemRegion
from conftest import ServerProcess, _stop_and_check, assert_matches_reference, random_qkv, zip_all
from metrics_helpers import scrape
from sequences_truth import Truth
from test_bad_input_matrix import PeakRss
from test_sequences_shm import Region, _step_request

pytestmark = pytest.mark.e2e
KV_FLAGS = ["--kv_cache_bytes=33554432", "--kv_page_tokens=16"]
SHAPE = dict(heads_q=4, heads_kv=2, head_dim=64)
TOKEN = "local-transport-test-token-0123456789"


def socket_dir() -> str:
    return tempfile.mkdtemp(prefix="fsl", dir="/tmp")  # short: sun_path holds 107 bytes




@pytest.fixture(scope="module")
def local_server(flashserve_bin, tmp_path_factory):
    directory = socket_dir()
    s = ServerProcess(flashserve_bin, tmp_path_factory.mktemp("local"),
                      [f"--local_socket={directory}/fs.sock", "--allow_client_shm", "--local_read_timeout_ms=500",
                       # > 0 on every machine (the default is 0 on 2 cores): calls longer than this go through the
                       # waiter's short-sleep polling before its futex (edge/local/call_waiter.h)
                       "--local_spin_us=50", "--local_max_connections=16", *KV_FLAGS], name="local").start()
    s.local_path = f"{directory}/fs.sock"
    yield s
    _stop_and_check(s)
    assert not os.path.exists(s.local_path), "the socket file outlived the server"
    shutil.rmtree(directory, ignore_errors=True)


def raw_connect(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(path)
    return sock


def read_frame(sock: socket.socket):
    """(status, payload) of one response frame, or None when the server closed without one."""
    head = b""
    while len(head) < HEADER.size:
        chunk = sock.recv(HEADER.size - len(head))
        if not chunk:
            return None
        head += chunk
    magic, status, _, size, _ = HEADER.unpack(head)
    assert magic == MAGIC
    body = b""
    while len(body) < size:
        chunk = sock.recv(size - len(body))
        assert chunk, "closed mid-frame"
        body += chunk
    return status, body


def assert_closed(sock: socket.socket) -> None:
    sock.settimeout(5)
    try:
        assert sock.recv(1) == b""
    except ConnectionResetError:
        pass


def frame(method: int, payload: bytes = b"", flags: int = 0, magic: int = MAGIC, size=None) -> bytes:
    return HEADER.pack(magic, method, flags, len(payload) if size is None else size, 0) + payload


# ---------------------------------------------------------------------------------------------- answers


@pytest.mark.parametrize("dtype,shape,causal", [
    ("float16", (1, 19, 37, 4, 2, 64), True),
    ("bfloat16", (2, 7, 9, 3, 1, 32), False),
    ("float32", (1, 33, 5, 6, 3, 80), True),
])
def test_attention_through_system_shm_matches_reference(local_server, rng, dtype, shape, causal):
    q, k, v = random_qkv(rng, *shape, dtype)
    with flashserve.Client(local_server.address, timeout=30) as grpc_client, \
            SystemRegion(grpc_client, f"local-{dtype}", SystemRegion.bytes_for(q, k, v)) as region, \
            LocalClient(local_server.local_path, timeout=30) as local:
        region._buffer[:] = 0xFF  # NaN everywhere the server should write
        out, lse = local.attention(q, k, v, causal=causal, return_lse=True, region=region)
        assert_matches_reference(out, lse, q, k, v, causal=causal)


@pytest.mark.parametrize("dtype,shape", [("float16", (1, 3, 11, 2, 1, 32)), ("float32", (2, 5, 5, 4, 4, 16))])
def test_inline_attention_matches_reference(local_server, rng, dtype, shape):
    q, k, v = random_qkv(rng, *shape, dtype)
    with LocalClient(local_server.local_path, timeout=30) as local:
        for causal in (False, True):
            result = local.attention_with_metadata(q, k, v, causal=causal, return_lse=True, request_id="r-1")
            assert result.request_id == "r-1" and result.timing.total_us >= 0
            assert_matches_reference(result.out, result.lse, q, k, v, causal=causal)


def test_echo_returns_the_same_bytes(local_server, rng):
    with LocalClient(local_server.local_path, timeout=30) as local:
        for n in (0, 1, 4095, 1 << 20):
            data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
            assert local.echo(data) == data


def test_decode_step_and_attend_over_the_socket(local_server, rng):
    """DecodeSteps with items in the region and in the message, over the socket, vs the fp64 reference; then an
    Attend over the socket gives gRPC's answer byte for byte."""
    truth = Truth(rng, **SHAPE, dtype="float16")
    region = Region(local_server, "local-seq", 4 << 20)
    try:
        with flashserve.SequenceClient(local_server.address, timeout=30, reprefill=False) as client, \
                LocalClient(local_server.local_path, timeout=30) as local:
            seqs = []
            for n in (1, 17, 40):
                k, v = truth.rows(n)
                seqs.append(client.create(num_layers=1, **SHAPE, dtype="float16", prefix={0: (k, v)}))
                truth.add(seqs[-1].key, 0, k, v)
            for step in range(4):
                region.at, region.buf[:] = 0, 0xFF
                qs, kvs = [truth.query(1) for _ in seqs], [truth.rows(1) for _ in seqs]
                in_shm = [step % 2 == 0, True, False]
                request, outs = _step_request(region, seqs, qs, kvs, in_shm, return_lse=True)
                response = local.decode_step(request)
                for seq, q, (k, v), where, result in zip_all(seqs, qs, kvs, outs, response.results):
                    truth.add(seq.key, 0, k, v)
                    assert result.length == truth.length(seq.key, 0)
                    if where is None:
                        out = np.frombuffer(result.out.data, np.float16).reshape(q.shape)
                        lse = np.frombuffer(result.lse.data, np.float32).reshape(q.shape[1], 1)
                    else:
                        out = region.read(where[0], np.float16, q.shape)
                        lse = region.read(where[1], np.float32, (q.shape[1], 1))
                    truth.check(out, q, seq.key, 0, lse=lse)
            q = truth.query(2)
            attend = spb.AttendRequest(sequence_id=seqs[1].id, layer=0, q=tensors.to_proto_rows(q, "q"),
                                       return_lse=True)
            over_socket = local.attend(attend)
            over_grpc = client.stub(client.endpoints[0]).Attend(attend, timeout=30)
            assert over_socket.out.data == over_grpc.out.data and over_socket.lse.data == over_grpc.lse.data
            truth.check(np.frombuffer(over_socket.out.data, np.float16).reshape(q.shape), q, seqs[1].key, 0)
            attend.return_lse = False
            assert over_socket.HasField("lse") and not local.attend(attend).HasField("lse")
            with pytest.raises(flashserve.NotFoundError) as info:
                local.attend(spb.AttendRequest(sequence_id="0" * 32, layer=0, q=tensors.to_proto_rows(q, "q")))
            assert info.value.missing_ids == ("0" * 32,)
            with pytest.raises(flashserve.NotFoundError) as info:  # never echoed: sequence_id.h
                local.attend(spb.AttendRequest(sequence_id="bad\nid", layer=0, q=tensors.to_proto_rows(q, "q")))
            assert info.value.missing_ids == () and "bad\nid" not in str(info.value)
    finally:
        region.close()


class CountingPoller:
    """Wraps a client's select.poll object and counts the zero-timeout polls its poll_us loop makes."""

    def __init__(self, poller):
        self.poller, self.polls = poller, 0

    def poll(self, timeout=None):
        self.polls += 1
        return self.poller.poll(timeout)


def test_missing_ids_come_all_or_not_at_all(local_server):
    """A NOT_FOUND frame names every missing id or none: error messages are cut at 4 KiB, and 70 ids cut there read
    as 53 'missing ids' (the last one a fragment), so a client re-created only some of its lost sequences."""
    import secrets

    rng = np.random.default_rng(0)
    for n in (10, 70, 200):
        ids = [secrets.token_hex(16) for _ in range(n)]
        request = spb.DecodeStepRequest()
        for i in ids:
            request.items.add(sequence_id=i, layer=0)
        for field, heads in (("q", 4), ("k", 2), ("v", 2)):
            getattr(request.packed, field).CopyFrom(
                tensors.to_proto_rows(rng.standard_normal((n, heads, 64)).astype(np.float16), field))
        with LocalClient(local_server.local_path, timeout=30) as local:
            with pytest.raises(flashserve.NotFoundError) as info:
                local.decode_step(request)
        got = info.value.missing_ids
        assert got in ((), tuple(ids)) or set(got) == set(ids), (n, len(got), got[-1:])
        if n == 10:
            assert set(got) == set(ids)


@pytest.mark.parametrize("poll_us", [1_000_000, 1])
def test_polling_client_gets_the_same_answers(local_server, rng, poll_us):
    """poll_us 1 s: the reply lands while the client polls; 1 us: the window ends first and recv blocks as before.
    Either way the answers are the server's (echo bytes, attention against the fp64 reference)."""
    q, k, v = random_qkv(rng, 1, 33, 200, 4, 2, 64, "float16")
    with LocalClient(local_server.local_path, timeout=30, poll_us=poll_us) as local:
        local._poller = counter = CountingPoller(local._poller)
        data = rng.integers(0, 256, 70_000, dtype=np.uint8).tobytes()
        assert local.echo(data) == data
        out, lse = local.attention(q, k, v, causal=True, return_lse=True)
        assert_matches_reference(out, lse, q, k, v, causal=True)
        assert counter.polls >= 2  # each call polled before reading


def test_blocking_client_never_polls_and_poll_us_is_bounded(local_server):
    with LocalClient(local_server.local_path, timeout=30) as local:
        local._poller = counter = CountingPoller(local._poller)
        assert local.echo(b"x") == b"x" and counter.polls == 0
    for bad in (-1, 1_000_001):
        with pytest.raises(ValueError, match="poll_us"):
            LocalClient(local_server.local_path, poll_us=bad)
        with pytest.raises(ValueError, match="local_poll_us"):
            flashserve.SequenceClient(local_server.address, local_poll_us=bad)


def test_concurrent_clients(local_server, rng, concurrently):
    problems = [random_qkv(np.random.default_rng(i), 1, 5 + i, 9 + 2 * i, 4, 2, 32, "float16") for i in range(8)]

    def worker(i):
        q, k, v = problems[i]
        with LocalClient(local_server.local_path, timeout=60) as local:
            for _ in range(10):
                out = local.attention(q, k, v, causal=bool(i % 2))
                assert_matches_reference(out, None, q, k, v, causal=bool(i % 2))

    concurrently(worker, 8)


def test_metrics_count_local_calls(local_server):
    url = f"http://127.0.0.1:{local_server.metrics_port}/metrics"
    before = scrape(url).value("flashserve_requests_total", method="LocalEcho", status="OK")
    with LocalClient(local_server.local_path) as local:
        local.echo(b"x")
        local.echo(b"y")
        during = scrape(url)
        assert during.value("flashserve_local_connections") >= 1
    assert during.value("flashserve_requests_total", method="LocalEcho", status="OK") == before + 2
    assert ("flashserve_requests_total", frozenset({"method": "LocalAttention", "status": "OK"}.items())) \
        in during.samples
    refused = during.value("flashserve_requests_total", method="LocalOther", status="INVALID_ARGUMENT")
    with raw_connect(local_server.local_path) as sock:
        sock.sendall(frame(2, b"x", magic=0))
        assert read_frame(sock)[0] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert scrape(url).value("flashserve_requests_total", method="LocalOther", status="INVALID_ARGUMENT") \
        == refused + 1


# ---------------------------------------------------------------------------------------------- hostile


@pytest.mark.parametrize("bad,code,words", [
    (frame(2, b"abc", magic=0x12345678), grpc.StatusCode.INVALID_ARGUMENT, "magic"),
    (frame(99, b"abc"), grpc.StatusCode.INVALID_ARGUMENT, "unknown method"),
    (frame(0, b"abc"), grpc.StatusCode.INVALID_ARGUMENT, "unknown method"),
    (frame(2, b"abc", flags=1), grpc.StatusCode.INVALID_ARGUMENT, "flags"),
    (frame(3, size=(16 << 20)), grpc.StatusCode.RESOURCE_EXHAUSTED, "local_max_frame_bytes"),
])
def test_bad_headers_get_an_error_frame_then_close(local_server, bad, code, words):
    with raw_connect(local_server.local_path) as sock:
        sock.sendall(bad)
        status, body = read_frame(sock)
        assert status == code.value[0] and words in body.decode(), (status, body)
        assert_closed(sock)


def test_huge_claimed_length_allocates_nothing(local_server):
    with PeakRss(local_server.proc.pid) as rss:
        socks = [raw_connect(local_server.local_path) for _ in range(12)]
        for sock in socks:
            sock.sendall(frame(3, size=0xFFFFFFFF))
        for sock in socks:
            status, body = read_frame(sock)
            assert status == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], body
            sock.close()
    assert rss.growth < 8, f"RSS grew {rss.growth:.1f} MiB for claims of 4 GiB"


def test_trickled_header_and_payload_time_out(local_server):
    for prefix in (b"", frame(2, b"x" * 100)[:30]):  # the header trickled; the payload trickled
        with raw_connect(local_server.local_path) as sock:
            sock.sendall(prefix)
            start = time.monotonic()
            answer = None
            for i in range(40):  # a byte every 100 ms: never complete within --local_read_timeout_ms=500
                try:
                    sock.sendall(b"\x46" if not prefix else b"x")
                except (BrokenPipeError, ConnectionResetError):
                    break
                sock.settimeout(0.1)
                try:
                    answer = read_frame(sock)
                    break
                except socket.timeout:
                    continue
            assert time.monotonic() - start < 3, "the server waited past its read timeout"
            assert answer is None or answer[0] == grpc.StatusCode.DEADLINE_EXCEEDED.value[0], answer


def test_a_stalled_header_says_how_much_of_it_came(local_server):
    """The timeout's message counts the header's bytes from its first: it said "0 of 14" for a header stalled after
    10 of its 24 bytes (the first read's bytes were left out)."""
    with raw_connect(local_server.local_path) as sock:
        sock.sendall(frame(2, b"x" * 100)[:10])
        status, body = read_frame(sock)  # after --local_read_timeout_ms=500
    assert status == grpc.StatusCode.DEADLINE_EXCEEDED.value[0], body
    assert f"10 of {HEADER.size} bytes arrived".encode() in body, body


def test_garbage_message_is_refused_and_the_connection_lives(local_server):
    with LocalClient(local_server.local_path, timeout=10) as local:
        for method in (3, 4, 5):
            with pytest.raises(flashserve.InvalidArgumentError):
                local.call(method, b"\xff\xff\xff\xff garbage")
        assert local.echo(b"still here") == b"still here"


def test_client_leaving_mid_call_or_mid_frame_does_not_hurt(local_server, rng):
    q, k, v = random_qkv(rng, 1, 1024, 2048, 8, 4, 64, "float16")  # tens of ms on two CPU threads
    request = pb.AttentionRequest(q=tensors.to_proto(q, "q"), k=tensors.to_proto(k, "k"), v=tensors.to_proto(v, "v"))
    payload = request.SerializeToString()
    assert len(payload) < 8 << 20
    for _ in range(3):
        with raw_connect(local_server.local_path) as sock:
            sock.sendall(frame(3, payload))  # then gone before the answer
        with raw_connect(local_server.local_path) as sock:
            sock.sendall(frame(3, size=len(payload)) + payload[:1000])  # gone mid-frame
    with LocalClient(local_server.local_path, timeout=30) as local:
        small = random_qkv(rng, 1, 3, 4, 2, 2, 16, "float16")
        assert_matches_reference(local.attention(*small), None, *small)
    assert local_server.proc.poll() is None


def test_connection_cap(flashserve_bin, tmp_path):
    directory = socket_dir()
    s = ServerProcess(flashserve_bin, tmp_path, [f"--local_socket={directory}/fs.sock", "--local_max_connections=3"],
                      name="cap").start()
    try:
        clients = [LocalClient(f"{directory}/fs.sock", timeout=10) for _ in range(3)]
        for c in clients:
            assert c.echo(b"ok") == b"ok"  # accepted and counted
        with raw_connect(f"{directory}/fs.sock") as extra:
            status, body = read_frame(extra)
            assert status == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and b"local_max_connections" in body
            assert_closed(extra)
        clients.pop().close()
        deadline = time.monotonic() + 5
        while True:  # the server frees the slot once it sees the close
            try:
                with LocalClient(f"{directory}/fs.sock", timeout=10) as again:
                    assert again.echo(b"in") == b"in"
                break
            except (flashserve.ResourceExhaustedError, flashserve.UnavailableError):
                assert time.monotonic() < deadline
                time.sleep(0.05)
        for c in clients:
            c.close()
        _stop_and_check(s)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- auth


def test_auth_hello_and_region_ownership(flashserve_bin, tmp_path, rng):
    directory = socket_dir()
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    path = f"{directory}/fs.sock"
    s = ServerProcess(flashserve_bin, tmp_path, [f"--local_socket={path}", f"--auth_token_file={token_file}",
                                                 "--allow_client_shm"], name="auth").start()
    try:
        with raw_connect(path) as sock:  # no Hello: refused before the payload is read, then closed
            sock.sendall(frame(2, b"hi"))
            status, body = read_frame(sock)
            assert status == grpc.StatusCode.UNAUTHENTICATED.value[0], body
            assert_closed(sock)
        with raw_connect(path) as sock:  # a Hello too long to be a token is not even read
            sock.sendall(frame(1, size=1 << 20))
            status, body = read_frame(sock)
            assert status == grpc.StatusCode.UNAUTHENTICATED.value[0]
            assert b"a Hello holds at most 4096 bytes (the token), got 1048576" in body, body
        with pytest.raises(flashserve.FlashserveError) as info:
            LocalClient(path, token=TOKEN[:-1] + "X")
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
        q, k, v = random_qkv(rng, 1, 9, 13, 2, 1, 32, "float16")
        with flashserve.Client(s.address, timeout=30, token=TOKEN) as grpc_client, \
                SystemRegion(grpc_client, "owned", SystemRegion.bytes_for(q, k, v)) as region, \
                LocalClient(path, token=TOKEN, timeout=30) as local:
            assert local.echo(b"in") == b"in"
            out, lse = local.attention(q, k, v, return_lse=True, region=region)  # registered over gRPC, same owner
            assert_matches_reference(out, lse, q, k, v)
        _stop_and_check(s)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_a_client_that_cannot_connect_or_is_refused_its_hello_closes_its_socket(flashserve_bin, tmp_path,
                                                                                monkeypatch):
    """LocalClient's constructor closes the socket it made when the connect fails (no server there) or the server
    refuses its Hello (a wrong token). Before, the socket stayed open as long as anything held the failed client (an
    exception's traceback does): on the server's side a refused Hello's connection held one of its slots."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    path = os.path.join(socket_dir(), "fs.sock")
    s = ServerProcess(flashserve_bin, tmp_path, [f"--local_socket={path}", f"--auth_token_file={token_file}"],
                      name="local_refused_hello").start()
    made = []

    class Recorded(socket.socket):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    try:
        monkeypatch.setattr(socket, "socket", Recorded)
        with pytest.raises(OSError):
            LocalClient(str(tmp_path / "no-server.sock"))
        with pytest.raises(flashserve.FlashserveError) as info:
            LocalClient(path, token=TOKEN[:-1] + "X", timeout=10)
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert len(made) == 2 and all(sock.fileno() == -1 for sock in made)
    finally:
        monkeypatch.undo()
        _stop_and_check(s)
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def test_connections_without_a_hello_do_not_hold_the_slots(flashserve_bin, tmp_path):
    """With a token, connections that never send their Hello are closed after --local_read_timeout_ms: two idle ones
    held both slots of --local_max_connections=2 for good, so a local user without the token kept every client
    out (a mode like 0666 lets any local user connect)."""
    directory = socket_dir()
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    path = f"{directory}/fs.sock"
    s = ServerProcess(flashserve_bin, tmp_path, [f"--local_socket={path}", f"--auth_token_file={token_file}",
                                                 "--local_max_connections=2", "--local_read_timeout_ms=500"],
                      name="idle").start()
    try:
        idle = [raw_connect(path) for _ in range(2)]
        started = time.monotonic()
        for sock in idle:
            status, body = read_frame(sock)
            assert status == grpc.StatusCode.DEADLINE_EXCEEDED.value[0], body
            assert b"a Hello first" in body, body
            assert_closed(sock)
            sock.close()
        assert time.monotonic() - started < 5
        deadline = time.monotonic() + 5
        while True:  # the slots come back once the server has closed the idle connections
            try:
                with LocalClient(path, token=TOKEN, timeout=10) as local:
                    assert local.echo(b"in") == b"in"
                break
            except (flashserve.ResourceExhaustedError, flashserve.UnavailableError):
                assert time.monotonic() < deadline
                time.sleep(0.05)
        with LocalClient(path, token=TOKEN, timeout=10) as local:  # authenticated: idle for longer is fine
            time.sleep(1.0)
            assert local.echo(b"still") == b"still"
        _stop_and_check(s)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- the socket file


def test_socket_file_life(flashserve_bin, tmp_path):
    directory = socket_dir()
    path = f"{directory}/fs.sock"
    try:
        stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stale.bind(path)
        stale.close()  # a crashed server's socket: nobody listens
        s = ServerProcess(flashserve_bin, tmp_path, [f"--local_socket={path}", "--local_socket_mode=0660"],
                          name="stale").start()
        assert stat.S_IMODE(os.lstat(path).st_mode) == 0o660
        with LocalClient(path) as c:
            assert c.echo(b"x") == b"x"
        taken = subprocess_run(flashserve_bin, path)  # a second server on a live socket
        assert taken.returncode == 2 and "in use" in taken.stderr, taken.stderr
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(30) == 0
        assert not os.path.exists(path)
        with open(path, "w") as f:
            f.write("not a socket")
        refused = subprocess_run(flashserve_bin, path)
        assert refused.returncode == 2 and "not a socket" in refused.stderr, refused.stderr
        assert open(path).read() == "not a socket"
        os.unlink(path)
        missing = subprocess_run(flashserve_bin, f"{directory}/no/such/dir/fs.sock")
        assert missing.returncode == 2 and "bind" in missing.stderr, missing.stderr
        default = ServerProcess(flashserve_bin, tmp_path, [f"--local_socket={path}"], name="mode").start()
        assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600
        _stop_and_check(default)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_a_listener_with_a_full_backlog_stops_the_server_at_once(flashserve_bin):
    """The check for a live socket at the path connected blocking: a listener whose backlog is full (a wedged
    earlier instance) held the new server there forever, before it bound anything or said a word."""
    import subprocess

    directory = socket_dir()
    path = f"{directory}/fs.sock"
    wedged = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    queued = []
    try:
        wedged.bind(path)
        wedged.listen(0)
        for _ in range(8):  # fill its queue: then a connect would block
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.setblocking(False)
            queued.append(c)
            try:
                c.connect(path)
            except BlockingIOError:
                break
        else:
            pytest.fail("the listener's queue never filled")
        start = time.monotonic()
        taken = subprocess.run([str(flashserve_bin), "--backend=cpu", "--grpc_port=0", "--http_port=0",
                                "--metrics_port=0", f"--local_socket={path}"], capture_output=True, text=True,
                               timeout=30)
        assert taken.returncode == 2 and "in use" in taken.stderr, taken.stderr
        assert time.monotonic() - start < 20
    finally:
        for c in queued:
            c.close()
        wedged.close()
        shutil.rmtree(directory, ignore_errors=True)


def subprocess_run(binary, path):
    import subprocess

    return subprocess.run([str(binary), "--backend=cpu", "--grpc_port=0", "--http_port=0", "--metrics_port=0",
                           f"--local_socket={path}"], capture_output=True, text=True, timeout=60)


def test_a_frame_begun_before_the_drain_is_answered(flashserve_bin, tmp_path):
    """A connection counted for the drain only once a whole header was in: a frame whose first bytes came before the
    SIGTERM and the rest after was cut off when the drain found no call in progress ("the client left mid-frame").
    Counted from its first byte, it is read whole and answered before the server exits."""
    directory = socket_dir()
    path = f"{directory}/fs.sock"
    s = ServerProcess(flashserve_bin, tmp_path, [f"--local_socket={path}", "--local_read_timeout_ms=5000"],
                      name="drain_mid_frame").start()
    try:
        echo = frame(2, b"still here")
        with raw_connect(path) as sock:
            sock.sendall(echo[:5])
            time.sleep(0.2)  # the server has read those bytes
            s.proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)  # the drain is under way (a drain with nothing in progress ends in ~2 ms)
            sock.sendall(echo[5:])
            sock.settimeout(10)
            answer = read_frame(sock)
        assert answer is not None and answer[0] == 0 and answer[1] == b"still here", answer
        assert s.proc.wait(30) == 0
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
        shutil.rmtree(directory, ignore_errors=True)


def test_clients_sending_frames_back_to_back_do_not_hold_the_drain(flashserve_bin, tmp_path):
    """The drain waits until no frame is in progress; eight connections each sending echo frames back to back kept
    one in progress nearly always, and a SIGTERM waited out most of the grace period (measured 12 s of 20). A
    connection now closes after the answer it is writing once the drain has begun."""
    directory = socket_dir()
    path = f"{directory}/fs.sock"
    s = ServerProcess(flashserve_bin, tmp_path, [f"--local_socket={path}", "--shutdown_grace_seconds=30"],
                      name="drain_back_to_back").start()
    stop = threading.Event()
    answered = []

    def pump():
        with raw_connect(path) as sock:
            got = [0]

            def read():
                try:
                    while chunk := sock.recv(1 << 16):
                        got[0] += len(chunk)
                except OSError:
                    pass

            reader = threading.Thread(target=read)
            reader.start()
            burst = frame(2, b"x" * 100) * 50
            try:
                while not stop.is_set():
                    sock.sendall(burst)
            except OSError:  # closed by the server: the drain began
                pass
            reader.join(30)
            answered.append(got[0])

    pumps = [threading.Thread(target=pump) for _ in range(8)]
    try:
        for t in pumps:
            t.start()
        time.sleep(1.0)
        start = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(30) == 0
        took = time.monotonic() - start
        print(f"drained in {took:.2f} s with 8 connections sending frames back to back")
        assert took < 5, f"the drain took {took:.1f} s of its 30 s grace"
    finally:
        stop.set()
        for t in pumps:
            t.join(30)
        if s.proc.poll() is None:
            s.proc.kill()
        shutil.rmtree(directory, ignore_errors=True)
    assert len(answered) == 8 and min(answered) > 0, answered  # every connection was being answered


def test_sigterm_answers_the_call_in_progress_then_removes_the_socket(flashserve_bin, tmp_path, rng):
    directory = socket_dir()
    path = f"{directory}/fs.sock"
    s = ServerProcess(flashserve_bin, tmp_path, [f"--local_socket={path}"], name="drain").start()
    try:
        q, k, v = random_qkv(rng, 1, 1024, 2048, 8, 4, 64, "float16")  # long enough to signal while it runs
        result = {}

        def call():
            with LocalClient(path, timeout=60) as c:
                result["out"] = c.attention(q, k, v)

        with LocalClient(path, timeout=10) as idle:  # an idle connection must not hold the exit up
            url = f"http://127.0.0.1:{s.metrics_port}/metrics"
            for attempt in range(20):  # a call done between two scrapes (~25 ms of compute) is made again
                result.clear()
                worker = threading.Thread(target=call)
                worker.start()
                deadline = time.monotonic() + 10
                while worker.is_alive() and scrape(url).value("flashserve_inflight_requests") < 1:
                    assert time.monotonic() < deadline, "the call never started"
                    time.sleep(0.002)
                if worker.is_alive():  # the call is in the server
                    break
                worker.join()
            else:
                pytest.fail("20 calls all ended before a scrape saw them in the server")
            s.proc.send_signal(signal.SIGTERM)
            worker.join(60)
            assert s.proc.wait(30) == 0
            assert "out" in result, "the call in progress was not answered"
            assert_matches_reference(result["out"], None, q, k, v)
            assert not os.path.exists(path)
            with pytest.raises(flashserve.UnavailableError):
                idle.echo(b"x")  # its connection was closed at the end of the drain
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
        shutil.rmtree(directory, ignore_errors=True)


def test_a_client_taking_its_answer_slowly_is_cut_off_after_the_read_timeout(local_server):
    """A client taking its answer a little at a time held the call (a compute call's in-flight bytes and admission
    with it: other clients were refused) for as long as it kept reading: the socket's send timeout restarted at
    every chunk. The whole answer now gets one --local_read_timeout_ms (500 ms here), then the connection closes."""
    payload = bytes(4 << 20)
    with raw_connect(local_server.local_path) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(frame(2, payload))  # Echo: the answer is the payload back
        got, started = 0, time.monotonic()
        while time.monotonic() - started < 10:
            time.sleep(0.1)
            chunk = sock.recv(16384)  # ~160 KB/s: the whole answer would take ~26 s
            if not chunk:
                break
            got += len(chunk)
        elapsed = time.monotonic() - started
    assert got < len(payload), "the whole answer came: the test tests nothing"
    assert elapsed < 4, f"the server kept sending for {elapsed:.1f} s"
    # Counted OK where it was handed over, as on gRPC; the log says it never arrived (it said nothing).
    deadline = time.monotonic() + 5
    while "was not delivered" not in local_server.logs(limit=200000) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert f"an answer of {len(payload) + 16} bytes was not delivered" in local_server.logs(limit=200000)


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS:")).split()[1]) / 1024


def test_idle_connections_give_their_large_buffers_back(flashserve_bin, tmp_path):
    """Each connection echoes 8 MiB once, then idles: a connection kept its largest request's buffer between calls
    (12 idle ones held 96 MiB more); now one larger than 1 MiB goes once the connection has been idle for 1 s. A
    server of its own, with malloc's heap retention off (after recent DecodeSteps the heap keeps freed buffers, which
    would hide what the connections hold)."""
    from test_allocators import _sanitized

    if _sanitized(flashserve_bin):
        pytest.skip("a sanitized server's RSS says nothing about its buffers")
    directory = socket_dir()
    server = ServerProcess(flashserve_bin, tmp_path, [f"--local_socket={directory}/fs.sock",
                                                      "--malloc_trim_threshold_bytes=0"], name="idle_buffers").start()
    try:
        pid = server.proc.pid
        before = _rss_mib(pid)
        socks = [raw_connect(f"{directory}/fs.sock") for _ in range(12)]
        try:
            for sock in socks:
                sock.sendall(frame(2, bytes(8 << 20)))
                status, body = read_frame(sock)
                assert status == 0 and len(body) == 8 << 20
            time.sleep(2.0)
            grew = _rss_mib(pid) - before
        finally:
            for sock in socks:
                sock.close()
        assert grew < 48, f"12 idle connections hold {grew:.0f} MiB more"
    finally:
        _stop_and_check(server)
        shutil.rmtree(directory, ignore_errors=True)


def test_half_closed_client_still_gets_its_answer(local_server, rng):
    q, k, v = random_qkv(rng, 1, 64, 256, 4, 2, 32, "float16")
    request = pb.AttentionRequest(q=tensors.to_proto(q, "q"), k=tensors.to_proto(k, "k"), v=tensors.to_proto(v, "v"))
    with raw_connect(local_server.local_path) as sock:
        sock.sendall(frame(3, request.SerializeToString()))
        sock.shutdown(socket.SHUT_WR)  # done sending, still reading (socat, shell pipelines)
        status, body = read_frame(sock)
        assert status == 0, body
        out = tensors.from_proto(pb.AttentionResponse.FromString(body).out, "numpy", None)
        assert_matches_reference(out, None, q, k, v)
        assert_closed(sock)


def test_concurrent_decode_steps(local_server, concurrently):
    """Clients on disjoint sequences stepping at once over the socket (calls run on their connection threads and on
    the scheduler's worker side by side): every O against the fp64 reference."""

    def worker(i):
        truth = Truth(np.random.default_rng(100 + i), **SHAPE, dtype="bfloat16")
        with flashserve.SequenceClient(local_server.address, timeout=30, reprefill=False) as client, \
                LocalClient(local_server.local_path, timeout=30) as local:
            seqs = []
            for n in (3 + i, 20):
                k, v = truth.rows(n)
                seqs.append(client.create(num_layers=1, **SHAPE, dtype="bfloat16", prefix={0: (k, v)}))
                truth.add(seqs[-1].key, 0, k, v)
            for _ in range(8):
                request = spb.DecodeStepRequest()
                qs, kvs = [truth.query(1) for _ in seqs], [truth.rows(1) for _ in seqs]
                for seq, q, (k, v) in zip(seqs, qs, kvs):
                    item = request.items.add(sequence_id=seq.id, layer=0)
                    for field, x in (("q", q), ("k", k), ("v", v)):
                        getattr(item, field).CopyFrom(tensors.to_proto_rows(x, field))
                response = local.decode_step(request)
                for seq, q, (k, v), result in zip_all(seqs, qs, kvs, response.results):
                    truth.add(seq.key, 0, k, v)
                    out = tensors.from_proto(result.out, "numpy", None).reshape(q.shape)
                    truth.check(out, q, seq.key, 0)
            for seq in seqs:
                seq.release()

    concurrently(worker, 4)
