"""A DecodeStep's answer sent from the buffer its outputs were computed into (edge/sequences/answer_buffer.h; CPU
backend, the real binary): with many items the answer is thousands of pieces (more than one sendmsg takes on the
local socket), with and without LSE, mixed with outputs into a region; and a server whose pool is off
(--pinned_pool_bytes=0) puts them into the message instead. Every answer against the fp64 reference, over gRPC and
the local socket."""

from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np
import pytest

import flashserve
from flashserve import sequences_pb2 as spb
from flashserve import tensors
from flashserve.local import LocalClient
from conftest import ServerProcess, _stop_and_check
from sequences_truth import Truth
from test_sequences_shm import Region

pytestmark = pytest.mark.e2e
SHAPE = dict(heads_q=2, heads_kv=1, head_dim=32)
ITEMS = 600  # per item: header, O, LSE header, LSE -> ~2,400 pieces, over IOV_MAX (1024)


@pytest.fixture(scope="module", params=["pool", "no_pool"])
def answer_server(request, flashserve_bin, tmp_path_factory):
    path = os.path.join(tempfile.mkdtemp(prefix="fsa", dir="/tmp"), "fs.sock")  # sun_path: at most 107 bytes
    flags = ["--kv_cache_bytes=67108864", "--kv_page_tokens=16", "--allow_client_shm", f"--local_socket={path}"]
    if request.param == "no_pool":
        flags.append("--pinned_pool_bytes=0")
    s = ServerProcess(flashserve_bin, tmp_path_factory.mktemp(request.param), flags, name=request.param).start()
    s.local_path = path
    yield s
    _stop_and_check(s)
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def _step(seqs, qs, kvs, region, return_lse):
    """Per-item step; every 7th item writes O (and LSE) into `region` instead of the answer."""
    request = spb.DecodeStepRequest(return_lse=return_lse)
    in_region = {}
    for i, (seq, q, (k, v)) in enumerate(zip(seqs, qs, kvs)):
        item = request.items.add(sequence_id=seq.id, layer=0)
        for field, x in (("q", q), ("k", k), ("v", v)):
            getattr(item, field).CopyFrom(tensors.to_proto_rows(x, field))
        if i % 7 == 3:
            item.out_shm.CopyFrom(region.reserve(q.nbytes))
            if return_lse:
                item.lse_shm.CopyFrom(region.reserve(4 * q.shape[0] * q.shape[1]))
            in_region[i] = (item.out_shm, item.lse_shm if return_lse else None)
    return request, in_region


@pytest.mark.parametrize("transport", ["grpc", "local"])
@pytest.mark.parametrize("return_lse", [True, False])
def test_many_item_answers_match_reference(answer_server, rng, transport, return_lse):
    truth = Truth(rng, **SHAPE, dtype="float16")
    region = Region(answer_server, f"answer-{transport}-{return_lse}", 1 << 20)
    local = LocalClient(answer_server.local_path, timeout=60) if transport == "local" else None
    try:
        with flashserve.SequenceClient(answer_server.address, timeout=60, reprefill=False) as client:
            seqs = truth.create(client, [1 + i % 5 for i in range(ITEMS)])
            stub = client.stub(client.endpoints[0])
            for _ in range(2):
                region.reset()
                qs = [truth.query(1 + i % 2) for i in range(ITEMS)]
                kvs = [truth.rows(1) for _ in range(ITEMS)]
                request, in_region = _step(seqs, qs, kvs, region, return_lse)
                response = local.decode_step(request) if local else stub.DecodeStep(request, timeout=60)
                assert len(response.results) == ITEMS
                for i, (seq, q, (k, v), result) in enumerate(zip(seqs, qs, kvs, response.results)):
                    truth.add(seq.key, 0, k, v)
                    assert result.length == truth.length(seq.key, 0)
                    assert result.HasField("lse") == return_lse
                    if i in in_region:
                        assert result.out.data == b"" and list(result.out.shape) == list(q.shape)
                        out_ref, lse_ref = in_region[i]
                        out = region.read(out_ref, np.float16, q.shape)
                        lse = region.read(lse_ref, np.float32, (q.shape[1], q.shape[0])) if return_lse else None
                    else:
                        out = np.frombuffer(result.out.data, np.float16).reshape(q.shape)
                        lse = (np.frombuffer(result.lse.data, np.float32).reshape(q.shape[1], q.shape[0])
                               if return_lse else None)
                    if i % 37 == 0 or i in in_region:  # the fp64 reference on a spread of items
                        truth.check(out, q, seq.key, 0, lse=lse)
                    assert not np.isnan(out.astype(np.float32)).any()
            for seq in seqs:
                client.release(seq)
    finally:
        if local is not None:
            local.close()
        region.close()
