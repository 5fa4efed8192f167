"""DecodeStep with items in a CUDA shared-memory region (a torch CUDA tensor shared by CUDA IPC, on the KV cache's
GPU): the server reads q/k/v and writes O/LSE there on the device. Each tensor of each item is in the CUDA region,
in a system region or in the message, in turns, over many steps (GQA, odd lengths, multi-row causal queries), all
against the fp64 reference with NaN-poisoned outputs. The refusals (sizes, bounds, overlap, a region on another GPU,
CUDA regions on the CPU backend) are clear errors that change nothing. The steps run over gRPC and over the local
socket (both transports resolve regions alike). Skips without an NVIDIA GPU or torch CUDA."""

from __future__ import annotations

import tempfile

import numpy as np
import grpc
import pytest

import flashserve
from flashserve.local import LocalClient
from flashserve import attention_pb2 as pb
from flashserve import sequences_pb2 as spb
from flashserve import tensors
from conftest import ServerProcess, _stop_and_check, zip_all
from sequences_truth import Truth
from test_gpu_e2e import _gpu_present
from test_sequences_shm import Region, _refused, _shm_tensor

pytestmark = [pytest.mark.e2e, pytest.mark.gpu]
KV_FLAGS = ["--kv_cache_bytes=268435456", "--kv_page_tokens=64", "--allow_client_shm"]


def _torch_cuda():
    torch = pytest.importorskip("torch", reason="torch is not installed: CUDA-region Sequences tests skipped")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device: CUDA-region Sequences tests skipped")
    return torch


@pytest.fixture(scope="module")
def server(flashserve_bin, tmp_path_factory):
    if not _gpu_present():
        pytest.skip("no NVIDIA GPU on this machine (nvidia-smi -L fails): CUDA-region Sequences tests skipped")
    _torch_cuda()
    socket_dir = tempfile.mkdtemp(prefix="fsl", dir="/tmp")  # short: sun_path holds 107 bytes
    s = ServerProcess(flashserve_bin, tmp_path_factory.mktemp("kv_cuda_shm"),
                      ["--backend=cuda", f"--local_socket={socket_dir}/fs.sock"] + KV_FLAGS,
                      name="kv_cuda_shm").start()
    s.local_path = f"{socket_dir}/fs.sock"
    yield s
    _stop_and_check(s)


class CudaRegion:
    """A poisoned torch CUDA buffer registered as a CUDA region (flashserve.shm.TorchCudaIpc); put() lays arrays
    out one after another, as Region does for a system region."""

    def __init__(self, server, size: int, device: int = 0):
        from flashserve.shm import TorchCudaIpc

        self.torch = _torch_cuda()
        self.client = flashserve.Client(server.address, timeout=30)
        self.buf = self.torch.full((size,), 0xFF, dtype=self.torch.uint8, device=f"cuda:{device}")
        self.ipc = TorchCudaIpc(self.client)
        self.name, self.base = self.ipc._region(self.buf)
        # The region is the whole device allocation holding buf (torch's caching allocator may make it larger).
        self.region_bytes = self.ipc._allocation(self.buf.data_ptr())[1]
        self.size, self.at = size, 0

    def sync(self) -> None:
        self.torch.cuda.synchronize()  # the server's stream must see this process's writes

    def reset(self) -> None:
        self.buf.fill_(0xFF)  # NaN in every float type
        self.at = 0

    def reserve(self, nbytes: int, align: int = 4) -> pb.SharedMemoryRef:
        self.at = (self.at + align - 1) // align * align
        ref = pb.SharedMemoryRef(region=self.name, offset=self.base + self.at, byte_size=nbytes)
        self.at += nbytes
        return ref

    def put(self, x, align: int = 4) -> pb.SharedMemoryRef:
        raw = np.frombuffer(np.ascontiguousarray(x).tobytes(), np.uint8)
        ref = self.reserve(raw.size, align)
        start = ref.offset - self.base
        self.buf[start:start + raw.size].copy_(self.torch.from_numpy(raw.copy()))
        return ref

    def read(self, ref: pb.SharedMemoryRef, dtype, shape) -> np.ndarray:
        start = ref.offset - self.base
        return self.buf[start:start + ref.byte_size].cpu().numpy().view(dtype).reshape(shape).copy()

    def close(self) -> None:
        self.ipc.close()
        self.client.close()


PLACES = ("cuda", "system", "inline")


def _place_input(item, field, x, where, regions):
    if where == "inline":
        getattr(item, field).CopyFrom(tensors.to_proto_rows(x, field))
    elif where == "cuda":  # 2-byte aligned: the device copies handle any alignment
        getattr(item, field).CopyFrom(_shm_tensor(x, regions[where].put(x, 2)))
    else:
        getattr(item, field).CopyFrom(_shm_tensor(x, regions[where].put(x)))


def _step(stub, regions, seqs, qs, kvs, step, return_lse):
    """One DecodeStep; tensor t of item i in PLACES[(i + t + step) % 3]; returns (out, lse) per item."""
    request = spb.DecodeStepRequest(return_lse=return_lse, causal=qs[0].shape[0] > 1)
    places = []
    for i, (seq, q, (k, v)) in enumerate(zip(seqs, qs, kvs)):
        item = request.items.add(sequence_id=seq.id, layer=0)
        where = [PLACES[(i + t + step) % 3] for t in range(5)]
        for field, x, w in zip(("q", "k", "v"), (q, k, v), where):
            _place_input(item, field, x, w, regions)
        out_ref = lse_ref = None
        if where[3] != "inline":
            out_ref = regions[where[3]].reserve(q.nbytes, 2)
            item.out_shm.CopyFrom(out_ref)
        if return_lse and where[4] != "inline":
            lse_ref = regions[where[4]].reserve(4 * q.shape[0] * q.shape[1])
            item.lse_shm.CopyFrom(lse_ref)
        places.append((where, out_ref, lse_ref))
    regions["cuda"].sync()
    response = stub.DecodeStep(request, timeout=60)
    answers = []
    for q, (where, out_ref, lse_ref), result in zip_all(qs, places, response.results):
        ndt, lse_shape = q.dtype, (q.shape[1], q.shape[0])
        out = regions[where[3]].read(out_ref, ndt, q.shape) if out_ref is not None else \
            np.frombuffer(result.out.data, ndt).reshape(q.shape)
        lse = None
        if return_lse:
            lse = regions[where[4]].read(lse_ref, np.float32, lse_shape) if lse_ref is not None else \
                np.frombuffer(result.lse.data, np.float32).reshape(lse_shape)
        answers.append((out, lse, result.length))
    return answers


class LocalStub:
    """DecodeStep over the local socket with the gRPC stub's call shape (both transports resolve regions alike)."""

    def __init__(self, path: str):
        self.client = LocalClient(path, timeout=60)

    def DecodeStep(self, request, timeout=None):  # noqa: N802 (the stub's name)
        return self.client.decode_step(request)


@pytest.mark.parametrize("transport", ["grpc", "local"])
@pytest.mark.parametrize("dtype,heads,rows_q", [("bfloat16", (32, 8, 128), 1), ("float16", (12, 4, 64), 3)])
def test_decode_steps_through_cuda_region_match_reference(server, rng, dtype, heads, rows_q, transport):
    heads_q, heads_kv, head_dim = heads
    truth = Truth(rng, heads_q, heads_kv, head_dim, dtype)
    regions = {"cuda": CudaRegion(server, 8 << 20), "system": Region(server, f"seqcuda-{dtype}", 8 << 20)}
    try:
        with flashserve.SequenceClient(server.address, timeout=60, reprefill=False) as client:
            seqs = []
            for n in (0, 1, 63, 65, 700):  # empty, page edges, several pages
                k, v = truth.rows(n)
                prefix = {0: (k, v)} if n else None
                seqs.append(client.create(num_layers=1, heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim,
                                          dtype=dtype, prefix=prefix))
                truth.add(seqs[-1].key, 0, k, v)
            stub = client.stub(client.endpoints[0]) if transport == "grpc" else LocalStub(server.local_path)
            for step in range(7):
                regions["cuda"].reset()
                regions["system"].at = 0
                regions["system"].buf[:] = 0xFF
                qs = [truth.query(rows_q) for _ in seqs]
                kvs = [truth.rows(rows_q if step % 3 else 1) for _ in seqs]
                answers = _step(stub, regions, seqs, qs, kvs, step, return_lse=step % 2 == 1)
                for seq, q, (k, v), (out, lse, length) in zip_all(seqs, qs, kvs, answers):
                    truth.add(seq.key, 0, k, v)
                    assert length == truth.length(seq.key, 0)
                    assert not np.isnan(out.astype(np.float32)).any()
                    truth.check(out, q, seq.key, 0, causal=rows_q > 1, lse=lse)
    finally:
        regions["cuda"].close()
        regions["system"].close()


def test_bad_cuda_references_are_refused_and_change_nothing(server, rng):
    truth = Truth(rng, 8, 2, 64, "float16")
    region = CudaRegion(server, 1 << 16)
    try:
        with flashserve.SequenceClient(server.address, timeout=30, reprefill=False) as client:
            k, v = truth.rows(9)
            seq = client.create(num_layers=1, heads_q=8, heads_kv=2, head_dim=64, dtype="float16",
                                prefix={0: (k, v)})
            truth.add(seq.key, 0, k, v)
            stub = client.stub(client.endpoints[0])
            q, (k1, v1) = truth.query(), truth.rows(1)

            def request():
                region.reset()
                r = spb.DecodeStepRequest(return_lse=True)
                item = r.items.add(sequence_id=seq.id, layer=0)
                for field, x in (("q", q), ("k", k1), ("v", v1)):
                    _place_input(item, field, x, "cuda", {"cuda": region})
                item.out_shm.CopyFrom(region.reserve(q.nbytes))
                item.lse_shm.CopyFrom(region.reserve(4 * q.shape[1]))
                return r

            r = request()
            r.items[0].out_shm.byte_size -= 2  # too small for O
            _refused(stub, r, grpc.StatusCode.INVALID_ARGUMENT, "out_shm", "byte_size")
            r = request()
            r.items[0].q.shm.byte_size -= 2  # too small for q's shape
            _refused(stub, r, grpc.StatusCode.INVALID_ARGUMENT, "q:")
            r = request()
            r.items[0].lse_shm.offset += 2  # LSE not 4-byte aligned
            _refused(stub, r, grpc.StatusCode.INVALID_ARGUMENT, "lse_shm")
            r = request()
            r.items[0].out_shm.offset = r.items[0].k.shm.offset  # O over k
            _refused(stub, r, grpc.StatusCode.INVALID_ARGUMENT, "overlaps")
            r = request()
            r.items[0].v.shm.offset = region.region_bytes - 8  # past the region's (the allocation's) end
            _refused(stub, r, grpc.StatusCode.INVALID_ARGUMENT, "v:")
            assert list(seq.info().layer_lengths) == [truth.length(seq.key, 0)]  # nothing appended
            r = request()
            result = stub.DecodeStep(r, timeout=30).results[0]  # and the good one works
            truth.add(seq.key, 0, k1, v1)
            assert result.length == truth.length(seq.key, 0)
            item = r.items[0]
            truth.check(region.read(item.out_shm, np.float16, q.shape), q, seq.key, 0,
                        lse=region.read(item.lse_shm, np.float32, (q.shape[1], 1)))
    finally:
        region.close()


def test_cuda_region_on_another_gpu_is_refused(server, rng):
    torch = _torch_cuda()
    if torch.cuda.device_count() < 2:
        pytest.skip("one GPU: a CUDA region on another device than the KV cache's needs two")
    region = CudaRegion(server, 1 << 16, device=1)
    try:
        truth = Truth(rng, 8, 2, 64, "float16")
        with flashserve.SequenceClient(server.address, timeout=30, reprefill=False) as client:
            seq = client.create(num_layers=1, heads_q=8, heads_kv=2, head_dim=64, dtype="float16")
            r = spb.DecodeStepRequest()
            item = r.items.add(sequence_id=seq.id, layer=0)
            _place_input(item, "q", truth.query(), "cuda", {"cuda": region})
            _refused(client.stub(client.endpoints[0]), r, grpc.StatusCode.FAILED_PRECONDITION, "device 1")
    finally:
        region.close()


def test_cpu_backend_refuses_cuda_regions(flashserve_bin, tmp_path, rng):
    """The CPU backend's KV cache is in host memory: a CUDA region cannot even be registered (a clear error), and a
    DecodeStep naming one is NOT_FOUND; the server keeps serving."""
    if not _gpu_present():
        pytest.skip("no NVIDIA GPU: no CUDA memory to offer the CPU backend")
    torch = _torch_cuda()
    s = ServerProcess(flashserve_bin, tmp_path, ["--backend=cpu"] + KV_FLAGS, name="kv_cpu_cuda").start()
    try:
        with pytest.raises(Exception) as info:
            CudaRegion(s, 1 << 16)
        assert "CUDA backend" in str(info.value), str(info.value)
        truth = Truth(rng, 8, 2, 64, "float16")
        with flashserve.SequenceClient(s.address, timeout=30, reprefill=False) as client:
            seq = client.create(num_layers=1, heads_q=8, heads_kv=2, head_dim=64, dtype="float16")
            q = truth.query()
            r = spb.DecodeStepRequest()
            r.items.add(sequence_id=seq.id, layer=0).q.CopyFrom(
                _shm_tensor(q, pb.SharedMemoryRef(region="never-registered", offset=0, byte_size=q.nbytes)))
            _refused(client.stub(client.endpoints[0]), r, grpc.StatusCode.NOT_FOUND, "q:")
            k, v = truth.rows(3)  # still serving, nothing appended by the refused step
            out = seq.step(0, q, k, v)
            truth.add(seq.key, 0, k, v)
            truth.check(out, q, seq.key, 0)
            assert torch.cuda.is_available()
    finally:
        _stop_and_check(s)
