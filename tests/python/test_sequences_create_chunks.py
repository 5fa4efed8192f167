"""A create whose prefix is more than create_chunk_bytes of K/V goes as the create and appends (flashserve/
_seq_create.py): the sequence holds every row in order, a re-prefill after NOT_FOUND goes the same way, and an
append that fails releases the part made. Against in-process fakes (sequences_fake.py) and the real server (CPU
backend) with a --max_request_bytes the whole prefix would not fit."""

from __future__ import annotations

import os

import grpc
import pytest

import flashserve
from conftest import ServerProcess, _stop_and_check
from sequences_fake import FakeSequencesServer
from sequences_truth import Truth

SHAPE = dict(num_layers=3, heads_q=4, heads_kv=2, head_dim=16, dtype="float16")  # 64-byte rows


@pytest.fixture
def fake():
    server = FakeSequencesServer()
    yield server
    server.stop()


def _truth(rng, shape=SHAPE):
    return Truth(rng, shape["heads_q"], shape["heads_kv"], shape["head_dim"], shape["dtype"])


def _create(client, truth, rows, key, shape=SHAPE):
    prefix = {layer: truth.rows(n) for layer, n in enumerate(rows)}
    seq = client.create(**shape, prefix=prefix, key=key)
    for layer, (k, v) in prefix.items():
        truth.add(key, layer, k, v)
    return seq


def _check_layers(seq, truth, layers):
    """Causal attends of up to 16 query rows (the most a call takes): row i sees only the keys up to its place, so
    rows in another order change the answer (a one-row, non-causal attend cannot tell: chunks sent in reverse order
    passed)."""
    for layer in range(layers):
        q = truth.query(max(1, min(16, truth.length(seq.key, layer))))
        truth.check(seq.attend(layer, q, causal=True), q, seq.key, layer, causal=True)


def test_a_prefix_over_the_chunk_goes_as_a_create_and_appends(fake, rng):
    truth = _truth(rng)
    with flashserve.SequenceClient(fake.address, timeout=30, create_chunk_bytes=4096) as client:
        seq = _create(client, truth, (50, 3, 70), "big")  # 128 B per row of K and V: 32 rows a request
        assert fake.servicer.calls.count("CreateSequence") == 1
        assert fake.servicer.calls.count("Append") == 4, fake.servicer.calls
        assert seq.lengths == [50, 3, 70]
        _check_layers(seq, truth, 3)
        small = _create(client, truth, (10, 2, 5), "small")  # fits: one create
        assert fake.servicer.calls.count("Append") == 4
        _check_layers(small, truth, 3)
        # Lost by the server: re-created from the history the same way, every row back in order.
        fake.servicer.forget_all()
        q = truth.query()
        truth.check(seq.attend(2, q), q, seq.key, 2)
        assert seq.reprefills == 1 and fake.servicer.calls.count("Append") == 8, fake.servicer.calls
        _check_layers(seq, truth, 3)


def test_an_append_that_fails_releases_the_part_made(fake, rng):
    truth = _truth(rng)
    with flashserve.SequenceClient(fake.address, timeout=30, create_chunk_bytes=4096) as client:
        fake.servicer.fail_next_append = (grpc.StatusCode.RESOURCE_EXHAUSTED, False)
        with pytest.raises(flashserve.errors.FlashserveError) as info:
            _create(client, truth, (50, 3, 70), "fails")
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert fake.servicer.seqs == {}, "the sequence holding part of the prefix was left on the server"
        assert fake.servicer.calls[-1] == "Release"


def test_chunk_bytes_must_be_positive():
    with pytest.raises(ValueError):
        flashserve.SequenceClient("127.0.0.1:1", create_chunk_bytes=0)


def test_max_attempts_must_allow_a_try():
    """max_attempts=0 was taken, and every call then failed deep inside (AssertionError, UnboundLocalError)."""
    with pytest.raises(ValueError, match="max_attempts"):
        flashserve.SequenceClient("127.0.0.1:1", max_attempts=0)


@pytest.mark.e2e
def test_a_prefix_over_the_servers_request_limit(flashserve_bin, tmp_path, rng):
    """The real server with --max_request_bytes=1 MiB: a 3-layer prefix of 3 MiB is refused whole, created in 256 KiB
    requests, answers against fp64, and comes back the same way after the server lost the sequence."""
    shape = dict(num_layers=3, heads_q=8, heads_kv=4, head_dim=64, dtype="bfloat16")  # 512-byte rows
    server = ServerProcess(flashserve_bin, tmp_path, ["--kv_cache_bytes=67108864", "--kv_page_tokens=16",
                                                      "--max_request_bytes=1048576"], name="create_chunks").start()
    try:
        truth = _truth(rng, shape)
        rows = (1024, 700, 1100)  # 1 MiB of K and V per 1024 rows
        with flashserve.SequenceClient(server.address, timeout=30, reprefill=False) as whole:
            with pytest.raises(flashserve.errors.FlashserveError) as info:
                _create(whole, _truth(rng, shape), rows, "whole", shape)
            assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value
        with flashserve.SequenceClient(server.address, timeout=30, create_chunk_bytes=256 << 10) as client:
            seq = _create(client, truth, rows, "chunked", shape)
            assert seq.lengths == list(rows)
            _check_layers(seq, truth, 3)
            with flashserve.SequenceClient(server.address, timeout=30) as other:  # lost behind the client's back
                other.stub(server.address).Release(flashserve.sequences_pb2.ReleaseRequest(sequence_ids=[seq.id]))
            q = truth.query()
            truth.check(seq.attend(1, q), q, seq.key, 1)
            assert seq.reprefills == 1
            _check_layers(seq, truth, 3)
    finally:
        _stop_and_check(server)
        assert not os.path.exists(os.path.join(tmp_path, "core"))
