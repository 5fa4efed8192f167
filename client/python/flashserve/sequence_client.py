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
internal) after sending rows marks the sequence uncertain, as does a multi-server step's share taken back because
another share failed: the next call first compares the server's lengths with the client's, cuts off (Truncate) rows
that failed calls sent, and re-creates only a sequence that is gone or whose lengths are not the client's plus such
rows; after a failure that may still be running on the server (deadline, cancelled, or UNAVAILABLE the client does
not retry: its rows may land after any check) it re-creates without asking. Every server call is all-or-nothing, and
every append names the length it follows (expected_length: a retry whose first try was applied finds its rows there
and is not applied again), so a retried step appends its rows exactly once: no wrong answer, only a slower one. Only
an append's (or truncate's) answer sets a layer's length, and an answer from a sequence id the client re-created
meanwhile (another thread's recovery) is dropped and its item sent again.

Deadline: a call's ``timeout`` (or the client's) is one deadline for the whole call -- its wait for this client's
other calls on its layers, its tries, and recovery's looks, truncates, releases, re-creates and backoffs: each RPC
gets the time left, and once none is left the call raises DEADLINE_EXCEEDED ("recovery ran out of time") without
sending more. None: no deadline.

Truncate (speculative decoding: ``seq.truncate(n)`` after a step that appended the drafts keeps each layer's first n
tokens; ``truncate_many`` a batch's, one call per server) is an append in reverse for all of the above: it holds its
layers, a re-created sequence gets every row back and is cut again (a layer already that short is left as it is, so a
retry cuts nothing more), a truncate that failed ambiguously makes the sequence uncertain, and the history keeps only
the rows the server kept.

Creates: every CreateSequence carries a create_token (a fresh ``secrets.token_urlsafe(16)``, or ``create(...,
create_token=...)``). A create that failed with UNAVAILABLE (through one endpoint) or DEADLINE_EXCEEDED may have made
the sequence with its answer lost; it is sent again with the same token (up to ``max_attempts`` tries, as other calls;
none with ``reprefill=False``), and the server answers the sequence the lost try made (``already_created``, counted in
``stats["already_created"]``) instead of making a second one that would hold pages until its TTL. A re-create after
NOT_FOUND uses a new token. A prefix of more than ``create_chunk_bytes`` of K/V (default 256 MiB) goes as the create
and then appends (each naming the length it follows), so that a many-layer sequence is created -- and re-created after
NOT_FOUND -- within the server's --max_request_bytes (default 1 GiB) and gRPC's 2 GiB; a failed append releases the
part made and raises.

Local socket (``local_sockets={endpoint: path}``): a server on this host started with ``--local_socket=PATH`` takes
this client's DecodeStep and Attend calls as frames over that Unix socket (``flashserve.local``; no HTTP/2, the same
messages, errors and missing ids), one connection per thread (closed when the thread ends); create, append, truncate,
release and info stay on gRPC. A connection that failed is dropped and the next call reconnects, so a restarted server
is found again as over gRPC.
``local_poll_us``: those connections poll for each reply that long before sleeping (LocalClient's ``poll_us``).
"""

from __future__ import annotations

import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence as Seq, Tuple, Union

import grpc

from . import tensors
from ._pb import sequences_pb2 as spb
from ._pb import sequences_pb2_grpc as spb_grpc
from ._seq_create import CREATE_CHUNK_BYTES
from ._seq_recovery import CallDeadline, _mark_uncertain, _Recovery
from ._seq_step import _answer, _copy_rows, _DecodeSteps, _Item, _unreadable, DecodeInput
from ._seq_truncate import _Cut, _Truncates, TruncateInput
from ._step_answer import DecodeStepAnswer
from ._wire import append_request_bytes
from .client import _channel_options
from .errors import FlashserveError, NotFoundError, UnavailableError, error_for, from_rpc_error
from .hashring import DEFAULT_VNODES, HashRing
from .local import MAX_POLL_US, LocalClient
from .sequences import Prefix, Sequence, SequenceSpec, checked_layer, encode_prefix, encode_rows, hold_layers

ROUTE_HEADER = "x-sequence-key"
# A restarted server is reconnected within ~0.1-1 s instead of gRPC's default 1-120 s backoff. Not
# grpc.min_reconnect_backoff_ms: gRPC also takes it as the shortest time it gives a connection attempt (default 20 s),
# and at 100 ms a server slower than that to greet a new connection (TLS over a long path, a loaded server) failed
# every call UNAVAILABLE.
_RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000)]
# The calls a server's local socket takes (LocalClient's method for each); the others always go over gRPC.
_LOCAL_METHODS = {"DecodeStep": "decode_step_answer", "Attend": "attend"}
# Local-socket failures after which its connection cannot be trusted (mid-frame, or gone): reconnect next time.
_DROP_CONNECTION = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL}


def _row_blocks(rows: tensors.HostRows, count: int, copy: bool) -> List[tensors.HostRows]:
    """A [count x n, heads, d] tensor's bytes as count [n, heads, d] blocks: views (nothing copied; a packed request
    joins them back in one copy), or with copy each block's bytes of its own (k/v: a sequence's history keeps its
    block, and a view would keep the whole batch's buffer alive with it)."""
    n = rows.shape[0] // count
    size = len(rows.data) // count
    whole = memoryview(rows.data)
    cut = (lambda i: bytes(whole[i * size:(i + 1) * size])) if copy else (lambda i: whole[i * size:(i + 1) * size])
    return [tensors.HostRows(rows.dtype, (n,) + tuple(rows.shape[1:]), cut(i)) for i in range(count)]


class SequenceClient(_Recovery, _DecodeSteps, _Truncates):
    """Blocking client. ``endpoints``: one address or a list (consistent hashing over them)."""

    def __init__(self, endpoints: Union[str, Seq[str]], *, token: Optional[str] = None,
                 timeout: Optional[float] = None, credentials: Optional[grpc.ChannelCredentials] = None,
                 options=None, vnodes: int = DEFAULT_VNODES, reprefill: bool = True, down_s: float = 5.0,
                 max_attempts: int = 4, local_sockets: Optional[Mapping[str, str]] = None,
                 packed_steps: bool = True, local_poll_us: int = 0, create_chunk_bytes: int = CREATE_CHUNK_BYTES):
        # Each endpoint once: the ring holds it once, and recovery counts the others left to move to.
        self.endpoints = list(dict.fromkeys([endpoints] if isinstance(endpoints, str) else endpoints))
        self.ring = HashRing(self.endpoints, vnodes)
        self.timeout = timeout
        self.reprefill = reprefill
        self.down_s = down_s
        self.max_attempts = max_attempts
        # decode_step sends DecodeStepRequest.packed (one q/k/v tensor per step) when the items allow it.
        self.packed_steps = packed_steps
        if create_chunk_bytes < 1:
            raise ValueError(f"create_chunk_bytes must be positive, got {create_chunk_bytes}")
        if max_attempts < 1:  # no try at all ended in an AssertionError / UnboundLocalError deep in a call
            raise ValueError(f"max_attempts must be at least 1, got {max_attempts}")
        # A (re-)create's prefix beyond this many bytes of K/V goes as the create and then appends (_seq_create.py).
        self.create_chunk_bytes = create_chunk_bytes
        self._token = token
        self._credentials = credentials
        self._options = _channel_options(_RECONNECT_OPTIONS + list(options or []))
        self._channels: Dict[str, Tuple[grpc.Channel, Any]] = {}
        self._raw_calls: Dict[Tuple[str, str], Any] = {}  # (endpoint, method) -> its wire-bytes callable
        self._down: Dict[str, float] = {}
        self._lock = threading.Lock()
        # A call over several endpoints sends its first share from the calling thread and the others from here; the
        # pool is shared by every thread using the client (threads are made as needed, up to the bound).
        self._pool = ThreadPoolExecutor(max_workers=max(8, 4 * len(self.endpoints)), thread_name_prefix="fs-seq")
        # max_batched_calls: the most DecodeStep calls the server reported running in one launch (--batch_window_us).
        # already_appended: appends a retry found applied by its lost first try (expected_length), not applied again.
        # already_created: creates whose retry found the sequence its lost try made (create_token).
        # left_behind_released: ids a failover after UNAVAILABLE left on a server that then took their release.
        # truncated_back: uncertain sequences whose failed calls' rows a Truncate cut off (instead of a re-create).
        self.stats = {"reprefills": 0, "not_found": 0, "unavailable": 0, "max_batched_calls": 0,
                      "already_appended": 0, "already_created": 0, "left_behind_released": 0, "truncated_back": 0}
        unknown = set(local_sockets or {}) - set(self.endpoints)
        if unknown:
            raise ValueError(f"local_sockets names endpoints not in the list: {sorted(unknown)}")
        self.local_sockets = dict(local_sockets or {})
        if not 0 <= local_poll_us <= MAX_POLL_US:
            raise ValueError(f"local_poll_us must be in 0..{MAX_POLL_US}, got {local_poll_us}")
        self.local_poll_us = local_poll_us  # LocalClient's poll_us for the local-socket connections
        self._local = threading.local()  # per thread: {socket path: LocalClient}
        # Every connection open, closed by close(). Weak: a thread's connections close when it ends (LocalClient
        # closes when collected); held here, they stayed open, and after --local_max_connections (64) threads every
        # new thread's step failed RESOURCE_EXHAUSTED.
        self._local_clients: "weakref.WeakSet[LocalClient]" = weakref.WeakSet()

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
        raw = self._raw_calls.get((endpoint, method))  # made once: building one took ~3.4 us a call
        if raw is None:
            channel = self._channel(endpoint)[0]
            if method == "DecodeStep":  # a packed answer's O / LSE read as views of the answer's bytes
                deserializer = DecodeStepAnswer.parse
            else:
                deserializer = getattr(spb, spb.DESCRIPTOR.services_by_name["Sequences"].methods_by_name[method]
                                       .output_type.name).FromString
            raw = channel.unary_unary(f"/{spb.DESCRIPTOR.package}.Sequences/{method}", request_serializer=None,
                                      response_deserializer=deserializer)
            with self._lock:
                raw = self._raw_calls.setdefault((endpoint, method), raw)
        return raw

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
                    self._local_clients.add(client)
            client.set_timeout(timeout)
            return getattr(client, _LOCAL_METHODS[method])(request)
        except FlashserveError as e:  # first: UnavailableError and DeadlineExceededError are OSErrors too
            if e.code in _DROP_CONNECTION or (client is not None and client.closed):
                self._drop_local(path)
            raise
        except OSError as e:  # no socket file, connection refused: the server is not there (now)
            self._drop_local(path)
            raise error_for(grpc.StatusCode.UNAVAILABLE, f"local socket {path}: {e}") from None
        except BaseException:  # interrupted mid-call: the client closed the connection, whose answer is unread
            if client is not None and client.closed:
                self._drop_local(path)
            raise

    def _drop_local(self, path: str) -> None:
        client = self._local.__dict__.get("connections", {}).pop(path, None)
        if client is not None:
            client.close()
            with self._lock:
                self._local_clients.discard(client)  # close() may have emptied the set already

    # --- create / re-create ------------------------------------------------------------------------------------------

    def create(self, num_layers: int, heads_q: int, heads_kv: int, head_dim: int, dtype: str,
               prefix: Optional[Prefix] = None, *, key: Optional[str] = None, max_tokens: int = 0, label: str = "",
               keep_history: bool = True, prefix_source=None, timeout: Optional[float] = None,
               create_token: Optional[str] = None) -> Sequence:
        """Creates a sequence (on the ring's endpoint for ``key``) with an optional prefix {layer: (k, v)}.

        ``create_token``: CreateSequenceRequest.create_token for this create and its retries (default: a fresh
        ``secrets.token_urlsafe(16)``; 16-64 characters of [0-9A-Za-z_-], random: whoever knows it can obtain the
        sequence's id). A re-create after the server lost the sequence uses a new one."""
        if dtype not in tensors.PROTO_DTYPE:
            raise error_for(grpc.StatusCode.INVALID_ARGUMENT, f"dtype {dtype!r}: expected float16 or bfloat16")
        spec = SequenceSpec(num_layers, heads_q, heads_kv, head_dim, dtype)
        seq = Sequence(self, spec, key, keep_history, prefix_source, max_tokens, label)
        encoded = encode_prefix(prefix)
        self._create_on_ring(seq, encoded, self._deadline(timeout), create_token, recovering=False)
        seq.reset_history(encoded)
        return seq

    # --- calls -------------------------------------------------------------------------------------------------------

    @staticmethod
    def _check_live(seq: Sequence) -> None:
        if seq.released:
            raise error_for(grpc.StatusCode.FAILED_PRECONDITION, f"sequence {seq.id} was released by this client")

    def append(self, seq: Sequence, rows: Mapping[int, Tuple[Any, Any]], timeout: Optional[float] = None):
        """Appends {layer: (k, v)} (k/v [rows, heads_kv, head_dim]); returns every layer's length."""
        self._check_live(seq)
        # HostRows (the arrays' bytes copied once), joined into the request's wire bytes (_wire.py): a pb.Tensor
        # copied them into the message, into the request and again when it was serialized.
        encoded = {checked_layer(seq, layer): (encode_rows(k, f"rows[{layer}].k"), encode_rows(v, f"rows[{layer}].v"))
                   for layer, (k, v) in rows.items()}

        def attempt(ids, left):
            sent_id = ids[0]
            with seq.lock:  # the lengths of the id read (a re-create changes both)
                if seq.id != sent_id:
                    raise NotFoundError(grpc.StatusCode.NOT_FOUND, f"sequence {sent_id} was re-created meanwhile",
                                        missing_ids=(sent_id,))
                expected = {layer: seq.lengths[layer] for layer in encoded}
            request = append_request_bytes(sent_id, encoded, expected)
            response = self._rpc(seq.endpoint, "Append", request, seq.key, left)
            self._count_already_appended(len(response.already_appended_layers))
            with seq.lock:
                if seq.id != sent_id:  # re-created while this ran, without these rows: send them again
                    raise NotFoundError(grpc.StatusCode.NOT_FOUND, f"sequence {sent_id} was re-created while an "
                                        "append to it ran", missing_ids=(sent_id,))
                # Only the appended layers: the others' lengths in this answer may be older than the client's.
                for layer, (k, v) in encoded.items():
                    seq.acknowledge_layer(layer, k, v, response.layer_lengths[layer])
                return list(seq.lengths)

        deadline = self._deadline(timeout)
        appended_rows = {layer: int(k.shape[0]) if k.shape else 0 for layer, (k, _) in encoded.items()}
        with hold_layers(writes=[(seq, layer) for layer in encoded], timeout=deadline.remaining()):
            return self._with_recovery([seq], attempt, deadline, appended_rows)

    def truncate(self, seq: Sequence, length: int, layers: Optional[Iterable[int]] = None,
                 timeout: Optional[float] = None) -> List[int]:
        """Cuts ``layers`` (default: every layer) back to their first ``length`` tokens; returns every layer's
        length. See truncate_many."""
        return self.truncate_many([(seq, length, layers)], timeout=timeout)[0]

    def truncate_many(self, items: Iterable[TruncateInput], timeout: Optional[float] = None) -> List[List[int]]:
        """For each (sequence, length, layers or None): cut its layers back to their first ``length`` tokens -- one
        speculative step of a batch: the rejected drafts of every sequence -- in one Truncate per endpoint holding
        some of the sequences (in parallel). Returns every layer's length per item. Retried and recovered like an
        append (a server that lost a sequence gets it back from the history and it is cut again: a retry cuts
        nothing more). A call that raises may have cut the sequences of the endpoints that answered (their
        ``lengths`` say so); sending it again is safe."""
        cuts = [_Cut(entry) for entry in items]
        if len({id(cut.seq) for cut in cuts}) != len(cuts):
            raise error_for(grpc.StatusCode.INVALID_ARGUMENT, "truncate_many: a sequence is named twice")
        for cut in cuts:
            self._check_live(cut.seq)
        # An empty list of layers cuts nothing, so it is not sent: a request naming no layer means "every layer" to
        # the server (it cut them all while the history kept them: later answers went wrong).
        sent = [cut for cut in cuts if cut.named]
        results: List[Optional[List[int]]] = [None] * len(sent)
        doubtful: List[Tuple[Sequence, str, grpc.StatusCode, dict]] = []
        deadline = self._deadline(timeout)
        with hold_layers(writes=[(cut.seq, layer) for cut in sent for layer in cut.named],
                         timeout=deadline.remaining()):
            try:
                answered = iter(self._truncate(sent, results, doubtful, deadline) if sent else [])
            except BaseException:
                for seq, sent_id, code, rows in doubtful:  # tries that may have cut: settled before the next call
                    _mark_uncertain([seq], [sent_id], code, [rows])
                raise
            return [next(answered) if cut.named else list(cut.seq.lengths) for cut in cuts]

    def _call_timeout(self, timeout: Optional[float]) -> Optional[float]:
        return self.timeout if timeout is None else timeout

    def _deadline(self, timeout: Optional[float]) -> CallDeadline:
        """The whole call's deadline: its timeout (or the client's) from now, recovery included; None: none."""
        return CallDeadline(self._call_timeout(timeout))

    def _count_already_appended(self, n: int) -> None:
        if n:
            with self._lock:
                self.stats["already_appended"] += n

    def attend(self, seq: Sequence, layer: int, q, causal: bool = False, softmax_scale: Optional[float] = None,
               return_lse: bool = False, timeout: Optional[float] = None):
        """Attention of q [rows_q, heads_q, head_dim] over the layer's cache (no append)."""
        self._check_live(seq)
        item = _Item((seq, layer, q))

        def attempt(ids, left):
            request = spb.AttendRequest(sequence_id=ids[0], layer=int(layer), causal=bool(causal),
                                        return_lse=bool(return_lse))
            _copy_rows(request.q, item.q)
            if softmax_scale is not None:
                request.softmax_scale = float(softmax_scale)
            response = self._rpc(seq.endpoint, "Attend", request, seq.key, left)
            try:
                return _answer(response, item, return_lse)
            except (FlashserveError, ValueError) as e:  # the server's fault, not the caller's
                raise _unreadable("Attend", e) from e

        deadline = self._deadline(timeout)
        with hold_layers(reads=[(seq, int(layer))], timeout=deadline.remaining()):
            return self._with_recovery([seq], attempt, deadline, None)

    def decode_step(self, items: Iterable[DecodeInput], causal: bool = False, softmax_scale: Optional[float] = None,
                    return_lse: bool = False, timeout: Optional[float] = None) -> list:
        """For each (sequence, layer, q, k, v): append k/v (may be None) to the layer, attend q. One DecodeStep per
        endpoint holding some of the sequences (in parallel). Returns outs (or (out, lse)) in the items' order."""
        return self._run_decode([_Item(entry) for entry in items], (bool(causal), softmax_scale, bool(return_lse)),
                                timeout)

    def decode_step_batch(self, seqs: Seq[Sequence], layer: int, q, k=None, v=None, causal: bool = False,
                          softmax_scale: Optional[float] = None, return_lse: bool = False,
                          timeout: Optional[float] = None):
        """decode_step for a batch held as a model server holds it: q [len(seqs) x rows_q, heads_q, head_dim] and
        k/v [len(seqs) x rows, heads_kv, head_dim] (or None), sequence i's rows the i-th block, numpy or torch. Each
        tensor is encoded once (not once per sequence) and O comes back as one tensor like q (LSE as [len(seqs),
        heads_q, rows_q]): 64 sequences cost a fraction of what 64 items do. Same calls, retries and recovery."""
        seqs = list(seqs)
        count = len(seqs)
        if count == 0 or (k is None) != (v is None) or q.shape[0] % count or \
                (k is not None and (k.shape[0] % count or tuple(k.shape) != tuple(v.shape))):
            raise error_for(grpc.StatusCode.INVALID_ARGUMENT, f"decode_step_batch: q {tuple(q.shape)} and k/v "
                            f"{None if k is None else tuple(k.shape)} must hold the same rows for each of the "
                            f"{count} sequences (k and v both or neither)")
        kind = "torch" if tensors.is_torch(q) else "numpy"
        device = q.device if kind == "torch" else None
        # q is read in place (sent, never kept); k/v are copied once, block by block: the history keeps each block.
        blocks = [_row_blocks(tensors.to_host_rows(t, name, copy=False), count, copy=name != "q") if t is not None
                  else [None] * count for name, t in (("q", q), ("k", k), ("v", v))]
        prepared = [_Item.encoded(seq, layer, qi, ki, vi) for seq, qi, ki, vi in zip(seqs, *blocks)]
        answers = self._run_decode(prepared, (bool(causal), softmax_scale, bool(return_lse)), timeout)
        out = tensors.from_proto(tensors.HostRows(blocks[0][0].dtype, tuple(int(n) for n in q.shape),
                                                  bytearray().join(a[0] for a in answers)), kind, device)
        if not return_lse:
            return out
        lse_shape = (count, int(q.shape[1]), int(q.shape[0]) // count)
        lse = tensors.from_proto(tensors.HostRows(tensors.PROTO_DTYPE["float32"], lse_shape,
                                                  bytearray().join(a[1] for a in answers)), kind, device)
        return out, lse

    def _run_decode(self, prepared: List[_Item], options, timeout: Optional[float]) -> list:
        """options: (causal, softmax_scale, return_lse)."""
        for item in prepared:
            self._check_live(item.seq)
        deadline = self._deadline(timeout)
        with hold_layers(writes=[(item.seq, item.layer) for item in prepared if item.k is not None],
                         reads=[(item.seq, item.layer) for item in prepared if item.k is None],
                         timeout=deadline.remaining()):
            results: List[Any] = [None] * len(prepared)
            doubtful: List[Tuple[Sequence, str, grpc.StatusCode, Optional[dict]]] = []
            try:
                return self._decode_step(prepared, results, doubtful, options, deadline)
            except BaseException:
                # A step that raises appended nothing, for the caller (who may well send it again). Its tries that
                # failed in a way that may have appended (every group, every try, not only the error raised) make
                # their sequences uncertain; items that one server took while another server's share failed are
                # taken back: the client forgets their rows and the next call cuts them off the server (Truncate).
                for seq, sent_id, code, rows in doubtful:
                    _mark_uncertain([seq], [sent_id], code, [rows])
                for item, result in zip(prepared, results):
                    if result is not None and item.k is not None:
                        with item.seq.lock:
                            item.seq.take_back(item.layer, item.k)
                            item.seq.doubt(may_land=False, rows=item.appended_rows())
                raise

    # --- release and information ----------------------------------------------------------------------------------

    def release(self, seq: Sequence, timeout: Optional[float] = None) -> bool:
        """Frees the sequence on its server. True when the server still held it; False when it had already lost it
        or cannot be reached (its TTL frees the pages then)."""
        with seq.lock:
            if seq.released:
                return False
            seq.released = True
            seq.reset_history({})  # nothing re-creates a released sequence: its rows need not stay
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
            self._raw_calls.clear()
            for client in list(self._local_clients):
                client.close()
            self._local_clients.clear()

    def __enter__(self) -> "SequenceClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


