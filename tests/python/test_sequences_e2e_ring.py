"""Three real servers (CPU backend), sequences spread by the client's consistent-hash ring; one server is killed
(SIGKILL) mid-run. Every answer is checked against the fp64 reference: no wrong answer, only the lost sequences are
re-created (on the next server of the ring) and the others stay where they are. A client without re-prefill sees
only UNAVAILABLE / NOT_FOUND, never a wrong answer."""

from __future__ import annotations

import collections
import threading
import time

import pytest

import flashserve
from conftest import zip_all
from ring_keys import keys_spread_over
from sequences_truth import Truth

pytestmark = pytest.mark.e2e
KV_FLAGS = ("--kv_cache_bytes=67108864", "--kv_page_tokens=16")
SHAPE = dict(num_layers=2, heads_q=8, heads_kv=2, head_dim=64, dtype="bfloat16")


def _round(client, seqs, truth, layer):
    qs = [truth.query() for _ in seqs]
    kvs = [truth.rows(1) for _ in seqs]
    outs = client.decode_step([(s, layer, q, k, v) for s, q, (k, v) in zip(seqs, qs, kvs)])
    for seq, q, (k, v), out in zip_all(seqs, qs, kvs, outs):
        truth.add(seq.key, layer, k, v)
        truth.check(out, q, seq.key, layer)


def test_three_servers_one_killed_mid_run(start_server, rng):
    servers = [start_server(*KV_FLAGS, name=f"ring{i}") for i in range(3)]
    truth = Truth(rng, SHAPE["heads_q"], SHAPE["heads_kv"], SHAPE["head_dim"], SHAPE["dtype"])
    with flashserve.SequenceClient([s.address for s in servers], timeout=20, down_s=120) as client:
        seqs = []
        for i, key in enumerate(keys_spread_over(client.ring, client.endpoints, 6, prefix="conversation-")):
            prefix = {0: truth.rows(20 + i), 1: truth.rows(5)}
            seqs.append(client.create(**SHAPE, prefix=prefix, key=key))
            for layer, (k, v) in prefix.items():
                truth.add(seqs[-1].key, layer, k, v)
        placement = collections.Counter(s.endpoint for s in seqs)
        assert len(placement) == 3, placement
        for step in range(12):
            if step == 5:
                servers[1].proc.kill()
                servers[1].proc.wait()
            _round(client, seqs, truth, layer=step % 2)
        victim = servers[1].address
        before = {s.key: client.ring.lookup(s.key) for s in seqs}
        lost = [s for s in seqs if before[s.key] == victim]
        assert lost and all(s.reprefills == 1 and s.endpoint != victim for s in lost)
        assert all(s.reprefills == 0 and s.endpoint == before[s.key] for s in seqs if s not in lost)
        assert client.stats["reprefills"] == len(lost)
        for seq in seqs:
            assert list(seq.info().layer_lengths) == [truth.length(seq.key, 0), truth.length(seq.key, 1)]


def test_without_reprefill_a_client_sees_only_errors_never_a_wrong_answer(start_server, rng):
    servers = [start_server(*KV_FLAGS, name=f"plain{i}") for i in range(3)]
    truth = Truth(rng, SHAPE["heads_q"], SHAPE["heads_kv"], SHAPE["head_dim"], SHAPE["dtype"])
    errors = collections.Counter()
    answers_after_kill = sweeps_after_kill = 0
    with flashserve.SequenceClient([s.address for s in servers], timeout=20, reprefill=False) as client:
        keys = keys_spread_over(client.ring, client.endpoints, per_endpoint=4)
        seqs = [client.create(**SHAPE, key=key) for key in keys]
        killer = threading.Timer(0.3, servers[2].proc.kill)  # while calls are in flight
        killer.start()
        deadline = time.monotonic() + 60  # a loaded machine may be slow; the sweeps after the kill decide
        while sweeps_after_kill < 2 and time.monotonic() < deadline:
            killed_before_sweep = not killer.is_alive()
            for seq in seqs:
                q, (k, v) = truth.query(), truth.rows(1)
                try:
                    out = seq.step(0, q, k, v)
                except (flashserve.UnavailableError, flashserve.NotFoundError) as e:
                    errors[type(e).__name__] += 1
                    continue
                truth.add(seq.key, 0, k, v)
                truth.check(out, q, seq.key, 0)
                answers_after_kill += killed_before_sweep
            sweeps_after_kill += killed_before_sweep
        killer.join()
    assert sweeps_after_kill == 2, "the client never finished two sweeps after the kill"
    assert errors["UnavailableError"] > 0, errors
    assert answers_after_kill >= 2 * 8  # the two live servers' sequences answer every time
