"""An in-process fake of flashserve.v1.Sequences (numpy, fp64 reference rounded to the dtype) for client tests.

It implements what the client relies on (create with prefix, append, truncate, attend, DecodeStep all-or-nothing,
NOT_FOUND with the missing ids in trailing metadata, release, info) and nothing of the server's memory management:
the real server is tested by test_sequences_e2e*.py. ``forget_all()`` plays an eviction or a restart; ``stop()`` a
server that leaves.

Failure injection: ``fail_next_step`` / ``fail_next_append`` / ``fail_next_truncate`` = (grpc.StatusCode, whether the
rows were appended -- or cut -- first), or a list of those for the next calls in turn. ``hold("DecodeStep" | "Append",
where)`` stops the next such call "before" it reads anything (a request on its way, or one the server has not got to
yet: the real server's Append applies however late, DecodeStep once it has started running) or "after" it applied and
built its answer (an answer on its way back) until the test lets it go; ``hold("GetSequenceInfo", "after")`` the same
for an info answer, and ``hold("Release", "before")`` for a release on its way.
``slow(method, seconds)``: every call of ``method`` waits that long before it reads anything (and still applies after
the client's deadline, as the real server's Append does); ``slow(method, 0)`` ends it.
"""

from __future__ import annotations

import secrets
import threading
import time
from concurrent import futures
from typing import Dict, List, Optional

import grpc
import numpy as np

from flashserve import reference, tensors
from flashserve import attention_pb2 as pb
from flashserve import sequences_pb2 as spb
from flashserve import sequences_pb2_grpc as spb_grpc

BIG = 2**31 - 1


class _FakeSeq:
    def __init__(self, request):
        self.spec = (request.heads_q, request.heads_kv, request.head_dim, request.dtype)
        self.num_layers = request.num_layers
        self.k: List[np.ndarray] = [np.zeros((0, request.heads_kv, request.head_dim))] * request.num_layers
        self.v: List[np.ndarray] = list(self.k)


def _next_failure(armed):
    """(this call's failure or None, what stays armed): a tuple is one failure, a list one per call in turn."""
    if isinstance(armed, list):
        return (armed[0], armed[1:] or None) if armed else (None, None)
    return armed, None


class Hold:
    """One held call: ``entered`` is set when it stops, it goes on when ``proceed`` is set, ``finished`` when its
    handler returns (answered or failed)."""

    def __init__(self, where: str):
        assert where in ("before", "after"), where
        self.where = where
        self.entered, self.proceed, self.finished = threading.Event(), threading.Event(), threading.Event()

    def wait_entered(self, timeout: float = 10.0) -> "Hold":
        assert self.entered.wait(timeout), "the held call never came"
        return self

    def release(self, wait: bool = True, timeout: float = 10.0) -> None:
        self.proceed.set()
        if wait:
            assert self.finished.wait(timeout), "the held call did not finish"


class FakeSequences(spb_grpc.SequencesServicer):
    def __init__(self):
        self.seqs: Dict[str, _FakeSeq] = {}
        self.lock = threading.Lock()
        self.calls: List[str] = []
        self.metadata_seen: List[dict] = []
        # One-shot failures of the next DecodeStep: (grpc.StatusCode, whether the rows were appended first), or a list
        # of them for the next DecodeSteps in turn.
        self.fail_next_step = None
        self.fail_next_append = None  # the same for the next Append
        self.fail_next_truncate = None  # the same for the next Truncate (whether it cut)
        self.holds: Dict[str, Hold] = {}  # method -> the next call of it to hold (hold())
        self.delays: Dict[str, float] = {}  # method -> seconds each call of it waits first (slow())
        self.packed_steps = 0  # DecodeSteps that came packed (DecodeStepRequest.packed)

    def hold(self, method: str, where: str) -> Hold:
        """Holds the next call of ``method`` ("before" it reads anything, or "after" it applied); see Hold."""
        self.holds[method] = Hold(where)
        return self.holds[method]

    def slow(self, method: str, seconds: float) -> None:
        """Every call of ``method`` waits ``seconds`` before it reads anything (0: no more)."""
        self.delays[method] = seconds

    def _held(self, method: str, where: str) -> Optional[Hold]:
        with self.lock:
            hold = self.holds.get(method)
            if hold is None or hold.where != where:
                return None
            del self.holds[method]
        hold.entered.set()
        hold.proceed.wait(30)
        return hold

    def forget_all(self):
        with self.lock:
            self.seqs.clear()

    def _missing(self, context, ids):
        context.set_trailing_metadata((("flashserve-missing-sequence-ids", ",".join(ids)),))
        context.abort(grpc.StatusCode.NOT_FOUND, f"unknown sequence ids: {', '.join(ids)}")

    def _get(self, context, sequence_id) -> _FakeSeq:
        seq = self.seqs.get(sequence_id)
        if seq is None:
            self._missing(context, [sequence_id])
        return seq

    def _note(self, name, context):
        self.calls.append(name)
        self.metadata_seen.append(dict(context.invocation_metadata()))
        if self.delays.get(name):
            time.sleep(self.delays[name])

    def CreateSequence(self, request, context):
        self._note("CreateSequence", context)
        seq = _FakeSeq(request)
        for layer_kv in request.prefix:
            seq.k[layer_kv.layer] = tensors.from_proto(layer_kv.k).astype(np.float64)
            seq.v[layer_kv.layer] = tensors.from_proto(layer_kv.v).astype(np.float64)
        sequence_id = secrets.token_hex(16)
        with self.lock:
            self.seqs[sequence_id] = seq
        return spb.CreateSequenceResponse(sequence_id=sequence_id, ttl_ms=0, max_tokens=1 << 17,
                                          layer_lengths=[len(k) for k in seq.k])

    def Append(self, request, context):
        self._note("Append", context)
        holds = []
        try:
            holds.append(self._held("Append", "before"))
            with self.lock:
                seq = self._get(context, request.sequence_id)
                failure, self.fail_next_append = _next_failure(self.fail_next_append)
                if failure is not None and not failure[1]:
                    context.abort(failure[0], "injected failure before the append")
                there = [self._already_there(context, seq, r.layer, r, r.k) for r in request.rows]
                for layer_kv, already in zip(request.rows, there):
                    if not already:
                        self._append(seq, layer_kv.layer, layer_kv.k, layer_kv.v)
                if failure is not None:
                    context.abort(failure[0], "injected failure after the append")
                response = spb.AppendResponse(layer_lengths=[len(k) for k in seq.k],
                                              already_appended_layers=[r.layer for r, a in zip(request.rows, there)
                                                                       if a])
            holds.append(self._held("Append", "after"))
            return response
        finally:
            for hold in holds:
                if hold is not None:
                    hold.finished.set()

    @staticmethod
    def _already_there(context, seq, layer, message, k) -> bool:
        """expected_length as the server reads it: False (append), True (an earlier try's rows), or ABORTED."""
        if not message.HasField("expected_length"):
            return False
        length, rows = len(seq.k[layer]), (k.shape[0] if k.shape else 0)
        if length == message.expected_length:
            return False
        if rows and length == message.expected_length + rows:
            return True
        context.abort(grpc.StatusCode.ABORTED, f"layer {layer} holds {length} tokens but the call expected "
                                               f"{message.expected_length} before its {rows} row(s)")

    @staticmethod
    def _append(seq, layer, k, v):
        if k.shape and k.shape[0]:
            seq.k[layer] = np.concatenate([seq.k[layer], tensors.from_proto(k).astype(np.float64)])
            seq.v[layer] = np.concatenate([seq.v[layer], tensors.from_proto(v).astype(np.float64)])

    @staticmethod
    def _attend(seq, layer, q_pb, causal, scale, return_lse):
        q = tensors.from_proto(q_pb)
        out, lse = reference.attention(q[None], seq.k[layer][None], seq.v[layer][None], causal=causal,
                                       softmax_scale=scale, return_lse=True)
        out = out[0].astype(q.dtype)
        result = spb.DecodeResult(out=tensors.to_proto_rows(out, "out"), length=len(seq.k[layer]))
        if return_lse:
            lse32 = lse[0].astype("<f4")
            result.lse.CopyFrom(pb.Tensor(dtype=tensors.PROTO_DTYPE["float32"],
                                                          shape=list(lse32.shape), data=lse32.tobytes()))
        return result

    def Attend(self, request, context):
        self._note("Attend", context)
        hold = self._held("Attend", "before")
        try:
            scale = request.softmax_scale if request.HasField("softmax_scale") else None
            with self.lock:
                seq = self._get(context, request.sequence_id)
                r = self._attend(seq, request.layer, request.q, request.causal, scale, request.return_lse)
            response = spb.AttendResponse(out=r.out, length=r.length, kernel="fake")
            if request.return_lse:
                response.lse.CopyFrom(r.lse)
            return response
        finally:
            if hold is not None:
                hold.finished.set()

    def DecodeStep(self, request, context):
        self._note("DecodeStep", context)
        holds = []
        try:
            holds.append(self._held("DecodeStep", "before"))
            response = self._decode_step(request, context)
            holds.append(self._held("DecodeStep", "after"))
            return response
        finally:
            for hold in holds:
                if hold is not None:
                    hold.finished.set()

    def _decode_step(self, request, context):
        scale = request.softmax_scale if request.HasField("softmax_scale") else None
        with self.lock:
            missing = [i.sequence_id for i in request.items if i.sequence_id not in self.seqs]
            if missing:
                self._missing(context, list(dict.fromkeys(missing)))
            failure, self.fail_next_step = _next_failure(self.fail_next_step)
            if failure is not None and not failure[1]:
                context.abort(failure[0], "injected failure before the append")
            items = self._items_of(request)
            there = [self._already_there(context, self.seqs[i.sequence_id], i.layer, i, i.k) for i in items]
            results = []
            for item, already in zip(items, there):
                seq = self.seqs[item.sequence_id]
                if not already:
                    self._append(seq, item.layer, item.k, item.v)
                results.append(self._attend(seq, item.layer, item.q, request.causal, scale, request.return_lse))
                results[-1].already_appended = already
            if failure is not None:
                context.abort(failure[0], "injected failure after the append")
        return spb.DecodeStepResponse(results=results, kernel="fake", batched_calls=1)

    def _items_of(self, request):
        """The step's items with their own q/k/v: as sent, or sliced out of DecodeStepRequest.packed."""
        if not request.HasField("packed"):
            return list(request.items)
        self.packed_steps += 1
        p, n = request.packed, len(request.items)
        rows_q = list(p.rows_q) or [1] * n
        rows_kv = list(p.rows_kv) or (rows_q if p.HasField("k") else [0] * n)

        def piece(t, first, rows):
            row = len(t.data) // t.shape[0]
            return pb.Tensor(dtype=t.dtype, shape=[rows, *t.shape[1:]], data=t.data[first * row:(first + rows) * row])

        items, first_q, first_kv = [], 0, 0
        for item, rq, rkv in zip(request.items, rows_q, rows_kv):
            one = spb.DecodeItem(sequence_id=item.sequence_id, layer=item.layer, q=piece(p.q, first_q, rq))
            if item.HasField("expected_length"):
                one.expected_length = item.expected_length
            if rkv:
                one.k.CopyFrom(piece(p.k, first_kv, rkv))
                one.v.CopyFrom(piece(p.v, first_kv, rkv))
            items.append(one)
            first_q, first_kv = first_q + rq, first_kv + rkv
        return items

    def Truncate(self, request, context):
        self._note("Truncate", context)
        with self.lock:
            missing = [item.sequence_id for item in request.items if item.sequence_id not in self.seqs]
            if missing:  # every missing id, as the server names them
                self._missing(context, list(dict.fromkeys(missing)))
            seqs = [self.seqs[item.sequence_id] for item in request.items]
            failure, self.fail_next_truncate = _next_failure(self.fail_next_truncate)
            if failure is not None and not failure[1]:
                context.abort(failure[0], "injected failure before the truncate")
            plans = [(seq, item.length, list(item.layers) or list(range(seq.num_layers)))
                     for seq, item in zip(seqs, request.items)]
            for seq, length, layers in plans:
                if any(len(seq.k[layer]) < length for layer in layers):
                    context.abort(grpc.StatusCode.ABORTED, f"a layer holds fewer than {length} tokens")
            results = []
            for seq, length, layers in plans:
                dropped = sum(len(seq.k[layer]) - length for layer in layers)
                for layer in layers:
                    seq.k[layer], seq.v[layer] = seq.k[layer][:length], seq.v[layer][:length]
                results.append(spb.TruncateResult(layer_lengths=[len(k) for k in seq.k], dropped_tokens=dropped))
            if failure is not None:
                context.abort(failure[0], "injected failure after the truncate")
            return spb.TruncateResponse(results=results)

    def Release(self, request, context):
        self._note("Release", context)
        hold = self._held("Release", "before")
        try:
            with self.lock:
                gone = [i for i in request.sequence_ids if self.seqs.pop(i, None) is None]
            return spb.ReleaseResponse(released=len(request.sequence_ids) - len(gone), not_found=gone)
        finally:
            if hold is not None:
                hold.finished.set()

    def GetSequenceInfo(self, request, context):
        self._note("GetSequenceInfo", context)
        with self.lock:
            seq = self._get(context, request.sequence_id)
            info = spb.SequenceInfo(sequence_id=request.sequence_id, num_layers=seq.num_layers,
                                    layer_lengths=[len(k) for k in seq.k])
        hold = self._held("GetSequenceInfo", "after")
        if hold is not None:
            hold.finished.set()
        return info


class FakeSequencesServer:
    def __init__(self):
        self.servicer = FakeSequences()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8),
                                  options=[("grpc.max_send_message_length", BIG),
                                           ("grpc.max_receive_message_length", BIG)])
        spb_grpc.add_SequencesServicer_to_server(self.servicer, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{self.port}"
        self.server.start()

    def stop(self):
        self.server.stop(grace=None).wait()
