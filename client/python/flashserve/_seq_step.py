"""SequenceClient's DecodeStep: items encoded once, one call per endpoint holding some of the sequences (in
parallel), retries with re-prefill, and answers acknowledged only from the sequence ids they were sent to."""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import grpc

from . import tensors
from ._pb import attention_pb2 as pb
from ._pb import sequences_pb2 as spb
from ._seq_recovery import CallDeadline, _mark_uncertain
from .errors import FlashserveError, error_for
from ._step_answer import DecodeStepAnswer
from .packed_step import packed_step_request
from .sequences import Sequence, checked_layer, encode_rows

DecodeInput = Tuple[Sequence, int, Any, Any, Any]  # (sequence, layer, q, k, v); k/v may be None


class _Item:
    """One DecodeStep item, encoded once (retries re-send the same bytes)."""

    __slots__ = ("seq", "layer", "q", "k", "v", "kind", "device")

    def __init__(self, entry):
        seq, layer, q = entry[0], checked_layer(entry[0], entry[1]), entry[2]
        k = entry[3] if len(entry) > 3 else None
        v = entry[4] if len(entry) > 4 else None
        if (k is None) != (v is None):
            raise error_for(grpc.StatusCode.INVALID_ARGUMENT, "decode item: give both k and v, or neither")
        self.seq, self.layer = seq, layer
        self.kind = "torch" if tensors.is_torch(q) else "numpy"
        self.device = q.device if self.kind == "torch" else None
        # HostRows, not messages (building 3 pb.Tensor per item was a third of a 64-item step's own time); q is
        # sent from the caller's memory (never kept), k/v are copied: the history keeps them.
        self.q = encode_rows(q, "q", copy=False)
        self.k = encode_rows(k, "k") if k is not None else None
        self.v = encode_rows(v, "v") if v is not None else None

    @classmethod
    def encoded(cls, seq, layer: int, q, k, v) -> "_Item":
        """An item of rows already in wire form (pb.Tensor or HostRows slices of a batch's tensors): answered as the
        raw bytes of its O and LSE (decode_step_batch joins them)."""
        item = cls.__new__(cls)
        item.seq, item.layer, item.q, item.k, item.v = seq, checked_layer(seq, layer), q, k, v
        item.kind, item.device = "raw", None
        return item

    def appended_rows(self) -> Optional[dict]:
        """{layer: rows} this item appends; None for an attend-only item."""
        if self.k is None:
            return None
        return {self.layer: int(self.k.shape[0]) if self.k.shape else 0}

    def add_to(self, request: "spb.DecodeStepRequest", sequence_id: str) -> None:
        item = request.items.add(sequence_id=sequence_id, layer=self.layer)
        _copy_rows(item.q, self.q)
        if self.k is not None:
            _copy_rows(item.k, self.k)
            _copy_rows(item.v, self.v)


def _copy_rows(field: "pb.Tensor", rows) -> None:
    """A message's tensor field set from a pb.Tensor or HostRows."""
    if isinstance(rows, tensors.HostRows):
        field.dtype, field.data = rows.dtype, bytes(rows.data)  # a block of a batch's tensor is a view
        field.shape.extend(rows.shape)
    else:
        field.CopyFrom(rows)



class _DecodeSteps:
    """Mixin of SequenceClient (which supplies packed_steps, stats, _lock, _rpc, _calls_by_endpoint and
    _count_already_appended)."""

    def _decode_step(self, prepared: List[_Item], results: List[Any], doubtful: list, options,
                     deadline: CallDeadline) -> list:
        """decode_step's calls and retries (its layers held by hold_layers) within ``deadline``; fills results, and
        doubtful with (sequence, id sent, code, rows) of the items whose rows a failed try may have left on a server.
        Each item goes with its sequence's id and the layer's length (expected_length), read together. options:
        (causal, softmax_scale, return_lse)."""
        return self._calls_by_endpoint(
            [item.seq for item in prepared],
            lambda i: (prepared[i].seq.id, prepared[i].seq.lengths[prepared[i].layer]),
            lambda group, sent, endpoint, timeout: self._step_group(prepared, group, sent, endpoint, results,
                                                                    *options, timeout),
            results, doubtful, deadline, "decode", lambda i: prepared[i].appended_rows())

    def _step_group(self, prepared, group, sent, endpoint, results, causal, softmax_scale, return_lse,
                    timeout) -> None:
        """One DecodeStep of the group's items to (id, expected_length) ``sent``; fills results of the items whose
        sequence still has the id sent (the others are left None: sent again by the caller)."""
        # An item that appends names the length it follows; an attend-only one follows whatever is there.
        expected = [length if prepared[i].k is not None else None for i, (_, length) in zip(group, sent)]
        request = None
        if self.packed_steps:  # wire bytes
            request = packed_step_request([(sequence_id, prepared[i].layer, prepared[i].q, prepared[i].k,
                                            prepared[i].v) for i, (sequence_id, _) in zip(group, sent)],
                                          expected, (causal, softmax_scale, return_lse))
        if request is None:
            request = spb.DecodeStepRequest(causal=causal, return_lse=return_lse)
            if softmax_scale is not None:
                request.softmax_scale = float(softmax_scale)
            for i, (sequence_id, _), length in zip(group, sent, expected):
                prepared[i].add_to(request, sequence_id)
                if length is not None:
                    request.items[-1].expected_length = length
        try:
            answer = self._rpc(endpoint, "DecodeStep", request, prepared[group[0]].seq.key, timeout)
        except FlashserveError:
            raise  # the caller judges by the code
        except BaseException:  # interrupted with the request maybe sent: as a cancelled call
            _doubt_group(prepared, group, sent, grpc.StatusCode.CANCELLED)
            raise
        # Answered OK: every item's rows are on the server. Every answer read before any is acknowledged: one that
        # cannot be read fails the group whole, as INTERNAL (the caller marks its rows doubtful: the next call cuts
        # them off). Before, a malformed answer raised INVALID_ARGUMENT, taken for "nothing appended": the next step
        # named the same expected_length and was answered over this one's rows.
        try:
            if not isinstance(answer, DecodeStepAnswer):  # a typed request's answer
                answer = DecodeStepAnswer.of(answer)
            response = answer.response
            if len(response.results) != len(group):
                raise error_for(grpc.StatusCode.INTERNAL,
                                f"DecodeStep answered {len(response.results)} results for {len(group)} items")
            if answer.out is not None or answer.lse is not None:
                answers = _packed_answers(answer, [prepared[i] for i in group], return_lse)
            else:
                answers = [_answer(result, prepared[i], return_lse) for i, result in zip(group, response.results)]
        except (FlashserveError, ValueError) as e:
            raise _unreadable("DecodeStep", e) from e
        except BaseException:  # interrupted, or an answer the caller's tensors cannot take (out of memory ...)
            _doubt_group(prepared, group, sent, grpc.StatusCode.INTERNAL)  # landed, and nothing more will: cut back
            raise
        self._count_already_appended(sum(1 for result in response.results if result.already_appended))
        with self._lock:
            self.stats["max_batched_calls"] = max(self.stats["max_batched_calls"], int(response.batched_calls))
        for i, (sent_id, _), result, answer in zip(group, sent, response.results, answers):
            item = prepared[i]
            with item.seq.lock:
                if item.seq.id != sent_id:  # re-created while this ran, without these rows: the caller sends again
                    continue
                if item.k is not None:  # an attend-only item's length may be older than an append acknowledged since
                    item.seq.acknowledge_layer(item.layer, item.k, item.v, result.length)
                results[i] = answer  # with its acknowledgement: decode_step takes back those with a result


def _doubt_group(prepared: List[_Item], group: List[int], sent: list, code: grpc.StatusCode) -> None:
    """Marks the sequences of the group's appending items uncertain: a failure that is no FlashserveError (the caller
    judges those by their code) after the request was handed over."""
    appended = [j for j, i in enumerate(group) if prepared[i].k is not None]
    _mark_uncertain([prepared[group[j]].seq for j in appended], [sent[j][0] for j in appended], code,
                    [prepared[group[j]].appended_rows() for j in appended])


def _unreadable(call: str, error: Exception) -> FlashserveError:
    """INTERNAL for an answer that came back OK but cannot be read: the server's fault, not the caller's (from_proto
    says INVALID_ARGUMENT, as of a caller's tensor); an appending call's rows are on the server all the same."""
    if isinstance(error, FlashserveError) and error.code == grpc.StatusCode.INTERNAL:
        return error
    return error_for(grpc.StatusCode.INTERNAL, f"{call} answered a result that cannot be read "
                     f"({error.message if isinstance(error, FlashserveError) else error})")


def _answer(response, item: _Item, return_lse: bool):
    """out (like the item's q: numpy, or torch on q's device), or (out, lse) when return_lse; for a "raw" item
    (_Item.encoded) the bytes of out and lse (None without return_lse), their sizes checked. From a result that
    carries its own out / lse (_packed_answers: from a packed answer). O must be q's dtype and shape and LSE FLOAT32
    [heads_q, rows_q] (INTERNAL otherwise): O of another dtype was handed to the caller as it came."""
    if item.kind == "raw":
        return _raw_answer(response, item, return_lse)
    q_shape = [int(n) for n in item.q.shape]
    if response.out.dtype != item.q.dtype or list(response.out.shape) != q_shape:
        raise error_for(grpc.StatusCode.INTERNAL, f"the answer's out is {_described(response.out)} for q of "
                        f"{_described(item.q)}")
    out = tensors.from_proto(response.out, item.kind, item.device)
    if not return_lse:
        return out
    if not response.HasField("lse"):
        raise error_for(grpc.StatusCode.INTERNAL, "return_lse was set but the response has no lse")
    if response.lse.dtype != tensors.PROTO_DTYPE["float32"] or list(response.lse.shape) != q_shape[1::-1]:
        raise error_for(grpc.StatusCode.INTERNAL, f"the answer's lse is {_described(response.lse)} for q of "
                        f"{_described(item.q)} (expected float32 [heads_q, rows_q])")
    return out, tensors.from_proto(response.lse, item.kind, item.device)


def _described(t) -> str:
    """A wire tensor's dtype and shape, for a message."""
    return f"{tensors.NAME_OF_PROTO_DTYPE.get(t.dtype, t.dtype)} {[int(n) for n in t.shape]}"


def _packed_answers(answer: DecodeStepAnswer, items: List[_Item], return_lse: bool) -> list:
    """Each item's answer (as _answer gives it) from a packed answer: O [sum of rows_q, heads_q, head_dim] and LSE
    (each item's FLOAT32 [heads_q, rows_q] back to back), their dtype, shape and sizes checked; a "raw" item's are
    views of the answer's bytes."""
    first = items[0].q
    rows = sum(int(item.q.shape[0]) for item in items)
    row_bytes = len(first.data) // max(1, int(first.shape[0]))
    out = answer.out
    data = out.data if out is not None else b""
    if out is None or out.dtype != first.dtype or list(out.shape) != [rows, *first.shape[1:]] or \
            len(data) != rows * row_bytes:
        raise error_for(grpc.StatusCode.INTERNAL, f"DecodeStep answered a packed out of shape "
                        f"{None if out is None else list(out.shape)} and {len(data)} bytes for {rows} rows of q "
                        f"shaped {list(first.shape[1:])}")
    lse = answer.lse.data if return_lse and answer.lse is not None else b""
    heads = int(first.shape[1])
    if return_lse and len(lse) != 4 * heads * rows:  # FLOAT32 [heads_q, rows_q] per item
        raise error_for(grpc.StatusCode.INTERNAL, "return_lse was set but the packed answer has no lse of its shape")
    data, lse = memoryview(data), memoryview(lse)
    answers, at = [], 0
    for item in items:
        n = int(item.q.shape[0])
        o = data[at * row_bytes:(at + n) * row_bytes]
        lse_rows = lse[4 * heads * at:4 * heads * (at + n)] if return_lse else None
        at += n
        if item.kind == "raw":
            answers.append((o, lse_rows))
            continue
        o = tensors.from_proto(tensors.HostRows(out.dtype, tuple(item.q.shape), o), item.kind, item.device)
        answers.append((o, tensors.from_proto(tensors.HostRows(tensors.PROTO_DTYPE["float32"], (heads, n), lse_rows),
                                              item.kind, item.device)) if return_lse else o)
    return answers


def _raw_answer(response, item: _Item, return_lse: bool) -> Tuple[bytes, Optional[bytes]]:
    out = response.out
    data = out.data  # read once: each read of a bytes field copies it
    if out.dtype != item.q.dtype or list(out.shape) != list(item.q.shape) or len(data) != len(item.q.data):
        raise error_for(grpc.StatusCode.INTERNAL, f"DecodeStep answered out of shape {list(out.shape)} and "
                        f"{len(data)} bytes for q of shape {list(item.q.shape)}")
    if not return_lse:
        return data, None
    lse = response.lse.data if response.HasField("lse") else b""
    if response.lse.dtype != tensors.PROTO_DTYPE["float32"] or \
            len(lse) != 4 * int(item.q.shape[0]) * int(item.q.shape[1]):  # FLOAT32 [heads_q, rows_q]
        raise error_for(grpc.StatusCode.INTERNAL, "return_lse was set but the answer has no lse of its shape")
    return data, lse
