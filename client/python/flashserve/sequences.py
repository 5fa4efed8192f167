"""A sequence whose K/V cache stays on the server (flashserve.v1.Sequences): per token send only q and the new k/v.

    with flashserve.SequenceClient(["127.0.0.1:8001"]) as client:
        with client.create(num_layers=32, heads_q=32, heads_kv=8, head_dim=128, dtype="bfloat16",
                           prefix={0: (k0, v0), 1: (k1, v1)}) as seq:     # k/v [rows, heads_kv, head_dim]
            out = seq.step(layer=0, q=q, k=k_new, v=v_new)                # append then attend, one round trip
            seq.append(1, k_new1, v_new1)
            out = seq.attend(1, q1)                                       # q [rows_q, heads_q, head_dim]
            seq.truncate(n)            # speculative decoding: keep each layer's first n tokens (the accepted drafts)
        outs = client.decode_step([(seq_a, 0, qa, ka, va), (seq_b, 0, qb, kb, vb)])   # many sequences, one call

The client keeps every acknowledged K/V row (``keep_history=True``, the default) or asks ``prefix_source(seq)`` for
them, so that when the server loses the sequence (TTL eviction, restart, the server left the ring) it re-creates the
sequence with those rows and retries the call: the answer is the same, only slower. ``reprefills`` counts that. Of
what ``prefix_source`` gives it takes each layer's first ``seq.lengths[layer]`` rows (those the server acknowledged):
the source may be the caller's own cache, already holding the rows of the call being retried.

Retries: every append names the layer's length it follows (``expected_length``), so a call retried after its answer
was lost (a dropped connection, with one endpoint or a proxy) appends its rows once: the server finds them there and
attends without appending again (``stats["already_appended"]`` counts those). A create carries a random
``create_token``: retried after its answer was lost, the server answers the sequence the first try made
(``stats["already_created"]``) instead of making a second one.

Thread safety: a Sequence may be used from several threads. Appends to the same layer from two threads run one after
the other (in no defined order); appends to different layers run at once.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
import time
import uuid
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple, Union

import grpc

from . import tensors
from ._pb import attention_pb2 as pb
from ._seq_history import LayerHistory
from .errors import error_for

# (k, v) per layer: arrays [rows, heads_kv, head_dim] (numpy or torch), or already encoded wire tensors.
Prefix = Mapping[int, Tuple[Any, Any]]


@dataclasses.dataclass(frozen=True)
class SequenceSpec:
    num_layers: int
    heads_q: int
    heads_kv: int
    head_dim: int
    dtype: str  # "float16" | "bfloat16"


# A wire tensor of rows: a pb.Tensor, or HostRows (tensors.py), which reads like one.
Rows = Union["pb.Tensor", tensors.HostRows]


def encode_rows(x: Any, field: str, copy: bool = True) -> Rows:
    """A [rows, heads, head_dim] array or tensor as HostRows (its bytes copied once, or with copy=False a view for
    rows sent and not kept; _wire.py joins them into a request), or an already encoded pb.Tensor / HostRows as it
    is. Prefixes, appends and decode items all go through here."""
    return x if isinstance(x, (pb.Tensor, tensors.HostRows)) else tensors.to_host_rows(x, field, copy=copy)


def encode_prefix(prefix: Optional[Prefix]) -> Dict[int, Tuple[Rows, Rows]]:
    return {int(layer): (encode_rows(k, f"prefix[{layer}].k"), encode_rows(v, f"prefix[{layer}].v"))
            for layer, (k, v) in (prefix or {}).items()}


def _first_rows(t: Rows, n: int) -> Rows:
    if int(t.shape[0]) == n:
        return t
    row_bytes = len(t.data) // int(t.shape[0])
    return tensors.HostRows(t.dtype, (n,) + tuple(t.shape[1:]), bytes(t.data[:n * row_bytes]))


def _acknowledged_rows(prefix: Dict[int, Tuple[Rows, Rows]], lengths: List[int]) -> Dict[int, Tuple[Rows, Rows]]:
    """prefix_source's rows cut to the rows the server acknowledged (``lengths``): the source may be the caller's own
    cache, which already holds the rows of a call in flight -- that call appends them again once the sequence is
    re-created. Fewer rows than acknowledged: FAILED_PRECONDITION (a re-created sequence would lack some)."""
    fitted = {}
    for layer, n in enumerate(lengths):
        k, v = prefix.get(layer, (None, None))
        have = min(int(k.shape[0]), int(v.shape[0])) if k is not None and k.shape and v.shape else 0
        if have < n:
            raise error_for(grpc.StatusCode.FAILED_PRECONDITION,
                            f"prefix_source gave {have} rows for layer {layer}; the server had acknowledged {n}")
        if n:
            fitted[layer] = (_first_rows(k, n), _first_rows(v, n))
    return fitted


class Sequence:
    """One server-side sequence. Made by SequenceClient.create; ``id`` changes when it is re-created elsewhere."""

    def __init__(self, client, spec: SequenceSpec, key: Optional[str], keep_history: bool,
                 prefix_source: Optional[Callable[["Sequence"], Prefix]], max_tokens: int, label: str):
        self.client = client
        self.spec = spec
        self.key = key if key is not None else uuid.uuid4().hex  # routing key: which endpoint holds it
        self.max_tokens = max_tokens
        self.label = label
        self.id = ""
        self.endpoint = ""
        self.lengths: List[int] = [0] * spec.num_layers
        self.reprefills = 0
        self.released = False
        self.uncertain = False  # the last append failed ambiguously: check the server's lengths first
        self.may_land = False  # ... and may still be applied later (a deadline, UNAVAILABLE): re-create, don't check
        self.doubts = 0  # failures that made it uncertain: a check of the lengths clears only those it began after
        # Per layer, the rows that failed calls sent and the server may hold past self.lengths: a server copy longer
        # by at most these is cut back (Truncate) instead of re-created.
        self.doubtful_rows: Dict[int, int] = {}
        # Per layer, this client's calls in flight (hold_layers, below): the append (an append names the length it
        # follows, expected_length, which two concurrent appends to one layer would both name; and its rows may
        # still be taken back), attends reading it, appends waiting for them.
        self._writing: set = set()
        self._reading: collections.Counter = collections.Counter()
        self._waiting_writers: collections.Counter = collections.Counter()
        self._written = threading.Condition(threading.Lock())
        self._sleepers = 0  # threads in self._written.wait(): a release with none wakes nobody (notify costs ~2 us)
        self._history = LayerHistory(spec.num_layers) if keep_history else None
        self._prefix_source = prefix_source
        self.lock = threading.RLock()

    # --- the calls -------------------------------------------------------------------------------------------------

    def step(self, layer: int, q, k=None, v=None, causal: bool = False, softmax_scale: Optional[float] = None,
             return_lse: bool = False, timeout: Optional[float] = None):
        """Appends k/v (optional) to ``layer`` and attends q [rows_q, heads_q, head_dim] over the whole layer."""
        return self.client.decode_step([(self, layer, q, k, v)], causal=causal, softmax_scale=softmax_scale,
                                       return_lse=return_lse, timeout=timeout)[0]

    def append(self, layer, k=None, v=None, timeout: Optional[float] = None) -> List[int]:
        """append(layer, k, v) or append({layer: (k, v), ...}); returns the lengths of every layer."""
        rows = layer if isinstance(layer, Mapping) else {layer: (k, v)}
        return self.client.append(self, rows, timeout=timeout)

    def attend(self, layer: int, q, causal: bool = False, softmax_scale: Optional[float] = None,
               return_lse: bool = False, timeout: Optional[float] = None):
        """Attention of q [rows_q, heads_q, head_dim] over the layer's cache; out like q, or (out, lse)."""
        return self.client.attend(self, layer, q, causal=causal, softmax_scale=softmax_scale,
                                  return_lse=return_lse, timeout=timeout)

    def truncate(self, length: int, layers: Optional[Iterable[int]] = None,
                 timeout: Optional[float] = None) -> List[int]:
        """Cuts ``layers`` (default: every layer) back to their first ``length`` tokens -- speculative decoding: after
        a step that appended the drafts, keep the accepted ones. Returns every layer's length."""
        return self.client.truncate(self, length, layers=layers, timeout=timeout)

    def info(self, timeout: Optional[float] = None):
        """The server's SequenceInfo message (layer lengths, idle time, pool bytes held)."""
        return self.client.sequence_info(self, timeout=timeout)

    def release(self, timeout: Optional[float] = None) -> bool:
        """Frees the server's pages; True when the server still held it. Further calls raise."""
        return self.client.release(self, timeout=timeout)

    def __enter__(self) -> "Sequence":
        return self

    def __exit__(self, *exc) -> None:
        if not self.released:
            try:
                self.release()
            except Exception:  # noqa: BLE001 - the server may be gone; its TTL frees the pages
                if exc[0] is None:
                    raise

    def __repr__(self) -> str:
        return f"Sequence(id={self.id!r}, endpoint={self.endpoint!r}, lengths={self.lengths})"

    # --- state, used by SequenceClient under self.lock ---------------------------------------------------------------

    def acknowledge_layer(self, layer: int, k: Rows, v: Rows, length: int) -> None:
        """The server appended rows k / v to ``layer``; ``length`` is the layer's length after that."""
        if self._history is not None:
            self._history.add(layer, k, v)
        self.lengths[layer] = int(length)

    def doubt(self, may_land: bool, rows: Optional[Mapping[int, int]] = None) -> None:
        """A call that sent rows failed, and they may be on the server (under self.lock). ``rows``: how many it sent
        per layer (none for a truncate: it adds none)."""
        self.uncertain = True
        self.may_land = self.may_land or may_land
        self.doubts += 1
        for layer, n in (rows or {}).items():
            self.doubtful_rows[layer] = self.doubtful_rows.get(layer, 0) + n

    def settle(self) -> None:
        """The server's copy is the client's again: the rows of failed calls are not there (under self.lock)."""
        self.uncertain = False
        self.doubtful_rows = {}

    def take_back(self, layer: int, k: Rows) -> None:
        """Forgets the last acknowledged append of ``layer`` (rows ``k``; appends to a layer run one at a time)."""
        if self._history is not None:
            self._history.take_back(layer, k)
        self.lengths[layer] -= int(k.shape[0]) if k.shape else 0

    def cut(self, layers: Iterable[int], length: int, lengths: Mapping[int, int]) -> None:
        """The server cut ``layers`` to ``length`` tokens; ``lengths`` are theirs after it."""
        for layer in layers:
            if self._history is not None:
                self._history.keep(layer, length)
            self.lengths[layer] = int(lengths[layer])

    def recovery_prefix(self) -> Optional[Dict[int, Tuple[Rows, Rows]]]:
        """Every row the server should hold, to re-create the sequence; None when nothing can supply them."""
        if self._history is not None:
            return self._history.prefix()
        if self._prefix_source is not None:
            return _acknowledged_rows(encode_prefix(self._prefix_source(self)), self.lengths)
        return None

    def reset_history(self, prefix: Dict[int, Tuple[Rows, Rows]]) -> None:
        if self._history is not None:
            self._history.replace(prefix)

    @property
    def history_bytes(self) -> int:
        return self._history.bytes if self._history is not None else 0


def checked_layer(seq: Sequence, layer) -> int:
    """``layer`` as an int, INVALID_ARGUMENT unless in [0, num_layers): checked before anything is sent. Past the end
    it raised IndexError from the client's own bookkeeping, inside the try that takes any such exception for a call
    maybe sent: the sequence was made uncertain (re-created, or for good unusable without a history)."""
    layer = int(layer)
    if not 0 <= layer < seq.spec.num_layers:
        raise error_for(grpc.StatusCode.INVALID_ARGUMENT, f"layer {layer} of sequence {seq.id}: expected a layer "
                        f"in [0, {seq.spec.num_layers})")
    return layer


@contextlib.contextmanager
def hold_layers(writes: Iterable = (), reads: Iterable = (), timeout: Optional[float] = None):
    """Holds, for a call and its retries, the (sequence, layer) pairs it appends to (writes) and those it attends
    over without appending (reads). An append waits for the layer's other append (both would name the same
    expected_length) and for its attends in flight; an attend waits for the layer's append in flight (its rows may
    still be taken back when it fails: the attend would have seen a row that, for the caller, was never appended),
    not for other attends; an append waiting goes before attends that come after it. Taken in one order: no
    deadlock. Waits at most ``timeout`` seconds (None: as long as it takes), then raises DEADLINE_EXCEEDED with
    nothing held: a call's timeout also bounds its wait for another call on the same layer."""
    wanted = {pair: False for pair in reads}
    wanted.update((pair, True) for pair in writes)
    deadline = None if timeout is None else time.monotonic() + timeout
    taken = []
    try:
        for (seq, layer), write in sorted(wanted.items(), key=lambda e: (id(e[0][0]), e[0][1])):
            with seq._written:
                if write:
                    _wait_to_write(seq, layer, deadline)
                else:
                    while layer in seq._writing or seq._waiting_writers[layer]:
                        _sleep(seq, deadline, layer)
                    seq._reading[layer] += 1
            taken.append((seq, layer, write))
        yield
    finally:
        for seq, layer, write in taken:
            with seq._written:
                if write:
                    seq._writing.discard(layer)
                else:
                    seq._reading[layer] -= 1
                if seq._sleepers:
                    seq._written.notify_all()


def _sleep(seq: Sequence, deadline: Optional[float], layer: int) -> None:
    """Under seq._written: waits for a notify, counted in seq._sleepers (only then do holders notify);
    DEADLINE_EXCEEDED once ``deadline`` (time.monotonic()) has passed."""
    left = None if deadline is None else deadline - time.monotonic()
    if left is not None and left <= 0:
        raise error_for(grpc.StatusCode.DEADLINE_EXCEEDED, f"the call's timeout passed while it waited for another "
                        f"call on layer {layer} of sequence {seq.id} to end; nothing of it was sent")
    seq._sleepers += 1
    try:
        seq._written.wait(left)
    finally:
        seq._sleepers -= 1


def _wait_to_write(seq: Sequence, layer: int, deadline: Optional[float]) -> None:
    """Under seq._written: waits until no other call appends to or attends over the layer, then takes it."""
    if layer in seq._writing or seq._reading[layer]:
        seq._waiting_writers[layer] += 1
        try:
            while layer in seq._writing or seq._reading[layer]:
                _sleep(seq, deadline, layer)
        finally:
            seq._waiting_writers[layer] -= 1
            if seq._sleepers:  # attends held back by this waiting append (also if the wait was interrupted)
                seq._written.notify_all()
    seq._writing.add(layer)
