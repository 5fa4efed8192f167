"""SequenceClient over a server's local socket (``local_sockets={endpoint: path}``; CPU backend, the real binary):
DecodeStep and Attend go as frames over the Unix socket -- counted under the Local* methods, none over gRPC -- and
answer as over gRPC (fp64 reference over many steps); a sequence released behind the client's back is re-prefilled
from the missing ids the frame names; a restarted server (same socket path) is reconnected; the bearer token travels
in the Hello; a socket path with no server is UNAVAILABLE, not a crash."""

from __future__ import annotations

import contextlib

import os
import shutil
import tempfile
import time

import grpc
import pytest

import flashserve
import conftest
from conftest import ServerProcess, _stop_and_check, zip_all
from metrics_helpers import scrape
from sequences_truth import Truth

pytestmark = pytest.mark.e2e
KV_FLAGS = ["--kv_cache_bytes=67108864", "--kv_page_tokens=16"]
SHAPE = dict(num_layers=2, heads_q=8, heads_kv=2, head_dim=64, dtype="bfloat16")


def _socket_path() -> str:
    return os.path.join(tempfile.mkdtemp(prefix="fsq", dir="/tmp"), "fs.sock")  # sun_path: at most 107 bytes


def _start(flashserve_bin, tmp_path, path, *extra, name="seq_local"):
    return ServerProcess(flashserve_bin, tmp_path, [*KV_FLAGS, f"--local_socket={path}", *extra], name=name).start()


@contextlib.contextmanager
def _private_server(flashserve_bin, tmp_path, *extra, name):
    """A server of the test's own on a fresh socket path (server.local_path), stopped and checked after."""
    path = _socket_path()
    server = _start(flashserve_bin, tmp_path, path, *extra, name=name)
    server.local_path = path
    try:
        yield server
    finally:
        _stop_and_check(server)
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def _truth(rng):
    return Truth(rng, SHAPE["heads_q"], SHAPE["heads_kv"], SHAPE["head_dim"], SHAPE["dtype"])


@pytest.fixture(scope="module")
def local_kv_server(flashserve_bin, tmp_path_factory):
    path = _socket_path()
    s = _start(flashserve_bin, tmp_path_factory.mktemp("seq_local"), path)
    s.local_path = path
    yield s
    _stop_and_check(s)
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def _client(server, **kw):
    return flashserve.SequenceClient(server.address, timeout=30, local_sockets={server.address: server.local_path},
                                     **kw)


def _calls(server, method):
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    return sum(scrape(url).value("flashserve_requests_total", method=method, status=status)
               for status in ("OK", "NOT_FOUND"))


def _steps(client, seqs, truth, n, layer=0):
    for _ in range(n):
        qs = [truth.query(1) for _ in seqs]
        kvs = [truth.rows(1) for _ in seqs]
        outs = client.decode_step([(s, layer, q, k, v) for s, q, (k, v) in zip(seqs, qs, kvs)])
        for seq, q, (k, v), out in zip_all(seqs, qs, kvs, outs):
            truth.add(seq.key, layer, k, v)
            truth.check(out, q, seq.key, layer)


def _create(client, truth, prefix_rows):
    k, v = truth.rows(prefix_rows)
    seq = client.create(**SHAPE, prefix={0: (k, v)})
    truth.add(seq.key, 0, k, v)
    return seq


@pytest.mark.parametrize("poll_us", [0, 200_000])
def test_steps_and_attend_go_over_the_socket_and_match_reference(local_kv_server, rng, poll_us):
    truth = _truth(rng)
    grpc_before = _calls(local_kv_server, "DecodeStep") + _calls(local_kv_server, "Attend")
    local_before = _calls(local_kv_server, "LocalDecodeStep")
    with _client(local_kv_server, local_poll_us=poll_us) as client:
        seqs = [_create(client, truth, n) for n in (1, 17, 33)]
        _steps(client, seqs, truth, 6)
        q = truth.query(2)
        out, lse = seqs[1].attend(0, q, causal=True, return_lse=True)
        truth.check(out, q, seqs[1].key, 0, causal=True, lse=lse)
        assert client._local_clients and all(c.poll_us == poll_us for c in client._local_clients)
    assert _calls(local_kv_server, "LocalDecodeStep") - local_before == 6
    assert _calls(local_kv_server, "DecodeStep") + _calls(local_kv_server, "Attend") == grpc_before


def test_a_sequence_lost_behind_the_clients_back_is_reprefilled(local_kv_server, rng):
    truth = _truth(rng)
    with _client(local_kv_server) as client, _client(local_kv_server, reprefill=False) as plain:
        seqs = [_create(client, truth, 9) for _ in range(2)]
        _steps(client, seqs, truth, 2)
        stub = client.stub(local_kv_server.address)
        stub.Release(flashserve.sequences_pb2.ReleaseRequest(sequence_ids=[seqs[0].id]))
        _steps(client, seqs, truth, 3)  # NOT_FOUND over the socket names seqs[0]: re-created, retried
        assert seqs[0].reprefills == 1 and seqs[1].reprefills == 0
        watched = plain.create(**SHAPE)
        plain.stub(local_kv_server.address).Release(
            flashserve.sequences_pb2.ReleaseRequest(sequence_ids=[watched.id]))
        with pytest.raises(flashserve.NotFoundError) as info:
            watched.attend(0, truth.query(1))
        assert info.value.missing_ids == (watched.id,)


def test_a_restarted_server_is_reconnected(flashserve_bin, tmp_path, rng, monkeypatch):
    path = _socket_path()
    server = _start(flashserve_bin, tmp_path, path, name="seq_local_restart")
    server.local_path = path
    truth = _truth(rng)
    try:
        with _client(server) as client:
            seqs = [_create(client, truth, 5) for _ in range(2)]
            _steps(client, seqs, truth, 2)
            assert server.stop() == 0
            ports = [server.grpc_port, server.http_port] + ([server.metrics_port] if server.metrics_port else [])
            monkeypatch.setattr(conftest, "free_port", iter(ports).__next__)
            server.start(attempts=1)  # same ports and socket path, empty memory
            monkeypatch.undo()
            deadline = time.monotonic() + 20
            while True:  # UNAVAILABLE while gRPC reconnects (re-prefill goes over gRPC), then correct answers
                try:
                    _steps(client, seqs, truth, 1)
                    break
                except flashserve.UnavailableError:
                    assert time.monotonic() < deadline, "no answer after the restart"
                    time.sleep(0.2)
            _steps(client, seqs, truth, 2)
            assert all(s.reprefills == 1 for s in seqs)
    finally:
        server.stop()
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def test_bearer_token_goes_in_the_hello(flashserve_bin, tmp_path, rng):
    (tmp_path / "token").write_text("s3cret-token-0123456789\n")
    truth = _truth(rng)
    with _private_server(flashserve_bin, tmp_path, f"--auth_token_file={tmp_path / 'token'}",
                         name="seq_local_auth") as server:
        with _client(server, token="s3cret-token-0123456789") as client:
            seq = _create(client, truth, 3)
            _steps(client, [seq], truth, 2)
            with _client(server, token="wrong") as wrong:
                with pytest.raises(flashserve.FlashserveError) as info:
                    wrong.attend(seq, 0, truth.query(1))  # the Hello is refused before any step
                assert info.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_a_thread_that_ends_gives_its_connection_back(flashserve_bin, tmp_path, rng):
    """Each thread steps over a connection of its own; it is closed when the thread ends, and close() closes those of
    threads still alive. Before, the client held every connection until close(): once --local_max_connections
    threads (64 by default; 2 here) had stepped, one after the other, every new thread's step failed
    RESOURCE_EXHAUSTED, though only one thread was alive."""
    import threading

    truth = _truth(rng)
    with _private_server(flashserve_bin, tmp_path, "--local_max_connections=2", name="seq_local_threads") as server:
        with _client(server) as client:
            seq = _create(client, truth, 3)
            errors = []

            def one_step():
                try:
                    _steps(client, [seq], truth, 1)
                except Exception as e:  # noqa: BLE001 - reported below
                    errors.append(e)

            for _ in range(6):  # a web server's per-request threads, one after the other
                thread = threading.Thread(target=one_step)
                thread.start()
                thread.join()
            assert errors == [] and len(client._local_clients) == 0
            _steps(client, [seq], truth, 1)  # this thread's connection stays open until close()
            open_ones = list(client._local_clients)
            assert len(open_ones) == 1 and not open_ones[0].closed
        assert open_ones[0].closed


def test_no_server_on_the_socket_path_is_unavailable(local_kv_server, rng):
    truth = _truth(rng)
    with flashserve.SequenceClient(local_kv_server.address, timeout=10, max_attempts=1,
                                   local_sockets={local_kv_server.address: "/tmp/no-such-dir/fs.sock"}) as client:
        seq = _create(client, truth, 3)  # create goes over gRPC
        with pytest.raises(flashserve.UnavailableError, match="local socket"):
            seq.attend(0, truth.query(1))
    with pytest.raises(ValueError, match="not in the list"):
        flashserve.SequenceClient(local_kv_server.address, local_sockets={"elsewhere:1": "/tmp/x.sock"})


def test_a_deadline_on_the_socket_is_ambiguous_and_then_settled(flashserve_bin, tmp_path, rng):
    """A step that times out on the socket may or may not have appended its rows (as over gRPC): the client raises
    DEADLINE_EXCEEDED, not UNAVAILABLE, marks the sequences uncertain, and settles them before its next step. The
    server's 100 ms batch window makes every step slower than the 1 ms timeout (Python's shortest socket wait)."""
    truth = _truth(rng)
    with _private_server(flashserve_bin, tmp_path, "--batch_window_us=100000", name="seq_local_deadline") as server:
        with _client(server) as client:
            seqs = [_create(client, truth, 20) for _ in range(4)]
            items = [(s, 0, truth.query(1), *truth.rows(1)) for s in seqs]
            with pytest.raises(flashserve.DeadlineExceededError):
                client.decode_step(items, timeout=1e-3)
            assert all(s.uncertain for s in seqs)
            _steps(client, seqs, truth, 2)  # the timed-out rows are in no sequence the answers are checked against
            assert not any(s.uncertain for s in seqs)
