"""SequenceClient over the local socket when a call does not end normally (CPU backend, the real binary): a step
interrupted while its answer is on the way (a signal's exception in the waiting thread) gives the connection up, so
the next steps read their own answers, not the interrupted one's (fp64 reference); a step whose frame is over the
server's --local_max_frame_bytes is refused RESOURCE_EXHAUSTED as the server answered it, not UNAVAILABLE (which
would mark a healthy server down and re-prefill its sequences elsewhere)."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

import flashserve
from conftest import ServerProcess, _stop_and_check, zip_all
from sequences_truth import Truth

pytestmark = pytest.mark.e2e
SHAPE = dict(num_layers=1, heads_q=8, heads_kv=2, head_dim=64, dtype="float16")
FRAME_LIMIT = 256 << 10  # a step of 64 sequences x 16 query rows (1 MiB of q) does not fit


@pytest.fixture(scope="module")
def small_frame_server(flashserve_bin, tmp_path_factory):
    path = os.path.join(tempfile.mkdtemp(prefix="fsi", dir="/tmp"), "fs.sock")  # sun_path: at most 107 bytes
    s = ServerProcess(flashserve_bin, tmp_path_factory.mktemp("seq_local_interrupt"),
                      ["--kv_cache_bytes=67108864", "--kv_page_tokens=16", f"--local_socket={path}",
                       f"--local_max_frame_bytes={FRAME_LIMIT}"], name="seq_local_interrupt").start()
    s.local_path = path
    yield s
    _stop_and_check(s)
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def _client(server):
    return flashserve.SequenceClient(server.address, timeout=30, local_sockets={server.address: server.local_path})


def _steps(client, seqs, truth, n, rows_q=1):
    for _ in range(n):
        qs = [truth.query(rows_q) for _ in seqs]
        kvs = [truth.rows(rows_q) for _ in seqs]
        outs = client.decode_step([(s, 0, q, k, v) for s, q, (k, v) in zip(seqs, qs, kvs)], causal=True)
        for seq, q, (k, v), out in zip_all(seqs, qs, kvs, outs):
            truth.add(seq.key, 0, k, v)
            truth.check(out, q, seq.key, 0)


def _create(client, truth, n, prefix_rows=5):
    seqs = []
    for i in range(n):
        k, v = truth.rows(prefix_rows + i)
        seqs.append(client.create(**SHAPE, prefix={0: (k, v)}))
        truth.add(seqs[-1].key, 0, k, v)
    return seqs


def test_a_step_interrupted_while_its_answer_comes_does_not_shift_later_answers(small_frame_server, rng):
    truth = Truth(rng, SHAPE["heads_q"], SHAPE["heads_kv"], SHAPE["head_dim"], SHAPE["dtype"])
    with _client(small_frame_server) as client:
        seqs = _create(client, truth, 3)
        _steps(client, seqs, truth, 2)
        connection = client._local.connections[small_frame_server.local_path]
        receive = connection._recv

        def interrupted_once(n):  # the step's request is out; its answer is on the way
            connection._recv = receive
            raise KeyboardInterrupt

        connection._recv = interrupted_once
        with pytest.raises(KeyboardInterrupt):
            client.decode_step([(s, 0, truth.query(1), *truth.rows(1)) for s in seqs], causal=True)
        # The interrupted rows may be on the server: the client settles that (re-prefill) and answers right after,
        # each step with its own answer (a kept connection answered every later step with the one before's).
        _steps(client, seqs, truth, 3)
        assert client._local.connections[small_frame_server.local_path] is not connection


def test_a_frame_over_the_servers_limit_is_refused_as_the_server_said(small_frame_server, rng):
    truth = Truth(rng, SHAPE["heads_q"], SHAPE["heads_kv"], SHAPE["head_dim"], SHAPE["dtype"])
    with _client(small_frame_server) as client:
        seqs = _create(client, truth, 64, prefix_rows=1)
        with pytest.raises(flashserve.errors.FlashserveError) as info:
            client.decode_step([(s, 0, truth.query(16)) for s in seqs])  # attend only: nothing appended
        assert info.value.code.name == "RESOURCE_EXHAUSTED", info.value
        assert "local_max_frame_bytes" in str(info.value), info.value
        assert client.stats["unavailable"] == 0 and client.stats["reprefills"] == 0, client.stats
        _steps(client, seqs[:4], truth, 2)  # the endpoint is still up: a small step goes through
