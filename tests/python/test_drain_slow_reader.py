"""SIGTERM while a large answer is still being written to a slow reader: every API (native Attention, KServe
ModelInfer, striped download, KServe REST, a Sequences DecodeStep or Attend) must finish writing it within the grace
period, not cut it off when gRPC's own shutdown deadline (1 s) passes. The reader is slowed by a TCP proxy that passes the server's bytes on at a
few MB/s. The other side of that wait: a client that stalls mid-upload holds the exit until the grace period ends,
and no longer."""

from __future__ import annotations

import signal
import threading
import time

import numpy as np
import pytest

import flashserve
from flashserve import sequences_pb2 as spb
from flashserve import tensors
from conftest import assert_matches_reference, zip_all
from sequences_truth import Truth
from metrics_helpers import scrape
from tcp_proxy import ThrottlingProxy
from test_kserve_grpc import infer_request, oip, outputs_of, stub_for  # noqa: F401 - oip is a fixture
from test_kserve_rest import binary_request, decode

pytestmark = pytest.mark.e2e

# 16 MiB of output (q's size) for very little compute: seqlen_k is tiny.
Q_SHAPE, KV_SHAPE = (1, 8192, 4, 128), (1, 8, 4, 128)


def _inputs(rng):
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


def _call_striped(address, q, k, v, stripes=2):
    with flashserve.StripedClient(address, stripes=stripes, timeout=120) as c:
        return c.attention(q, k, v)


def _answer_to_a_slow_reader(server, proxy, call, answered=lambda: True):
    """Runs call() (its answer passes `proxy`), sends SIGTERM once 1 MiB of the answer went through and
    `answered()` holds; returns (result, exit code, seconds from SIGTERM to the answer's end)."""
    result = {}

    def run():
        try:
            result["out"] = call()
            result["at"] = time.monotonic()
        except BaseException as e:  # noqa: BLE001 - reported below
            result["error"] = e

    thread = threading.Thread(target=run)
    try:
        thread.start()
        # SIGTERM once the answer is flowing: its computation is over, gRPC is writing it.
        deadline = time.monotonic() + 60
        while (proxy.to_client < (1 << 20) or not answered()) and thread.is_alive() and time.monotonic() < deadline:
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
    assert "error" not in result, f"the answer was cut off: {result.get('error')}\n{server.logs()}"
    assert code == 0, f"exit code {code}\n{server.logs()}"
    return result["out"], result["at"] - sigterm_at


# striped_inline: one stripe, so Compute answers O inline (its reactor was not counted as a live call: cut off).
@pytest.mark.parametrize("api", ["native", "kserve", "striped", "striped_inline", "rest"])
def test_sigterm_while_a_large_answer_is_written_to_a_slow_reader(api, start_server, request, rng):
    server = start_server("--shutdown_grace_seconds=60", name=f"drain_{api}")
    proxy = ThrottlingProxy(server.http_port if api == "rest" else server.grpc_port)
    q, k, v = _inputs(rng)
    call = {"native": _call_native, "striped": _call_striped, "rest": _call_rest,
            "striped_inline": lambda *a: _call_striped(*a, stripes=1),
            "kserve": lambda *a: _call_kserve(request.getfixturevalue("oip"), *a)}[api]
    out, answered_after = _answer_to_a_slow_reader(server, proxy, lambda: call(proxy.address, q, k, v))
    # The write went on well past the 1 s gRPC gives its calls at shutdown: the drain waited for it.
    assert answered_after > 1.5, f"{api}: answer complete {answered_after:.2f} s after SIGTERM"
    # The whole answer: most of it was written after SIGTERM (only the first MiB had reached the client).
    assert_matches_reference(out, None, q, k, v)


def _sequences_behind_a_slow_proxy(start_server, rng, name, heads_q, head_dim, prefixes, rate=4 << 20):
    """A server with a KV cache, a throttling proxy to it (`rate` bytes/s to the client), and fp16 sequences (8 KV
    heads) created directly."""
    server = start_server("--shutdown_grace_seconds=60", "--kv_cache_bytes=67108864", "--kv_page_tokens=16",
                          name=name)
    proxy = ThrottlingProxy(server.grpc_port, rate=rate)
    truth = Truth(rng, heads_q=heads_q, heads_kv=8, head_dim=head_dim, dtype="float16")
    with flashserve.SequenceClient(server.address, timeout=120, reprefill=False) as setup:
        seqs = truth.create(setup, prefixes)
    return server, proxy, truth, seqs


def test_sigterm_while_a_decode_step_answer_is_written_to_a_slow_reader(start_server, rng):
    """The same for a DecodeStep, whose answer is sent from the buffer its outputs were computed into
    (edge/sequences/answer_buffer.h): 64 sequences x 16 query rows x 64 heads x d128 = 16 MiB of O."""
    server, proxy, truth, seqs = _sequences_behind_a_slow_proxy(start_server, rng, "drain_sequences", 64, 128,
                                                                [1 + i % 9 for i in range(64)])
    qs = [truth.query(16) for _ in seqs]

    def step():
        with flashserve.SequenceClient(proxy.address, timeout=120, reprefill=False) as client:
            request = spb.DecodeStepRequest()
            for seq, q in zip(seqs, qs):
                request.items.add(sequence_id=seq.id, layer=0).q.CopyFrom(tensors.to_proto_rows(q, "q"))
            return client.stub(client.endpoints[0]).DecodeStep(request, timeout=120)

    response, answered_after = _answer_to_a_slow_reader(server, proxy, step)
    assert answered_after > 1.5, f"answer complete {answered_after:.2f} s after SIGTERM"
    assert len(response.results) == len(seqs)
    for seq, q, result in list(zip_all(seqs, qs, response.results))[::7]:
        out = np.frombuffer(result.out.data, np.float16).reshape(q.shape)
        assert not np.isnan(out.astype(np.float32)).any()
        truth.check(out, q, seq.key, 0)


def test_sigterm_while_attend_answers_are_written_to_a_slow_reader(start_server, rng):
    """The same for Attend, whose typed answer is built in the call's done callback (its admission ends there):
    eight answers of 2 MiB on one connection, more than the sockets between server and reader hold, so the drain
    must count the calls themselves until gRPC has written them."""
    # 2 MB/s: SIGTERM waits for all eight to be computed, which on a busy 2-core machine let ~10 of the 16 MiB
    # through first at 4 MB/s (a CI run saw the rest arrive 1.497 s after SIGTERM, under the 1.5 s the test needs).
    server, proxy, truth, seqs = _sequences_behind_a_slow_proxy(start_server, rng, "drain_attend", 256, 256,
                                                                [1 + i % 5 for i in range(8)], rate=2 << 20)
    qs = [truth.query(16) for _ in seqs]  # 16 x 256 x 256 fp16: 2 MiB of O each

    def attend_all():
        with flashserve.SequenceClient(proxy.address, timeout=120, reprefill=False) as client:
            stub = client.stub(client.endpoints[0])
            futures = [stub.Attend.future(spb.AttendRequest(sequence_id=seq.id, layer=0,
                                                            q=tensors.to_proto_rows(q, "q")), timeout=120)
                       for seq, q in zip(seqs, qs)]
            return [f.result() for f in futures]

    def all_answered():  # every call computed and its answer handed to gRPC (counted at that point)
        url = f"http://127.0.0.1:{server.metrics_port}/metrics"
        return scrape(url).value("flashserve_requests_total", method="Attend", status="OK") >= len(seqs)

    responses, answered_after = _answer_to_a_slow_reader(server, proxy, attend_all, all_answered)
    assert answered_after > 1.5, f"answers complete {answered_after:.2f} s after SIGTERM"
    for seq, q, response in list(zip_all(seqs, qs, responses))[::3]:
        out = np.frombuffer(response.out.data, np.float16).reshape(q.shape)
        assert not np.isnan(out.astype(np.float32)).any()
        truth.check(out, q, seq.key, 0)


def test_sigterm_with_a_stalled_upload_waits_out_the_grace_period(start_server, rng):
    """A native call admitted from its first byte whose client then stops sending: SIGTERM waits for it up to
    --shutdown_grace_seconds, then cancels it and exits 0 -- neither sooner (that request would be dropped while it
    might still arrive) nor later."""
    grace_s = 3
    server = start_server(f"--shutdown_grace_seconds={grace_s}", name="drain_stalled")
    proxy = ThrottlingProxy(server.grpc_port, upload_limit=2 << 20)
    q, k, v = _inputs(rng)  # 16 MiB of q: the proxy passes 2 MiB of it
    result = {}

    def run():
        try:
            result["out"] = _call_native(proxy.address, q, k, v)
        except BaseException as e:  # noqa: BLE001 - checked below
            result["error"] = e

    thread = threading.Thread(target=run)
    try:
        thread.start()
        proxy.wait_to_server(2 << 20, timeout=30)
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
