"""End-to-end tests of the striped streaming API (AttentionStreamService) and flashserve.StripedClient, CPU backend."""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest

import flashserve
from flashserve import attention_pb2 as pb
from flashserve import attention_pb2_grpc as pb_grpc
from flashserve import tensors
from metrics_helpers import scrape

pytestmark = pytest.mark.e2e


def _header(b=1, s=16, hq=2, hkv=2, d=8, dtype=pb.BFLOAT16, return_lse=False):
    h = pb.AttentionRequest(return_lse=return_lse)
    h.q.CopyFrom(pb.Tensor(dtype=dtype, shape=[b, s, hq, d]))
    h.k.CopyFrom(pb.Tensor(dtype=dtype, shape=[b, s, hkv, d]))
    h.v.CopyFrom(pb.Tensor(dtype=dtype, shape=[b, s, hkv, d]))
    return h


@pytest.fixture
def stub(server):
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.AttentionStreamServiceStub(channel)


@pytest.mark.parametrize(
    "dtype,shape,causal,return_lse,stripes,inline_bytes",
    [
        ("bfloat16", (1, 70, 65, 4, 2, 64), False, False, 3, 0),  # striped output, uneven chunks
        ("float32", (2, 33, 47, 4, 1, 32), True, True, 4, 0),  # GQA, causal, LSE striped too
        ("float16", (1, 40, 40, 2, 2, 16), False, True, 1, 0),  # one stripe: O inline
        ("bfloat16", (1, 8, 8, 2, 2, 8), True, False, 2, 1 << 20),  # small output inline
    ],
)
def test_striped_matches_reference(server, rng, make_qkv, check_answer, dtype, shape, causal, return_lse, stripes,
                                   inline_bytes):
    q, k, v = make_qkv(rng, *shape, dtype)
    with flashserve.StripedClient(server.address, stripes=stripes, chunk_bytes=4096, timeout=60,
                                  inline_output_bytes=inline_bytes) as client:
        result = client.attention_with_metadata(q, k, v, causal=causal, return_lse=return_lse, request_id="striped")
        assert result.request_id == "striped"
        check_answer(result.out, result.lse, q, k, v, causal=causal)
        # The same answer as the unary API, bit for bit (same backend, same inputs).
        with flashserve.Client(server.address, timeout=60) as unary:
            out = unary.attention(q, k, v, causal=causal)
        np.testing.assert_array_equal(np.asarray(result.out).view(np.uint8), np.asarray(out).view(np.uint8))


def test_bad_chunks_are_rejected(stub):
    info = stub.OpenSession(_header())  # 16*2*8*2 = 512 bytes per tensor
    sid = info.session_id
    assert sid and info.idle_timeout_ms > 0

    def upload(*chunks):
        return stub.Upload(iter(chunks), timeout=10)

    cases = [
        pb.AttentionChunk(session_id=sid, tensor=pb.TENSOR_Q, offset=500, data=b"x" * 13),  # past the end
        pb.AttentionChunk(session_id=sid, tensor=pb.TENSOR_Q, offset=-1, data=b"x"),  # negative
        pb.AttentionChunk(session_id=sid, tensor=pb.TENSOR_OUT, offset=0, data=b"x"),  # not an input
        pb.AttentionChunk(session_id="", tensor=pb.TENSOR_Q, offset=0, data=b"x"),  # no session
    ]
    for chunk in cases:
        with pytest.raises(grpc.RpcError) as e:
            upload(chunk)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (chunk, e.value.details())
    with pytest.raises(grpc.RpcError) as e:
        upload(pb.AttentionChunk(session_id="nope", tensor=pb.TENSOR_Q, offset=0, data=b"x"))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND

    ack = upload(pb.AttentionChunk(session_id=sid, tensor=pb.TENSOR_Q, offset=0, data=b"a" * 256))
    assert ack.bytes_received == 256
    with pytest.raises(grpc.RpcError) as e:  # overlaps bytes already sent
        upload(pb.AttentionChunk(session_id=sid, tensor=pb.TENSOR_Q, offset=128, data=b"b" * 256))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "overlaps" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:  # incomplete
        stub.Compute(pb.ComputeRequest(session_id=sid), timeout=10)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.RpcError) as e:  # no output yet
        list(stub.Download(pb.DownloadRequest(session_id=sid, tensor=pb.TENSOR_OUT), timeout=10))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
    with pytest.raises(grpc.RpcError) as e:
        stub.Compute(pb.ComputeRequest(session_id=sid), timeout=10)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_bad_headers_are_rejected(stub):
    bad = [
        _header(hq=3, hkv=2),  # heads_q % heads_kv != 0: the full validation runs at OpenSession
        _header(s=0),
    ]
    with_data = _header()
    with_data.q.data = b"\0" * 512
    bad.append(with_data)
    rank3 = _header()
    del rank3.k.shape[-1]
    bad.append(rank3)
    for header in bad:
        with pytest.raises(grpc.RpcError) as e:
            stub.OpenSession(header, timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()


def test_session_bytes_limit(limits_server):
    with grpc.insecure_channel(limits_server.address) as channel:
        stub = pb_grpc.AttentionStreamServiceStub(channel)
        with pytest.raises(grpc.RpcError) as e:  # 3 x 512 KiB > --max_request_bytes = 1 MiB
            stub.OpenSession(_header(s=256, hq=8, hkv=8, d=128), timeout=10)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_output_downloads_once_and_ends_session(stub, rng, make_qkv):
    q, k, v = make_qkv(rng, 1, 16, 16, 2, 2, 8, "float32")
    header = _header(dtype=pb.FLOAT32)
    sid = stub.OpenSession(header).session_id
    for tensor, x in ((pb.TENSOR_Q, q), (pb.TENSOR_K, k), (pb.TENSOR_V, v)):
        stub.Upload(iter([pb.AttentionChunk(session_id=sid, tensor=tensor, offset=0, data=x.tobytes())]))
    response = stub.Compute(pb.ComputeRequest(session_id=sid))
    assert not response.out.data and list(response.out.shape) == [1, 16, 2, 8]
    first = list(stub.Download(pb.DownloadRequest(session_id=sid, tensor=pb.TENSOR_OUT, offset=0, length=512,
                                                  chunk_bytes=4096)))
    assert sum(len(c.data) for c in first) == 512
    with pytest.raises(grpc.RpcError) as e:  # each byte once
        list(stub.Download(pb.DownloadRequest(session_id=sid, tensor=pb.TENSOR_OUT, offset=256, length=512)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    rest = list(stub.Download(pb.DownloadRequest(session_id=sid, tensor=pb.TENSOR_OUT, offset=512)))
    out = np.frombuffer(b"".join(c.data for c in first + rest), dtype=np.float32).reshape(1, 16, 2, 8)
    ref = flashserve.reference.attention(q, k, v)
    assert np.abs(out - ref).max() < 1e-4
    with pytest.raises(grpc.RpcError) as e:  # all downloaded: the session is gone
        stub.Compute(pb.ComputeRequest(session_id=sid))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_download_chunk_bytes_outside_the_range_is_refused(stub, rng, make_qkv):
    """chunk_bytes was clamped without a word (-1 meant the 4 MiB default, 100 became 4096, 1 GiB 64 MiB). Now
    0 is the default, 4096 .. 64 MiB are used as given, anything else is INVALID_ARGUMENT naming the field, and a
    refused call reserves nothing: every byte can still be downloaded."""
    q, k, v = make_qkv(rng, 1, 128, 128, 2, 2, 8, "float32")  # O: 8 KiB
    sid = stub.OpenSession(_header(s=128, dtype=pb.FLOAT32)).session_id
    for tensor, x in ((pb.TENSOR_Q, q), (pb.TENSOR_K, k), (pb.TENSOR_V, v)):
        stub.Upload(iter([pb.AttentionChunk(session_id=sid, tensor=tensor, offset=0, data=x.tobytes())]))
    stub.Compute(pb.ComputeRequest(session_id=sid))
    for bad in (-1, 1, 4095, (64 << 20) + 1, 1 << 40):
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Download(pb.DownloadRequest(session_id=sid, tensor=pb.TENSOR_OUT, chunk_bytes=bad), timeout=10))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (bad, e.value.details())
        assert f"DownloadRequest.chunk_bytes: {bad} is outside [4096, 67108864]" in e.value.details()
    first = list(stub.Download(pb.DownloadRequest(session_id=sid, tensor=pb.TENSOR_OUT, length=6144, chunk_bytes=4096)))
    assert [len(c.data) for c in first] == [4096, 2048]
    rest = list(stub.Download(pb.DownloadRequest(session_id=sid, tensor=pb.TENSOR_OUT, offset=6144, chunk_bytes=0)))
    assert [len(c.data) for c in rest] == [2048]  # the default (4 MiB) holds the rest
    out = np.frombuffer(b"".join(c.data for c in first + rest), dtype=np.float32).reshape(q.shape)
    assert np.abs(out - flashserve.reference.attention(q, k, v)).max() < 1e-4


def test_abandoned_sessions_are_dropped(start_server):
    # 2 s idle: the three opens below must come within it on a loaded machine; the drop is polled for.
    s = start_server("--stream_session_timeout_ms=2000", "--stream_max_sessions=2")
    with grpc.insecure_channel(s.address) as channel:
        stub = pb_grpc.AttentionStreamServiceStub(channel)
        a = stub.OpenSession(_header(), timeout=10).session_id
        stub.Upload(iter([pb.AttentionChunk(session_id=a, tensor=pb.TENSOR_Q, offset=0, data=b"x" * 100)]))
        stub.OpenSession(_header(), timeout=10)  # abandoned at once
        with pytest.raises(grpc.RpcError) as e:
            stub.OpenSession(_header(), timeout=10)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        deadline = time.monotonic() + 30
        while True:
            time.sleep(0.2)
            with pytest.raises(grpc.RpcError) as e:
                stub.Compute(pb.ComputeRequest(session_id=a), timeout=10)
            if e.value.code() == grpc.StatusCode.NOT_FOUND or time.monotonic() > deadline:
                break
        assert e.value.code() == grpc.StatusCode.NOT_FOUND, e.value.details()
        assert stub.OpenSession(_header(), timeout=10).session_id  # room again
        assert "dropped after 2000 ms idle" in s.logs()
    assert s.stop() == 0


def test_striped_calls_are_counted_like_every_call(server, rng, make_qkv):
    """Each call of the striped API lands in flashserve_requests_total{method,status}, its duration histogram and
    request_bytes_total, through the same wrapper as Attention and ModelInfer (server/edge/grpc/grpc_call.h)."""
    if server.metrics_port is None:
        pytest.skip("this server binary has no --metrics_port")
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    stripes = 3
    q, k, v = make_qkv(rng, 1, 97, 65, 2, 1, 16, "float32")
    before = scrape(url)
    with flashserve.StripedClient(server.address, stripes=stripes, chunk_bytes=4096, timeout=60,
                                  inline_output_bytes=0) as client:
        client.attention(q, k, v)
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.AttentionStreamServiceStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            stub.Compute(pb.ComputeRequest(session_id="no-such-session"), timeout=10)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        stub.CloseSession(pb.CloseSessionRequest(session_id="no-such-session"), timeout=10)
    after = scrape(url)

    def delta(name, **labels):
        return after.value(name, **labels) - before.value(name, **labels)

    requests = "flashserve_requests_total"
    assert delta(requests, method="OpenSession", status="OK") == 1
    assert delta(requests, method="Upload", status="OK") == stripes
    assert delta(requests, method="Compute", status="OK") == 1
    assert delta(requests, method="Compute", status="NOT_FOUND") == 1
    assert delta(requests, method="Download", status="OK") == stripes
    assert delta(requests, method="CloseSession", status="OK") == 1
    assert delta("flashserve_request_duration_seconds_count", method="Compute") == 2
    assert delta("flashserve_request_duration_seconds_count", method="Upload") == stripes
    # Every tensor byte came in on an Upload and O went out on the Downloads (plus the chunks' framing).
    tensor_bytes = q.nbytes + k.nbytes + v.nbytes
    assert tensor_bytes <= delta("flashserve_request_bytes_total", direction="in") < tensor_bytes + 4096
    assert q.nbytes <= delta("flashserve_request_bytes_total", direction="out") < q.nbytes + 4096


def test_client_refuses_chunk_sizes_the_server_would_refuse():
    """The client's chunk size is also its Download chunk: past 64 MiB the server now refuses it (it was clamped)."""
    for bad in (4095, (64 << 20) + 1):
        with pytest.raises(ValueError, match="4096"):
            flashserve.StripedClient("127.0.0.1:1", chunk_bytes=bad)
    flashserve.StripedClient("127.0.0.1:1", chunk_bytes=64 << 20).close()


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))


def test_uploads_left_open_do_not_keep_closed_sessions(start_server, flashserve_bin):
    """Open a session, upload its 24 MiB without ending the Upload call, close the session, repeat. The open Upload
    held its session, and so its memory, after the table had given the session's room back: twelve rounds under
    --stream_max_sessions=2 grew the server by ~300 MB. Now a closed session's memory is freed while its Upload is
    still open (the Upload holds it only while it copies), and the memory still held by a session counts in the
    table's limits until it is freed."""
    import threading

    s = start_server("--stream_max_sessions=2", f"--max_inflight_bytes={64 << 20}")
    shape = [1, 2048, 8, 128]  # FP32: 8 MiB per tensor
    blob = np.random.default_rng(1).random(int(np.prod(shape)), dtype=np.float32).tobytes()
    header = pb.AttentionRequest()
    for t in (header.q, header.k, header.v):
        t.CopyFrom(pb.Tensor(dtype=pb.FLOAT32, shape=shape))
    gate, uploads = threading.Event(), []
    with grpc.insecure_channel(s.address, options=[("grpc.max_send_message_length", 1 << 30)]) as channel:
        stub = pb_grpc.AttentionStreamServiceStub(channel)
        base = _rss_kib(s.proc.pid)
        for _ in range(12):
            sid = stub.OpenSession(header, timeout=10).session_id  # RESOURCE_EXHAUSTED once room ran out
            sent = threading.Event()

            def chunks(sid=sid, sent=sent):
                for tensor in (pb.TENSOR_Q, pb.TENSOR_K, pb.TENSOR_V):
                    yield pb.AttentionChunk(session_id=sid if tensor == pb.TENSOR_Q else "", tensor=tensor, offset=0,
                                            data=blob)
                sent.set()
                gate.wait(60)  # the Upload stays open

            uploads.append(stub.Upload.future(chunks(), timeout=90))
            assert sent.wait(30)
            time.sleep(0.3)  # the last chunk reaches the session
            stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=10)
        grown_mib = (_rss_kib(s.proc.pid) - base) / 1024
        gate.set()
        for u in uploads:
            try:
                u.result(timeout=30)
            except grpc.RpcError as e:  # NOT_FOUND: its session closed under it (it sent nothing more)
                assert e.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.OK), e
    print(f"12 closed 24 MiB sessions with their Uploads open: server RSS grew {grown_mib:.0f} MiB")
    from test_allocators import _sanitized

    if _sanitized(flashserve_bin):
        pytest.skip("sanitized server: its allocator keeps freed memory in quarantine, so RSS cannot show it freed "
                    f"(grew {grown_mib:.0f} MiB); the plain build's run checks it")
    assert grown_mib < 120, f"closed sessions kept their memory: RSS grew {grown_mib:.0f} MiB"


def test_close_during_compute_frees_the_session_when_compute_answers(start_server, rng, make_qkv):
    """CloseSession while Compute runs (StripedClient does so when its call times out): the session was kept for the
    idle reaper (60 s), holding its slot; with --stream_max_sessions=1 every OpenSession meanwhile was refused."""
    s = start_server("--stream_max_sessions=1")
    q, k, v = make_qkv(rng, 1, 2048, 4096, 8, 8, 64, "float32")  # ~0.5 s or more on the CPU backend
    header = pb.AttentionRequest()
    for t, x in ((header.q, q), (header.k, k), (header.v, v)):
        t.CopyFrom(pb.Tensor(dtype=pb.FLOAT32, shape=list(x.shape)))
    with grpc.insecure_channel(s.address, options=[("grpc.max_send_message_length", 1 << 30)]) as channel:
        stub = pb_grpc.AttentionStreamServiceStub(channel)
        sid = stub.OpenSession(header, timeout=10).session_id
        stub.Upload(iter([pb.AttentionChunk(session_id=sid if i == 0 else "", tensor=tensor, offset=0, data=x.tobytes())
                          for i, (tensor, x) in enumerate(((pb.TENSOR_Q, q), (pb.TENSOR_K, k), (pb.TENSOR_V, v)))]),
                    timeout=30)
        computing = stub.Compute.future(pb.ComputeRequest(session_id=sid), timeout=60)
        time.sleep(0.05)
        stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=10)
        computing.result()
        # The closed session's slot is free again once the server has finished the Compute call (its answer may
        # reach the client a moment before; a sanitized server takes longer): seconds, not the reaper's 60 s.
        given_up = time.monotonic() + 5
        while True:
            try:
                assert stub.OpenSession(header, timeout=10).session_id
                break
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > given_up:
                    raise
                time.sleep(0.05)
        with pytest.raises(grpc.RpcError) as e:
            next(iter(stub.Download(pb.DownloadRequest(session_id=sid, tensor=pb.TENSOR_OUT), timeout=10)))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_the_timeout_bounds_the_whole_call(server, rng):
    """StripedClient's timeout is the whole call's, as its docstring says: each of its OpenSession, Upload, Compute
    and Download RPCs got the full timeout, so a call whose upload and answer each took most of it went on past it.
    Here the upload and the inline answer each take ~1 s behind a 4 MiB/s proxy; the timeout is 1.5 s."""
    from tcp_proxy import ThrottlingProxy

    proxy = ThrottlingProxy(int(server.address.rsplit(":", 1)[1]), rate=4 << 20, upload_rate=4 << 20)
    try:
        q = rng.standard_normal((1, 1024, 8, 128)).astype(np.float32)  # 4 MiB, as O
        k = rng.standard_normal((1, 16, 8, 128)).astype(np.float32)
        with flashserve.StripedClient(proxy.address, stripes=1) as c:
            start = time.monotonic()
            with pytest.raises(flashserve.DeadlineExceededError):
                c.attention(q, k, k, timeout=1.5)
            took = time.monotonic() - start
        assert took < 1.5 + 0.7, f"the call ran {took:.2f} s with a 1.5 s timeout"
    finally:
        proxy.close()


def test_a_compute_refused_before_it_ran_keeps_the_session(start_server, rng, make_qkv):
    """A Compute refused as busy (--max_inflight_bytes: RESOURCE_EXHAUSTED, "retry later") ended its session: the
    retry got NOT_FOUND and up to --stream_max_session_bytes had to be uploaded again (audit, session 47). A Compute
    that never ran now leaves the session as uploaded; the retry computes the right answer."""
    # The session must outlive the busy call: a sanitized server takes ~60 s over it, the default idle timeout.
    s = start_server(f"--max_inflight_bytes={64 << 20}", "--stream_session_timeout_ms=600000")
    q, k, v = make_qkv(rng, 1, 4096, 4096, 8, 8, 64, "float32")  # 32 MiB with its output
    header = pb.AttentionRequest()
    for t, x in ((header.q, q), (header.k, k), (header.v, v)):
        t.CopyFrom(pb.Tensor(dtype=pb.FLOAT32, shape=list(x.shape)))
    busy_q = rng.standard_normal((1, 4096, 8, 64)).astype(np.float32)
    busy_kv = rng.standard_normal((1, 8192, 8, 64)).astype(np.float32)  # 48 MiB in flight for a second or more
    url = f"http://127.0.0.1:{s.metrics_port}/metrics"
    with grpc.insecure_channel(s.address, options=[("grpc.max_send_message_length", 1 << 30),
                                                   ("grpc.max_receive_message_length", 1 << 30)]) as channel:
        stub = pb_grpc.AttentionStreamServiceStub(channel)

        def uploaded_session() -> str:
            sid = stub.OpenSession(header, timeout=10).session_id
            stub.Upload(iter([pb.AttentionChunk(session_id=sid if i == 0 else "", tensor=tensor, offset=0,
                                                data=x.tobytes())
                              for i, (tensor, x) in enumerate(((pb.TENSOR_Q, q), (pb.TENSOR_K, k), (pb.TENSOR_V, v)))]),
                        timeout=30)
            return sid

        refused = None
        attention = pb_grpc.AttentionServiceStub(channel).Attention
        for _ in range(5):  # a busy call that ended before the Compute came is made again, longer
            sid = uploaded_session()
            busy = attention.future(pb.AttentionRequest(q=tensors.to_proto(busy_q, "q"), k=tensors.to_proto(busy_kv, "k"),
                                                        v=tensors.to_proto(busy_kv, "v")), timeout=120)
            deadline = time.monotonic() + 30
            while scrape(url).value("flashserve_inflight_requests") < 1 and not busy.done():
                assert time.monotonic() < deadline, "the busy call never started"
                time.sleep(0.002)
            try:
                stub.Compute(pb.ComputeRequest(session_id=sid), timeout=60)
            except grpc.RpcError as e:
                refused = e
            busy.result()
            if refused is not None:
                break
            busy_kv = np.concatenate([busy_kv, busy_kv], axis=1)
        assert refused is not None and refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused
        assert "--max_inflight_bytes" in refused.details()
        stub.Compute(pb.ComputeRequest(session_id=sid), timeout=60)  # the retry: same session, inputs intact
        out = b"".join(c.data for c in stub.Download(pb.DownloadRequest(session_id=sid, tensor=pb.TENSOR_OUT),
                                                        timeout=60))
    out = np.frombuffer(out, dtype=np.float32).reshape(q.shape)
    assert not np.isnan(out).any()
    assert np.abs(out - flashserve.reference.attention(q, k, v)).max() < 1e-4
