"""SequenceClient's recovery: creating a sequence on its ring endpoint, re-creating one a server lost (re-prefill), and
the bookkeeping of calls that failed after sending rows (sequence_client.py's module docstring says the rules)."""

from __future__ import annotations

import secrets
import threading
import time
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import grpc

from . import tensors
from ._pb import sequences_pb2 as spb
from ._seq_create import split_prefix
from ._wire import append_request_bytes, create_request_bytes
from .errors import DeadlineExceededError, FlashserveError, NotFoundError, UnavailableError, error_for
from .sequences import Sequence

# Failures after which the server may or may not have appended the rows it was sent.
_AMBIGUOUS = {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN,
              grpc.StatusCode.INTERNAL}
# Failures after which the call may still be on its way or running on the server (the client stopped waiting, or the
# connection broke with the request sent): its rows may land after any look at the lengths. UNAVAILABLE is retried
# (the same expected_length, or a new sequence elsewhere); when the client gives up on it, it is one of these.
_MAY_LAND = {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE}
# Retries through a single endpoint after UNAVAILABLE wait 0.1, 0.2, 0.4 ... s.
_UNAVAILABLE_BACKOFF_S = 0.1
_RELEASE_LEFT_BEHIND_S = 5.0  # the background release of ids a failover left behind
# CreateSequence failures after which the server may have made the sequence (its answer lost on the way, or the
# deadline raced it): the create is sent again with the same create_token, and the server answers that sequence.
_CREATE_MAY_HAVE_RUN = (UnavailableError, DeadlineExceededError)


def new_create_token() -> str:
    """A fresh CreateSequenceRequest.create_token: 128 random bits, URL-safe (22 characters). It is all a retry needs
    to obtain the sequence's id, so it is random and kept like the id."""
    return secrets.token_urlsafe(16)


def _mark_uncertain(seqs: Iterable[Sequence], sent_ids: Iterable[str], code: grpc.StatusCode) -> None:
    """A call that sent rows to these sequences (ids as sent) failed with ``code`` and is not retried: its rows may be
    there. A sequence re-created since (another id) is left alone: the call's rows are not in it."""
    for seq, sent_id in zip(seqs, sent_ids):
        with seq.lock:
            if seq.id == sent_id:
                seq.doubt(may_land=code in _MAY_LAND)



class _Recovery:
    """Mixin of SequenceClient (which supplies endpoints, reprefill, max_attempts, stats, _lock, _rpc, pick and
    mark_down)."""

    def _create_request(self, seq: Sequence, prefix, create_token: str) -> bytes:
        """The CreateSequenceRequest's wire bytes (_wire.py: the prefix's bytes copied once)."""
        s = seq.spec
        header = spb.CreateSequenceRequest(num_layers=s.num_layers, heads_q=s.heads_q, heads_kv=s.heads_kv,
                                           head_dim=s.head_dim, dtype=tensors.PROTO_DTYPE[s.dtype],
                                           max_tokens=seq.max_tokens, label=seq.label, create_token=create_token)
        return create_request_bytes(header, prefix)

    def _create_on_ring(self, seq: Sequence, prefix, timeout, create_token: Optional[str] = None) -> None:
        """CreateSequence on the key's endpoint, with ``create_token`` (default: a fresh one). A try whose answer may
        have been lost (UNAVAILABLE through one endpoint, DEADLINE_EXCEEDED) is sent again as it was, token
        included, up to max_attempts tries (the calls' retry policy: none without reprefill; UNAVAILABLE waits
        0.1, 0.2 ... s): the server answers the sequence a lost try made instead of making a second one that would
        hold pages until its TTL. With several endpoints an UNAVAILABLE one is marked down and the next one tried."""
        prefix, appends = split_prefix(prefix, self.create_chunk_bytes)
        request = self._create_request(seq, prefix, create_token or new_create_token())
        failovers = retries = 0
        while failovers < len(self.endpoints):
            endpoint = self.pick(seq.key)
            try:
                response = self._rpc(endpoint, "CreateSequence", request, seq.key, timeout)
            except _CREATE_MAY_HAVE_RUN as e:
                if not self.reprefill:
                    raise
                if isinstance(e, UnavailableError) and len(self.endpoints) > 1:
                    self.mark_down(endpoint)  # the server left: the ring's next endpoint
                    failovers += 1
                    continue
                retries += 1
                if retries >= self.max_attempts:
                    raise
                if isinstance(e, UnavailableError):
                    time.sleep(_UNAVAILABLE_BACKOFF_S * 2 ** (retries - 1))
                continue
            if appends:
                self._append_prefix_rest(seq, endpoint, response, appends, timeout)
            self._created(seq, endpoint, response)
            return
        raise error_for(grpc.StatusCode.UNAVAILABLE, f"no endpoint could create the sequence ({self.endpoints})")

    def _append_prefix_rest(self, seq: Sequence, endpoint: str, response, appends, timeout) -> None:
        """The prefix's rows that did not fit the create (_seq_create.split_prefix), appended in order to the sequence
        the create made; `response` (the create's answer) then holds the layers' lengths after them. Each append names
        the length it follows, so a try sent again after a lost answer appends nothing twice. A failure releases the
        sequence (it holds only part of the prefix) and raises."""
        sequence_id, lengths = response.sequence_id, [int(n) for n in response.layer_lengths]
        try:
            for rows in appends:
                request = append_request_bytes(sequence_id, rows, {layer: lengths[layer] for layer in rows})
                for attempt in range(self.max_attempts):
                    try:
                        answer = self._rpc(endpoint, "Append", request, seq.key, timeout)
                        break
                    except _CREATE_MAY_HAVE_RUN:
                        if attempt + 1 == self.max_attempts:
                            raise
                        time.sleep(_UNAVAILABLE_BACKOFF_S * 2 ** attempt)
                lengths = [int(n) for n in answer.layer_lengths]
        except BaseException:
            self._release_quietly(endpoint, sequence_id, seq.key)
            raise
        del response.layer_lengths[:]
        response.layer_lengths.extend(lengths)

    def _created(self, seq: Sequence, endpoint: str, response) -> None:
        """seq is now the CreateSequenceResponse's sequence on ``endpoint``."""
        if response.already_created:  # a retry found the sequence its lost try made
            with self._lock:
                self.stats["already_created"] += 1
        seq.id, seq.endpoint, seq.uncertain, seq.may_land = response.sequence_id, endpoint, False, False
        seq.max_tokens = int(response.max_tokens) or seq.max_tokens
        seq.lengths = [int(n) for n in response.layer_lengths] or [0] * seq.spec.num_layers

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
            # A new create_token (the default): the lost sequence's token is not this create's -- and where the
            # sequence was only given up on (_settle_uncertain), the server may still hold it under the old one.
            self._create_on_ring(seq, prefix, timeout)
            seq.reprefills += 1
            with self._lock:
                self.stats["reprefills"] += 1

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
        moved = []
        for seq, failed_id in dict((id(s), (s, i)) for s, i in lost).values():
            self._reprefill(seq, failed_id, timeout)
            if seq.id != failed_id:
                moved.append((seq.key, failed_id))
        if isinstance(error, UnavailableError) and moved:
            self._release_left_behind(endpoint, moved)

    def _release_left_behind(self, endpoint: str, moved: List[Tuple[str, str]]) -> None:
        """Best effort, in the background: releases the ids a failover left on ``endpoint``. UNAVAILABLE may be a
        moment's trouble (a reset connection, a GOAWAY) of a server that still holds the sequences, whose pages would
        stay taken until its TTL (or for good with --sequence_ttl_s=0) while their copies live on elsewhere."""
        def release():
            try:
                self._rpc(endpoint, "Release", spb.ReleaseRequest(sequence_ids=[i for _, i in moved]), moved[0][0],
                          _RELEASE_LEFT_BEHIND_S)
                with self._lock:
                    self.stats["left_behind_released"] += len(moved)
            except Exception:  # noqa: BLE001 - gone for good, or still down: its TTL frees them
                pass

        threading.Thread(target=release, name="flashserve-release-left-behind", daemon=True).start()

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
                same, gone = False, False
                try:
                    if not may_land:
                        info = self._rpc(endpoint, "GetSequenceInfo", spb.GetSequenceInfoRequest(sequence_id=failed_id),
                                         seq.key, timeout)
                        same = [int(n) for n in info.layer_lengths] == seq.lengths
                except NotFoundError:
                    gone = True
                except UnavailableError:
                    pass
                if same:
                    with seq.lock:  # only the doubts this look saw: a failure since may have appended after it
                        if seq.doubts == doubts and seq.id == failed_id:
                            seq.uncertain = False
                    continue
                with seq.lock:
                    rebuildable = seq.recovery_prefix() is not None
                if not rebuildable and not gone:
                    # Releasing it would throw away the server's copy, the only one (it did with keep_history=False
                    # after one deadline, then blamed the server for losing it).
                    raise error_for(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"sequence {failed_id}: a call that failed may or may not have appended its rows "
                                    f"on {endpoint}, and the client keeps no history (keep_history=False and no "
                                    "prefix_source) to re-create it; the server's copy is left as it is "
                                    "(GetSequenceInfo has its lengths; release() drops it)")
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

    def _send_all(self, send, runs: list) -> Tuple[list, Optional[BaseException]]:
        """(each run's outcome: None, or what it raised; what interrupted this thread while it waited, or None): the
        first run sent from this thread, the others from the pool. Returns only once every run has ended, also when
        interrupted: a step that raises must leave no share landing on a server after it, unaccounted for."""
        others = [self._pool.submit(_send_one, send, run) for run in runs[1:]]
        outcomes = [_send_one(send, runs[0])]
        interrupted = None
        for future in others:
            while True:
                try:
                    outcomes.append(future.result())
                    break
                except BaseException as e:  # noqa: BLE001 - a signal while waiting: wait on, raise it after
                    interrupted = interrupted or e
        return outcomes, interrupted

    def _calls_by_endpoint(self, seqs: List[Sequence], sent_of: Callable[[int], tuple],
                           send: Callable[[List[int], list, str], None], results: list, doubtful: list, timeout,
                           what: str, writes: Callable[[int], bool]) -> list:
        """One call per endpoint holding some of the items (seqs[i]: item i's sequence), in parallel, retried with
        recovery until every item has its result. sent_of(i): what item i is sent with, its sequence id first, read
        under its lock together with its endpoint (a re-create changes both); send(items, sent, endpoint) makes one
        call and fills the results of the items whose sequence still has the id sent (the others are sent again).
        doubtful gets (sequence, id sent, code) of the items a failed try may have changed (writes(i))."""
        pending = list(range(len(seqs)))
        for n in range(self.max_attempts):
            self._settle_uncertain({id(seqs[i]): seqs[i] for i in pending}.values(), timeout)
            runs = _runs_by_endpoint(seqs, pending, sent_of)

            outcomes, interrupted = self._send_all(send, runs)
            failed = [(run, e) for run, e in zip(runs, outcomes) if e is not None]
            for (group, sent, _), error in failed:
                if isinstance(error, FlashserveError) and error.code in _AMBIGUOUS | _MAY_LAND:
                    doubtful.extend((seqs[i], s[0], error.code) for i, s in zip(group, sent) if writes(i))
            if interrupted is not None:
                raise interrupted
            for _, error in failed:  # out of memory, an interrupted share ...: raised as it is, every share ended
                if not isinstance(error, FlashserveError):
                    raise error
            for (group, sent, endpoint), error in failed:
                if not self.reprefill or n + 1 == self.max_attempts or error.code in _AMBIGUOUS:
                    raise error
                self._recover(error, [seqs[i] for i in group], [s[0] for s in sent], endpoint, timeout, n)
            # Failed groups' items, and items answered from a sequence re-created meanwhile.
            pending = [i for i in pending if results[i] is None]
            if not pending:
                return results
        raise error_for(grpc.StatusCode.ABORTED, f"{len(pending)} {what} item(s) were answered by sequences that "
                        f"another call re-created meanwhile, {self.max_attempts} times")


def _send_one(send, run):
    """None, or what send(*run) raised."""
    try:
        send(*run)
        return None
    except BaseException as e:  # noqa: BLE001 - the caller raises it once every share has ended
        return e


def _runs_by_endpoint(seqs: List[Sequence], indices: List[int],
                      sent_of: Callable[[int], tuple]) -> List[Tuple[List[int], list, str]]:
    """The items as one (items, what each is sent with, endpoint) per endpoint."""
    groups: Dict[str, Tuple[List[int], list]] = {}
    for i in indices:
        with seqs[i].lock:
            sent, endpoint = sent_of(i), seqs[i].endpoint
        group = groups.setdefault(endpoint, ([], []))
        group[0].append(i)
        group[1].append(sent)
    return [(group, sent, endpoint) for endpoint, (group, sent) in groups.items()]
