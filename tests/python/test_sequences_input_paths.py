"""flashserve_request_inputs_total{path} for Sequences calls (CPU backend, the real binary), over gRPC and over the
local socket: a DecodeStep that reads q/k/v from a client's system region counts once in path="shm_system" (however
many items and tensors name the region), as an Attention call does; rows carried in the message (inline DecodeSteps,
every Attend) and refused calls count in no path. README "Sequences" says what counts."""

from __future__ import annotations

import shutil
import tempfile

import grpc
import numpy as np
import pytest

import flashserve
from flashserve import sequences_pb2 as spb
from flashserve import tensors
from flashserve.local import LocalClient
from conftest import ServerProcess, _stop_and_check, zip_all
from metrics_helpers import scrape
from sequences_truth import Truth
from test_sequences_shm import Region, _step_request

pytestmark = pytest.mark.e2e
INPUTS = "flashserve_request_inputs_total"
PATHS = ("in_place", "copied", "shm_system", "shm_cuda")
SHAPE = dict(heads_q=4, heads_kv=2, head_dim=64)


@pytest.fixture(scope="module")
def server(flashserve_bin, tmp_path_factory):
    directory = tempfile.mkdtemp(prefix="fsp", dir="/tmp")  # short: sun_path holds 107 bytes
    s = ServerProcess(flashserve_bin, tmp_path_factory.mktemp("paths"),
                      [f"--local_socket={directory}/fs.sock", "--allow_client_shm", "--kv_cache_bytes=33554432",
                       "--kv_page_tokens=16"], name="paths").start()
    s.local_path = f"{directory}/fs.sock"
    yield s
    _stop_and_check(s)
    shutil.rmtree(directory, ignore_errors=True)


def _paths(server) -> dict:
    m = scrape(f"http://127.0.0.1:{server.metrics_port}/metrics")
    return {path: m.value(INPUTS, path=path) for path in PATHS}


def _counted(server, call) -> dict:
    """The paths that `call()` moved, and by how much."""
    before = _paths(server)
    call()
    after = _paths(server)
    return {path: after[path] - before[path] for path in PATHS if after[path] != before[path]}


@pytest.mark.parametrize("transport", ["grpc", "local"])
def test_sequences_calls_count_their_input_paths(server, rng, transport):
    truth = Truth(rng, **SHAPE, dtype="float16")
    region = Region(server, f"paths-{transport}", 1 << 20)
    try:
        with flashserve.SequenceClient(server.address, timeout=30, reprefill=False) as client, \
                LocalClient(server.local_path, timeout=30) as local:
            stub = client.stub(client.endpoints[0])
            decode_step = (lambda r: stub.DecodeStep(r, timeout=30)) if transport == "grpc" else local.decode_step
            attend = (lambda r: stub.Attend(r, timeout=30)) if transport == "grpc" else local.attend
            seqs = []
            for n in (3, 20):
                k, v = truth.rows(n)
                seqs.append(client.create(num_layers=1, **SHAPE, dtype="float16", prefix={0: (k, v)}))
                truth.add(seqs[-1].key, 0, k, v)

            def step(in_shm):
                """One DecodeStep of one new row per sequence; item i's q/k/v (and O) in the region when in_shm[i]."""
                region.at, region.buf[:] = 0, 0xFF
                qs, kvs = [truth.query(1) for _ in seqs], [truth.rows(1) for _ in seqs]
                request, outs = _step_request(region, seqs, qs, kvs, in_shm, return_lse=False)
                response = decode_step(request)
                for seq, q, (k, v), where, result in zip_all(seqs, qs, kvs, outs, response.results):
                    truth.add(seq.key, 0, k, v)
                    out = np.frombuffer(result.out.data, np.float16).reshape(q.shape) if where is None \
                        else region.read(where[0], np.float16, q.shape)
                    truth.check(out, q, seq.key, 0)

            # Six tensors of two items in one region: one count for the call.
            assert _counted(server, lambda: step([True, True])) == {"shm_system": 1}
            assert _counted(server, lambda: step([False, True])) == {"shm_system": 1}
            assert _counted(server, lambda: step([False, False])) == {}

            q = truth.query(2)
            request = spb.AttendRequest(sequence_id=seqs[0].id, layer=0, q=tensors.to_proto_rows(q, "q"))
            assert _counted(server, lambda: truth.check(
                np.frombuffer(attend(request).out.data, np.float16).reshape(q.shape), q, seqs[0].key, 0)) == {}

            def refused():  # O over q: refused before the runtime sees it
                region.at = 0
                request, _ = _step_request(region, seqs[:1], [truth.query(1)], [truth.rows(1)], [True], False)
                request.items[0].out_shm.offset = request.items[0].q.shm.offset
                with pytest.raises((grpc.RpcError, flashserve.FlashserveError), match="overlaps"):
                    decode_step(request)
            assert _counted(server, refused) == {}
    finally:
        region.close()
