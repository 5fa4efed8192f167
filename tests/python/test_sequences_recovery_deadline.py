"""SequenceClient recovery: (1) a call's timeout is one deadline for the whole call, recovery included; (2) rows
that failed calls left on a healthy sequence are cut off with a Truncate, and only sequences that are gone or whose
lengths cannot be reconciled are re-created (re-prefilled). Every answer is checked against the fp64 reference over
the rows the caller believes are in the sequence (a call that returned appended its rows; a call that raised did
not).

Fake-based (sequences_fake.py: slow() delays a method, hold() stops one call, fail_next_* injects a failure), and one
test on two real servers (CPU backend) whose DecodeStep fails on one of them.
"""

from __future__ import annotations

import time

import grpc
import pytest

import flashserve
from flashserve import tensors

pytest.importorskip("flashserve.sequence_client", reason="no sequences.proto in this checkout")

from conftest import zip_all  # noqa: E402
from ring_keys import key_on  # noqa: E402
from test_sequences_client_faults import (  # noqa: E402,F401 - fakes: the fixture, shared
    SHAPE, _create, _rounds, _server_rows, _Thread, _truth, fakes)

E2E_SHAPE = dict(num_layers=2, heads_q=8, heads_kv=2, head_dim=64, dtype="bfloat16")
INTERNAL, UNAVAILABLE = grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE
TIMEOUT = 1.0  # the call's timeout in the deadline tests
SLACK = 0.9  # what a loaded 2-core machine may add to a call that keeps to its deadline (the old client: 2+ s)


def _call(seq, truth, call, timeout=None):
    """One call of kind `call` with fresh rows; it must raise (its rows are not added to truth)."""
    if call == "step":
        return seq.step(0, truth.query(), *truth.rows(1), timeout=timeout)
    if call == "append":
        return seq.append(0, *truth.rows(2), timeout=timeout)
    return seq.attend(0, truth.query(), timeout=timeout)


def _assert_server_holds_truth(fake, seq, truth):
    assert _server_rows(fake, seq) == [truth.length(seq.key, layer) for layer in range(SHAPE["num_layers"])]


def _raises_within(error_type, seconds, fn):
    """fn() raises error_type within `seconds`; returns the error."""
    start = time.monotonic()
    with pytest.raises(error_type) as info:
        fn()
    elapsed = time.monotonic() - start
    assert elapsed < seconds, f"the call took {elapsed:.2f} s, past its deadline ({info.value})"
    return info.value


# --- (1) one deadline for the whole call -----------------------------------------------------------------------------


@pytest.mark.parametrize("call", ["step", "append", "attend"])
def test_a_retry_after_a_reprefill_gets_only_the_time_left(fakes, rng, call):
    """The server lost the sequence and is slow: the first try takes 0.7 s of the call's 1 s to answer NOT_FOUND, the
    client re-creates the sequence and retries. Before, the retry got the whole timeout again and the call returned
    after ~1.4 s; now it gets the 0.3 s left and the call raises DEADLINE_EXCEEDED at its deadline."""
    truth = _truth(rng)
    fake = fakes[0].servicer
    method = {"step": "DecodeStep", "append": "Append", "attend": "Attend"}[call]
    with flashserve.SequenceClient(fakes[0].address, timeout=30) as client:
        seq = _create(client, truth)
        fake.forget_all()  # an eviction or a restart
        fake.slow(method, 0.7 * TIMEOUT)
        _raises_within(flashserve.DeadlineExceededError, TIMEOUT + SLACK, lambda: _call(seq, truth, call, TIMEOUT))
        fake.slow(method, 0)
        _rounds(client, [seq], truth, 3)
        _assert_server_holds_truth(fakes[0], seq, truth)


@pytest.mark.parametrize("timeout_on", ["call", "client"])
def test_a_release_on_the_way_to_a_recreate_gets_only_the_time_left(fakes, rng, timeout_on):
    """A step failed with DEADLINE_EXCEEDED after the server appended, so the next call releases the sequence and
    re-creates it. The release hangs (a server that takes the connection and does not answer). Before, it had a fixed
    5 s whatever the call's timeout, and the call of 1 s took over 5 s; now it gets the time left and the call raises
    DEADLINE_EXCEEDED saying that recovery ran out of time. The client's default timeout is the same deadline."""
    truth = _truth(rng)
    fake = fakes[0].servicer
    client_timeout, call_timeout = (TIMEOUT, None) if timeout_on == "client" else (30, TIMEOUT)
    with flashserve.SequenceClient(fakes[0].address, timeout=client_timeout) as client:
        seq = _create(client, truth)
        fake.fail_next_step = (grpc.StatusCode.DEADLINE_EXCEEDED, True)
        with pytest.raises(flashserve.DeadlineExceededError):
            seq.step(0, truth.query(), *truth.rows(1))
        assert seq.uncertain and seq.may_land
        hold = fake.hold("Release", "before")
        try:
            error = _raises_within(flashserve.DeadlineExceededError, TIMEOUT + SLACK,
                                   lambda: _call(seq, truth, "step", call_timeout))
            assert "recovery ran out of time" in error.message, error
        finally:
            hold.release(wait=False)
        _rounds(client, [seq], truth, 3)
        _assert_server_holds_truth(fakes[0], seq, truth)


def test_a_slow_recreate_is_not_retried_past_the_deadline(fakes, rng):
    """The server lost the sequence and its creates are slow (0.8 s). Before, each try of the re-create got the call's
    whole timeout (0.5 s) and was sent again up to max_attempts times: the call took 2 s. Now the first try gets what
    is left and the call raises once it passes."""
    truth = _truth(rng)
    fake = fakes[0].servicer
    timeout = TIMEOUT / 2
    with flashserve.SequenceClient(fakes[0].address, timeout=30) as client:
        seq = _create(client, truth)
        fake.forget_all()
        fake.slow("CreateSequence", 0.8)
        error = _raises_within(flashserve.DeadlineExceededError, timeout + SLACK,
                               lambda: _call(seq, truth, "step", timeout))
        assert "recovery ran out of time" in error.message, error
        fake.slow("CreateSequence", 0)
        _rounds(client, [seq], truth, 3)
        _assert_server_holds_truth(fakes[0], seq, truth)


def test_unavailable_backoff_keeps_to_the_deadline(fakes, rng):
    """One endpoint answering UNAVAILABLE: the client retries after 0.1, 0.2, 0.4 s. Before, with a timeout of 0.25 s
    the call went on for 0.7 s and raised UNAVAILABLE; now its backoff stops at the deadline: DEADLINE_EXCEEDED."""
    truth = _truth(rng)
    fake = fakes[0].servicer
    with flashserve.SequenceClient(fakes[0].address, timeout=30) as client:
        seq = _create(client, truth)
        fake.fail_next_step = [(UNAVAILABLE, False)] * 4
        error = _raises_within(flashserve.DeadlineExceededError, 0.25 + SLACK,
                               lambda: _call(seq, truth, "step", 0.25))
        assert "recovery ran out of time" in error.message, error
        fake.fail_next_step = None
        _rounds(client, [seq], truth, 2)
        _assert_server_holds_truth(fakes[0], seq, truth)


def test_without_a_timeout_recovery_has_no_deadline(fakes, rng):
    """timeout=None (call and client): recovery takes as long as it takes, as before."""
    truth = _truth(rng)
    fake = fakes[0].servicer
    with flashserve.SequenceClient(fakes[0].address) as client:
        seq = _create(client, truth)
        fake.forget_all()
        fake.slow("DecodeStep", 0.3)
        _rounds(client, [seq], truth, 1)  # NOT_FOUND after 0.3 s, re-created, 0.3 s again: no deadline to pass
        fake.slow("DecodeStep", 0)
        assert seq.reprefills == 1
        _assert_server_holds_truth(fakes[0], seq, truth)


# --- (2) rows of failed calls are cut back, the sequence is not re-created -------------------------------------------


@pytest.mark.parametrize("failure", [(grpc.StatusCode.RESOURCE_EXHAUSTED, False), (INTERNAL, True)],
                         ids=["exhausted", "internal_after_append"])
def test_a_partial_step_failure_cuts_the_taken_rows_back_instead_of_recreating(fakes, rng, failure):
    """A step over two servers: server 0 takes its share, server 1's share fails. The step raises, so server 0's rows
    are taken back (for the caller the step appended nothing). Before, the next call found server 0's sequences one
    row longer and released and re-created them with their whole prefix; now a Truncate cuts the row off and they
    stay as they are. With INTERNAL after server 1 appended, its sequences are cut back the same way."""
    truth = _truth(rng)
    with flashserve.SequenceClient([f.address for f in fakes], timeout=30) as client:
        seqs = [_create(client, truth, key=key_on(client.ring, fakes[i // 2].address, f"s{i}-")) for i in range(4)]
        ids = [s.id for s in seqs]
        qs, kvs = [truth.query() for _ in seqs], [truth.rows(1) for _ in seqs]
        items = [(s, 0, q, k, v) for s, q, (k, v) in zip(seqs, qs, kvs)]
        fakes[1].servicer.fail_next_step = failure
        with pytest.raises(flashserve.FlashserveError):
            client.decode_step(items)
        creates = [f.servicer.calls.count("CreateSequence") for f in fakes]
        outs = client.decode_step(items)  # the caller sends the step again
        for s, q, (k, v), out in zip_all(seqs, qs, kvs, outs):
            truth.add(s.key, 0, k, v)
            truth.check(out, q, s.key, 0)
        _rounds(client, seqs, truth, 2)
        assert [s.reprefills for s in seqs] == [0] * 4 and [s.id for s in seqs] == ids
        assert [f.servicer.calls.count("CreateSequence") for f in fakes] == creates
        assert client.stats["truncated_back"] == (4 if failure[1] else 2)
        for i, s in enumerate(seqs):
            _assert_server_holds_truth(fakes[i // 2], s, truth)


@pytest.mark.parametrize("keep_history", [True, False])
@pytest.mark.parametrize("call", ["step", "append"])
def test_an_internal_after_the_append_is_cut_back(fakes, rng, call, keep_history):
    """INTERNAL after the server appended (the call ended; its rows are there and will stay there): the next call finds
    the sequence longer by those rows and cuts them off. Before, it released and re-created the sequence from its
    history; without a history (keep_history=False) it could not, and every later call raised
    FAILED_PRECONDITION. An append of two layers is cut back to each layer's own length."""
    truth = _truth(rng)
    fake = fakes[0].servicer
    with flashserve.SequenceClient(fakes[0].address, timeout=30) as client:
        seq = _create(client, truth, keep_history=keep_history)
        sequence_id = seq.id
        with pytest.raises(flashserve.FlashserveError) as info:
            if call == "step":
                fake.fail_next_step = (INTERNAL, True)
                seq.step(0, truth.query(), *truth.rows(1))
            else:
                fake.fail_next_append = (INTERNAL, True)
                seq.append({0: truth.rows(2), 1: truth.rows(3)})
        assert info.value.code == INTERNAL and seq.uncertain
        assert _server_rows(fakes[0], seq) != seq.lengths  # the failed call's rows are there
        _rounds(client, [seq], truth, 2)
        _rounds(client, [seq], truth, 1, layer=1)
        assert seq.reprefills == 0 and seq.id == sequence_id and not seq.uncertain
        assert client.stats["truncated_back"] == 1 and "Release" not in fake.calls
        _assert_server_holds_truth(fakes[0], seq, truth)


@pytest.mark.parametrize("reason", ["another_writer", "gone", "may_land"])
def test_a_sequence_that_cannot_be_cut_back_is_still_recreated(fakes, rng, reason):
    """What a Truncate cannot mend is re-created from the history as before: a copy longer than the failed call's
    rows (another writer appended), a sequence gone (NOT_FOUND), or a failure whose rows may land after any look
    (DEADLINE_EXCEEDED: the client does not even look)."""
    truth = _truth(rng)
    fake = fakes[0].servicer
    with flashserve.SequenceClient(fakes[0].address, timeout=30) as client:
        seq = _create(client, truth)
        code = grpc.StatusCode.DEADLINE_EXCEEDED if reason == "may_land" else INTERNAL
        fake.fail_next_step = (code, True)
        with pytest.raises(flashserve.FlashserveError):
            seq.step(0, truth.query(), *truth.rows(1))
        if reason == "another_writer":
            fake._append(fake.seqs[seq.id], 0, *(tensors.to_proto_rows(t, "kv") for t in truth.rows(1)))
        elif reason == "gone":
            fake.forget_all()
        looks = fake.calls.count("GetSequenceInfo")
        _rounds(client, [seq], truth, 2)
        assert seq.reprefills == 1 and client.stats.get("truncated_back", 0) == 0  # (no such count before)
        assert fake.calls.count("GetSequenceInfo") == looks + (reason != "may_land")
        _assert_server_holds_truth(fakes[0], seq, truth)


def test_a_look_that_began_before_another_thread_settled_cuts_nothing(fakes, rng):
    """Thread A's attend (layer 1) looks at the lengths of the uncertain sequence and the answer is slow. Meanwhile
    main's append to layer 0 settles the sequence itself (cuts the failed call's rows off) and sends its row, which
    lands on the server while its answer is on its way. A's answer -- the lengths from before -- must neither cut
    main's row (the next append was ABORTED, or an attend left the row out) nor re-create the sequence: a cut is made
    only while the sequence is still uncertain with the doubts the look began with. (The old client re-created the
    sequence here: it never cut back.)"""
    truth = _truth(rng)
    fake = fakes[0].servicer
    with flashserve.SequenceClient(fakes[0].address, timeout=30) as client:
        seq = _create(client, truth)
        fake.fail_next_append = (INTERNAL, True)
        with pytest.raises(flashserve.FlashserveError):
            seq.append(0, *truth.rows(2))
        look = fake.hold("GetSequenceInfo", "after")
        qa = truth.query()
        a = _Thread(lambda: seq.attend(1, qa))
        look.wait_entered()
        landed = fake.hold("Append", "after")
        k, v = truth.rows(1)
        main = _Thread(lambda: seq.append(0, k, v))
        landed.wait_entered()  # main's row is on the server, its answer held
        look.release(wait=False)
        truth.check(a.join(), qa, seq.key, 1)
        landed.release(wait=False)
        main.join()
        truth.add(seq.key, 0, k, v)
        _rounds(client, [seq], truth, 2)
        assert seq.reprefills == 0 and client.stats["truncated_back"] == 1
        _assert_server_holds_truth(fakes[0], seq, truth)


# --- the real server (CPU backend) -----------------------------------------------------------------------------------


@pytest.mark.e2e
def test_real_servers_cut_back_the_share_of_a_step_that_failed_elsewhere(start_server, rng):
    """Two real servers. A step's share on server 1 is refused (an append past its sequence's token limit:
    INVALID_ARGUMENT) after server 0 appended its share: the step raises and server 0's rows are taken back. The next
    step cuts them off server 0 with the server's Truncate (GetSequenceInfo, then Truncate) instead of re-creating
    the sequences: same ids, no re-prefill, every answer right and the server's lengths the client's."""
    servers = [start_server("--kv_cache_bytes=67108864", "--kv_page_tokens=16", name=f"cut{i}") for i in range(2)]
    truth = _truth(rng, E2E_SHAPE)
    with flashserve.SequenceClient([s.address for s in servers], timeout=30) as client:
        healthy = [_create(client, truth, rows=(9 + i, 2), key=key_on(client.ring, servers[0].address, f"h{i}-"),
                           shape=E2E_SHAPE) for i in range(2)]
        full = _create(client, truth, rows=(5, 0), key=key_on(client.ring, servers[1].address, "full-"),
                       shape=E2E_SHAPE, max_tokens=5)
        ids = [s.id for s in healthy]
        with pytest.raises(flashserve.InvalidArgumentError):
            client.decode_step([(s, 0, truth.query(), *truth.rows(1)) for s in healthy + [full]])
        assert [list(s.info().layer_lengths) for s in healthy] == [[10, 2], [11, 2]]  # the rows taken back are there
        _rounds(client, healthy, truth, 3)
        assert [s.reprefills for s in healthy] == [0, 0] and [s.id for s in healthy] == ids
        assert client.stats["truncated_back"] == 2
        for s in healthy:
            assert list(s.info().layer_lengths) == [truth.length(s.key, 0), truth.length(s.key, 1)]


def test_a_cut_back_that_timed_out_is_not_looked_at_again(fakes, rng):
    """The Truncate that cuts a failed call's rows back timed out (it may still cut later), and the call ran out of
    time before its re-create: the sequence stays uncertain. Its next call must re-create it without looking and
    cutting again -- a late first Truncate would cut rows appended after the second one. It used to look again."""
    truth = _truth(rng)
    fake = fakes[0].servicer
    with flashserve.SequenceClient(fakes[0].address, timeout=30) as client:
        seq = _create(client, truth)
        fake.fail_next_step = (INTERNAL, True)
        with pytest.raises(flashserve.FlashserveError):
            seq.step(0, truth.query(), *truth.rows(1))
        fake.fail_next_truncate = (grpc.StatusCode.DEADLINE_EXCEEDED, False)
        fake.slow("Release", 2 * TIMEOUT)  # the release on the way to the re-create eats the call's time
        with pytest.raises(flashserve.DeadlineExceededError):
            seq.step(0, truth.query(), *truth.rows(1), timeout=TIMEOUT)
        fake.slow("Release", 0)
        assert seq.uncertain
        looks = fake.calls.count("GetSequenceInfo")
        _rounds(client, [seq], truth, 2)
        assert fake.calls.count("GetSequenceInfo") == looks, "it looked (and could cut) again"
        assert seq.reprefills == 1 and not seq.uncertain
        _assert_server_holds_truth(fakes[0], seq, truth)
