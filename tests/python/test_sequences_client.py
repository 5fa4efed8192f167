"""SequenceClient logic against in-process fakes (sequences_fake.py): consistent hashing, re-prefill after a lost
sequence, a server leaving the ring, the routing header. The real server: test_sequences_e2e*.py."""

from __future__ import annotations

import collections
import concurrent.futures

import grpc
import numpy as np
import pytest

import flashserve
from flashserve.hashring import HashRing

pytest.importorskip("flashserve.sequence_client", reason="no sequences.proto in this checkout")

from conftest import zip_all  # noqa: E402
from ring_keys import keys_spread_over  # noqa: E402
from sequences_fake import FakeSequencesServer  # noqa: E402
from sequences_truth import Truth  # noqa: E402

SHAPE = dict(num_layers=2, heads_q=4, heads_kv=2, head_dim=16, dtype="float16")


@pytest.fixture
def fakes():
    servers = [FakeSequencesServer() for _ in range(3)]
    yield servers
    for s in servers:
        s.stop()


def _truth(rng):
    return Truth(rng, SHAPE["heads_q"], SHAPE["heads_kv"], SHAPE["head_dim"], SHAPE["dtype"])


# --- the CreateSequence request's wire bytes ---------------------------------------------------------------------------

def test_create_request_bytes_parse_to_the_typed_request(rng):
    """The client joins a CreateSequence request from its prefix's bytes (flashserve/_wire.py): they must parse to
    exactly the message the typed path builds: layers given out of order, rows whose lengths need multi-byte varints,
    a tensor in a shared-memory region (no data), an empty layer, a long label."""
    from flashserve import sequences_pb2 as spb
    from flashserve import tensors
    from flashserve._pb import attention_pb2 as pb
    from flashserve._wire import create_request_bytes

    def rows(n):
        return tensors.to_proto_rows(rng.standard_normal((n, 2, 64)).astype(np.float16), "k")

    in_region = pb.Tensor(dtype=tensors.PROTO_DTYPE["float16"], shape=[7, 2, 64],
                          shm=pb.SharedMemoryRef(region="r\u00e9gion", offset=1 << 40, byte_size=7 * 2 * 64 * 2))
    empty = pb.Tensor(dtype=tensors.PROTO_DTYPE["float16"], shape=[0, 2, 64])
    host = tensors.to_host_rows(rng.standard_normal((129, 2, 64)).astype(np.float16), "k")  # what create() sends
    prefix = {5: (rows(300), rows(300)), 0: (rows(1), rows(1)), 2: (in_region, in_region), 3: (empty, empty),
              4: (host, host)}
    header = spb.CreateSequenceRequest(num_layers=6, heads_q=4, heads_kv=2, head_dim=64,
                                       dtype=tensors.PROTO_DTYPE["float16"], max_tokens=(1 << 33) + 5,
                                       label="prefill \u2192 " * 40)
    typed = spb.CreateSequenceRequest()
    typed.CopyFrom(header)
    as_proto = {layer: tuple(t if isinstance(t, pb.Tensor) else pb.Tensor(dtype=t.dtype, shape=t.shape, data=t.data)
                             for t in kv) for layer, kv in prefix.items()}
    for layer, (k, v) in sorted(as_proto.items()):
        typed.prefix.add(layer=layer, k=k, v=v)
    raw = create_request_bytes(header, prefix)
    assert spb.CreateSequenceRequest.FromString(raw) == typed
    assert len(raw) == typed.ByteSize()


def test_append_request_bytes_parse_to_the_typed_request(rng):
    """Append's request is joined from its rows' bytes (flashserve/_wire.py): it must parse to exactly the typed
    message -- layers given out of order, rows long enough for multi-byte varints, an expected_length past 2^32 and
    one of 0, pb.Tensor and HostRows rows."""
    from flashserve import sequences_pb2 as spb
    from flashserve import tensors
    from flashserve._pb import attention_pb2 as pb
    from flashserve._wire import append_request_bytes

    def host(n):
        return tensors.to_host_rows(rng.standard_normal((n, 2, 64)).astype(np.float16), "k")

    proto = tensors.to_proto_rows(rng.standard_normal((3, 2, 64)).astype(np.float16), "k")
    rows = {7: (host(300), host(300)), 0: (proto, proto), 2: (host(1), host(1))}
    expected = {7: (1 << 33) + 3, 0: 0, 2: 17}
    typed = spb.AppendRequest(sequence_id="f" * 32)
    for layer in sorted(rows):
        k, v = (t if isinstance(t, pb.Tensor) else pb.Tensor(dtype=t.dtype, shape=t.shape, data=bytes(t.data))
                for t in rows[layer])
        typed.rows.add(layer=layer, k=k, v=v, expected_length=expected[layer])
    raw = append_request_bytes("f" * 32, rows, expected)
    assert spb.AppendRequest.FromString(raw) == typed
    assert len(raw) == typed.ByteSize()


@pytest.mark.parametrize("with_kv", [True, False])
def test_packed_step_bytes_parse_to_the_typed_request(rng, with_kv):
    """A packed DecodeStep is joined from its tensors' bytes (flashserve/packed_step.py, _wire.py): it must parse to
    exactly the typed message -- uneven rows (long enough for multi-byte varints), items with and without k/v (and
    without expected_length then), pb.Tensor pieces and views of one batch tensor (decode_step_batch), a scale."""
    from flashserve import sequences_pb2 as spb
    from flashserve import tensors
    from flashserve._pb import attention_pb2 as pb
    from flashserve.packed_step import packed_step_request

    def rows(n, heads):
        return tensors.to_proto_rows(rng.standard_normal((n, heads, 64)).astype(np.float16), "x")

    whole = tensors.to_host_rows(rng.standard_normal((6, 4, 64)).astype(np.float16), "q")
    view = memoryview(whole.data)
    blocks = [tensors.HostRows(whole.dtype, (3, 4, 64), view[i * 3 * 4 * 64 * 2:(i + 1) * 3 * 4 * 64 * 2])
              for i in range(2)]
    items = [("a" * 32, 0, rows(1, 4), rows(1, 2), rows(1, 2)), ("b" * 32, 3, blocks[0], None, None),
             ("c" * 32, 1, blocks[1], rows(300, 2), rows(300, 2)), ("d" * 32, 2, rows(16, 4), rows(0, 2), rows(0, 2))]
    if not with_kv:
        items = [(sid, layer, q, None, None) for sid, layer, q, _, _ in items]
    expected = [7, None, 1 << 35, 0] if with_kv else [None] * 4
    raw = packed_step_request(items, expected, (True, 0.25, True))

    def proto(t):
        return t if isinstance(t, pb.Tensor) else pb.Tensor(dtype=t.dtype, shape=t.shape, data=bytes(t.data))

    def joined(pieces):
        pieces = [proto(t) for t in pieces]
        return pb.Tensor(dtype=pieces[0].dtype, shape=[sum(t.shape[0] for t in pieces), *pieces[0].shape[1:]],
                         data=b"".join(t.data for t in pieces))

    typed = spb.DecodeStepRequest(causal=True, return_lse=True, softmax_scale=0.25)
    for (sid, layer, *_), length in zip(items, expected):
        entry = typed.items.add(sequence_id=sid, layer=layer)
        if length is not None:
            entry.expected_length = length
    typed.packed.q.CopyFrom(joined([q for _, _, q, _, _ in items]))
    typed.packed.rows_q.extend(int(q.shape[0]) for _, _, q, _, _ in items)
    typed.packed.answer_packed = True  # O / LSE asked for as one tensor each
    if with_kv:
        typed.packed.k.CopyFrom(joined([k for _, _, _, k, _ in items if k is not None]))
        typed.packed.v.CopyFrom(joined([v for _, _, _, k, v in items if k is not None]))
        typed.packed.rows_kv.extend(int(k.shape[0]) if k is not None else 0 for _, _, _, k, _ in items)
    assert spb.DecodeStepRequest.FromString(raw) == typed
    assert len(raw) == typed.ByteSize()
    mixed = items[:1] + [("e" * 32, 0, rows(1, 2), None, None)]  # another head count: not one packed tensor
    assert packed_step_request(mixed, [None, None], (False, None, False)) is None
    # A v of another dtype than the other items' (bf16 next to fp16): per item, where the server refuses it by
    # name, not relabeled as the first item's dtype in one packed v.
    bf16_v = tensors.to_proto_rows(rng.standard_normal((1, 2, 64)).astype(np.float32), "v")
    bf16_v.dtype = pb.BFLOAT16
    bf16_v.data = bf16_v.data[:len(bf16_v.data) // 2]
    other_v = items[:1] + [("e" * 32, 0, rows(1, 4), rows(1, 2), bf16_v)]
    assert packed_step_request(other_v, [None, None], (False, None, False)) is None


def test_batch_step_history_keeps_each_sequences_own_rows(fakes, rng):
    """decode_step_batch appends one block of k/v per sequence; each sequence's history keeps its own block's bytes,
    not a view of the whole batch's buffer (which would keep 64 sequences' rows alive for the one that stays)."""
    with flashserve.SequenceClient(fakes[0].address, timeout=30) as client:
        seqs = [client.create(1, 4, 2, 16, "float16") for _ in range(8)]
        q = rng.standard_normal((8, 4, 16)).astype(np.float16)
        k = rng.standard_normal((8, 2, 16)).astype(np.float16)
        client.decode_step_batch(seqs, 0, q, k, k.copy())
        for seq in seqs:
            for pieces in (seq._history._k[0], seq._history._v[0]):
                for piece in pieces:
                    held = memoryview(piece.data).obj
                    assert len(held) == len(piece.data) == 2 * 16 * 2, (len(held), len(piece.data))


def test_endpoints_named_twice_count_once():
    client = flashserve.SequenceClient(["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:1"])
    assert client.endpoints == ["127.0.0.1:1", "127.0.0.1:2"]
    client.close()


def test_history_joins_a_prefix_and_appended_rows(rng):
    """A sequence's history (what a re-prefill sends): the prefix as HostRows, then appended pb.Tensor rows, joined
    per layer in order; its byte count comes from the shapes."""
    from flashserve import tensors
    from flashserve._seq_history import LayerHistory

    arrays = [rng.standard_normal((n, 2, 64)).astype(np.float16) for n in (5, 1, 3)]
    history = LayerHistory(2)
    history.replace({1: (tensors.to_host_rows(arrays[0], "k"), tensors.to_host_rows(-arrays[0], "v"))})
    for a in arrays[1:]:
        history.add(1, tensors.to_proto_rows(a, "k"), tensors.to_proto_rows(-a, "v"))
    k, v = history.prefix()[1]
    assert list(k.shape) == [9, 2, 64] and history.rows(1) == 9 and 0 not in history.prefix()
    assert k.data == np.concatenate(arrays).tobytes() and v.data == (-np.concatenate(arrays)).tobytes()
    assert history.bytes == 2 * 9 * 2 * 64 * 2


# --- the ring --------------------------------------------------------------------------------------------------------


def test_ring_spreads_keys_and_is_deterministic():
    endpoints = ["a:1", "b:1", "c:1"]
    ring, again = HashRing(endpoints), HashRing(list(reversed(endpoints)))
    keys = [f"key-{i}" for i in range(6000)]
    owners = collections.Counter(ring.lookup(k) for k in keys)
    assert set(owners) == set(endpoints)
    assert all(1500 <= n <= 2500 for n in owners.values()), owners  # 2000 each when perfectly even
    assert all(ring.lookup(k) == again.lookup(k) for k in keys[:500])  # list order does not matter


def test_ring_moves_only_the_keys_of_a_removed_endpoint():
    ring = HashRing(["a:1", "b:1", "c:1"])
    keys = [f"key-{i}" for i in range(3000)]
    before = {k: ring.lookup(k) for k in keys}
    after = {k: ring.lookup(k, exclude={"b:1"}) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == "b:1" for k in moved)
    assert all(after[k] != "b:1" for k in keys)
    with pytest.raises(ValueError):
        ring.lookup("x", exclude={"a:1", "b:1", "c:1"})


# --- one endpoint ----------------------------------------------------------------------------------------------------


def _decode_rounds(client, seqs, truth, steps, layer=0):
    for _ in range(steps):
        qs = {s.key: truth.query() for s in seqs}
        kvs = {s.key: truth.rows(1) for s in seqs}
        outs = client.decode_step([(s, layer, qs[s.key], *kvs[s.key]) for s in seqs])
        for s, out in zip_all(seqs, outs):
            truth.add(s.key, layer, *(x.copy() for x in kvs[s.key]))
            truth.check(out, qs[s.key], s.key, layer)
            for x in (qs[s.key], *kvs[s.key]):  # the caller reuses its buffers: a re-prefill sends the history's
                x[...] = np.nan


def test_steps_match_reference_and_reprefill_after_loss(fakes, rng):
    truth = _truth(rng)
    with flashserve.SequenceClient(fakes[0].address, timeout=30) as client:
        seqs = []
        for i in range(3):
            k, v = truth.rows(5 + i)
            seq = client.create(**SHAPE, prefix={0: (k, v)})
            truth.add(seq.key, 0, k, v)
            seqs.append(seq)
        _decode_rounds(client, seqs, truth, 4)
        old_ids = [s.id for s in seqs]
        fakes[0].servicer.forget_all()  # an eviction or a restart
        _decode_rounds(client, seqs, truth, 4)
        assert client.stats["not_found"] == 1 and all(s.reprefills == 1 for s in seqs)
        assert all(s.id != old for s, old in zip(seqs, old_ids))
        assert [s.lengths[0] for s in seqs] == [truth.length(s.key, 0) for s in seqs]


@pytest.mark.parametrize("packed_steps", [True, False])
def test_steps_go_packed_unless_told_not_to(fakes, rng, packed_steps):
    """decode_step sends DecodeStepRequest.packed by default (items with and without k/v, uneven rows) and one tensor
    per item with packed_steps=False; the answers match the reference either way."""
    truth = _truth(rng)
    with flashserve.SequenceClient(fakes[0].address, timeout=30, packed_steps=packed_steps) as client:
        seqs = []
        for i in range(3):
            k, v = truth.rows(3 + i)
            seqs.append(client.create(**SHAPE, prefix={0: (k, v)}))
            truth.add(seqs[-1].key, 0, k, v)
        for step in range(3):
            qs = [truth.query(1 + (i + step) % 3) for i in range(3)]
            kvs = [truth.rows(len(q)) if (i + step) % 3 else (None, None) for i, q in enumerate(qs)]
            outs = client.decode_step([(s, 0, q, *kv) for s, q, kv in zip(seqs, qs, kvs)])
            for s, q, kv, out in zip_all(seqs, qs, kvs, outs):
                if kv[0] is not None:
                    truth.add(s.key, 0, *kv)
                truth.check(out, q, s.key, 0)
    assert fakes[0].servicer.packed_steps == (3 if packed_steps else 0)


def test_release_drops_the_history(fakes, rng):
    """A released sequence is never re-created: the rows the client kept for that go with it (they stayed)."""
    truth = _truth(rng)
    with flashserve.SequenceClient(fakes[0].address, timeout=30) as client:
        seq = client.create(**SHAPE, prefix={0: truth.rows(50)})
        assert seq.history_bytes > 0
        assert seq.release() is True
        assert seq.history_bytes == 0


def test_items_that_cannot_share_a_packed_step_go_one_by_one(fakes, rng):
    """Items of different head shapes (which the server refuses naming the item) are not packed."""
    with flashserve.SequenceClient(fakes[0].address, timeout=30) as client:
        kv = np.ones((2, 2, 16), np.float16)
        a = client.create(**SHAPE, prefix={0: (kv, kv)})
        b = client.create(**{**SHAPE, "heads_q": 2, "heads_kv": 1}, prefix={0: (kv[:, :1], kv[:, :1])})
        q_a = np.zeros((1, 4, 16), np.float16)
        q_b = np.zeros((1, 2, 16), np.float16)
        outs = client.decode_step([(a, 0, q_a, None, None), (b, 0, q_b, None, None)])
    assert fakes[0].servicer.packed_steps == 0
    # Each item answered in its own shape; V is all ones, so O is too, whatever the weights.
    assert [out.shape for out in outs] == [(1, 4, 16), (1, 2, 16)]
    for out in outs:
        np.testing.assert_array_equal(np.asarray(out, np.float32), 1.0)


def test_without_history_a_lost_sequence_is_an_error_unless_a_prefix_source_helps(fakes, rng):
    truth = _truth(rng)
    with flashserve.SequenceClient(fakes[0].address, timeout=30) as client:
        k, v = truth.rows(4)
        bare = client.create(**SHAPE, prefix={1: (k, v)}, keep_history=False)
        sourced = client.create(**SHAPE, prefix={1: (k, v)}, keep_history=False,
                                prefix_source=lambda seq: {1: (k, v)})
        truth.add("shared", 1, k, v)
        fakes[0].servicer.forget_all()
        q = truth.query(2)
        with pytest.raises(flashserve.NotFoundError, match="keeps no history"):
            bare.attend(1, q)
        truth.check(sourced.attend(1, q), q, "shared", 1)
        assert sourced.reprefills == 1


def test_a_not_found_that_names_no_ids_recreates_only_the_lost_sequences(fakes, rng, monkeypatch):
    """A NOT_FOUND without the missing ids (the server names at most ~100 in its metadata; a proxy may drop it): the
    client asks which ids the server lost. Before, it re-created every sequence of the step and left the copies the
    server still held there, holding their pages until the TTL (200 sequences, 110 lost: 200 re-prefills, 290 held)."""
    truth = _truth(rng)
    fake = fakes[0].servicer

    def missing_unnamed(context, ids):
        context.abort(grpc.StatusCode.NOT_FOUND, f"{len(ids)} unknown or evicted sequence(s)")

    monkeypatch.setattr(fake, "_missing", missing_unnamed)
    with flashserve.SequenceClient(fakes[0].address, timeout=30) as client:
        seqs = []
        for i in range(5):
            k, v = truth.rows(3 + i)
            seqs.append(client.create(**SHAPE, prefix={0: (k, v)}))
            truth.add(seqs[-1].key, 0, k, v)
        held = {s.id for s in seqs[2:]}
        for s in seqs[:2]:  # lost behind the client's back (TTL, an operator's release)
            del fake.seqs[s.id]
        _decode_rounds(client, seqs, truth, 2)
        assert client.stats["not_found"] == 1 and [s.reprefills for s in seqs] == [1, 1, 0, 0, 0]
        assert {s.id for s in seqs[2:]} == held
        assert set(fake.seqs) == {s.id for s in seqs}  # nothing left behind


def test_reprefill_off_shows_not_found_with_the_missing_ids(fakes, rng):
    truth = _truth(rng)
    with flashserve.SequenceClient(fakes[0].address, timeout=30, reprefill=False) as client:
        a, b = client.create(**SHAPE), client.create(**SHAPE)
        fakes[0].servicer.forget_all()
        with pytest.raises(flashserve.NotFoundError) as info:
            client.decode_step([(a, 0, truth.query(), *truth.rows(1)), (b, 0, truth.query(), *truth.rows(1))])
        assert set(info.value.missing_ids) == {a.id, b.id}
        assert a.lengths == [0, 0]  # nothing acknowledged


@pytest.mark.parametrize("keep_history", [True, False], ids=["history", "no_history"])
@pytest.mark.parametrize("call", ["append", "append_many", "step", "attend", "decode_step_batch", "negative"])
def test_a_layer_out_of_range_is_refused_before_anything_is_sent(fakes, rng, call, keep_history):
    """A layer past the sequence's last (or negative) is INVALID_ARGUMENT, nothing sent, the sequence as it was.
    Before, an append's raised IndexError from the client's bookkeeping, taken for a call maybe sent: the sequence was
    made uncertain, and re-created from the history at the next call -- or, without one, unusable for good
    (FAILED_PRECONDITION); a step's raised IndexError; a negative layer was read as the last one's length."""
    truth = _truth(rng)
    fake = fakes[0].servicer
    with flashserve.SequenceClient(fakes[0].address, timeout=30) as client:
        k, v = truth.rows(4)
        seq = client.create(**SHAPE, prefix={0: (k, v)}, keep_history=keep_history)
        truth.add(seq.key, 0, k, v)
        calls = list(fake.calls)
        bad = -1 if call == "negative" else SHAPE["num_layers"]
        with pytest.raises(flashserve.InvalidArgumentError, match=f"layer {bad} "):
            if call in ("append", "negative"):
                seq.append(bad, *truth.rows(1))
            elif call == "append_many":
                seq.append({0: truth.rows(1), bad: truth.rows(1)})
            elif call == "step":
                client.decode_step([(seq, 0, truth.query(), *truth.rows(1)), (seq, bad, truth.query(), *truth.rows(1))])
            elif call == "attend":
                seq.attend(bad, truth.query())
            else:
                client.decode_step_batch([seq], bad, truth.query(), *truth.rows(1))
        assert fake.calls == calls and not seq.uncertain and seq.lengths == [4, 0]
        _decode_rounds(client, [seq], truth, 2)
        assert seq.reprefills == 0


@pytest.mark.parametrize("appended", [True, False])
def test_ambiguous_failure_is_settled_before_the_next_call(fakes, rng, appended):
    """A step that failed with INTERNAL may have appended its rows (the server says so): the next call compares the
    server's lengths with the client's and, when they hold the failed step's row, cuts it off (Truncate): the
    sequence is not re-created (test_sequences_recovery_deadline.py)."""
    truth = _truth(rng)
    with flashserve.SequenceClient(fakes[0].address, timeout=30) as client:
        k, v = truth.rows(6)
        seq = client.create(**SHAPE, prefix={0: (k, v)})
        truth.add(seq.key, 0, k, v)
        fakes[0].servicer.fail_next_step = (grpc.StatusCode.INTERNAL, appended)
        with pytest.raises(flashserve.FlashserveError) as info:
            seq.step(0, truth.query(), *truth.rows(1))
        assert info.value.code == grpc.StatusCode.INTERNAL and seq.uncertain
        _decode_rounds(client, [seq], truth, 3)
        assert seq.reprefills == 0 and not seq.uncertain
        assert client.stats["truncated_back"] == int(appended)
        assert len(fakes[0].servicer.seqs) == 1  # no second copy


@pytest.mark.parametrize("code,cut", [(grpc.StatusCode.INTERNAL, False), (grpc.StatusCode.INTERNAL, True),
                                      (grpc.StatusCode.DEADLINE_EXCEEDED, True)])
def test_a_truncate_that_failed_cut_nothing_for_the_caller(fakes, rng, code, cut):
    """A truncate that raised may or may not have cut on the server: the next call settles it (the lengths, or after a
    failure that may still land, a re-create from the history, which the failed truncate left whole), so the answers
    are those of the uncut sequence; the truncate sent again then cuts."""
    truth = _truth(rng)
    with flashserve.SequenceClient(fakes[0].address, timeout=30) as client:
        k, v = truth.rows(6)
        seq = client.create(**SHAPE, prefix={0: (k, v)})
        truth.add(seq.key, 0, k, v)
        drafts = truth.rows(3)
        q = truth.query(3)
        out = seq.step(0, q, *drafts, causal=True)
        truth.add(seq.key, 0, *drafts)
        truth.check(out, q, seq.key, 0, causal=True)
        fakes[0].servicer.fail_next_truncate = (code, cut)
        with pytest.raises(flashserve.FlashserveError) as info:
            seq.truncate(7, layers=[0])
        assert info.value.code == code and seq.uncertain and seq.lengths == [9, 0]
        _decode_rounds(client, [seq], truth, 2)  # over all 9 rows (+ its own)
        assert seq.reprefills == int(cut) and not seq.uncertain
        assert seq.truncate(7, layers=[0]) == [7, 0]
        truth.keep(seq.key, 0, 7)
        _decode_rounds(client, [seq], truth, 2)
        assert seq.lengths == [9, 0] and seq.history_bytes == 9 * 2 * (2 * 16 * 2)


@pytest.mark.parametrize("packed_steps", [True, False])
def test_a_step_retried_after_its_answer_was_lost_appends_once(fakes, rng, packed_steps):
    """UNAVAILABLE after the server appended (a connection cut between it and a lone endpoint, e.g. a proxy): the
    client retries, and the step's expected_length lets the server see the rows there and attend without appending
    them again. Without it the retry appended the token twice: a wrong answer from then on."""
    truth = _truth(rng)
    with flashserve.SequenceClient(fakes[0].address, timeout=30, packed_steps=packed_steps) as client:
        k, v = truth.rows(4)
        seq = client.create(**SHAPE, prefix={0: (k, v)})
        truth.add(seq.key, 0, k, v)
        fakes[0].servicer.fail_next_step = (grpc.StatusCode.UNAVAILABLE, True)
        _decode_rounds(client, [seq], truth, 3)
        assert client.stats["already_appended"] == 1 and seq.reprefills == 0
        assert [len(x) for x in fakes[0].servicer.seqs[seq.id].k] == [7, 0]


def test_appends_to_one_layer_from_many_threads_all_land(fakes, rng):
    """Each append names the length it follows; two threads naming the same one would see the second taken for
    a retry of the first (not appended). The client runs appends to one layer one at a time."""
    truth = _truth(rng)
    with flashserve.SequenceClient(fakes[0].address, timeout=30) as client:
        seq = client.create(**SHAPE)
        rows = [truth.rows(1) for _ in range(48)]

        def worker(i):
            for k, v in rows[i::8]:
                seq.append(0, k, v)

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(worker, range(8)))
        assert client.stats["already_appended"] == 0
        assert seq.lengths[0] == 48 and len(fakes[0].servicer.seqs[seq.id].k[0]) == 48


def test_an_attend_does_not_see_the_row_of_an_append_still_in_flight(fakes, rng):
    """An attend on a layer while another thread's append to it is in flight: the append lands on the server, then
    fails for its caller (its deadline passed while the answer was on its way), so the client forgets the row and
    re-creates the sequence without it. Before, the attend ran meanwhile and its answer included that row: a state
    of the layer that, for the caller, never existed. Attends now wait for the layer's appends in flight (and
    appends for its attends)."""
    truth = _truth(rng)
    with flashserve.SequenceClient(fakes[0].address, timeout=30) as client:
        k, v = truth.rows(5)
        seq = client.create(**SHAPE, prefix={0: (k, v)})
        truth.add(seq.key, 0, k, v)
        hold = fakes[0].servicer.hold("Append", "after")  # applied on the server, the answer held back
        row_k, row_v = truth.rows(1)
        q = truth.query()
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            appended = pool.submit(seq.append, 0, row_k, row_v, 0.5)
            hold.wait_entered()
            attended = pool.submit(seq.attend, 0, q)
            with pytest.raises(flashserve.FlashserveError) as failed:
                appended.result(timeout=10)
            assert failed.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            hold.release(wait=False)
            out = attended.result(timeout=30)
        truth.check(out, q, seq.key, 0)  # the five rows only: the append failed for its caller
        assert seq.reprefills == 1 and seq.lengths[0] == 5


def test_attends_to_one_layer_do_not_wait_for_each_other(fakes, rng):
    """Attends register as readers of their layer: two in flight at once both reach the server."""
    truth = _truth(rng)
    with flashserve.SequenceClient(fakes[0].address, timeout=30) as client:
        k, v = truth.rows(3)
        seq = client.create(**SHAPE, prefix={0: (k, v)})
        truth.add(seq.key, 0, k, v)
        hold = fakes[0].servicer.hold("Attend", "before")
        q1, q2 = truth.query(), truth.query()
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            first = pool.submit(seq.attend, 0, q1)
            hold.wait_entered()
            second = pool.submit(seq.attend, 0, q2)
            truth.check(second.result(timeout=10), q2, seq.key, 0)  # while the first is still held
            hold.release()
            truth.check(first.result(timeout=10), q1, seq.key, 0)


def test_an_unexpected_length_is_aborted(fakes, rng):
    """Another writer appended behind the client's back: its next append is refused (ABORTED), nothing appended."""
    truth = _truth(rng)
    with flashserve.SequenceClient(fakes[0].address, timeout=30) as client:
        seq = client.create(**SHAPE)
        other = fakes[0].servicer.seqs[seq.id]
        other.k[0] = np.zeros((2, 2, 16))  # two rows the client never sent
        other.v[0] = np.zeros((2, 2, 16))
        with pytest.raises(flashserve.FlashserveError) as info:
            seq.append(0, *truth.rows(1))
        assert info.value.code == grpc.StatusCode.ABORTED and "holds 2 tokens" in str(info.value)
        assert len(other.k[0]) == 2


def test_route_header_and_release(fakes, rng):
    with flashserve.SequenceClient(fakes[0].address, timeout=30) as client:
        with client.create(**SHAPE, key="request-7") as seq:
            seq.append(0, *_truth(rng).rows(3))
        assert seq.released and not fakes[0].servicer.seqs
        seen = fakes[0].servicer.metadata_seen
        assert [m.get(flashserve.ROUTE_HEADER) for m in seen] == ["request-7"] * len(seen)
        with pytest.raises(flashserve.FlashserveError, match="released"):
            seq.attend(0, _truth(rng).query())


# --- three endpoints, one leaves -----------------------------------------------------------------------------------


def test_a_server_leaving_moves_only_its_sequences(fakes, rng):
    truth = _truth(rng)
    with flashserve.SequenceClient([f.address for f in fakes], timeout=10, down_s=60) as client:
        seqs = [client.create(**SHAPE, key=key) for key in keys_spread_over(client.ring, client.endpoints, 8, "req-")]
        by_endpoint = collections.Counter(s.endpoint for s in seqs)
        assert len(by_endpoint) == 3, by_endpoint
        _decode_rounds(client, seqs, truth, 3)
        before = {s.key: (s.endpoint, s.id) for s in seqs}
        victim = fakes[1]
        victim.stop()
        _decode_rounds(client, seqs, truth, 3)
        moved = [s for s in seqs if before[s.key][0] == victim.address]
        stayed = [s for s in seqs if before[s.key][0] != victim.address]
        assert moved and all(s.endpoint != victim.address and s.reprefills == 1 for s in moved)
        assert all((s.endpoint, s.id) == before[s.key] and s.reprefills == 0 for s in stayed)
        assert all(s.endpoint == client.ring.lookup(s.key, exclude={victim.address}) for s in moved)


def test_truncate_many_cuts_across_endpoints_through_a_lost_and_a_leaving_server(fakes, rng):
    """One speculative step of a batch spread over three servers: truncate_many sends one Truncate per server; the
    sequences of a server that forgot them are re-created from the history (the uncut rows) and cut again, those of
    a server that left move to the ring's next one; every later answer sees exactly the kept rows."""
    truth = _truth(rng)
    with flashserve.SequenceClient([f.address for f in fakes], timeout=10, down_s=60) as client:
        keys = keys_spread_over(client.ring, client.endpoints, 4, "spec-")  # the ring hashes the fakes' random ports
        seqs = [client.create(**SHAPE, key=key) for key in keys]
        assert len({s.endpoint for s in seqs}) == 3
        for lost in (fakes[0].servicer.forget_all, fakes[2].stop):
            start = [s.lengths[0] for s in seqs]
            qs, kvs = [truth.query(4) for _ in seqs], [truth.rows(4) for _ in seqs]
            for seq, q, kv, out in zip_all(seqs, qs, kvs, client.decode_step(
                    [(s, 0, q, *kv) for s, q, kv in zip(seqs, qs, kvs)], causal=True)):
                truth.add(seq.key, 0, *kv)
                truth.check(out, q, seq.key, 0, causal=True)
            truncates = [f.servicer.calls.count("Truncate") for f in fakes]
            on_2 = [s for s in seqs if s.endpoint == fakes[2].address]
            lost()
            kept = [n + i % 5 for i, n in enumerate(start)]
            assert client.truncate_many([(s, n, [0]) for s, n in zip(seqs, kept)]) == [[n, 0] for n in kept]
            for seq, n in zip(seqs, kept):
                truth.keep(seq.key, 0, n)
            # One call per server holding some of them, and one more to where lost sequences were re-created: the
            # server that forgot them, or the ring's next servers of those whose server left.
            sent = [f.servicer.calls.count("Truncate") - t for f, t in zip(fakes, truncates)]
            if lost == fakes[0].servicer.forget_all:
                assert sent == [2, 1, 1], sent
            else:
                assert sent == [1 + any(s.endpoint == f.address for s in on_2) for f in fakes[:2]] + [0], sent
            _decode_rounds(client, seqs, truth, 2)
        assert sum(s.reprefills for s in seqs) >= 4


@pytest.mark.parametrize("rows_q,causal,return_lse,packed_steps", [(1, False, False, True), (3, True, True, True),
                                                                  (2, True, True, False)])
def test_decode_step_batch_matches_the_reference_and_recovers(fakes, rng, rows_q, causal, return_lse, packed_steps):
    """decode_step_batch: one q/k/v tensor for the batch (sequence i's rows the i-th block), O (and LSE) as one tensor;
    the same retries and recovery as decode_step (a server that forgot the sequences re-creates them), packed steps
    or one tensor per item."""
    truth = _truth(rng)
    with flashserve.SequenceClient([f.address for f in fakes], timeout=30, packed_steps=packed_steps) as client:
        seqs = []
        for i in range(5):
            k, v = truth.rows(4 + i)
            seqs.append(client.create(**SHAPE, prefix={1: (k, v)}, key=f"batch-{i}"))
            truth.add(seqs[-1].key, 1, k, v)
        for step in range(3):
            if step == 2:
                for f in fakes:
                    f.servicer.forget_all()
            q = np.concatenate([truth.query(rows_q) for _ in seqs])
            k, v = (np.concatenate(x) for x in zip(*[truth.rows(rows_q) for _ in seqs]))
            answer = client.decode_step_batch(seqs, 1, q, k, v, causal=causal, return_lse=return_lse)
            out, lse = answer if return_lse else (answer, None)
            assert out.shape == q.shape and out.dtype == q.dtype and out.flags.writeable
            for i, seq in enumerate(seqs):
                block = slice(i * rows_q, (i + 1) * rows_q)
                truth.add(seq.key, 1, k[block].copy(), v[block].copy())
                truth.check(out[block], q[block], seq.key, 1, causal=causal,
                            lse=None if lse is None else lse[i])
                assert seq.lengths[1] == truth.length(seq.key, 1)
            for x in (q, k, v):  # the caller reuses its buffers: the history (step 2's re-prefill) kept copies
                x[...] = np.nan
        assert all(s.reprefills == 1 for s in seqs)
        with pytest.raises(flashserve.InvalidArgumentError, match="same rows for each"):
            client.decode_step_batch(seqs, 1, q[:-1], k, v)


def _answer_bytes(out=None, lse=None, results=2, packed_first=True):
    """A DecodeStepResponse's wire bytes with a packed answer written first (as the server does) or after."""
    from flashserve import sequences_pb2 as spb

    rest = spb.DecodeStepResponse(kernel="k", batched_calls=3)
    for i in range(results):
        rest.results.add(length=300 + i)
    packed = spb.DecodeStepResponse()
    if out is not None:
        packed.packed.out.CopyFrom(out)
    if lse is not None:
        packed.packed.lse.CopyFrom(lse)
    head, tail = packed.SerializeToString(), rest.SerializeToString()
    return head + tail if packed_first else tail + head


def test_step_answer_reads_a_leading_packed_answer_in_place(rng):
    """_step_answer.DecodeStepAnswer.parse: a packed answer written first gives O / LSE as views of the answer's
    bytes (nothing copied) and the rest as a message; any other layout (packed after the results, a second packed
    field, a tensor naming a region, a truncated field) is parsed whole, with the same values or protobuf's error."""
    from google.protobuf.message import DecodeError

    from flashserve import tensors
    from flashserve._pb import attention_pb2 as pb
    from flashserve._step_answer import DecodeStepAnswer

    out = tensors.to_proto_rows(rng.standard_normal((300, 4, 64)).astype(np.float16), "out")  # multi-byte sizes
    lse = pb.Tensor(dtype=tensors.PROTO_DTYPE["float32"], shape=[1200],
                    data=rng.standard_normal(1200).astype(np.float32).tobytes())
    raw = _answer_bytes(out, lse)
    answer = DecodeStepAnswer.parse(raw)
    assert isinstance(answer.out.data, memoryview) and answer.out.data.obj is raw  # a view, not a copy
    assert bytes(answer.out.data) == out.data and answer.out.shape == (300, 4, 64) and answer.out.dtype == out.dtype
    assert bytes(answer.lse.data) == lse.data and answer.lse.shape == (1200,)
    assert [r.length for r in answer.response.results] == [300, 301] and answer.response.batched_calls == 3
    assert DecodeStepAnswer.parse(_answer_bytes(out)).lse is None
    plain = DecodeStepAnswer.parse(_answer_bytes())
    assert plain.out is None and plain.lse is None and len(plain.response.results) == 2
    for other in (_answer_bytes(out, lse, packed_first=False), raw + _answer_bytes(out, results=0)):
        whole = DecodeStepAnswer.parse(other)
        expected = DecodeStepAnswer.of(type(whole.response).FromString(other))
        assert not isinstance(whole.out.data, memoryview)  # parsed as a message
        assert (whole.out.shape, bytes(whole.out.data)) == (expected.out.shape, bytes(expected.out.data))
    in_region = pb.Tensor(dtype=out.dtype, shape=out.shape, data=out.data)
    in_region.shm.region = "r"
    assert not isinstance(DecodeStepAnswer.parse(_answer_bytes(in_region)).out.data, memoryview)
    with pytest.raises(DecodeError):
        DecodeStepAnswer.parse(raw[:len(raw) // 2])  # cut inside the packed field: protobuf's own error


def test_to_host_rows_views_only_when_told(rng):
    """to_host_rows(copy=False) (the q of decode_step and decode_step_batch) views the array's memory; the default
    copies (k/v, which the history keeps)."""
    from flashserve import tensors

    q = rng.standard_normal((4, 2, 8)).astype(np.float16)
    view, copy = tensors.to_host_rows(q, "q", copy=False), tensors.to_host_rows(q, "q")
    assert bytes(view.data) == bytes(copy.data) == q.tobytes() and len(view.data) == q.nbytes
    q[0] = 7
    assert bytes(view.data) == q.tobytes() != bytes(copy.data)
    strided = q[::2]  # not contiguous: copied even without copy
    assert bytes(tensors.to_host_rows(strided, "q", copy=False).data) == strided.tobytes()


def test_step_answer_parse_agrees_with_protobuf_on_mutated_answers(rng):
    """Differential check of the hand-read packed answer: for answers with random bytes changed, cut or inserted
    (an answer is untrusted input), DecodeStepAnswer.parse either raises where protobuf raises or reads exactly what
    protobuf reads (the same O / LSE dtype, shape and bytes, the same results)."""
    from google.protobuf.message import DecodeError

    from flashserve import tensors
    from flashserve._pb import attention_pb2 as pb
    from flashserve._step_answer import DecodeStepAnswer

    out = tensors.to_proto_rows(rng.standard_normal((5, 2, 8)).astype(np.float16), "out")
    lse = pb.Tensor(dtype=tensors.PROTO_DTYPE["float32"], shape=[10], data=b"\x02" * 40)
    valid = bytearray(_answer_bytes(out, lse, results=3))

    def read(raw):
        try:
            a = DecodeStepAnswer.parse(raw)
        except DecodeError:
            return "error"
        return ([(t.dtype, tuple(t.shape), bytes(t.data)) if t is not None else None for t in (a.out, a.lse)],
                a.response.SerializeToString(deterministic=True))

    def reference(raw):
        try:
            m = type(DecodeStepAnswer.parse(_answer_bytes()).response).FromString(raw)
        except DecodeError:
            return "error"
        a = DecodeStepAnswer.of(m)
        m.ClearField("packed")
        return ([(t.dtype, tuple(t.shape), bytes(t.data)) if t is not None else None for t in (a.out, a.lse)],
                m.SerializeToString(deterministic=True))

    for trial in range(3000):
        raw = bytearray(valid)
        for _ in range(int(rng.integers(1, 4))):
            at = int(rng.integers(0, len(raw)))
            how = trial % 3
            if how == 0:
                raw[at] = int(rng.integers(0, 256))
            elif how == 1:
                del raw[at:at + int(rng.integers(1, 8))]
            else:
                raw[at:at] = bytes(rng.integers(0, 256, int(rng.integers(1, 4)), dtype=np.uint8))
        raw = bytes(raw)
        assert read(raw) == reference(raw), f"trial {trial}: {raw.hex()}"
