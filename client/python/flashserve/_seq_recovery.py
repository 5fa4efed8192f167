"""SequenceClient's recovery: creating a sequence on its ring endpoint, re-creating one a server lost (re-prefill), and
the bookkeeping of calls that failed after sending rows (sequence_client.py's module docstring says the rules)."""

from __future__ import annotations

import secrets
import threading
import time
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Tuple

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
_RELEASE_LEFT_BEHIND_S = 5.0  # the background release of ids left behind (the caller does not wait for it)
# A release on the way to a re-create, in a call without a deadline: best effort, it must not hang the call. With a
# deadline it gets the time left.
_RELEASE_S = 5.0
# CreateSequence failures after which the server may have made the sequence (its answer lost on the way, or the
# deadline raced it): the create is sent again with the same create_token, and the server answers that sequence.
_CREATE_MAY_HAVE_RUN = (UnavailableError, DeadlineExceededError)


def new_create_token() -> str:
    """A fresh CreateSequenceRequest.create_token: 128 random bits, URL-safe (22 characters). It is all a retry needs
    to obtain the sequence's id, so it is random and kept like the id."""
    return secrets.token_urlsafe(16)


class CallDeadline:
    """One deadline for a call and all it sends: its tries and its recovery's looks, truncates, releases, re-creates
    and backoffs. Each RPC gets the time left (a retry used to get the whole timeout again, and a release 5 s: a call
    of timeout T took several T); once none is left, DEADLINE_EXCEEDED before anything more is sent. ``timeout``
    None: no deadline."""

    __slots__ = ("timeout", "_at")

    def __init__(self, timeout: Optional[float]):
        self.timeout = timeout
        self._at = None if timeout is None else time.monotonic() + timeout

    def remaining(self) -> Optional[float]:
        """Seconds left (0.0 once passed), or None without a deadline."""
        return None if self._at is None else max(0.0, self._at - time.monotonic())

    def left(self, before: str, recovering: bool = True) -> Optional[float]:
        """The timeout of the RPC that ``before`` names: the time left; DeadlineExceededError when none is."""
        left = self.remaining()
        if left is not None and left <= 0.0:
            raise error_for(grpc.StatusCode.DEADLINE_EXCEEDED,
                            ("recovery ran out of time: " if recovering else "") +
                            f"the call's timeout of {self.timeout:g} s passed before {before}; nothing more was sent")
        return left

    def sleep(self, seconds: float) -> None:
        """A retry's backoff, cut short at the deadline (the next left() then raises)."""
        left = self.remaining()
        time.sleep(seconds if left is None else min(seconds, left))


def _mark_uncertain(seqs: Iterable[Sequence], sent_ids: Iterable[str], code: grpc.StatusCode,
                    rows: Optional[Iterable[Optional[Mapping[int, int]]]] = None) -> None:
    """A call that sent rows to these sequences (ids as sent) failed with ``code`` and is not retried: its rows may be
    there. ``rows``: per sequence, how many it sent per layer. A sequence re-created since (another id) is left
    alone: the call's rows are not in it."""
    seqs = list(seqs)
    for seq, sent_id, sent_rows in zip(seqs, sent_ids, rows if rows is not None else [None] * len(seqs)):
        with seq.lock:
            if seq.id == sent_id:
                seq.doubt(may_land=code in _MAY_LAND, rows=sent_rows)


def _cuts_back(ours: List[int], theirs: List[int], doubtful_rows: Mapping[int, int]) -> Optional[Dict[int, List[int]]]:
    """{length: layers} that Truncate cuts the server's lengths ``theirs`` back to the client's ``ours`` with (empty:
    they are the same), or None when they are not the client's plus some of the rows failed calls sent to those
    layers (a layer shorter: a cut the client does not know of; longer by more: another writer)."""
    if len(theirs) != len(ours):
        return None
    cuts: Dict[int, List[int]] = {}
    for layer, (mine, server) in enumerate(zip(ours, theirs)):
        if server == mine:
            continue
        if not mine < server <= mine + doubtful_rows.get(layer, 0):
            return None
        cuts.setdefault(mine, []).append(layer)
    return cuts



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

    def _create_on_ring(self, seq: Sequence, prefix, deadline: CallDeadline, create_token: Optional[str] = None,
                        recovering: bool = True) -> None:
        """CreateSequence on the key's endpoint, with ``create_token`` (default: a fresh one). A try whose answer may
        have been lost (UNAVAILABLE through one endpoint, DEADLINE_EXCEEDED) is sent again as it was, token
        included, up to max_attempts tries (the calls' retry policy: none without reprefill; UNAVAILABLE waits
        0.1, 0.2 ... s) while the deadline leaves time: the server answers the sequence a lost try made instead of
        making a second one that would hold pages until its TTL. With several endpoints an UNAVAILABLE one is marked
        down and the next one tried."""
        prefix, appends = split_prefix(prefix, self.create_chunk_bytes)
        request = self._create_request(seq, prefix, create_token or new_create_token())
        failovers = retries = 0
        while failovers < len(self.endpoints):
            endpoint = self.pick(seq.key)
            timeout = deadline.left(f"creating sequence {seq.key!r} on {endpoint}" +
                                    (f" (try {retries + failovers + 1})" if retries + failovers else ""),
                                    recovering=recovering or bool(retries + failovers))
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
                    deadline.sleep(_UNAVAILABLE_BACKOFF_S * 2 ** (retries - 1))
                continue
            if appends:
                self._append_prefix_rest(seq, endpoint, response, appends, deadline)
            self._created(seq, endpoint, response)
            return
        raise error_for(grpc.StatusCode.UNAVAILABLE, f"no endpoint could create the sequence ({self.endpoints})")

    def _append_prefix_rest(self, seq: Sequence, endpoint: str, response, appends, deadline: CallDeadline) -> None:
        """The prefix's rows that did not fit the create (_seq_create.split_prefix), appended in order to the sequence
        the create made; `response` (the create's answer) then holds the layers' lengths after them. Each append names
        the length it follows, so a try sent again after a lost answer appends nothing twice. A failure releases the
        sequence (it holds only part of the prefix) and raises."""
        sequence_id, lengths = response.sequence_id, [int(n) for n in response.layer_lengths]
        try:
            for rows in appends:
                request = append_request_bytes(sequence_id, rows, {layer: lengths[layer] for layer in rows})
                for attempt in range(self.max_attempts):
                    timeout = deadline.left(f"appending the rest of sequence {sequence_id}'s prefix")
                    try:
                        answer = self._rpc(endpoint, "Append", request, seq.key, timeout)
                        break
                    except _CREATE_MAY_HAVE_RUN:
                        if attempt + 1 == self.max_attempts:
                            raise
                        deadline.sleep(_UNAVAILABLE_BACKOFF_S * 2 ** attempt)
                lengths = [int(n) for n in answer.layer_lengths]
        except BaseException:
            self._release_part_made(endpoint, sequence_id, seq.key, deadline)
            raise
        del response.layer_lengths[:]
        response.layer_lengths.extend(lengths)

    def _created(self, seq: Sequence, endpoint: str, response) -> None:
        """seq is now the CreateSequenceResponse's sequence on ``endpoint``."""
        if response.already_created:  # a retry found the sequence its lost try made
            with self._lock:
                self.stats["already_created"] += 1
        seq.id, seq.endpoint, seq.uncertain, seq.may_land = response.sequence_id, endpoint, False, False
        seq.doubtful_rows = {}
        seq.max_tokens = int(response.max_tokens) or seq.max_tokens
        seq.lengths = [int(n) for n in response.layer_lengths] or [0] * seq.spec.num_layers

    def _reprefill(self, seq: Sequence, failed_id: str, deadline: CallDeadline) -> None:
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
            self._create_on_ring(seq, prefix, deadline)
            seq.reprefills += 1
            with self._lock:
                self.stats["reprefills"] += 1

    def _recover(self, error: FlashserveError, seqs: List[Sequence], ids: List[str], endpoint: str,
                 deadline: CallDeadline, attempt: int = 0) -> None:
        """Re-creates the sequences a failed call lost, or re-raises ``error`` when it is not a lost sequence."""
        unsure: set = set()  # ids re-created without knowing they were lost: released after, as left behind
        if isinstance(error, NotFoundError):
            with self._lock:
                self.stats["not_found"] += 1
            missing = set(error.missing_ids)
            if not missing:  # not named: more than the server's metadata holds (~100), or a proxy dropped them
                missing, unsure = self._ask_missing(endpoint, seqs, ids, deadline)
            lost = [(s, i) for s, i in zip(seqs, ids) if i in missing]
        elif isinstance(error, UnavailableError) and len(self.endpoints) > 1:
            self.mark_down(endpoint)
            lost = list(zip(seqs, ids))
        elif isinstance(error, UnavailableError):
            # One endpoint, e.g. a proxy that routes by x-sequence-key: it moves the key to another server, which
            # answers NOT_FOUND on the retry, and that re-creates the sequence; or a server restarting. A lone
            # server that stays down fails every retry and the error reaches the caller.
            deadline.sleep(_UNAVAILABLE_BACKOFF_S * 2 ** attempt)
            return
        else:
            raise error
        moved = []
        for seq, failed_id in dict((id(s), (s, i)) for s, i in lost).values():
            self._reprefill(seq, failed_id, deadline)
            if seq.id != failed_id:
                moved.append((seq.key, failed_id))
        if isinstance(error, UnavailableError) and moved:
            self._release_left_behind(endpoint, moved)
        elif any(i in unsure for _, i in moved):
            self._release_left_behind(endpoint, [(k, i) for k, i in moved if i in unsure], counted=None)

    def _ask_missing(self, endpoint: str, seqs: List[Sequence], ids: List[str],
                     deadline: CallDeadline) -> Tuple[set, set]:
        """(the ids to re-create, those of them not known to be lost) after a NOT_FOUND that named none: each id is
        asked about (GetSequenceInfo), and one the look fails for is re-created all the same. Before, every id of
        the call was re-created: 200 re-prefills for 110 lost, and the 90 the server still held stayed there,
        holding their pages until the TTL (for good with --sequence_ttl_s=0)."""
        keys = {i: s.key for s, i in zip(seqs, ids)}
        if len(keys) == 1:
            return set(keys), set()  # the call's one id
        missing, unsure = set(), set()
        for sequence_id, key in keys.items():
            timeout = deadline.left(f"asking {endpoint} which of {len(keys)} sequences it lost")
            try:
                self._rpc(endpoint, "GetSequenceInfo", spb.GetSequenceInfoRequest(sequence_id=sequence_id), key,
                          timeout)
            except NotFoundError:
                missing.add(sequence_id)
            except FlashserveError:
                unsure.add(sequence_id)
        return missing | unsure, unsure

    def _release_left_behind(self, endpoint: str, moved: List[Tuple[str, str]],
                             counted: Optional[str] = "left_behind_released") -> None:
        """Best effort, in the background: releases the ids a failover left on ``endpoint``. UNAVAILABLE may be a
        moment's trouble (a reset connection, a GOAWAY) of a server that still holds the sequences, whose pages would
        stay taken until its TTL (or for good with --sequence_ttl_s=0) while their copies live on elsewhere.
        ``moved``: (key, id) pairs; ``counted``: the stats key that counts them once released."""
        def release():
            try:
                self._rpc(endpoint, "Release", spb.ReleaseRequest(sequence_ids=[i for _, i in moved]), moved[0][0],
                          _RELEASE_LEFT_BEHIND_S)
                if counted:
                    with self._lock:
                        self.stats[counted] += len(moved)
            except Exception:  # noqa: BLE001 - gone for good, or still down: its TTL frees them
                pass

        threading.Thread(target=release, name="flashserve-release-left-behind", daemon=True).start()

    def _settle_uncertain(self, seqs: Iterable[Sequence], deadline: CallDeadline) -> bool:
        """Before using a sequence whose last write failed ambiguously (seq.uncertain), makes the server's copy the
        client's again. Lengths that are the client's need nothing; longer only by rows failed calls sent to those
        layers (an INTERNAL after the append, a multi-server step's share taken back): a Truncate cuts them, and the
        sequence stays where it is. Gone, lengths that cannot be reconciled, or a failure that may still land
        (seq.may_land: the rows may come after any look, and a cut): released and re-created from the history.
        Returns whether any of them was uncertain (recovery ran)."""
        recovered = False
        for seq in seqs:
            while True:
                with seq.lock:
                    if not seq.uncertain:
                        break
                    failed_id, endpoint, doubts, may_land = seq.id, seq.endpoint, seq.doubts, seq.may_land
                recovered, gone = True, False
                try:
                    if not may_land and self._cut_back(seq, failed_id, endpoint, doubts, deadline):
                        continue  # settled, or changed meanwhile: look again
                except NotFoundError:
                    gone = True
                except UnavailableError:
                    pass
                self._check_rebuildable(seq, failed_id, endpoint, gone)
                left = deadline.left(f"releasing sequence {failed_id} to re-create it")
                self._release_quietly(endpoint, failed_id, seq.key, _RELEASE_S if left is None else left)
                self._reprefill(seq, failed_id, deadline)  # then look again: a new id may have a new doubt
        return recovered

    def _cut_back(self, seq: Sequence, failed_id: str, endpoint: str, doubts: int, deadline: CallDeadline) -> bool:
        """Asks the server for the uncertain sequence's lengths and, when they are the client's plus rows failed calls
        sent (_cuts_back), cuts those rows away and settles it. True when settled, or when the sequence changed
        meanwhile (settled or re-created by another thread, or a new failure): look again. False: re-create it.
        NotFoundError: it is gone."""
        info = self._rpc(endpoint, "GetSequenceInfo", spb.GetSequenceInfoRequest(sequence_id=failed_id), seq.key,
                         deadline.left(f"asking {endpoint} for the lengths of sequence {failed_id}"))
        theirs = [int(n) for n in info.layer_lengths]
        # Held over the Truncate: a look that began before another thread's settle must not cut what it then
        # appended. Failed calls' layers have no append of this client in flight (each call settles first).
        with seq.lock:
            if not seq.uncertain or seq.id != failed_id or seq.doubts != doubts:
                return True
            cuts = _cuts_back(seq.lengths, theirs, seq.doubtful_rows)
            if cuts is None:
                return False
            for length, layers in cuts.items():  # a sequence once per request: one request per length
                request = spb.TruncateRequest()
                request.items.add(sequence_id=failed_id, length=length, layers=layers)
                try:
                    self._rpc(endpoint, "Truncate", request, seq.key,
                              deadline.left(f"cutting sequence {failed_id} back to the client's lengths"))
                except NotFoundError:
                    raise
                except FlashserveError as e:  # refused, or cut maybe: a re-create makes it certain
                    if e.code in _MAY_LAND:  # may still cut later, after rows appended since: no more looks
                        seq.may_land = True
                    return False
            seq.settle()
        if cuts:
            with self._lock:
                self.stats["truncated_back"] += 1
        return True

    def _check_rebuildable(self, seq: Sequence, failed_id: str, endpoint: str, gone: bool) -> None:
        """FAILED_PRECONDITION for a sequence still on its server that nothing could re-create once released."""
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

    def _release_quietly(self, endpoint: str, sequence_id: str, key: str, timeout: Optional[float]) -> None:
        try:
            self._rpc(endpoint, "Release", spb.ReleaseRequest(sequence_ids=[sequence_id]), key, timeout)
        except FlashserveError:
            pass  # gone with its server, or freed by its TTL later

    def _release_part_made(self, endpoint: str, sequence_id: str, key: str, deadline: CallDeadline) -> None:
        """Releases a sequence a failed create left half made: within the call's time left, else in the
        background (the call's deadline has passed; its TTL would hold the pages meanwhile)."""
        left = deadline.remaining()
        if left is None or left > 0:
            self._release_quietly(endpoint, sequence_id, key, _RELEASE_S if left is None else left)
        else:
            self._release_left_behind(endpoint, [(key, sequence_id)], counted=None)

    def _with_recovery(self, seqs: List[Sequence], attempt, deadline: CallDeadline,
                       appended_rows: Optional[Mapping[int, int]]):
        """attempt(ids, timeout) is one RPC on seqs[0].endpoint for seqs (ids: theirs as read once, under their
        locks), given the time left; a lost sequence is re-created and the RPC retried, all within ``deadline``.
        ``appended_rows``: the rows an attempt appends per layer (None: it appends nothing, an attend)."""
        appends = appended_rows is not None
        doubtful = []  # (ids, code) of the tries whose rows may be on the server
        try:
            for n in range(self.max_attempts):
                settled = self._settle_uncertain(seqs, deadline)
                ids, endpoint = [], seqs[0].endpoint
                for seq in seqs:
                    with seq.lock:
                        ids.append(seq.id)
                timeout = deadline.left(_try_name(n), recovering=n > 0 or settled)
                try:
                    return attempt(ids, timeout)
                except FlashserveError as e:
                    if appends and e.code in _AMBIGUOUS | _MAY_LAND:
                        doubtful.append((ids, e.code))
                    if not self.reprefill or n + 1 == self.max_attempts or (appends and e.code in _AMBIGUOUS):
                        raise
                    self._recover(e, seqs, ids, endpoint, deadline, n)
                except BaseException:  # interrupted with the request maybe sent: as a cancelled call
                    if appends:
                        doubtful.append((ids, grpc.StatusCode.CANCELLED))
                    raise
            raise AssertionError("unreachable")
        except BaseException:
            for ids, code in doubtful:  # given up, whatever the last error: any earlier try's rows may be there
                _mark_uncertain(seqs, ids, code, [appended_rows] * len(seqs))
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
                           send: Callable[[List[int], list, str, Optional[float]], None], results: list,
                           doubtful: list, deadline: CallDeadline, what: str,
                           writes: Callable[[int], Optional[Mapping[int, int]]]) -> list:
        """One call per endpoint holding some of the items (seqs[i]: item i's sequence), in parallel, retried with
        recovery until every item has its result, all within ``deadline``. sent_of(i): what item i is sent with, its
        sequence id first, read under its lock together with its endpoint (a re-create changes both); send(items,
        sent, endpoint, timeout) makes one call and fills the results of the items whose sequence still has the id
        sent (the others are sent again). writes(i): the rows item i adds per layer ({} for a cut), None when it
        changes nothing. doubtful gets (sequence, id sent, code, rows) of the items a failed try may have changed."""
        pending = list(range(len(seqs)))
        for n in range(self.max_attempts):
            settled = self._settle_uncertain({id(seqs[i]): seqs[i] for i in pending}.values(), deadline)
            runs = _runs_by_endpoint(seqs, pending, sent_of)
            timeout = deadline.left(_try_name(n), recovering=n > 0 or settled)

            outcomes, interrupted = self._send_all(lambda *run: send(*run, timeout), runs)
            failed = [(run, e) for run, e in zip(runs, outcomes) if e is not None]
            for (group, sent, _), error in failed:
                if isinstance(error, FlashserveError) and error.code in _AMBIGUOUS | _MAY_LAND:
                    doubtful.extend((seqs[i], s[0], error.code, writes(i)) for i, s in zip(group, sent)
                                    if writes(i) is not None)
            if interrupted is not None:
                raise interrupted
            for _, error in failed:  # out of memory, an interrupted share ...: raised as it is, every share ended
                if not isinstance(error, FlashserveError):
                    raise error
            for (group, sent, endpoint), error in failed:
                if not self.reprefill or n + 1 == self.max_attempts or error.code in _AMBIGUOUS:
                    raise error
                self._recover(error, [seqs[i] for i in group], [s[0] for s in sent], endpoint, deadline, n)
            # Failed groups' items, and items answered from a sequence re-created meanwhile.
            pending = [i for i in pending if results[i] is None]
            if not pending:
                return results
        raise error_for(grpc.StatusCode.ABORTED, f"{len(pending)} {what} item(s) were answered by sequences that "
                        f"another call re-created meanwhile, {self.max_attempts} times")


def _try_name(n: int) -> str:
    """Try n (from 0) of a call, for a deadline's message."""
    return f"try {n + 1} of the call" if n else "the call was sent"


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
