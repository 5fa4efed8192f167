"""Native Attention on the CUDA backend with some inputs in a client's CUDA region and the others inline: the inline
ones are staged, the region's read where they are (a host copy of device memory killed the server with SIGSEGV);
O and LSE outputs in a CUDA region must suit the kernel's stores (LSE at a multiple of 4 bytes), else
INVALID_ARGUMENT -- a misaligned LSE store faulted the GPU and the backend answered UNAVAILABLE ever after. Regions
are torch CUDA tensors named by CUDA IPC (flashserve.shm.TorchCudaIpc); every answer against the fp64 reference."""

from __future__ import annotations

import numpy as np
import pytest

import flashserve
from conftest import ServerProcess, _stop_and_check
from flashserve._pb import attention_pb2 as pb
from flashserve.shm import TorchCudaIpc
from test_gpu_e2e import _gpu_present


# Inline tensors land in the page-locked receive arena (read as they lie) or, without it, in pageable memory (staged
# through the pinned pool: the case that copied the region's device memory on the host).
@pytest.fixture(scope="module", params=[[], ["--receive_arena_bytes=0"]], ids=["arena", "no_arena"])
def cuda_server(request, flashserve_bin, tmp_path_factory):
    if not _gpu_present():
        pytest.skip("no NVIDIA GPU on this machine (nvidia-smi -L fails): CUDA region tests skipped")
    s = ServerProcess(flashserve_bin, tmp_path_factory.mktemp("mixed_inputs"),
                      ["--backend=cuda", "--allow_client_shm", *request.param], name="mixed_inputs").start()
    yield s
    _stop_and_check(s)


@pytest.fixture(scope="module")
def torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    return torch


def _request(q, k, v, return_lse=True):
    """The native request with every tensor inline (as the client would send it by value)."""
    request = pb.AttentionRequest(causal=True, return_lse=return_lse)
    for field, x in (("q", q), ("k", k), ("v", v)):
        t = getattr(request, field)
        t.dtype, t.data = pb.FLOAT16, x.tobytes()
        t.shape.extend(x.shape)
    return request


@pytest.mark.parametrize("in_region", ["q", "k", "kv"])
def test_inputs_partly_in_a_cuda_region(cuda_server, torch, rng, make_qkv, check_answer, in_region):
    q, k, v = make_qkv(rng, 2, 37, 61, 4, 2, 64, "float16")
    with flashserve.Client(cuda_server.address, timeout=60) as client:
        ipc = TorchCudaIpc(client)
        request = _request(q, k, v)
        kept = []
        for field, x in (("q", q), ("k", k), ("v", v)):
            if field in in_region:
                t = torch.from_numpy(x).cuda()
                kept.append(t)
                msg = getattr(request, field)
                msg.ClearField("data")
                msg.shm.CopyFrom(ipc._name(t))
        torch.cuda.synchronize()
        response = client._stub.Attention(request, timeout=60)
        out = np.frombuffer(response.out.data, np.float16).reshape(q.shape)
        lse = np.frombuffer(response.lse.data, np.float32).reshape(q.shape[0], q.shape[2], q.shape[1])
        check_answer(out, lse, q, k, v, causal=True)
        ipc.close()
        assert client.server_info().backend == "cuda"  # still serving


def test_outputs_in_a_cuda_region_must_suit_the_kernels_stores(cuda_server, torch, rng, make_qkv, check_answer):
    q, k, v = make_qkv(rng, 1, 33, 50, 4, 2, 64, "float16")
    lse_bytes = 4 * q.shape[0] * q.shape[2] * q.shape[1]
    with flashserve.Client(cuda_server.address, timeout=60) as client:
        ipc = TorchCudaIpc(client)
        space = torch.full((q.nbytes + lse_bytes + 64,), 255, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        for o_at, lse_at, ok in ((0, q.nbytes, True), (0, q.nbytes + 2, False), (8, q.nbytes + 16, False),
                                 (16, q.nbytes + 20, True)):
            request = _request(q, k, v)
            base = ipc._name(space)
            request.out_shm.CopyFrom(pb.SharedMemoryRef(region=base.region, offset=base.offset + o_at,
                                                        byte_size=q.nbytes))
            request.lse_shm.CopyFrom(pb.SharedMemoryRef(region=base.region, offset=base.offset + lse_at,
                                                        byte_size=lse_bytes))
            if not ok:
                with pytest.raises(Exception) as info:
                    client._stub.Attention(request, timeout=60)
                assert info.value.code().name == "INVALID_ARGUMENT", info.value
                assert "multiple of" in info.value.details(), info.value.details()
                continue
            client._stub.Attention(request, timeout=60)
            torch.cuda.synchronize()
            raw = space.cpu().numpy()
            out = np.frombuffer(raw[o_at:o_at + q.nbytes].tobytes(), np.float16).reshape(q.shape)
            lse = np.frombuffer(raw[lse_at:lse_at + lse_bytes].tobytes(), np.float32).reshape(
                q.shape[0], q.shape[2], q.shape[1])
            check_answer(out, lse, q, k, v, causal=True)
        ipc.close()
        # The misaligned requests were refused before the GPU ran anything: it still serves.
        out = client.attention(q, k, v, causal=True)
        check_answer(out, None, q, k, v, causal=True)


@pytest.mark.parametrize("inputs_inline", [True, False], ids=["inline", "in_region"])
def test_outputs_in_a_system_region_leave_the_bytes_between_them(cuda_server, rng, make_qkv, check_answer,
                                                                   inputs_inline):
    """O and LSE in a client's system region with LSE where the device buffer has it (O's size rounded up to 256
    bytes): the bytes between them are the client's, not padding. One DMA of O through LSE overwrote them."""
    from flashserve.shm import SystemRegion
    q, k, v = make_qkv(rng, 1, 33, 50, 3, 1, 64, "float16")  # O: 12,672 bytes, a 128-byte gap to 12,800
    lse_bytes = 4 * q.shape[0] * q.shape[2] * q.shape[1]
    lse_at = -(-q.nbytes // 256) * 256
    gap = lse_at - q.nbytes
    assert gap > 0
    inputs_at = lse_at + lse_bytes + 64
    with flashserve.Client(cuda_server.address, timeout=60) as client, \
            SystemRegion(client, "gap", inputs_at + q.nbytes + 2 * k.nbytes + 64) as region:
        sentinel = rng.integers(0, 256, gap, dtype=np.uint8).tobytes()
        for _ in range(3):
            region.write(np.full(q.nbytes, 0xFF, np.uint8).tobytes(), 0)  # poisoned: NaN halves
            region.write(sentinel, q.nbytes)
            request = _request(q, k, v)
            if not inputs_inline:
                at = inputs_at
                for field, x in (("q", q), ("k", k), ("v", v)):
                    msg = getattr(request, field)
                    msg.ClearField("data")
                    msg.shm.CopyFrom(region.write(x.tobytes(), at))
                    at += -(-x.nbytes // 64) * 64
            request.out_shm.CopyFrom(region.ref(0, q.nbytes))
            request.lse_shm.CopyFrom(region.ref(lse_at, lse_bytes))
            client._stub.Attention(request, timeout=60)
            assert region.read(q.nbytes, gap) == sentinel, "the bytes between O and LSE were overwritten"
            out = np.frombuffer(region.read(0, q.nbytes), np.float16).reshape(q.shape)
            lse = np.frombuffer(region.read(lse_at, lse_bytes), np.float32).reshape(
                q.shape[0], q.shape[2], q.shape[1])
            check_answer(out, lse, q, k, v, causal=True)


def test_cuda_ipc_keeps_working_past_the_servers_region_limit(flashserve_bin, tmp_path, torch, rng, make_qkv,
                                                               check_answer):
    """flashserve.Client registers each CUDA allocation its tensors live in as a region and kept them all: past
    --shm_max_regions (5 here) the server refused the next (RESOURCE_EXHAUSTED), the client turned CUDA IPC off and
    then never unregistered the regions it held (close() skipped them). Now the least recently used regions make
    room, every call goes by IPC, and close() gives every region back."""
    import warnings

    from conftest import free_port
    from metrics_helpers import scrape

    port = free_port()
    s = ServerProcess(flashserve_bin, tmp_path, ["--backend=cuda", "--allow_client_shm", "--shm_max_regions=5",
                                                 f"--metrics_port={port}"], name="ipc_regions").start()
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        before = scrape(url).value("flashserve_request_inputs_total", path="shm_cuda")
        kept = []  # every call's tensors stay alive: their allocations stay distinct
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # "CUDA IPC off" would raise here
            with flashserve.Client(s.address, timeout=60) as client:
                for _ in range(6):
                    q, k, v = make_qkv(rng, 1, 2048, 2048, 4, 2, 128, "float16")  # 2 MiB each: own segments
                    tq, tk, tv = (torch.from_numpy(x).cuda() for x in (q, k, v))
                    kept.append((tq, tk, tv))
                    out = client.attention(tq, tk, tv, causal=True)
                    check_answer(out.cpu().numpy(), None, q, k, v, causal=True)
                assert scrape(url).value("flashserve_shm_regions", type="cuda") <= 5
        assert scrape(url).value("flashserve_request_inputs_total", path="shm_cuda") - before == 6
        assert scrape(url).value("flashserve_shm_regions", type="cuda") == 0, "regions left registered after close"
    finally:
        _stop_and_check(s)
