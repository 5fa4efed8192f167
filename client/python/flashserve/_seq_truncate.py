"""SequenceClient's Truncate: items checked once, one call per endpoint holding some of the sequences (in parallel),
retried and recovered like an append. A truncate is idempotent (a layer already that short is left as it is), so a
re-created sequence -- which gets every row back from the history -- is simply cut again."""

from __future__ import annotations

from typing import Iterable, List, Optional, Tuple

import grpc

from ._pb import sequences_pb2 as spb
from ._seq_recovery import CallDeadline
from .errors import error_for
from .sequences import Sequence

# (sequence, length, layers or None: every layer)
TruncateInput = Tuple[Sequence, int, Optional[Iterable[int]]]


class _Cut:
    """One item: the layers it names (all when none were given) and what the request carries."""

    __slots__ = ("seq", "length", "named", "layers")

    def __init__(self, entry):
        seq, length = entry[0], int(entry[1])
        layers = entry[2] if len(entry) > 2 else None
        count = seq.spec.num_layers
        self.named = list(range(count)) if layers is None else sorted({int(layer) for layer in layers})
        if length < 0 or any(not 0 <= layer < count for layer in self.named):
            raise error_for(grpc.StatusCode.INVALID_ARGUMENT, f"truncate to {length} tokens of layers {self.named}: "
                            f"expected a length >= 0 and layers in [0, {count})")
        self.seq, self.length = seq, length
        self.layers = [] if layers is None else self.named  # empty: the server cuts every layer


class _Truncates:
    """Mixin of SequenceClient (which supplies _rpc and _calls_by_endpoint)."""

    def _truncate(self, cuts: List[_Cut], results: List[Optional[List[int]]], doubtful: list,
                  deadline: CallDeadline) -> list:
        """truncate_many's calls and retries (its layers held) within ``deadline``; fills results (every layer's
        length per item), and doubtful with (sequence, id sent, code, rows: none) of the items a failed try may have
        cut on a server."""
        return self._calls_by_endpoint(
            [cut.seq for cut in cuts], lambda i: (cuts[i].seq.id,),
            lambda group, sent, endpoint, timeout: self._truncate_group(cuts, group, [s[0] for s in sent], endpoint,
                                                                        results, timeout),
            results, doubtful, deadline, "truncate", lambda i: {})

    def _truncate_group(self, cuts, group, sent, endpoint, results, timeout) -> None:
        """One Truncate of the group's items to the ids ``sent``; fills results of the items whose sequence still has
        the id sent (the others stay None: sent again, to the sequence re-created from the uncut rows)."""
        request = spb.TruncateRequest()
        for i, sequence_id in zip(group, sent):
            request.items.add(sequence_id=sequence_id, length=cuts[i].length, layers=cuts[i].layers)
        response = self._rpc(endpoint, "Truncate", request, cuts[group[0]].seq.key, timeout)
        if len(response.results) != len(group):
            raise error_for(grpc.StatusCode.INTERNAL,
                            f"Truncate answered {len(response.results)} results for {len(group)} items")
        for i, sent_id, result in zip(group, sent, response.results):
            cut = cuts[i]
            with cut.seq.lock:
                if cut.seq.id != sent_id:
                    continue
                # Only the named layers: the others' lengths in this answer may be older than the client's.
                cut.seq.cut(cut.named, cut.length, {layer: result.layer_lengths[layer] for layer in cut.named})
                results[i] = list(cut.seq.lengths)
