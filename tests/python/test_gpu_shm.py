"""Shared memory on the CUDA backend (Triton's extension): CUDA regions (cudaIpcMemHandle from another process) read
and written in place by the kernel on the same device, system regions page-locked once; answers checked against the
fp64 reference over odd shapes, and the bad cases (bad handle, wrong device, a byte size beyond the allocation).

Skips without an NVIDIA GPU, and without tritonclient's CUDA helpers (cuda-python) in the interop interpreter.
"""

from __future__ import annotations

import json
import subprocess
import textwrap

import numpy as np
import pytest

from conftest import ServerProcess, _stop_and_check
from metrics_helpers import scrape
from test_gpu_e2e import _gpu_present
from test_kserve_shm import COMMON, INFER_SCRIPT, run_client
from test_kserve_tritonclient import interop_python

pytestmark = [pytest.mark.e2e, pytest.mark.gpu]


@pytest.fixture(scope="module")
def cuda_shm_server(flashserve_bin, tmp_path_factory):
    if not _gpu_present():
        pytest.skip("no NVIDIA GPU on this machine (nvidia-smi -L fails): CUDA shared-memory tests skipped")
    probe = subprocess.run([interop_python(), "-c", "import tritonclient.utils.cuda_shared_memory"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip("tritonclient.utils.cuda_shared_memory is not importable (needs cuda-python):\n"
                    + probe.stderr[-500:])
    s = ServerProcess(flashserve_bin, tmp_path_factory.mktemp("cuda_shm_server"),
                      ["--backend=cuda", "--allow_client_shm"], name="cuda_shm_server").start()
    yield s
    _stop_and_check(s)


CUDA_SCRIPT = COMMON + textwrap.dedent("""
    import base64
    import tritonclient.utils.cuda_shared_memory as cudashm
    problems = json.load(open(f"{work}/problems.json"))
    for p in problems:
        mod, client = client_of(p["client"])
        data = np.load(f"{work}/{p['name']}.npz")
        qkv = [data[n].astype(NUMPY[p["datatype"]]) for n in ("Q", "K", "V")]
        b, sq, hq = qkv[0].shape[:3]
        o_bytes, lse_bytes = qkv[0].nbytes, 4 * b * hq * sq
        name = p["name"]
        h_in = cudashm.create_shared_memory_region(f"in-{name}", sum(x.nbytes for x in qkv), 0)
        h_out = cudashm.create_shared_memory_region(f"out-{name}", o_bytes + lse_bytes, 0)
        cudashm.set_shared_memory_region(h_in, qkv)  # back to back from offset 0
        cudashm.set_shared_memory_region(h_out, [np.full((o_bytes + lse_bytes) // 4, np.nan, np.float32)])
        client.register_cuda_shared_memory(f"in-{name}", cudashm.get_raw_handle(h_in), 0,
                                           sum(x.nbytes for x in qkv))
        client.register_cuda_shared_memory(f"out-{name}", cudashm.get_raw_handle(h_out), 0, o_bytes + lse_bytes)
        inputs, at = [], 0
        for n, x in zip(("Q", "K", "V"), qkv):
            i = mod.InferInput(n, list(x.shape), p["datatype"])
            i.set_shared_memory(f"in-{name}", x.nbytes, offset=at)
            at += x.nbytes
            inputs.append(i)
        o = mod.InferRequestedOutput("O")
        o.set_shared_memory(f"out-{name}", o_bytes)
        lse = mod.InferRequestedOutput("LSE")
        lse.set_shared_memory(f"out-{name}", lse_bytes, offset=o_bytes)
        result = client.infer("attention", inputs, outputs=[o, lse],
                              parameters={"causal": p["causal"], "return_lse": True})
        resp = result.get_response()
        params = resp["parameters"] if isinstance(resp, dict) else \\
            {k: v.int64_param for k, v in resp.parameters.items() if v.HasField("int64_param")}
        both = cudashm.get_contents_as_numpy(h_out, np.uint8, (o_bytes + lse_bytes,))
        out = np.frombuffer(both[:o_bytes].tobytes(), NUMPY[p["datatype"]]).reshape(qkv[0].shape)
        lse_v = np.frombuffer(both[o_bytes:].tobytes(), np.float32).reshape(b, hq, sq)
        np.savez(f"{work}/{name}.out.npz", O=out.astype(np.float32), LSE=lse_v)
        report[name] = {"h2d_us": int(params["h2d_us"]), "d2h_us": int(params["d2h_us"])}
        client.unregister_cuda_shared_memory(f"in-{name}")
        client.unregister_cuda_shared_memory(f"out-{name}")
        cudashm.destroy_shared_memory_region(h_in)
        cudashm.destroy_shared_memory_region(h_out)

    # Bad cases: the server refuses them and keeps serving.
    h = cudashm.create_shared_memory_region("bad", 4096, 0)
    good = cudashm.get_raw_handle(h)
    report["random_handle"] = error_of(lambda: http.register_cuda_shared_memory(
        "bad", base64.b64encode(os.urandom(64)), 0, 4096))
    report["short_handle"] = error_of(lambda: grpc.register_cuda_shared_memory(
        "bad", base64.b64encode(b"x" * 10), 0, 4096))
    report["wrong_device"] = error_of(lambda: http.register_cuda_shared_memory("bad", good, 99, 4096))
    report["beyond_allocation"] = error_of(lambda: grpc.register_cuda_shared_memory("bad", good, 0, 1 << 30))
    report["good"] = error_of(lambda: http.register_cuda_shared_memory("bad", good, 0, 4096))
    report["status"] = [r["name"] for r in http.get_cuda_shared_memory_status()]
    report["unregister"] = error_of(lambda: grpc.unregister_cuda_shared_memory())
    cudashm.destroy_shared_memory_region(h)
    report["live"] = http.is_server_live() and http.is_server_ready()
    json.dump(report, open(f"{work}/report.json", "w"))
""")


def test_cuda_shm_in_place_matches_reference(cuda_shm_server, rng, make_qkv, check_answer, tmp_path):
    problems, inputs = [], {}
    cases = [("http", "FP16", (1, 37, 53, 4, 2, 64)), ("grpc", "BF16", (2, 19, 19, 3, 1, 128)),
             ("grpc", "FP16", (1, 2048, 2048, 16, 16, 128))]  # the last: a copy would show in h2d_us
    for n, (client, datatype, shape) in enumerate(cases):
        dtype = {"FP16": "float16", "BF16": "bfloat16"}[datatype]
        q, k, v = make_qkv(rng, *shape, dtype)
        name = f"cuda{n}{client}"
        inputs[name] = (q, k, v, n % 2 == 0)
        np.savez(tmp_path / f"{name}.npz", Q=q.astype(np.float32), K=k.astype(np.float32), V=v.astype(np.float32))
        problems.append({"name": name, "client": client, "datatype": datatype, "causal": n % 2 == 0})
    (tmp_path / "problems.json").write_text(json.dumps(problems))
    before = scrape(f"http://127.0.0.1:{cuda_shm_server.metrics_port}/metrics")
    r = run_client(CUDA_SCRIPT, cuda_shm_server, tmp_path, timeout=300)
    for p in problems:
        q, k, v, causal = inputs[p["name"]]
        got = np.load(tmp_path / f"{p['name']}.out.npz")
        check_answer(got["O"].astype(q.dtype), got["LSE"], q, k, v, causal=causal)
    # 24 MiB of inputs would take hundreds of microseconds to copy: on the same device nothing is copied.
    big = r[problems[-1]["name"]]
    assert big["h2d_us"] < 100 and big["d2h_us"] < 100, big
    after = scrape(f"http://127.0.0.1:{cuda_shm_server.metrics_port}/metrics")
    assert after.value("flashserve_request_inputs_total", path="shm_cuda") - \
        before.value("flashserve_request_inputs_total", path="shm_cuda") == len(problems)
    assert "raw_handle" in r["random_handle"], r["random_handle"]
    assert "cudaIpcMemHandle has 64" in r["short_handle"], r["short_handle"]
    assert "not a device of this server" in r["wrong_device"], r["wrong_device"]
    assert "allocation has" in r["beyond_allocation"], r["beyond_allocation"]
    assert r["good"] is None and r["status"] == ["bad"] and r["unregister"] is None
    assert r["live"]


def test_system_shm_on_cuda_matches_reference(cuda_shm_server, rng, make_qkv, check_answer, tmp_path):
    """System regions on the CUDA backend: page-locked at registration, DMA'd as they lie (aligned or not)."""
    problems, inputs = [], {}
    for n, (client, datatype, pad) in enumerate([("http", "FP16", 0), ("grpc", "BF16", 2), ("grpc", "FP16", 0)]):
        dtype = {"FP16": "float16", "BF16": "bfloat16"}[datatype]
        q, k, v = make_qkv(rng, 1, 29 + n, 41, 4, 2, 64, dtype)
        name = f"sys{n}{client}"
        inputs[name] = (q, k, v, n == 1)
        np.savez(tmp_path / f"{name}.npz", Q=q.astype(np.float32), K=k.astype(np.float32), V=v.astype(np.float32))
        problems.append({"name": name, "client": client, "datatype": datatype, "causal": n == 1, "pad": pad,
                         "q_inline": n == 2})
    (tmp_path / "problems.json").write_text(json.dumps(problems))
    run_client(INFER_SCRIPT, cuda_shm_server, tmp_path)
    for p in problems:
        q, k, v, causal = inputs[p["name"]]
        got = np.load(tmp_path / f"{p['name']}.out.npz")
        check_answer(got["O"].astype(q.dtype), got["LSE"], q, k, v, causal=causal)


def test_torch_cuda_tensors_go_by_cuda_ipc(cuda_shm_server, rng, make_qkv, check_answer):
    """flashserve.Client with torch CUDA tensors: q, k, v and O by CUDA IPC (no bytes on the socket, O lands in a
    tensor on q's device); cuda_ipc=False sends them by value. Both against the fp64 reference."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    import flashserve

    q, k, v = make_qkv(rng, 1, 77, 131, 8, 2, 128, "float16")
    tq, tk, tv = (torch.from_numpy(x).cuda() for x in (q, k, v))
    url = f"http://127.0.0.1:{cuda_shm_server.metrics_port}/metrics"
    for ipc in (True, False):
        before = scrape(url).value("flashserve_request_inputs_total", path="shm_cuda")
        with flashserve.Client(cuda_shm_server.address, timeout=60, cuda_ipc=ipc) as c:
            out, lse = c.attention(tq, tk, tv, causal=True, return_lse=True)
            assert out.is_cuda and out.device == tq.device
            check_answer(out.cpu().numpy(), lse.cpu().numpy(), q, k, v, causal=True)
        counted = scrape(url).value("flashserve_request_inputs_total", path="shm_cuda") - before
        assert counted == (1 if ipc else 0), (ipc, counted)
