"""Client of flashserve.v1.Sequences over one or many servers, with re-prefill when a server loses a sequence.

    client = flashserve.SequenceClient(["10.0.0.1:8001", "10.0.0.2:8001", "10.0.0.3:8001"], token=...)
    seq = client.create(num_layers=32, heads_q=32, heads_kv=8, head_dim=128, dtype="bfloat16", key="req-42")

Affinity: a sequence lives on one server. Its routing ``key`` (chosen by the client; a fresh uuid by default) is
hashed onto a consistent-hash ring of the endpoints (``flashserve.hashring``); the sequence is created there and
stays there. Every call also carries the key as gRPC metadata ``x-sequence-key``, so a proxy that hashes on that
header (deploy/proxy/) routes the same way when the client is given the proxy's one address instead of the list.

Recovery (``reprefill=True``): NOT_FOUND (evicted after --sequence_ttl_s, released elsewhere, server restarted) ->
re-create the sequence with every row the client keeps (or ``prefix_source`` gives) and retry the call. UNAVAILABLE
(the server left) -> mark the endpoint down for ``down_s`` seconds, re-create the sequence on the next endpoint of the
ring, retry (with one endpoint, e.g. a proxy, just retry). A call that failed ambiguously (deadline, cancelled,
internal) after sending rows marks the sequence uncertain: the next call first compares the server's lengths with the
client's and re-creates on a mismatch; after a failure that may still be running on the server (deadline, cancelled,
or UNAVAILABLE the client does not retry: its rows may land after any check) it re-creates without asking. Every
server call is all-or-nothing, and every append names the length it follows (expected_length: a retry whose first
try was applied finds its rows there and is not applied again), so a retried step appends its rows exactly once: no
wrong answer, only a slower one. Only an append's answer sets a layer's length, and an answer from a sequence id the
client re-created meanwhile (another thread's recovery) is dropped and its item sent again.

Local socket (``local_sockets={endpoint: path}``): a server on this host started with ``--local_socket=PATH`` takes
this client's DecodeStep and Attend calls as frames over that Unix socket (``flashserve.local``; no HTTP/2, the same
messages, errors and missing ids), one connection per thread; create, append, release and info stay on gRPC. A
connection that failed is dropped and the next call reconnects, so a restarted server is found again as over gRPC.
``local_poll_us``: those connections poll for each reply that long before sleeping (LocalClient's ``poll_us``).
"""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence as Seq, Tuple, Union

import grpc

from . import tensors
from ._pb import attention_pb2 as pb
from ._pb import sequences_pb2 as spb
from ._pb import sequences_pb2_grpc as spb_grpc
from ._wire import create_request_bytes
from .client import _channel_options
from .errors import FlashserveError, NotFoundError, UnavailableError, error_for, from_rpc_error
from .hashring import DEFAULT_VNODES, HashRing
from .local import MAX_POLL_US, LocalClient
from .packed_step import packed_step_request
from .sequences import Prefix, Sequence, SequenceSpec, encode_prefix, encode_rows

ROUTE_HEADER = "x-sequence-key"
# Failures after which the server may or may not have appended the rows it was sent.
_AMBIGUOUS = {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN,
              grpc.StatusCode.INTERNAL}
# Failures after which the call may still be on its way or running on the server (the client stopped waiting, or the
# connection broke with the request sent): its rows may land after any look at the lengths. UNAVAILABLE is retried
# (the same expected_length, or a new sequence elsewhere); when the client gives up on it, it is one of these.
_MAY_LAND = {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE}
# A restarted server is reconnected within ~0.1-1 s instead of gRPC's default 1-120 s backoff; retries through a
# single endpoint wait 0.1, 0.2, 0.4 ... s.
_RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                      ("grpc.max_reconnect_backoff_ms", 1000)]
_UNAVAILABLE_BACKOFF_S = 0.1
DecodeInput = Tuple[Sequence, int, Any, Any, Any]  # (sequence, layer, q, k, v); k/v may be None
# The calls a server's local socket takes (LocalClient's method for each); the others always go over gRPC.
_LOCAL_METHODS = {"DecodeStep": "decode_step", "Attend": "attend"}
# Local-socket failures after which its connection cannot be trusted (mid-frame, or gone): reconnect next time.
_DROP_CONNECTION = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL}


class _Item:
    """One DecodeStep item, encoded once (retries re-send the same bytes)."""

    __slots__ = ("seq", "layer", "q", "k", "v", "kind", "device")

    def __init__(self, entry):
        seq, layer, q = entry[0], int(entry[1]), entry[2]
        k = entry[3] if len(entry) > 3 else None
        v = entry[4] if len(entry) > 4 else None
        if (k is None) != (v is None):
            raise error_for(grpc.StatusCode.INVALID_ARGUMENT, "decode item: give both k and v, or neither")
        self.seq, self.layer = seq, layer
        self.kind = "torch" if tensors.is_torch(q) else "numpy"
        self.device = q.device if self.kind == "torch" else None
        self.q = encode_rows(q, "q")
        self.k = encode_rows(k, "k") if k is not None else None
        self.v = encode_rows(v, "v") if v is not None else None

    def add_to(self, request: "spb.DecodeStepRequest", sequence_id: str) -> None:
        item = request.items.add(sequence_id=sequence_id, layer=self.layer)
        item.q.CopyFrom(self.q)
        if self.k is not None:
            item.k.CopyFrom(self.k)
            item.v.CopyFrom(self.v)


@contextlib.contextmanager
def _appending(pairs):
    """Holds the (sequence, layer) pairs a call appends to for the call and its retries: another append of this
    client to one of them waits (both would name the same expected_length). Taken in one order: no deadlock."""
    taken = []
    try:
        for seq, layer in sorted(set(pairs), key=lambda pair: (id(pair[0]), pair[1])):
            with seq._written:
                while layer in seq._writing:
                    seq._written.wait()
                seq._writing.add(layer)
            taken.append((seq, layer))
        yield
    finally:
        for seq, layer in taken:
            with seq._written:
                seq._writing.discard(layer)
                seq._written.notify_all()


def _mark_uncertain(seqs: Iterable[Sequence], sent_ids: Iterable[str], code: grpc.StatusCode) -> None:
    """A call that sent rows to these sequences (ids as sent) failed with ``code`` and is not retried: its rows may be
    there. A sequence re-created since (another id) is left alone: the call's rows are not in it."""
    for seq, sent_id in zip(seqs, sent_ids):
        with seq.lock:
            if seq.id == sent_id:
                seq.doubt(may_land=code in _MAY_LAND)


def _add_layer_kv(repeated, layer: int, k: "pb.Tensor", v: "pb.Tensor") -> None:
    """Adds LayerKV(layer, k, v) to a repeated field, copying k and v once: LayerKV(k=k, v=v) and then
    append() copied them twice (32 MiB of rows: 43-51 ms against 6-11 ms on the 2-core build machine)."""
    entry = repeated.add(layer=layer)
    entry.k.CopyFrom(k)
    entry.v.CopyFrom(v)


class SequenceClient:
    """Blocking client. ``endpoints``: one address or a list (consistent hashing over them)."""

    def __init__(self, endpoints: Union[str, Seq[str]], *, token: Optional[str] = None,
                 timeout: Optional[float] = None, credentials: Optional[grpc.ChannelCredentials] = None,
                 options=None, vnodes: int = DEFAULT_VNODES, reprefill: bool = True, down_s: float = 5.0,
                 max_attempts: int = 4, local_sockets: Optional[Mapping[str, str]] = None,
                 packed_steps: bool = True, local_poll_us: int = 0):
        self.endpoints = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        self.ring = HashRing(self.endpoints, vnodes)
        self.timeout = timeout
        self.reprefill = reprefill
        self.down_s = down_s
        self.max_attempts = max_attempts
        # decode_step sends DecodeStepRequest.packed (one q/k/v tensor per step) when the items allow it.
        self.packed_steps = packed_steps
        self._token = token
        self._credentials = credentials
        self._options = _channel_options(_RECONNECT_OPTIONS + list(options or []))
        self._channels: Dict[str, Tuple[grpc.Channel, Any]] = {}
        self._down: Dict[str, float] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.endpoints)), thread_name_prefix="fs-seq")
        # max_batched_calls: the most DecodeStep calls the server reported running in one launch (--batch_window_us).
        # already_appended: appends a retry found applied by its lost first try (expected_length), not applied again.
        self.stats = {"reprefills": 0, "not_found": 0, "unavailable": 0, "max_batched_calls": 0,
                      "already_appended": 0}
        unknown = set(local_sockets or {}) - set(self.endpoints)
        if unknown:
            raise ValueError(f"local_sockets names endpoints not in the list: {sorted(unknown)}")
        self.local_sockets = dict(local_sockets or {})
        if not 0 <= local_poll_us <= MAX_POLL_US:
            raise ValueError(f"local_poll_us must be in 0..{MAX_POLL_US}, got {local_poll_us}")
        self.local_poll_us = local_poll_us  # LocalClient's poll_us for the local-socket connections
        self._local = threading.local()  # per thread: {socket path: LocalClient}
        self._local_clients: List[LocalClient] = []  # every connection made, closed by close()

    # --- endpoints ---------------------------------------------------------------------------------------------------

    def stub(self, endpoint: str) -> "spb_grpc.SequencesStub":
        return self._channel(endpoint)[1]

    def _channel(self, endpoint: str) -> Tuple[grpc.Channel, "spb_grpc.SequencesStub"]:
        with self._lock:
            if endpoint not in self._channels:
                channel = (grpc.insecure_channel(endpoint, options=self._options) if self._credentials is None
                           else grpc.secure_channel(endpoint, self._credentials, options=self._options))
                self._channels[endpoint] = (channel, spb_grpc.SequencesStub(channel))
            return self._channels[endpoint]

    def _call(self, endpoint: str, method: str, request):
        """The stub's method, or for a request already in wire bytes, the same method taking them as they are."""
        if not isinstance(request, bytes):
            return getattr(self.stub(endpoint), method)
        response_type = getattr(spb, spb.DESCRIPTOR.services_by_name["Sequences"].methods_by_name[method]
                                .output_type.name)
        return self._channel(endpoint)[0].unary_unary(
            f"/{spb.DESCRIPTOR.package}.Sequences/{method}", request_serializer=None,
            response_deserializer=response_type.FromString)

    def metadata(self, key: str):
        md = [(ROUTE_HEADER, key)]
        if self._token:
            md.append(("authorization", f"Bearer {self._token}"))
        return tuple(md)

    def mark_down(self, endpoint: str) -> None:
        with self._lock:
            self._down[endpoint] = time.monotonic() + self.down_s
            self.stats["unavailable"] += 1

    def pick(self, key: str) -> str:
        """The ring's endpoint for key among those not marked down; UnavailableError when none is left."""
        now = time.monotonic()
        with self._lock:
            down = {e for e, until in self._down.items() if until > now}
        try:
            return self.ring.lookup(key, exclude=down)
        except ValueError:
            raise error_for(grpc.StatusCode.UNAVAILABLE,
                            f"every endpoint is marked down ({', '.join(self.endpoints)})") from None

    def _rpc(self, endpoint: str, method: str, request, key: str, timeout: Optional[float]):
        path = self.local_sockets.get(endpoint)
        if path is not None and method in _LOCAL_METHODS:
            return self._local_call(path, method, request, self.timeout if timeout is None else timeout)
        try:
            return self._call(endpoint, method, request)(
                request, timeout=self.timeout if timeout is None else timeout, metadata=self.metadata(key))
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    def _local_call(self, path: str, method: str, request, timeout: Optional[float]):
        """One call over the server's local socket, on this thread's connection to it (made on first use)."""
        connections = self._local.__dict__.setdefault("connections", {})
        client = connections.get(path)
        try:
            if client is None:
                client = LocalClient(path, token=self._token, timeout=timeout, poll_us=self.local_poll_us)
                connections[path] = client
                with self._lock:
                    self._local_clients.append(client)
            client.set_timeout(timeout)
            return getattr(client, _LOCAL_METHODS[method])(request)
        except FlashserveError as e:  # first: UnavailableError and DeadlineExceededError are OSErrors too
            if e.code in _DROP_CONNECTION:
                self._drop_local(path)
            raise
        except OSError as e:  # no socket file, connection refused: the server is not there (now)
            self._drop_local(path)
            raise error_for(grpc.StatusCode.UNAVAILABLE, f"local socket {path}: {e}") from None

    def _drop_local(self, path: str) -> None:
        client = self._local.__dict__.get("connections", {}).pop(path, None)
        if client is not None:
            client.close()
            with self._lock:
                if client in self._local_clients:  # close() may have emptied the list already
                    self._local_clients.remove(client)

    # --- create / re-create ------------------------------------------------------------------------------------------

    def create(self, num_layers: int, heads_q: int, heads_kv: int, head_dim: int, dtype: str,
               prefix: Optional[Prefix] = None, *, key: Optional[str] = None, max_tokens: int = 0, label: str = "",
               keep_history: bool = True, prefix_source=None, timeout: Optional[float] = None) -> Sequence:
        """Creates a sequence (on the ring's endpoint for ``key``) with an optional prefix {layer: (k, v)}."""
        if dtype not in tensors.PROTO_DTYPE:
            raise error_for(grpc.StatusCode.INVALID_ARGUMENT, f"dtype {dtype!r}: expected float16 or bfloat16")
        spec = SequenceSpec(num_layers, heads_q, heads_kv, head_dim, dtype)
        seq = Sequence(self, spec, key, keep_history, prefix_source, max_tokens, label)
        encoded = encode_prefix(prefix)
        self._create_on_ring(seq, encoded, timeout)
        seq.reset_history(encoded)
        return seq

    def _create_request(self, seq: Sequence, prefix) -> bytes:
        """The CreateSequenceRequest's wire bytes (_wire.py: the prefix's bytes copied once)."""
        s = seq.spec
        header = spb.CreateSequenceRequest(num_layers=s.num_layers, heads_q=s.heads_q, heads_kv=s.heads_kv,
                                           head_dim=s.head_dim, dtype=tensors.PROTO_DTYPE[s.dtype],
                                           max_tokens=seq.max_tokens, label=seq.label)
        return create_request_bytes(header, prefix)

    def _create_on_ring(self, seq: Sequence, prefix, timeout) -> None:
        """CreateSequence on the key's endpoint; an unreachable endpoint is marked down and the next one tried."""
        request = self._create_request(seq, prefix)
        for _ in range(len(self.endpoints)):
            endpoint = self.pick(seq.key)
            try:
                response = self._rpc(endpoint, "CreateSequence", request, seq.key, timeout)
            except UnavailableError:
                if len(self.endpoints) == 1 or not self.reprefill:
                    raise
                self.mark_down(endpoint)
                continue
            seq.id, seq.endpoint, seq.uncertain, seq.may_land = response.sequence_id, endpoint, False, False
            seq.max_tokens = int(response.max_tokens) or seq.max_tokens
            seq.lengths = [int(n) for n in response.layer_lengths] or [0] * seq.spec.num_layers
            return
        raise error_for(grpc.StatusCode.UNAVAILABLE, f"no endpoint could create the sequence ({self.endpoints})")

    def _reprefill(self, seq: Sequence, failed_id: str, timeout) -> None:
        """Re-creates seq with every row the server should hold, unless another thread already did."""
        with seq.lock:
            if seq.id != failed_id:
                return
            if seq.released:  # release() ran while the failed call was on its way: nothing to bring back
                raise error_for(grpc.StatusCode.FAILED_PRECONDITION,
                                f"sequence {failed_id} was released by this client")
            prefix = seq.recovery_prefix()
            if prefix is None:
                raise error_for(grpc.StatusCode.NOT_FOUND,
                                f"sequence {failed_id} was lost by {seq.endpoint} and the client keeps no history "
                                "(keep_history=False and no prefix_source) to re-create it")
            self._create_on_ring(seq, prefix, timeout)
            seq.reprefills += 1
            with self._lock:
                self.stats["reprefills"] += 1

    # --- recovery ----------------------------------------------------------------------------------------------------

    def _recover(self, error: FlashserveError, seqs: List[Sequence], ids: List[str], endpoint: str,
                 timeout, attempt: int = 0) -> None:
        """Re-creates the sequences a failed call lost, or re-raises ``error`` when it is not a lost sequence."""
        if isinstance(error, NotFoundError):
            with self._lock:
                self.stats["not_found"] += 1
            missing = set(error.missing_ids) or set(ids)  # a NOT_FOUND without the list: every id is a suspect
            lost = [(s, i) for s, i in zip(seqs, ids) if i in missing]
        elif isinstance(error, UnavailableError) and len(self.endpoints) > 1:
            self.mark_down(endpoint)
            lost = list(zip(seqs, ids))
        elif isinstance(error, UnavailableError):
            # One endpoint, e.g. a proxy that routes by x-sequence-key: it moves the key to another server, which
            # answers NOT_FOUND on the retry, and that re-creates the sequence; or a server restarting. A lone
            # server that stays down fails every retry and the error reaches the caller.
            time.sleep(_UNAVAILABLE_BACKOFF_S * 2 ** attempt)
            return
        else:
            raise error
        for seq, failed_id in dict((id(s), (s, i)) for s, i in lost).values():
            self._reprefill(seq, failed_id, timeout)

    def _settle_uncertain(self, seqs: Iterable[Sequence], timeout) -> None:
        """Before using a sequence whose last append failed ambiguously: re-create it unless the server's lengths
        are the client's (the rows were not appended). After a failure that may still land (seq.may_land) the
        lengths prove nothing (the rows may come after the look): always re-create."""
        for seq in seqs:
            while True:
                with seq.lock:
                    if not seq.uncertain:
                        break
                    failed_id, endpoint, doubts, may_land = seq.id, seq.endpoint, seq.doubts, seq.may_land
                same = False
                try:
                    if not may_land:
                        info = self._rpc(endpoint, "GetSequenceInfo", spb.GetSequenceInfoRequest(sequence_id=failed_id),
                                         seq.key, timeout)
                        same = [int(n) for n in info.layer_lengths] == seq.lengths
                except (NotFoundError, UnavailableError):
                    same = False
                if same:
                    with seq.lock:  # only the doubts this look saw: a failure since may have appended after it
                        if seq.doubts == doubts and seq.id == failed_id:
                            seq.uncertain = False
                    continue
                self._release_quietly(endpoint, failed_id, seq.key)
                self._reprefill(seq, failed_id, timeout)  # then look again: a new id may have a new doubt

    def _release_quietly(self, endpoint: str, sequence_id: str, key: str) -> None:
        try:
            self._rpc(endpoint, "Release", spb.ReleaseRequest(sequence_ids=[sequence_id]), key, 5.0)
        except FlashserveError:
            pass  # gone with its server, or freed by its TTL later

    def _with_recovery(self, seqs: List[Sequence], attempt, timeout, appends: bool):
        """attempt(ids) is one RPC on seqs[0].endpoint for seqs (ids: theirs as read once, under their locks); a lost
        sequence is re-created and the RPC retried."""
        doubtful = []  # (ids, code) of the tries whose rows may be on the server
        try:
            for n in range(self.max_attempts):
                self._settle_uncertain(seqs, timeout)
                ids, endpoint = [], seqs[0].endpoint
                for seq in seqs:
                    with seq.lock:
                        ids.append(seq.id)
                try:
                    return attempt(ids)
                except FlashserveError as e:
                    if appends and e.code in _AMBIGUOUS | _MAY_LAND:
                        doubtful.append((ids, e.code))
                    if not self.reprefill or n + 1 == self.max_attempts or (appends and e.code in _AMBIGUOUS):
                        raise
                    self._recover(e, seqs, ids, endpoint, timeout, n)
                except BaseException:  # interrupted with the request maybe sent: as a cancelled call
                    if appends:
                        doubtful.append((ids, grpc.StatusCode.CANCELLED))
                    raise
            raise AssertionError("unreachable")
        except BaseException:
            for ids, code in doubtful:  # given up, whatever the last error: any earlier try's rows may be there
                _mark_uncertain(seqs, ids, code)
            raise

    # --- calls -------------------------------------------------------------------------------------------------------

    @staticmethod
    def _check_live(seq: Sequence) -> None:
        if seq.released:
            raise error_for(grpc.StatusCode.FAILED_PRECONDITION, f"sequence {seq.id} was released by this client")

    def append(self, seq: Sequence, rows: Mapping[int, Tuple[Any, Any]], timeout: Optional[float] = None):
        """Appends {layer: (k, v)} (k/v [rows, heads_kv, head_dim]); returns every layer's length."""
        self._check_live(seq)
        encoded = {int(layer): (encode_rows(k, f"rows[{layer}].k"), encode_rows(v, f"rows[{layer}].v"))
                   for layer, (k, v) in rows.items()}

        def attempt(ids):
            sent_id = ids[0]
            with seq.lock:  # the lengths of the id read (a re-create changes both)
                if seq.id != sent_id:
                    raise NotFoundError(grpc.StatusCode.NOT_FOUND, f"sequence {sent_id} was re-created meanwhile",
                                        missing_ids=(sent_id,))
                expected = {layer: seq.lengths[layer] for layer in encoded}
            request = spb.AppendRequest(sequence_id=sent_id)
            for layer, (k, v) in encoded.items():
                _add_layer_kv(request.rows, layer, k, v)
                request.rows[-1].expected_length = expected[layer]
            response = self._rpc(seq.endpoint, "Append", request, seq.key, timeout)
            self._count_already_appended(len(response.already_appended_layers))
            with seq.lock:
                if seq.id != sent_id:  # re-created while this ran, without these rows: send them again
                    raise NotFoundError(grpc.StatusCode.NOT_FOUND, f"sequence {sent_id} was re-created while an "
                                        "append to it ran", missing_ids=(sent_id,))
                # Only the appended layers: the others' lengths in this answer may be older than the client's.
                seq.acknowledge(encoded, {layer: response.layer_lengths[layer] for layer in encoded})
                return list(seq.lengths)

        with _appending((seq, layer) for layer in encoded):
            return self._with_recovery([seq], attempt, timeout, appends=True)

    def _count_already_appended(self, n: int) -> None:
        if n:
            with self._lock:
                self.stats["already_appended"] += n

    def attend(self, seq: Sequence, layer: int, q, causal: bool = False, softmax_scale: Optional[float] = None,
               return_lse: bool = False, timeout: Optional[float] = None):
        """Attention of q [rows_q, heads_q, head_dim] over the layer's cache (no append)."""
        self._check_live(seq)
        item = _Item((seq, layer, q))

        def attempt(ids):
            request = spb.AttendRequest(sequence_id=ids[0], layer=int(layer), q=item.q, causal=bool(causal),
                                        return_lse=bool(return_lse))
            if softmax_scale is not None:
                request.softmax_scale = float(softmax_scale)
            response = self._rpc(seq.endpoint, "Attend", request, seq.key, timeout)
            return _answer(response, item, return_lse)

        return self._with_recovery([seq], attempt, timeout, appends=False)

    def decode_step(self, items: Iterable[DecodeInput], causal: bool = False, softmax_scale: Optional[float] = None,
                    return_lse: bool = False, timeout: Optional[float] = None) -> list:
        """For each (sequence, layer, q, k, v): append k/v (may be None) to the layer, attend q. One DecodeStep per
        endpoint holding some of the sequences (in parallel). Returns outs (or (out, lse)) in the items' order."""
        prepared = [_Item(entry) for entry in items]
        for item in prepared:
            self._check_live(item.seq)
        with _appending((item.seq, item.layer) for item in prepared if item.k is not None):
            results: List[Any] = [None] * len(prepared)
            doubtful: List[Tuple[Sequence, str, grpc.StatusCode]] = []
            try:
                return self._decode_step(prepared, results, doubtful,
                                         (bool(causal), softmax_scale, bool(return_lse), timeout))
            except BaseException:
                # A step that raises appended nothing, for the caller (who may well send it again). Its tries that
                # failed in a way that may have appended (every group, every try, not only the error raised) make
                # their sequences uncertain; items that one server took while another server's share failed are
                # taken back: the client forgets their rows and the next call re-creates the sequence without them.
                for seq, sent_id, code in doubtful:
                    _mark_uncertain([seq], [sent_id], code)
                for item, result in zip(prepared, results):
                    if result is not None and item.k is not None:
                        with item.seq.lock:
                            item.seq.take_back(item.layer, item.k)
                            item.seq.doubt(may_land=False)
                raise

    def _decode_step(self, prepared: List[_Item], results: List[Any], doubtful: list, options) -> list:
        """decode_step's calls and retries (its appends held by _appending); fills results, and doubtful with
        (sequence, id sent, code) of the items whose rows a failed try may have left on a server."""
        timeout = options[-1]
        pending = list(range(len(prepared)))
        for n in range(self.max_attempts):
            self._settle_uncertain({id(prepared[i].seq): prepared[i].seq for i in pending}.values(), timeout)
            runs = _runs_by_endpoint(prepared, pending)
            outcomes = self._run_groups(prepared, runs, results, options)
            failed = [(run, e) for run, e in zip(runs, outcomes) if e is not None]
            for (group, sent, _), error in failed:
                if error.code in _AMBIGUOUS | _MAY_LAND:
                    doubtful.extend((prepared[i].seq, sent_id, error.code) for i, (sent_id, _) in zip(group, sent)
                                    if prepared[i].k is not None)
            for (group, sent, endpoint), error in failed:
                if not self.reprefill or n + 1 == self.max_attempts or error.code in _AMBIGUOUS:
                    raise error
                self._recover(error, [prepared[i].seq for i in group], [i for i, _ in sent], endpoint, timeout, n)
            # Failed groups' items, and items answered from a sequence re-created meanwhile (_step_group).
            pending = [i for i in pending if results[i] is None]
            if not pending:
                return results
        raise error_for(grpc.StatusCode.ABORTED, f"{len(pending)} decode item(s) were answered by sequences that "
                        f"another call re-created meanwhile, {self.max_attempts} times")

    def _run_groups(self, prepared, runs, results, options) -> List[Optional[FlashserveError]]:
        """Sends one DecodeStep per group (in parallel when several); fills results; returns each group's error."""
        def one(run):
            group, sent, endpoint = run
            try:
                self._step_group(prepared, group, sent, endpoint, results, *options)
                return None
            except FlashserveError as e:
                return e

        if len(runs) == 1:
            return [one(runs[0])]
        return list(self._pool.map(one, runs))

    def _step_group(self, prepared, group, sent, endpoint, results, causal, softmax_scale, return_lse,
                    timeout) -> None:
        """One DecodeStep of the group's items to (id, expected_length) ``sent``; fills results of the items whose
        sequence still has the id sent (the others are left None: sent again by the caller)."""
        request = None
        if self.packed_steps:
            request = packed_step_request([(sequence_id, prepared[i].layer, prepared[i].q, prepared[i].k,
                                            prepared[i].v) for i, (sequence_id, _) in zip(group, sent)])
        if request is None:
            request = spb.DecodeStepRequest()
            for i, (sequence_id, _) in zip(group, sent):
                prepared[i].add_to(request, sequence_id)
        for entry, i, (_, expected) in zip(request.items, group, sent):  # packed or not: a scalar of the item itself
            if prepared[i].k is not None:
                entry.expected_length = expected
        request.causal, request.return_lse = causal, return_lse
        if softmax_scale is not None:
            request.softmax_scale = float(softmax_scale)
        try:
            response = self._rpc(endpoint, "DecodeStep", request, prepared[group[0]].seq.key, timeout)
            if len(response.results) != len(group):
                raise error_for(grpc.StatusCode.INTERNAL,
                                f"DecodeStep answered {len(response.results)} results for {len(group)} items")
            # Every answer read before any is acknowledged: an answer that cannot be read fails the group whole.
            answers = [_answer(result, prepared[i], return_lse) for i, result in zip(group, response.results)]
        except FlashserveError:
            raise  # the caller judges by the code
        except BaseException:  # interrupted, or an answer the caller's tensors cannot take (out of memory ...)
            appended = [j for j, i in enumerate(group) if prepared[i].k is not None]
            _mark_uncertain([prepared[group[j]].seq for j in appended], [sent[j][0] for j in appended],
                            grpc.StatusCode.CANCELLED)
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
                    item.seq.acknowledge({item.layer: (item.k, item.v)}, {item.layer: result.length})
                results[i] = answer  # with its acknowledgement: decode_step takes back those with a result

    # --- release and information ----------------------------------------------------------------------------------

    def release(self, seq: Sequence, timeout: Optional[float] = None) -> bool:
        """Frees the sequence on its server. True when the server still held it; False when it had already lost it
        or cannot be reached (its TTL frees the pages then)."""
        with seq.lock:
            if seq.released:
                return False
            seq.released = True
        try:
            response = self._rpc(seq.endpoint, "Release", spb.ReleaseRequest(sequence_ids=[seq.id]), seq.key, timeout)
        except UnavailableError:
            return False
        return response.released == 1

    def sequence_info(self, seq: Sequence, timeout: Optional[float] = None) -> "spb.SequenceInfo":
        return self._rpc(seq.endpoint, "GetSequenceInfo", spb.GetSequenceInfoRequest(sequence_id=seq.id), seq.key,
                         timeout)

    def pool_info(self, endpoint: Optional[str] = None, timeout: Optional[float] = None) -> "spb.KvPoolInfo":
        """The KV pool of ``endpoint`` (default: the first endpoint)."""
        return self._rpc(endpoint or self.endpoints[0], "GetKvPoolInfo", spb.GetKvPoolInfoRequest(), "", timeout)

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        with self._lock:
            for channel, _ in self._channels.values():
                channel.close()
            self._channels.clear()
            for client in self._local_clients:
                client.close()
            self._local_clients.clear()

    def __enter__(self) -> "SequenceClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _runs_by_endpoint(prepared: List[_Item], indices: List[int]) -> List[Tuple[List[int], list, str]]:
    """The items as one (items, [(sequence id, expected_length)], endpoint) per endpoint, each item's id, length and
    endpoint read together (a re-create by another thread changes all three)."""
    groups: Dict[str, Tuple[List[int], list]] = {}
    for i in indices:
        seq = prepared[i].seq
        with seq.lock:
            sent, endpoint = (seq.id, seq.lengths[prepared[i].layer]), seq.endpoint
        group = groups.setdefault(endpoint, ([], []))
        group[0].append(i)
        group[1].append(sent)
    return [(group, sent, endpoint) for endpoint, (group, sent) in groups.items()]


def _answer(response, item: _Item, return_lse: bool):
    """out (like the item's q: numpy, or torch on q's device), or (out, lse) when return_lse."""
    out = tensors.from_proto(response.out, item.kind, item.device)
    if not return_lse:
        return out
    if not response.HasField("lse"):
        raise error_for(grpc.StatusCode.INTERNAL, "return_lse was set but the response has no lse")
    return out, tensors.from_proto(response.lse, item.kind, item.device)
