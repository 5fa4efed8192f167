"""A shared-memory output (O, LSE) that shares a byte with another tensor of its request is refused, whatever names
the memory was registered under, on every transport that resolves references: native Attention (gRPC and the local
socket), KServe (REST and gRPC ModelInfer) and DecodeStep; the refusal leaves the region as it was. An output that
starts exactly where an input ends is accepted and right (fp64 reference). Before the check the server answered OK
with a wrong O: the kernel still read K, V or Q where it had already written O."""

from __future__ import annotations

import importlib
import itertools
import json
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from multiprocessing import shared_memory

import grpc
import numpy as np
import pytest

import flashserve
from flashserve import attention_pb2 as pb
from flashserve import attention_pb2_grpc, tensors
from flashserve import sequences_pb2 as spb
from flashserve.local import ATTENTION, LocalClient
from conftest import REPO_ROOT, ServerProcess, _stop_and_check, assert_matches_reference
from sequences_truth import Truth

pytestmark = pytest.mark.e2e

if "shm" not in pb.Tensor.DESCRIPTOR.fields_by_name or spb is None:
    pytest.skip("the imported flashserve client predates Tensor.shm (run with PYTHONPATH=client/python of this tree)",
                allow_module_level=True)

SHAPE = (1, 256, 2, 64)  # q, k and v: [batch, seqlen, heads, head_dim], float16
NB = int(np.prod(SHAPE)) * 2  # bytes of each
LSE_BYTES = 4 * SHAPE[0] * SHAPE[2] * SHAPE[1]
KV_FLAGS = ["--kv_cache_bytes=33554432", "--kv_page_tokens=16"]
_NAMES = itertools.count()  # region names unique within the module's server


@pytest.fixture(scope="module")
def overlap_server(flashserve_bin, tmp_path_factory):
    directory = tempfile.mkdtemp(prefix="fsl", dir="/tmp")  # short: sun_path holds 107 bytes
    s = ServerProcess(flashserve_bin, tmp_path_factory.mktemp("shm_overlap"),
                      ["--allow_client_shm", f"--local_socket={directory}/fs.sock", *KV_FLAGS],
                      name="shm_overlap").start()
    s.local_path = f"{directory}/fs.sock"
    yield s
    _stop_and_check(s)
    shutil.rmtree(directory, ignore_errors=True)


def post(server, path: str, body: dict) -> None:
    req = urllib.request.Request(f"{server.http}{path}", data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200


class Object:
    """A POSIX shared-memory object, poisoned (NaN in every float type), registered under several names."""

    def __init__(self, server, size: int):
        self.server, self.names = server, []
        self.shm = shared_memory.SharedMemory(create=True, size=size)
        self.buf = np.frombuffer(self.shm.buf, np.uint8)
        self.buf[:] = 0xFF

    def register(self, name: str, offset: int = 0) -> str:
        post(self.server, f"/v2/systemsharedmemory/region/{name}/register",
             {"key": "/" + self.shm.name, "offset": offset, "byte_size": self.shm.size - offset})
        self.names.append(name)
        return name

    def put(self, at: int, x) -> None:
        raw = np.frombuffer(np.ascontiguousarray(x).tobytes(), np.uint8)
        self.buf[at:at + raw.size] = raw

    def read(self, at: int, dtype, shape) -> np.ndarray:
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return np.frombuffer(self.buf[at:at + n].tobytes(), dtype).reshape(shape)

    def close(self) -> None:
        for name in self.names:
            post(self.server, f"/v2/systemsharedmemory/region/{name}/unregister", {})
        del self.buf
        self.shm.close()
        self.shm.unlink()


@pytest.fixture
def qkv_object(overlap_server, rng):
    """Fresh q|k|v at 0|NB|2NB of an 8*NB object registered as "<test>"; (object, name, (q, k, v))."""
    obj = Object(overlap_server, 8 * NB)
    qkv = [rng.standard_normal(SHAPE).astype(np.float16) for _ in range(3)]
    for i, x in enumerate(qkv):
        obj.put(i * NB, x)
    try:
        yield obj, obj.register(f"ov{next(_NAMES)}"), qkv
    finally:
        obj.close()


# --- native Attention ----------------------------------------------------------------------------------------------


def native_request(name, out, lse) -> pb.AttentionRequest:
    """q/k/v in region `name` at 0/NB/2NB; out, lse: (region, offset) or None."""
    request = pb.AttentionRequest(return_lse=lse is not None)
    for i, field in enumerate(("q", "k", "v")):
        t = getattr(request, field)
        t.dtype, t.shape[:] = pb.FLOAT16, list(SHAPE)
        t.shm.CopyFrom(pb.SharedMemoryRef(region=name, offset=i * NB, byte_size=NB))
    if out is not None:
        request.out_shm.CopyFrom(pb.SharedMemoryRef(region=out[0], offset=out[1], byte_size=NB))
    if lse is not None:
        request.lse_shm.CopyFrom(pb.SharedMemoryRef(region=lse[0], offset=lse[1], byte_size=LSE_BYTES))
    return request


def native_call(server, transport: str, request: pb.AttentionRequest):
    """None when answered OK, else (code, message)."""
    if transport == "grpc":
        with grpc.insecure_channel(server.address) as channel:
            try:
                attention_pb2_grpc.AttentionServiceStub(channel).Attention(request, timeout=60)
            except grpc.RpcError as e:
                return e.code(), e.details()
        return None
    with LocalClient(server.local_path, timeout=60) as client:
        try:
            client.call(ATTENTION, request.SerializeToString())
        except flashserve.FlashserveError as e:
            return e.code, e.message
    return None


# (what, out, lse, words of the message): out / lse as (region, offset); "" is the test's region, "alias" another
# name for the same object registered at offset ALIAS_AT.
ALIAS_AT = NB + 512
REFUSED = [
    ("O over the second half of Q", ("", NB // 2), None,
     [f'O (region "@", offset {NB // 2}, {NB} bytes) overlaps Q (region "@", offset 0, {NB} bytes)']),
    ("O exactly Q", ("", 0), None, ["O (region", "overlaps Q"]),
    ("O over K", ("", NB), None, ["overlaps K"]),
    ("O over V", ("", 2 * NB + NB // 2), None, ["overlaps V"]),
    ("LSE over V", None, ("", 3 * NB - 8), ["LSE (region", "overlaps V"]),
    ("O over LSE", ("", 3 * NB), ("", 4 * NB - 64), ["O (region", "overlaps LSE"]),
    ("O over K through an alias", ("alias", 0), None,
     [f'O (region "alias@", offset 0, {NB} bytes) overlaps K (region "@", offset {NB}', "same shared memory"]),
    ("LSE over O through an alias", ("", 3 * NB), ("alias", 3 * NB + 100 - ALIAS_AT),
     [f'O (region "@", offset {3 * NB}, {NB} bytes) overlaps LSE (region "alias@", offset {2 * NB - 412}',
      "same shared memory"]),
]


def resolve(place, name):
    return None if place is None else ((place[0] + name) if place[0] else name, place[1])


@pytest.mark.parametrize("transport", ["grpc", "local"])
@pytest.mark.parametrize("what,out,lse,words", REFUSED, ids=[c[0] for c in REFUSED])
def test_native_output_overlap_is_refused(overlap_server, qkv_object, transport, what, out, lse, words):
    obj, name, _ = qkv_object
    obj.register("alias" + name, ALIAS_AT)
    before = obj.buf.copy()
    refused = native_call(overlap_server, transport, native_request(name, resolve(out, name), resolve(lse, name)))
    assert refused is not None, f"{what}: answered OK"
    code, message = refused
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, message)
    for word in words:
        assert word.replace("@", name) in message, message
    assert np.array_equal(obj.buf, before), "a refused request wrote into the region"


@pytest.mark.parametrize("transport", ["grpc", "local"])
@pytest.mark.parametrize("via_alias", [False, True])
def test_native_outputs_right_after_the_inputs_are_accepted(overlap_server, qkv_object, transport, via_alias):
    obj, name, (q, k, v) = qkv_object
    if via_alias:  # O and LSE named from another registration that starts where V ends
        tail = obj.register("tail" + name, 3 * NB)
        out, lse = (tail, 0), (tail, NB)
    else:
        out, lse = (name, 3 * NB), (name, 4 * NB)
    assert native_call(overlap_server, transport, native_request(name, out, lse)) is None
    got = obj.read(3 * NB, np.float16, SHAPE)
    got_lse = obj.read(4 * NB, np.float32, (SHAPE[0], SHAPE[2], SHAPE[1]))
    assert_matches_reference(got, got_lse, q, k, v)
    for i, x in enumerate((q, k, v)):  # the inputs are as they were
        assert np.array_equal(obj.read(i * NB, np.float16, SHAPE).view(np.uint16), x.view(np.uint16))


# --- KServe (REST and gRPC ModelInfer) -----------------------------------------------------------------------------


def shm_params(region, offset, nbytes) -> dict:
    return {"shared_memory_region": region, "shared_memory_offset": offset, "shared_memory_byte_size": nbytes}


def rest_infer(server, name, out, lse):
    """None when answered OK, else (code, message); the inputs as native_request lays them out."""
    body = {"inputs": [{"name": n, "shape": list(SHAPE), "datatype": "FP16", "parameters": shm_params(name, i * NB, NB)}
                       for i, n in enumerate(("Q", "K", "V"))],
            "outputs": [{"name": "O", "parameters": shm_params(*out, NB)},
                        {"name": "LSE", "parameters": shm_params(*lse, LSE_BYTES)}]}
    req = urllib.request.Request(f"{server.http}/v2/models/attention/infer", data=json.dumps(body).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60):
            return None
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())["error"]


@pytest.fixture(scope="module")
def oip(tmp_path_factory):
    """KServe gRPC stubs (pb2, pb2_grpc), generated from our .proto as test_kserve_grpc.py does."""
    pytest.importorskip("grpc_tools", reason="grpcio-tools (a dependency of flashserve) is not installed")
    proto = REPO_ROOT / "proto" / "inference" / "open_inference_grpc.proto"
    out = tmp_path_factory.mktemp("oip_stubs_overlap")
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{proto.parents[1]}", f"--python_out={out}",
                    f"--grpc_python_out={out}", str(proto)], check=True)
    sys.path.insert(0, str(out))
    try:
        return (importlib.import_module("inference.open_inference_grpc_pb2"),
                importlib.import_module("inference.open_inference_grpc_pb2_grpc"))
    finally:
        sys.path.remove(str(out))


def grpc_infer(oip, server, name, out, lse):
    pb2, pb2_grpc = oip

    def params(message, region, offset, nbytes):
        message.parameters["shared_memory_region"].string_param = region
        message.parameters["shared_memory_offset"].int64_param = offset
        message.parameters["shared_memory_byte_size"].int64_param = nbytes

    request = pb2.ModelInferRequest(model_name="attention")
    for i, n in enumerate(("Q", "K", "V")):
        params(request.inputs.add(name=n, datatype="FP16", shape=list(SHAPE)), name, i * NB, NB)
    params(request.outputs.add(name="O"), *out, NB)
    params(request.outputs.add(name="LSE"), *lse, LSE_BYTES)
    with grpc.insecure_channel(server.address) as channel:
        try:
            pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=60)
        except grpc.RpcError as e:
            return e.code(), e.details()
    return None


@pytest.mark.parametrize("transport", ["rest", "grpc"])
def test_kserve_output_overlap_is_refused_and_adjacent_accepted(overlap_server, qkv_object, oip, transport):
    obj, name, (q, k, v) = qkv_object
    alias = obj.register("alias" + name, ALIAS_AT)

    def infer(out, lse):
        return rest_infer(overlap_server, name, out, lse) if transport == "rest" else \
            grpc_infer(oip, overlap_server, name, out, lse)

    refused_code = 400 if transport == "rest" else grpc.StatusCode.INVALID_ARGUMENT
    before = obj.buf.copy()
    for out, lse, words in [((name, NB), (name, 4 * NB), ["O (region", "overlaps K"]),
                            ((name, 3 * NB), (name, 2 * NB + 100), ["LSE (region", "overlaps V"]),
                            ((alias, NB), (name, 4 * NB), ["O (region \"alias", "overlaps V", "same shared memory"])]:
        refused = infer(out, lse)
        assert refused is not None and refused[0] == refused_code, (out, lse, refused)
        for word in words:
            assert word in refused[1], refused[1]
        assert np.array_equal(obj.buf, before), "a refused request wrote into the region"
    assert infer((name, 3 * NB), (name, 4 * NB)) is None
    assert_matches_reference(obj.read(3 * NB, np.float16, SHAPE),
                             obj.read(4 * NB, np.float32, (SHAPE[0], SHAPE[2], SHAPE[1])), q, k, v)


# --- DecodeStep ----------------------------------------------------------------------------------------------------

SEQ_SHAPE = dict(heads_q=4, heads_kv=2, head_dim=64)


def _shm_tensor(x, region, offset) -> pb.Tensor:
    t = pb.Tensor(dtype=tensors.to_proto_rows(x, "x").dtype, shape=list(x.shape))
    t.shm.CopyFrom(pb.SharedMemoryRef(region=region, offset=offset, byte_size=x.nbytes))
    return t


def test_decode_step_output_over_an_alias_is_refused(overlap_server, rng):
    """Item 0's O named through a second registration of the object, over item 1's q: refused, nothing appended;
    the same step with the outputs right after the inputs (through that name) is accepted and right."""
    truth = Truth(rng, **SEQ_SHAPE, dtype="float16")
    obj = Object(overlap_server, 1 << 16)
    try:
        region = obj.register("e1")
        with flashserve.SequenceClient(overlap_server.address, timeout=30, reprefill=False) as client:
            seqs = truth.create(client, (3, 9))
            stub = client.stub(client.endpoints[0])
            qs = [truth.query() for _ in seqs]
            kvs = [truth.rows(1) for _ in seqs]
            request, at, q_at = spb.DecodeStepRequest(), 0, []
            for seq, q, (k, v) in zip(seqs, qs, kvs):
                item = request.items.add(sequence_id=seq.id, layer=0)
                q_at.append(at)
                for field, x in (("q", q), ("k", k), ("v", v)):
                    obj.put(at, x)
                    getattr(item, field).CopyFrom(_shm_tensor(x, region, at))
                    at += x.nbytes
            alias_at = q_at[1] - 64  # the alias starts inside item 0's v: absolute offsets must be compared
            alias = obj.register("e1alias", alias_at)
            request.items[0].out_shm.CopyFrom(pb.SharedMemoryRef(region=alias, offset=64, byte_size=qs[0].nbytes))
            before = obj.buf.copy()
            with pytest.raises(grpc.RpcError) as e:
                stub.DecodeStep(request, timeout=30)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
            assert 'out_shm (region "e1alias", offset 64' in e.value.details(), e.value.details()
            assert 'overlaps q (region "e1", offset ' + str(q_at[1]) in e.value.details(), e.value.details()
            assert np.array_equal(obj.buf, before)
            for seq in seqs:  # nothing appended
                assert list(seq.info().layer_lengths) == [truth.length(seq.key, 0)]

            outs = []
            for i, q in enumerate(qs):  # right after the inputs, named through the alias
                outs.append(at)
                request.items[i].out_shm.CopyFrom(pb.SharedMemoryRef(region=alias, offset=at - alias_at,
                                                                     byte_size=q.nbytes))
                at += q.nbytes
            response = stub.DecodeStep(request, timeout=30)
            for seq, q, (k, v), out, result in zip(seqs, qs, kvs, outs, response.results):
                truth.add(seq.key, 0, k, v)
                assert result.length == truth.length(seq.key, 0)
                truth.check(obj.read(out, np.float16, q.shape), q, seq.key, 0)
    finally:
        obj.close()
