"""SequenceClient recovery under injected failures: every answer is checked against the fp64 reference over the rows
the caller believes are in the sequence (a call that returned appended its rows; a call that raised did not).

Fake-based (sequences_fake.py: fail_next_step / fail_next_append, and hold() to stop a call before it reads anything
or after it applied, until the test lets it go), so each race is played in one fixed order:

* an UNAVAILABLE the client gives up on (reprefill=False, attempts spent) after the server appended, or one retried
  and then refused outright (RESOURCE_EXHAUSTED);
* a call interrupted (not a FlashserveError) after the server appended;
* a step over two endpoints where both fail, the first without appending; or where one succeeds and one fails, and
  the caller sends the step again;
* an answer from a sequence that another thread re-created while the answer was on its way;
* a release while a step is on its way (the step must not re-create the released sequence);
* an Append that the server applies after the client's deadline (the real server's Append has no deadline check),
  later than the next call's check of the lengths;
* a check of the lengths that began before a new ambiguous failure of another thread;
* an attend-only step item, or an Append of another layer, whose answer comes after a later append of this client;
* prefix_source returning the caller's own cache, which already holds the row of the call in flight.

Real server (CPU backend): an answer cut on its way over gRPC or mid-frame over the local socket, with the client not
retrying (reprefill=False).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time

import grpc
import numpy as np
import pytest

import flashserve

pytest.importorskip("flashserve.sequence_client", reason="no sequences.proto in this checkout")

from conftest import zip_all  # noqa: E402
from ring_keys import key_on  # noqa: E402
from sequences_fake import FakeSequencesServer  # noqa: E402
from sequences_truth import Truth  # noqa: E402
from tcp_proxy import AnswerCutter, LateGreetingProxy  # noqa: E402

SHAPE = dict(num_layers=2, heads_q=4, heads_kv=2, head_dim=16, dtype="float16")
UNAVAILABLE, INTERNAL = grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL


@pytest.fixture
def fakes():
    servers = [FakeSequencesServer() for _ in range(2)]
    yield servers
    for s in servers:
        for hold in list(s.servicer.holds.values()):
            hold.proceed.set()
        s.stop()


def _truth(rng, shape=SHAPE):
    return Truth(rng, shape["heads_q"], shape["heads_kv"], shape["head_dim"], shape["dtype"])


def _create(client, truth, rows=(4, 3), key=None, shape=SHAPE, **kw):
    """A sequence with `rows[layer]` prefix rows per layer (kept in truth under its key)."""
    prefix = {layer: truth.rows(n) for layer, n in enumerate(rows) if n}
    seq = client.create(**shape, prefix=prefix, key=key, **kw)
    for layer, (k, v) in prefix.items():
        truth.add(seq.key, layer, k, v)
    return seq


def _step(seq, truth, layer=0, append=True):
    q = truth.query()
    k, v = truth.rows(1) if append else (None, None)
    out = seq.step(layer, q, k, v)
    truth.add(seq.key, layer, k, v)
    truth.check(out, q, seq.key, layer)


def _rounds(client, seqs, truth, n, layer=0):
    for _ in range(n):
        qs = [truth.query() for _ in seqs]
        kvs = [truth.rows(1) for _ in seqs]
        outs = client.decode_step([(s, layer, q, k, v) for s, q, (k, v) in zip(seqs, qs, kvs)])
        for s, q, (k, v), out in zip_all(seqs, qs, kvs, outs):
            truth.add(s.key, layer, k, v)
            truth.check(out, q, s.key, layer)


def _server_rows(fake, seq):
    return [len(k) for k in fake.servicer.seqs[seq.id].k]


class _Thread(threading.Thread):
    """Runs fn; join() returns its value or raises its exception."""

    def __init__(self, fn):
        super().__init__(daemon=True)
        self.fn, self.value, self.error = fn, None, None
        self.start()

    def run(self):
        try:
            self.value = self.fn()
        except BaseException as e:  # noqa: BLE001 - handed to join()
            self.error = e

    def join(self, timeout=20):
        super().join(timeout)
        assert not self.is_alive(), "the call hangs"
        if self.error is not None:
            raise self.error
        return self.value


# --- an UNAVAILABLE the client does not retry, after the server appended ----------------------------------------------


@pytest.mark.parametrize("call", ["step", "append"])
@pytest.mark.parametrize("client_kw", [dict(reprefill=False), dict(max_attempts=1)], ids=["reprefill_off", "one_try"])
def test_an_unavailable_raised_after_the_server_appended_does_not_poison_the_next_step(fakes, rng, call, client_kw):
    """The connection broke after the server appended (the answer was lost) and the client gives up (reprefill=False,
    or its attempts are spent): the caller sees UNAVAILABLE and takes the rows for not appended. Before, the client
    did not mark the sequence uncertain (only DEADLINE/CANCELLED/UNKNOWN/INTERNAL did), so the next step, naming the
    same expected_length, was taken by the server for a retry of the lost one: its row was dropped and the answer
    was computed over the lost call's row instead."""
    truth = _truth(rng)
    fake = fakes[0].servicer
    with flashserve.SequenceClient(fakes[0].address, timeout=30, **client_kw) as client:
        seq = _create(client, truth)
        if call == "step":
            fake.fail_next_step = (UNAVAILABLE, True)
            with pytest.raises(flashserve.UnavailableError):
                seq.step(0, truth.query(), *truth.rows(1))
        else:
            fake.fail_next_append = (UNAVAILABLE, True)
            with pytest.raises(flashserve.UnavailableError):
                seq.append(0, *truth.rows(2))
        _rounds(client, [seq], truth, 3)
        assert _server_rows(fakes[0], seq) == [truth.length(seq.key, 0), 3]
        assert client.stats["already_appended"] == 0


@pytest.mark.parametrize("call", ["step", "append"])
def test_a_retry_refused_after_an_unavailable_that_appended_does_not_poison_the_next_step(fakes, rng, call):
    """One endpoint: the first try appends and its answer is lost (UNAVAILABLE); the client retries, and the server
    refuses the retry outright (RESOURCE_EXHAUSTED: its queue is full). The caller sees RESOURCE_EXHAUSTED. Before,
    only the last try's error was looked at: the first try's rows stayed, unknown to the client, and the next step
    was taken for a retry of them (wrong answer)."""
    truth = _truth(rng)
    fake = fakes[0].servicer
    failures = [(UNAVAILABLE, True), (grpc.StatusCode.RESOURCE_EXHAUSTED, False)]
    with flashserve.SequenceClient(fakes[0].address, timeout=30) as client:
        seq = _create(client, truth)
        with pytest.raises(flashserve.ResourceExhaustedError):
            if call == "step":
                fake.fail_next_step = failures
                seq.step(0, truth.query(), *truth.rows(1))
            else:
                fake.fail_next_append = failures
                seq.append(0, *truth.rows(2))
        _rounds(client, [seq], truth, 3)
        assert _server_rows(fakes[0], seq) == [truth.length(seq.key, 0), 3]


class _Interrupted(BaseException):
    """A KeyboardInterrupt, or an exception a signal handler raises, in the middle of a call."""


@pytest.mark.parametrize("where", ["step_answer", "step_rpc", "append_rpc"])
def test_a_call_interrupted_after_the_server_appended_does_not_poison_the_next_step(fakes, rng, monkeypatch, where):
    """The server appended and answered, and the call stops with something that is not a FlashserveError: the rpc
    interrupted (Ctrl-C, a signal handler) as the answer came, or an answer the caller's tensors cannot take (out of
    device memory turning O into a torch tensor on q's device). The caller takes the rows for not appended. Before,
    the client neither acknowledged them nor marked the sequence uncertain: the next step was taken for a retry of
    them (wrong answer), or ABORTED for an Append of another row count."""
    truth = _truth(rng)
    from flashserve import _seq_step

    with flashserve.SequenceClient(fakes[0].address, timeout=30) as client:
        seq = _create(client, truth)
        if where == "step_answer":
            monkeypatch.setattr(_seq_step, "_answer", lambda *a: (_ for _ in ()).throw(MemoryError("OOM")))
            expected = MemoryError
        else:
            real = client._rpc

            def interrupted(endpoint, method, *args):
                answer = real(endpoint, method, *args)
                if method in ("DecodeStep", "Append"):
                    raise _Interrupted()
                return answer

            monkeypatch.setattr(client, "_rpc", interrupted)
            expected = _Interrupted
        with pytest.raises(expected):
            if where == "append_rpc":
                seq.append(0, *truth.rows(2))
            else:
                seq.step(0, truth.query(), *truth.rows(1))
        monkeypatch.undo()
        _rounds(client, [seq], truth, 3)
        assert _server_rows(fakes[0], seq) == [truth.length(seq.key, 0), 3]


# --- an answer that came back OK but cannot be read ------------------------------------------------------------------


def _spoiled(result, bad: str):
    """A DecodeResult / AttendResponse the client cannot take: O a byte short, O in float32 (not q's dtype), or LSE
    in float16."""
    from flashserve import attention_pb2 as pb
    from flashserve import tensors

    if bad == "short_out":
        result.out.data = result.out.data[:-1]
    else:
        field = "out" if bad == "out_dtype" else "lse"
        x = tensors.from_proto(getattr(result, field)).astype("<f4" if bad == "out_dtype" else "<f2")
        getattr(result, field).CopyFrom(pb.Tensor(dtype=tensors.PROTO_DTYPE[x.dtype.name], shape=list(x.shape),
                                                  data=x.tobytes()))
    return result


def _spoil_next_answer(monkeypatch, fake, bad: str) -> None:
    """The fake's next answer (its _attend builds every result) spoiled as _spoiled says; the rows are appended."""
    real = fake._attend
    armed = [True]

    def attend(*args):
        result = real(*args)
        if armed and armed.pop():
            _spoiled(result, bad)
        return result

    monkeypatch.setattr(fake, "_attend", attend, raising=False)


@pytest.mark.parametrize("keep_history", [True, False], ids=["history", "no_history"])
@pytest.mark.parametrize("bad", ["short_out", "out_dtype", "lse_dtype"])
def test_a_step_answer_that_cannot_be_read_is_internal_and_its_rows_are_cut_back(fakes, rng, monkeypatch, bad,
                                                                                keep_history):
    """The server appended and answered OK, but the answer cannot be read: O of a byte count that is not its shape's,
    O not in q's dtype, LSE not float32. Before, the first raised INVALID_ARGUMENT (the caller's fault, "nothing
    appended") without marking the sequence: the next step named the same expected_length, was taken for a retry
    (already_appended) and answered over the first step's row; the other two were handed to the caller as they came.
    Now: INTERNAL, the sequence uncertain (rows landed, nothing more will: cut back, not re-created -- also without a
    history), and every later answer right."""
    truth = _truth(rng)
    fake = fakes[0].servicer
    with flashserve.SequenceClient(fakes[0].address, timeout=30) as client:
        seq = _create(client, truth, keep_history=keep_history)
        _step(seq, truth)
        _spoil_next_answer(monkeypatch, fake, bad)
        with pytest.raises(flashserve.FlashserveError) as info:
            seq.step(0, truth.query(), *truth.rows(1), return_lse=True)
        assert info.value.code == INTERNAL, info.value
        assert seq.uncertain and not seq.may_land
        _rounds(client, [seq], truth, 3)
        assert _server_rows(fakes[0], seq) == [truth.length(seq.key, 0), 3]
        assert client.stats["truncated_back"] == 1 and seq.reprefills == 0
        assert client.stats["already_appended"] == 0


@pytest.mark.parametrize("bad", ["short_out", "out_dtype", "lse_dtype"])
def test_an_attend_answer_that_cannot_be_read_is_internal(fakes, rng, monkeypatch, bad):
    """The same answers to an Attend: INTERNAL (before: INVALID_ARGUMENT, or the wrong dtype handed over), nothing
    made uncertain (an attend appends nothing)."""
    truth = _truth(rng)
    with flashserve.SequenceClient(fakes[0].address, timeout=30) as client:
        seq = _create(client, truth)
        _spoil_next_answer(monkeypatch, fakes[0].servicer, bad)
        with pytest.raises(flashserve.FlashserveError) as info:
            seq.attend(0, truth.query(), return_lse=True)
        assert info.value.code == INTERNAL, info.value
        assert not seq.uncertain
        _step(seq, truth)


# --- two endpoints, both fail ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("first_failure", [(INTERNAL, True), (grpc.StatusCode.RESOURCE_EXHAUSTED, False)],
                         ids=["internal", "exhausted"])
def test_every_endpoint_group_that_may_have_appended_is_settled(fakes, rng, first_failure):
    """A step over two servers fails on both: the first server's group with `first_failure`, the second's with
    INTERNAL after it appended. Before, the client raised at the first failed group and never looked at the
    second: its sequences were not marked uncertain, and their next step was taken for a retry (wrong answer)."""
    truth = _truth(rng)
    with flashserve.SequenceClient([f.address for f in fakes], timeout=30) as client:
        first = [_create(client, truth, key=key_on(client.ring, fakes[0].address, f"a{i}-")) for i in range(2)]
        second = [_create(client, truth, key=key_on(client.ring, fakes[1].address, f"b{i}-")) for i in range(2)]
        assert {s.endpoint for s in first} == {fakes[0].address} and {s.endpoint for s in second} == {fakes[1].address}
        fakes[0].servicer.fail_next_step = first_failure
        fakes[1].servicer.fail_next_step = (INTERNAL, True)
        with pytest.raises(flashserve.FlashserveError) as info:  # the first group's error
            client.decode_step([(s, 0, truth.query(), *truth.rows(1)) for s in first + second])
        assert info.value.code == first_failure[0]
        _rounds(client, first + second, truth, 3)
        for s in first + second:
            assert _server_rows(next(f for f in fakes if f.address == s.endpoint), s)[0] == truth.length(s.key, 0)


@pytest.mark.parametrize("failure", [(INTERNAL, True), (grpc.StatusCode.RESOURCE_EXHAUSTED, False)],
                         ids=["internal", "exhausted"])
def test_a_step_that_raises_leaves_none_of_its_rows_even_where_one_server_took_them(fakes, rng, failure):
    """A step over two servers: the first server's DecodeStep succeeds, the second's fails; decode_step raises. For
    the caller, a step that raised appended nothing -- as on one server, where the client settles an ambiguous failure
    by re-creating the sequence without the rows -- and retrying it is the natural thing. Before, the first server's
    sequences kept the rows (acknowledged) and the retry appended them a second time (wrong answers from then on)."""
    truth = _truth(rng)
    with flashserve.SequenceClient([f.address for f in fakes], timeout=30) as client:
        first = [_create(client, truth, key=key_on(client.ring, fakes[0].address, f"a{i}-")) for i in range(2)]
        second = [_create(client, truth, key=key_on(client.ring, fakes[1].address, f"b{i}-")) for i in range(2)]
        seqs = first + second
        qs, kvs = [truth.query() for _ in seqs], [truth.rows(1) for _ in seqs]
        items = [(s, 0, q, k, v) for s, q, (k, v) in zip(seqs, qs, kvs)]
        fakes[1].servicer.fail_next_step = failure
        with pytest.raises(flashserve.FlashserveError) as info:
            client.decode_step(items)
        assert info.value.code == failure[0]
        outs = client.decode_step(items)  # the caller retries the step
        for s, q, (k, v), out in zip_all(seqs, qs, kvs, outs):
            truth.add(s.key, 0, k, v)
            truth.check(out, q, s.key, 0)
        _rounds(client, seqs, truth, 2)
        for s in seqs:
            assert _server_rows(next(f for f in fakes if f.address == s.endpoint), s)[0] == truth.length(s.key, 0)


# --- an answer from a sequence re-created meanwhile ------------------------------------------------------------------


def test_an_answer_from_a_sequence_recreated_meanwhile_is_not_acknowledged(fakes, rng):
    """Thread C steps layer 1; the server appends and answers, but the answer is slow to reach C. Meanwhile thread
    main's step of layer 0 hits UNAVAILABLE: the endpoint is marked down and the sequence re-created on the other
    server from the rows acknowledged so far (not C's). Before, C then acknowledged its row (history, length) for a
    sequence that no longer held it: the next attend of layer 1 left C's row out (a wrong answer) and the next append
    was ABORTED. Now C's answer from the abandoned id is dropped and its item re-sent to the new sequence."""
    truth = _truth(rng)
    fake0 = fakes[0].servicer
    with flashserve.SequenceClient([f.address for f in fakes], timeout=30, down_s=60) as client:
        seq = _create(client, truth, key=key_on(client.ring, fakes[0].address, "c-"))
        hold = fake0.hold("DecodeStep", "after")
        qc, (kc, vc) = truth.query(), truth.rows(1)
        c = _Thread(lambda: seq.step(1, qc, kc, vc))
        hold.wait_entered()  # C's row is in the sequence on server 0; its answer waits
        fake0.fail_next_step = (UNAVAILABLE, False)
        _step(seq, truth, layer=0)  # UNAVAILABLE -> re-created on server 1, retried there
        assert seq.endpoint == fakes[1].address and seq.reprefills == 1
        hold.release(wait=False)
        out_c = c.join()
        truth.add(seq.key, 1, kc, vc)  # C's step returned: its row is in
        truth.check(out_c, qc, seq.key, 1)
        q = truth.query()
        truth.check(seq.attend(1, q), q, seq.key, 1)
        _step(seq, truth, layer=1)
        assert _server_rows(fakes[1], seq) == [truth.length(seq.key, 0), truth.length(seq.key, 1)]


def test_a_failover_releases_what_it_left_on_a_server_that_is_still_up(fakes, rng):
    """UNAVAILABLE from a server that is still up (a reset connection, a GOAWAY): the client re-creates the sequence
    on the next endpoint and, in the background, releases the id it left behind. Before, the old sequence kept its
    pages until the server's TTL (for good with --sequence_ttl_s=0) while its copy lived on elsewhere."""
    truth = _truth(rng)
    fake0 = fakes[0].servicer
    with flashserve.SequenceClient([f.address for f in fakes], timeout=30, down_s=60) as client:
        seq = _create(client, truth, key=key_on(client.ring, fakes[0].address, "f-"))
        old_id = seq.id
        fake0.fail_next_step = (UNAVAILABLE, False)
        _step(seq, truth, layer=0)  # UNAVAILABLE -> re-created on server 1, retried there
        assert seq.endpoint == fakes[1].address and seq.id != old_id
        deadline = time.monotonic() + 10  # released in the background: its answer comes when it comes
        while (old_id in fake0.seqs or client.stats["left_behind_released"] < 1) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert old_id not in fake0.seqs, "the id left behind on server 0 was never released"
        assert client.stats["left_behind_released"] == 1
        _step(seq, truth, layer=0)  # the sequence lives on where it moved
        assert _server_rows(fakes[1], seq)[0] == truth.length(seq.key, 0)


def test_a_step_whose_share_raises_ends_only_after_its_other_shares(fakes, rng, monkeypatch):
    """decode_step over two servers: server 0's share raises something other than a FlashserveError (out of memory
    turning its answer into the caller's tensors) while server 1's share is still in flight. The step raises once
    server 1's share has ended and takes that share's row back, so that sending the step again -- what a call that
    raised asks for -- leaves every row on its server once. Before, the step raised at once and server 1's share
    acknowledged its row afterwards: sent again, that row was on the server twice."""
    from flashserve import _seq_step

    truth = _truth(rng)
    with flashserve.SequenceClient([f.address for f in fakes], timeout=30) as client:
        a = _create(client, truth, key=key_on(client.ring, fakes[0].address, "a-"))
        b = _create(client, truth, key=key_on(client.ring, fakes[1].address, "b-"))
        hold = fakes[1].servicer.hold("DecodeStep", "after")  # b's row on server 1; its answer waits
        answer = _seq_step._answer

        def out_of_memory_for_a(response, item, return_lse):
            if item.seq is a:
                hold.wait_entered()
                threading.Timer(0.3, hold.release, kwargs={"wait": False}).start()  # b answers a moment later
                raise MemoryError("no memory for a's answer")
            return answer(response, item, return_lse)

        monkeypatch.setattr(_seq_step, "_answer", out_of_memory_for_a)
        qs = [truth.query() for _ in (a, b)]
        kvs = [truth.rows(1) for _ in (a, b)]
        items = [(seq, 0, q, k, v) for seq, q, (k, v) in zip((a, b), qs, kvs)]
        with pytest.raises(MemoryError):
            client.decode_step(items)
        assert hold.finished.wait(10)
        time.sleep(0.3)  # whatever b's answer did, it has done
        monkeypatch.setattr(_seq_step, "_answer", answer)
        outs = client.decode_step(items)  # sent again
        for seq, q, (k, v), out in zip_all((a, b), qs, kvs, outs):
            truth.add(seq.key, 0, k, v)
            truth.check(out, q, seq.key, 0)
        for fake, seq in zip(fakes, (a, b)):
            assert _server_rows(fake, seq) == [truth.length(seq.key, 0), truth.length(seq.key, 1)], seq.key


# --- release while a step is on its way -------------------------------------------------------------------------------


def test_a_step_that_finds_its_sequence_released_does_not_recreate_it(fakes, rng):
    """release() while a step of the same sequence is on its way: the step then finds the id gone (NOT_FOUND). Before,
    the client re-created the sequence from its history and answered, leaving a sequence on the server that nothing
    would release (its TTL may be 0: never). Now the step raises: the sequence was released by this client."""
    truth = _truth(rng)
    fake = fakes[0].servicer
    with flashserve.SequenceClient(fakes[0].address, timeout=30) as client:
        seq = _create(client, truth)
        hold = fake.hold("DecodeStep", "before")
        step = _Thread(lambda: seq.step(0, truth.query(), *truth.rows(1)))
        hold.wait_entered()
        assert seq.release() is True
        hold.release(wait=False)
        with pytest.raises(flashserve.FlashserveError) as info:
            step.join()
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION and "released" in info.value.message
        assert fake.seqs == {} and seq.reprefills == 0


# --- an Append applied after the client's deadline, after the next call's check ---------------------------------------


def test_an_append_applied_after_the_deadline_and_after_the_check_is_not_taken_for_the_next(fakes, rng):
    """An Append reaches the server, which applies it late (the real server's Append applies however late: it has no
    deadline check; a large one is parsed and copied for a while on a loaded host). The client's deadline passes
    first: DEADLINE_EXCEEDED, the sequence is uncertain. The next call checks the lengths -- still the client's --
    and then the Append lands. Before, the client trusted that check: the next append of layer 0 named the length
    the late Append had followed, the server took it for a retry, dropped its row and attended over the late row.
    Now a call that may still land makes the client re-create the sequence (the late rows land on the old id)."""
    truth = _truth(rng)
    fake = fakes[0].servicer
    with flashserve.SequenceClient(fakes[0].address, timeout=30) as client:
        seq = _create(client, truth)
        hold = fake.hold("Append", "before")
        with pytest.raises(flashserve.DeadlineExceededError):
            seq.append(0, *truth.rows(1), timeout=0.3)
        assert seq.uncertain
        hold.wait_entered()
        q = truth.query()
        truth.check(seq.attend(1, q), q, seq.key, 1)  # settles the sequence
        hold.release()  # the late Append lands now
        for _ in range(2):
            _step(seq, truth, layer=0)
        assert client.stats["already_appended"] == 0
        assert _server_rows(fakes[0], seq) == [truth.length(seq.key, 0), 3]


# --- a check of the lengths that overlaps a new failure ---------------------------------------------------------------


def test_a_check_that_began_before_a_new_ambiguous_failure_does_not_clear_it(fakes, rng):
    """Thread B's call settles the uncertain sequence (an earlier INTERNAL that appended nothing): it asks the server
    for the lengths and the answer is slow. Meanwhile main's step of layer 0 fails with INTERNAL after the server
    appended: uncertain again. B's answer -- the lengths from before main's rows -- matches the client's, and before,
    B cleared the flag, main's new doubt with it: the next step of layer 0 was taken for a retry (wrong answer). Now a
    check clears only the doubts that were there when it began."""
    truth = _truth(rng)
    fake = fakes[0].servicer
    with flashserve.SequenceClient(fakes[0].address, timeout=30) as client:
        seq = _create(client, truth)
        fake.fail_next_step = (INTERNAL, False)
        with pytest.raises(flashserve.FlashserveError):
            seq.step(1, truth.query(), *truth.rows(1))
        assert seq.uncertain
        hold = fake.hold("GetSequenceInfo", "after")
        qb = truth.query()
        b = _Thread(lambda: seq.attend(1, qb))
        hold.wait_entered()
        fake.fail_next_step = (INTERNAL, True)
        with pytest.raises(flashserve.FlashserveError):
            seq.step(0, truth.query(), *truth.rows(1))
        hold.release(wait=False)
        truth.check(b.join(), qb, seq.key, 1)
        for _ in range(2):
            _step(seq, truth, layer=0)
        assert _server_rows(fakes[0], seq) == [truth.length(seq.key, 0), 3]


# --- an answer that says nothing about a layer's appends -------------------------------------------------------------


@pytest.mark.parametrize("slow", ["attend_only_step", "append_of_another_layer"])
def test_a_late_answer_does_not_set_back_the_length_of_a_layer_it_did_not_append_to(fakes, rng, slow):
    """Thread U's call does not append to layer 0 (an attend-only step item of layer 0, or an Append to layer 1) and
    its answer, which carries layer 0's length as the server saw it, arrives after main's step appended to layer 0.
    Before, U's answer set the client's length of layer 0 back: main's next step named the old length, the server
    took it for a retry, dropped the row and attended over the previous one (wrong answer). An attend-only item of
    layer 0 now holds main's append to layer 0 back until it is answered (test_sequences_client.py): that late
    answer can no longer come after the append, which must wait for it instead of hanging."""
    truth = _truth(rng)
    fake = fakes[0].servicer
    with flashserve.SequenceClient(fakes[0].address, timeout=30) as client:
        seq = _create(client, truth)
        if slow == "attend_only_step":
            hold = fake.hold("DecodeStep", "after")
            u = _Thread(lambda: seq.step(0, truth.query()))
        else:
            hold = fake.hold("Append", "after")
            kz, vz = truth.rows(2)
            u = _Thread(lambda: seq.append(1, kz, vz))
        hold.wait_entered()
        main = _Thread(lambda: _step(seq, truth, layer=0))
        if slow == "attend_only_step":
            time.sleep(0.3)
            assert main.is_alive(), "an append to layer 0 ran while an attend over it was in flight"
        else:
            main.join()
        hold.release(wait=False)
        u.join()
        main.join()
        if slow == "append_of_another_layer":
            truth.add(seq.key, 1, kz, vz)
        for _ in range(2):
            _step(seq, truth, layer=0)
        _step(seq, truth, layer=1)
        assert seq.lengths == [truth.length(seq.key, 0), truth.length(seq.key, 1)]
        assert client.stats["already_appended"] == 0


# --- prefix_source ----------------------------------------------------------------------------------------------------


def test_prefix_source_holding_the_row_in_flight_is_cut_to_the_acknowledged_rows(fakes, rng):
    """keep_history=False with prefix_source returning the caller's own KV cache, which (as in a model) already holds
    the k/v of the token being stepped. The server restarts; the step finds its sequence gone and the client
    re-creates it from prefix_source. Before, the new sequence held the token already and the retried step appended it
    once more: that answer and every later one counted the token twice. Now only the rows the server had
    acknowledged (seq.lengths) are taken from the source."""
    truth = _truth(rng)
    cache = {0: list(truth.rows(5)), 1: list(truth.rows(3))}

    def source(seq):
        return {layer: tuple(kv) for layer, kv in cache.items()}

    with flashserve.SequenceClient(fakes[0].address, timeout=30) as client:
        seq = client.create(**SHAPE, prefix=source(None), keep_history=False, prefix_source=source)
        for layer, (k, v) in cache.items():
            truth.add(seq.key, layer, k, v)
        for step in range(4):
            q, (k, v) = truth.query(), truth.rows(1)
            cache[0] = [np.concatenate([cache[0][0], k]), np.concatenate([cache[0][1], v])]  # the model's cache first
            if step == 2:
                fakes[0].servicer.forget_all()  # a restart
            out = seq.step(0, q, k, v)
            truth.add(seq.key, 0, k, v)
            truth.check(out, q, seq.key, 0)
        assert seq.reprefills == 1 and _server_rows(fakes[0], seq) == [truth.length(seq.key, 0), 3]


def test_without_history_an_uncertain_sequence_is_left_on_the_server(fakes, rng):
    """keep_history=False: a step whose rows landed but whose answer was lost leaves the sequence uncertain, and the
    client cannot re-create it. It used to release the server's copy (the only one) and report NOT_FOUND "lost by the
    server"; now the next call says FAILED_PRECONDITION and the server keeps the sequence."""
    truth = _truth(rng)
    fake = fakes[0].servicer
    with flashserve.SequenceClient(fakes[0].address, timeout=30, max_attempts=1) as client:  # no retry
        k, v = truth.rows(4)
        seq = client.create(**SHAPE, prefix={0: (k, v)}, keep_history=False)
        fake.fail_next_step = (UNAVAILABLE, True)
        with pytest.raises(flashserve.UnavailableError):
            seq.step(0, truth.query(), *truth.rows(1))
        with pytest.raises(flashserve.FlashserveError) as info:
            seq.attend(0, truth.query())
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION, info.value
        assert "left as it is" in info.value.message
        assert _server_rows(fakes[0], seq) == [5, 0]
        assert "Release" not in fake.calls


def test_prefix_source_with_fewer_rows_than_acknowledged_is_refused(fakes, rng):
    """A source that cannot give every acknowledged row: re-creating from it would leave rows out (wrong answers)."""
    truth = _truth(rng)
    k, v = truth.rows(4)
    with flashserve.SequenceClient(fakes[0].address, timeout=30) as client:
        seq = client.create(**SHAPE, prefix={0: (k, v)}, keep_history=False, prefix_source=lambda s: {0: (k, v)})
        seq.append(0, *truth.rows(1))
        fakes[0].servicer.forget_all()
        with pytest.raises(flashserve.FlashserveError, match="prefix_source"):
            seq.attend(0, truth.query())
        assert fakes[0].servicer.seqs == {}


# --- the real server (CPU backend): an answer lost on its way, the client not retrying --------------------------------

E2E_SHAPE = dict(num_layers=2, heads_q=8, heads_kv=2, head_dim=64, dtype="bfloat16")


def test_a_server_that_answers_a_new_connection_late_is_still_reached(fakes, rng):
    """A server whose HTTP/2 greeting (SETTINGS) comes 0.5 s after the connection opens, as over a long TLS path or
    from a loaded server: calls wait for it. grpc.min_reconnect_backoff_ms is also gRPC's shortest connect timeout;
    the client once set it to 100 ms for fast reconnects, and every such connection failed UNAVAILABLE ("connection
    attempt timed out before receiving SETTINGS frame"; seen in CI against the sanitized server)."""
    proxy = LateGreetingProxy(fakes[0].port, delay=0.5)
    try:
        truth = _truth(rng)
        with flashserve.SequenceClient(proxy.address, timeout=20, reprefill=False) as client:
            seq = _create(client, truth)
            _step(seq, truth)
    finally:
        proxy.close()


@pytest.fixture(scope="module")
def kv_server(flashserve_bin, tmp_path_factory):
    from conftest import ServerProcess, _stop_and_check

    path = os.path.join(tempfile.mkdtemp(prefix="fsf", dir="/tmp"), "fs.sock")  # sun_path: at most 107 bytes
    s = ServerProcess(flashserve_bin, tmp_path_factory.mktemp("seq_faults"),
                      ["--kv_cache_bytes=67108864", "--kv_page_tokens=16", f"--local_socket={path}"],
                      name="seq_faults").start()
    s.local_path = path
    yield s
    _stop_and_check(s)
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def _e2e_truth(rng):
    return Truth(rng, E2E_SHAPE["heads_q"], E2E_SHAPE["heads_kv"], E2E_SHAPE["head_dim"], E2E_SHAPE["dtype"])


def _e2e_steps(client, seqs, truth, n):
    for _ in range(n):
        qs = [truth.query(2) for _ in seqs]
        kvs = [truth.rows(2) for _ in seqs]
        outs = client.decode_step([(s, 0, q, k, v) for s, q, (k, v) in zip(seqs, qs, kvs)], causal=True)
        for s, q, (k, v), out in zip_all(seqs, qs, kvs, outs):
            truth.add(s.key, 0, k, v)
            truth.check(out, q, s.key, 0, causal=True)
            assert s.info().layer_lengths[0] == truth.length(s.key, 0)


@pytest.mark.e2e
@pytest.mark.parametrize("cut_at", [0, 9, 16 + 40])
@pytest.mark.parametrize("reprefill", [False, True])
def test_local_socket_answer_cut_mid_frame(kv_server, rng, cut_at, reprefill):
    """A step over the local socket runs on the server and its reply frame is cut: before it, inside the 16-byte
    header, or inside the payload. The client drops the connection (UNAVAILABLE). With re-prefill on it retries over
    a new connection (the server finds the rows there: expected_length); with it off the caller sees UNAVAILABLE and
    the next steps must still be right (before, they were not: the sequence was not marked uncertain)."""
    truth = _e2e_truth(rng)
    cutter = AnswerCutter(unix_target=kv_server.local_path)
    try:
        with flashserve.SequenceClient(kv_server.address, timeout=30, reprefill=reprefill,
                                       local_sockets={kv_server.address: cutter.address}) as client:
            seqs = []
            for i in range(2):
                k, v = truth.rows(7 + i)
                seqs.append(client.create(**E2E_SHAPE, prefix={0: (k, v)}))
                truth.add(seqs[-1].key, 0, k, v)
            _e2e_steps(client, seqs, truth, 1)
            cutter.cut_next_answer(keep=cut_at)
            qs, kvs = [truth.query(2) for _ in seqs], [truth.rows(2) for _ in seqs]
            items = [(s, 0, q, k, v) for s, q, (k, v) in zip(seqs, qs, kvs)]
            if reprefill:
                outs = client.decode_step(items, causal=True)
                for s, q, (k, v), out in zip_all(seqs, qs, kvs, outs):
                    truth.add(s.key, 0, k, v)
                    truth.check(out, q, s.key, 0, causal=True)
                assert client.stats["already_appended"] == 2
            else:
                with pytest.raises(flashserve.UnavailableError):
                    client.decode_step(items, causal=True)
            assert cutter.cut == 1
            _e2e_steps(client, seqs, truth, 2)
    finally:
        cutter.close()


def _wait_reconnected(client, timeout=10.0):
    """Until a call goes through: the channel may try the dropped connection once more (UNAVAILABLE, which a client
    without re-prefill does not retry), and that is not what the test is about."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            client.pool_info(timeout=5)
            return
        except flashserve.UnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@pytest.mark.e2e
def test_grpc_answer_dropped_with_reprefill_off(kv_server, rng):
    """The same over gRPC, behind a TCP proxy that drops the connection carrying the step's answer
    (tcp_proxy.AnswerCutter): UNAVAILABLE to the caller, right answers after."""

    truth = _e2e_truth(rng)
    proxy = AnswerCutter(port=int(kv_server.address.rsplit(":", 1)[1]))
    try:
        with flashserve.SequenceClient(proxy.address, timeout=30, reprefill=False) as client:
            seqs = []
            for i in range(2):
                k, v = truth.rows(5 + i)
                seqs.append(client.create(**E2E_SHAPE, prefix={0: (k, v)}, key=f"d{i}"))
                truth.add(f"d{i}", 0, k, v)
            _e2e_steps(client, seqs, truth, 1)
            proxy.cut_next_answer(at_headers=True)  # the step's answer, from its first frame
            with pytest.raises(flashserve.UnavailableError):
                client.decode_step([(s, 0, truth.query(16), *truth.rows(2)) for s in seqs], causal=True)
            assert proxy.cut == 1
            _wait_reconnected(client)
            _e2e_steps(client, seqs, truth, 2)
    finally:
        proxy.close()
