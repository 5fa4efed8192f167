"""CreateSequenceRequest.create_token on the real server (CPU backend): a create sent again with its token answers the
sequence the first try made (already_created) and takes no pages and no sequence slot; other settings are
ALREADY_EXISTS, a malformed token INVALID_ARGUMENT (never echoed), a released sequence's token makes a new one. And
the client, whose first create's answer is lost after the server made the sequence, retries with the same token and
leaves no orphan in the pool."""

from __future__ import annotations

import grpc
import pytest

import flashserve
from conftest import ServerProcess, _stop_and_check
from flashserve import sequences_pb2 as spb
from flashserve import sequences_pb2_grpc as spb_grpc
from flashserve import tensors
from metrics_helpers import scrape
from sequences_truth import Truth
from tcp_proxy import AnswerCutter

pytestmark = pytest.mark.e2e
SHAPE = dict(num_layers=2, heads_q=8, heads_kv=2, head_dim=64, dtype="bfloat16")
TOKEN = "t0k3n-of_22-chars-AbCd"


@pytest.fixture(scope="module")
def token_server(flashserve_bin, tmp_path_factory):
    s = ServerProcess(flashserve_bin, tmp_path_factory.mktemp("seq_token"),
                      ["--kv_cache_bytes=67108864", "--kv_page_tokens=16"], name="seq_token").start()
    yield s
    _stop_and_check(s)


@pytest.fixture
def stub(token_server):
    with grpc.insecure_channel(token_server.address) as channel:
        yield spb_grpc.SequencesStub(channel)


@pytest.fixture
def truth(rng):
    return Truth(rng, SHAPE["heads_q"], SHAPE["heads_kv"], SHAPE["head_dim"], SHAPE["dtype"])


def _request(truth, token, rows=20, heads_kv=2):
    """A CreateSequenceRequest of SHAPE (heads_kv aside) with `rows` random prefix rows in layer 0."""
    request = spb.CreateSequenceRequest(num_layers=2, heads_q=8, heads_kv=heads_kv, head_dim=64,
                                        dtype=tensors.PROTO_DTYPE["bfloat16"], create_token=token)
    if rows and heads_kv == 2:
        k, v = truth.rows(rows)
        request.prefix.add(layer=0, k=tensors.to_proto_rows(k, "k"), v=tensors.to_proto_rows(v, "v"))
    return request


def _pool(stub):
    info = stub.GetKvPoolInfo(spb.GetKvPoolInfoRequest(), timeout=30)
    return info.sequences, info.pages_used


def _metric(server, name):
    return scrape(f"http://127.0.0.1:{server.metrics_port}/metrics").value(name)


def _release(stub, *ids):
    stub.Release(spb.ReleaseRequest(sequence_ids=list(ids)), timeout=30)


def test_a_create_sent_again_with_its_token_answers_the_same_sequence(token_server, stub, truth):
    before_pool = _pool(stub)
    before_replays = _metric(token_server, "flashserve_kv_sequences_already_created_total")
    first = stub.CreateSequence(_request(truth, TOKEN), timeout=30)
    made = _pool(stub)
    assert made == (before_pool[0] + 1, before_pool[1] + 2)  # 20 rows in pages of 16
    again = stub.CreateSequence(_request(truth, TOKEN), timeout=30)  # other bytes, same row counts
    assert not first.already_created and again.already_created
    assert again.sequence_id == first.sequence_id
    assert list(again.layer_lengths) == list(first.layer_lengths) == [20, 0]
    assert (again.ttl_ms, again.max_tokens) == (first.ttl_ms, first.max_tokens)
    assert _pool(stub) == made, "the replay took a sequence slot or pages"
    info = stub.GetSequenceInfo(spb.GetSequenceInfoRequest(sequence_id=first.sequence_id), timeout=30)
    assert info.idle_ms < 5_000
    assert _metric(token_server, "flashserve_kv_sequences_already_created_total") == before_replays + 1
    # After an append the replay answers the lengths as they are now.
    k, v = truth.rows(3)
    append = spb.AppendRequest(sequence_id=first.sequence_id)
    append.rows.add(layer=1, k=tensors.to_proto_rows(k, "k"), v=tensors.to_proto_rows(v, "v"), expected_length=0)
    stub.Append(append, timeout=30)
    assert list(stub.CreateSequence(_request(truth, TOKEN), timeout=30).layer_lengths) == [20, 3]
    # Released, the token is forgotten: the same create makes a new sequence.
    _release(stub, first.sequence_id)
    later = stub.CreateSequence(_request(truth, TOKEN), timeout=30)
    assert not later.already_created and later.sequence_id != first.sequence_id
    _release(stub, later.sequence_id)
    assert _pool(stub) == before_pool


def test_other_settings_and_malformed_tokens_are_refused_without_echo(token_server, stub, truth):
    token = "settings-token-0123456789"
    first = stub.CreateSequence(_request(truth, token), timeout=30)
    before = _pool(stub)
    for request, named in [(_request(truth, token, heads_kv=1), "heads_kv = 2, this request has 1"),
                           (_request(truth, token, rows=21), "prefix rows of layer 0 = 20, this request has 21")]:
        with pytest.raises(grpc.RpcError) as info:
            stub.CreateSequence(request, timeout=30)
        assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert named in info.value.details() and token not in info.value.details()
    for bad in ["a" * 15, "a" * 65, "bad/token/0123456789", "bad token 0123456789", "bad.token.0123456789"]:
        with pytest.raises(grpc.RpcError) as info:
            stub.CreateSequence(_request(truth, bad), timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"({len(bad)} bytes)" in info.value.details() and bad not in info.value.details()
    assert _pool(stub) == before
    _release(stub, first.sequence_id)


def _lose_first_create_answer(client, monkeypatch, code):
    """The client's first CreateSequence runs on the server; its answer is then lost (raised as `code`, as a dropped
    connection or a deadline that raced the answer would). Returns the ids the server answered."""
    answered = []
    real_call = client._call

    class _Lost(grpc.RpcError):
        def code(self):
            return code

        def details(self):
            return "the answer was lost on its way (test)"

    def call(endpoint, method, request):
        fn = real_call(endpoint, method, request)
        if method != "CreateSequence":
            return fn

        def lossy(*args, **kwargs):
            response = fn(*args, **kwargs)
            answered.append(response.sequence_id)
            if len(answered) == 1:
                raise _Lost()
            return response
        return lossy

    monkeypatch.setattr(client, "_call", call)
    return answered


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED])
def test_client_retries_a_lost_create_with_its_token_and_leaves_no_orphan(token_server, stub, truth, monkeypatch,
                                                                          code):
    before = _pool(stub)
    with flashserve.SequenceClient(token_server.address, timeout=30) as client:
        answered = _lose_first_create_answer(client, monkeypatch, code)
        k, v = truth.rows(20)
        seq = client.create(**SHAPE, prefix={0: (k, v)}, key="lost")
        truth.add("lost", 0, k, v)
        assert len(answered) == 2 and answered[0] == answered[1] == seq.id
        assert client.stats["already_created"] == 1
        assert _pool(stub) == (before[0] + 1, before[1] + 2), "the lost create left an orphan"
        q, (k1, v1) = truth.query(), truth.rows(1)
        out = seq.step(0, q, k1, v1)
        truth.add("lost", 0, k1, v1)
        truth.check(out, q, "lost", 0)
        seq.release()
    assert _pool(stub) == before


def test_client_recreates_after_not_found_with_a_new_token(token_server, stub, truth, monkeypatch):
    """A re-prefill after NOT_FOUND must not reuse the lost sequence's token (the server may still hold a sequence
    under it, e.g. one the client gave up on)."""
    with flashserve.SequenceClient(token_server.address, timeout=30) as client:
        sent = []
        real_call = client._call

        def call(endpoint, method, request):
            if method == "CreateSequence":
                sent.append(spb.CreateSequenceRequest.FromString(request).create_token)
            return real_call(endpoint, method, request)

        monkeypatch.setattr(client, "_call", call)
        k, v = truth.rows(5)
        seq = client.create(**SHAPE, prefix={0: (k, v)}, key="gone")
        truth.add("gone", 0, k, v)
        _release(stub, seq.id)  # lost, as after an eviction
        q = truth.query()
        truth.check(seq.attend(0, q), q, "gone", 0)
        assert seq.reprefills == 1 and client.stats["already_created"] == 0
        assert len(sent) == 2 and len(set(sent)) == 2 and all(len(t) >= 22 for t in sent)
        seq.release()
        explicit = client.create(**SHAPE, create_token=TOKEN + "-explicit")
        assert sent[-1] == TOKEN + "-explicit"
        explicit.release()


def test_client_behind_a_proxy_that_cuts_the_create_answer(token_server, stub, truth):
    """Over a real connection: the proxy drops the connection once the server has sent the create's answer
    (tcp_proxy.AnswerCutter). The client sees UNAVAILABLE, retries with the same token and gets the sequence: one
    sequence in the pool, none orphaned."""
    before = _pool(stub)
    proxy = AnswerCutter(port=int(token_server.address.rsplit(":", 1)[1]))
    try:
        with flashserve.SequenceClient(proxy.address, timeout=10) as client:
            client.pool_info()  # the connection up, so that the cut falls on the create's answer
            # Cut at the answer's first frame (HEADERS, sent once the create has run); the control frames the server
            # sends on receiving the request (a ping ack, window updates) pass, however many there are.
            proxy.cut_next_answer(at_headers=True)
            k, v = truth.rows(20)
            seq = client.create(**SHAPE, prefix={0: (k, v)}, key="cut")
            truth.add("cut", 0, k, v)
            assert proxy.cut == 1
            assert client.stats["already_created"] == 1
            assert _pool(stub) == (before[0] + 1, before[1] + 2), "the cut create left an orphan"
            q = truth.query()
            truth.check(seq.attend(0, q), q, "cut", 0)
            seq.release()
    finally:
        proxy.close()
    assert _pool(stub) == before
