"""Triton's shared-memory extension (system regions) with tritonclient, HTTP and gRPC, on the CPU backend.

Q, K and V are put into a POSIX shared-memory region with tritonclient.utils.shared_memory, O and LSE are read back
from another one, and the answer is checked against the fp64 reference (odd shapes, each dtype, offsets that are and
are not 16-byte aligned: the backend reads and writes the region in place, or the server stages / copies once).
Then the safety rules: off by default, a missing key, offsets outside a region, a region in use cannot be
unregistered, the limit on regions. tritonclient runs in a child process (see test_kserve_tritonclient.py).
"""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import signal
import subprocess
import textwrap
import threading
import time
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest

from metrics_helpers import scrape
from test_kserve_grpc import DATATYPES, oip, stub_for  # noqa: F401 - oip is a fixture
from test_kserve_tritonclient import interop_python

pytestmark = pytest.mark.e2e

COMMON = textwrap.dedent("""
    import json, os, sys, threading, time
    import ml_dtypes
    import numpy as np
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    import tritonclient.utils.shared_memory as shm
    from tritonclient.utils import InferenceServerException

    http_url, grpc_url, work = sys.argv[1:4]
    NUMPY = {"FP16": np.float16, "BF16": ml_dtypes.bfloat16, "FP32": np.float32}
    http = httpclient.InferenceServerClient(http_url)
    grpc = grpcclient.InferenceServerClient(grpc_url)
    report = {}
    tag = str(os.getpid())

    def client_of(kind):
        return (httpclient, http) if kind == "http" else (grpcclient, grpc)

    def error_of(fn):
        try:
            fn()
        except InferenceServerException as e:
            return str(e)
        return None
""")

INFER_SCRIPT = COMMON + textwrap.dedent("""
    problems = json.load(open(f"{work}/problems.json"))
    report["extensions"] = http.get_server_metadata()["extensions"]
    for p in problems:
        mod, client = client_of(p["client"])
        data = np.load(f"{work}/{p['name']}.npz")
        qkv = [data[n].astype(NUMPY[p["datatype"]]) for n in ("Q", "K", "V")]
        pad = p["pad"]  # bytes before each tensor: 0 keeps 16-byte alignment, 2 breaks it
        offsets, at = [], 0
        for x in qkv:
            at += pad
            offsets.append(at)
            at += x.nbytes
        o_bytes, lse_bytes = qkv[0].nbytes, 4 * qkv[0].shape[0] * qkv[0].shape[2] * qkv[0].shape[1]
        name = p["name"]
        h_in = shm.create_shared_memory_region(f"in-{name}", f"/fs_in_{tag}_{name}", at)
        h_out = shm.create_shared_memory_region(f"out-{name}", f"/fs_out_{tag}_{name}", pad + o_bytes + lse_bytes)
        # Poison the output region: a server that writes nothing there fails the reference check.
        shm.set_shared_memory_region(h_out, [np.full((pad + o_bytes + lse_bytes) // 4, np.nan, np.float32)])
        for x, off in zip(qkv, offsets):
            shm.set_shared_memory_region(h_in, [x], offset=off)
        client.register_system_shared_memory(f"in-{name}", f"/fs_in_{tag}_{name}", at)
        client.register_system_shared_memory(f"out-{name}", f"/fs_out_{tag}_{name}", pad + o_bytes + lse_bytes)
        inputs = []
        for n, x, off in zip(("Q", "K", "V"), qkv, offsets):
            i = mod.InferInput(n, list(x.shape), p["datatype"])
            if n == "Q" and p["q_inline"]:
                i.set_data_from_numpy(x)
            else:
                i.set_shared_memory(f"in-{name}", x.nbytes, offset=off)
            inputs.append(i)
        o = mod.InferRequestedOutput("O")
        o.set_shared_memory(f"out-{name}", o_bytes, offset=pad)
        lse = mod.InferRequestedOutput("LSE")
        lse.set_shared_memory(f"out-{name}", lse_bytes, offset=pad + o_bytes)
        result = client.infer("attention", inputs, outputs=[o, lse],
                              parameters={"causal": p["causal"], "return_lse": True})
        out = shm.get_contents_as_numpy(h_out, NUMPY[p["datatype"]], qkv[0].shape, offset=pad)
        lse_v = shm.get_contents_as_numpy(h_out, np.float32, (qkv[0].shape[0], qkv[0].shape[2], qkv[0].shape[1]),
                                          offset=pad + o_bytes)
        np.savez(f"{work}/{name}.out.npz", O=out.astype(np.float32), LSE=lse_v.copy())
        status = client.get_system_shared_memory_status()
        names = sorted(r["name"] for r in status) if p["client"] == "http" else sorted(status.regions)
        report[name] = {"regions": names}
        client.unregister_system_shared_memory(f"in-{name}")
        client.unregister_system_shared_memory(f"out-{name}")
        shm.destroy_shared_memory_region(h_in)
        shm.destroy_shared_memory_region(h_out)
    report["left"] = len(http.get_system_shared_memory_status())
    json.dump(report, open(f"{work}/report.json", "w"))
""")


def run_client(script: str, server, tmp_path, timeout: float = 180) -> dict:
    python = interop_python()
    probe = subprocess.run([python, "-c", "import tritonclient.http, tritonclient.grpc, ml_dtypes"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"tritonclient[http,grpc] is not importable by {python} (scripts/setup installs it into "
                    ".venv-interop):\n" + probe.stderr[-500:])
    (tmp_path / "client.py").write_text(script)
    run = subprocess.run([python, str(tmp_path / "client.py"), f"127.0.0.1:{server.http_port}", server.address,
                          str(tmp_path)], capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, f"tritonclient run failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}\n{server.logs()}"
    return json.loads((tmp_path / "report.json").read_text())


@pytest.fixture(scope="module")
def shm_server(flashserve_bin, tmp_path_factory):
    from conftest import ServerProcess, _stop_and_check

    s = ServerProcess(flashserve_bin, tmp_path_factory.mktemp("shm_server"),
                      ["--allow_client_shm", "--shm_max_regions=6"], name="shm_server").start()
    yield s
    _stop_and_check(s)


def test_system_shm_matches_reference(shm_server, rng, make_qkv, check_answer, tmp_path):
    problems, inputs = [], {}
    shapes = [(1, 19, 37, 4, 2, 64), (2, 7, 7, 3, 3, 32), (1, 33, 17, 2, 1, 128)]
    cases = [("http", "FP16", 0, False), ("grpc", "BF16", 0, False), ("http", "FP32", 2, False),
             ("grpc", "FP16", 2, True), ("http", "BF16", 0, True), ("grpc", "FP32", 0, False)]
    for n, (client, datatype, pad, q_inline) in enumerate(cases):
        dtype = {"FP16": "float16", "BF16": "bfloat16", "FP32": "float32"}[datatype]
        q, k, v = make_qkv(rng, *shapes[n % len(shapes)], dtype)
        name = f"{client}{n}{datatype.lower()}"
        causal = n % 2 == 1
        inputs[name] = (q, k, v, causal)
        np.savez(tmp_path / f"{name}.npz", Q=q.astype(np.float32), K=k.astype(np.float32), V=v.astype(np.float32))
        problems.append({"name": name, "client": client, "datatype": datatype, "causal": causal, "pad": pad,
                         "q_inline": q_inline})
    (tmp_path / "problems.json").write_text(json.dumps(problems))
    before = scrape(f"http://127.0.0.1:{shm_server.metrics_port}/metrics")
    report = run_client(INFER_SCRIPT, shm_server, tmp_path)

    assert "system_shared_memory" in report["extensions"]  # cuda_shared_memory: with the CUDA backend only
    for p in problems:
        q, k, v, causal = inputs[p["name"]]
        got = np.load(tmp_path / f"{p['name']}.out.npz")
        check_answer(got["O"].astype(q.dtype), got["LSE"], q, k, v, causal=causal)
        assert report[p["name"]]["regions"] == [f"in-{p['name']}", f"out-{p['name']}"]
    assert report["left"] == 0
    after = scrape(f"http://127.0.0.1:{shm_server.metrics_port}/metrics")
    counted = after.value("flashserve_request_inputs_total", path="shm_system") - \
        before.value("flashserve_request_inputs_total", path="shm_system")
    assert counted == len(problems)
    assert after.value("flashserve_shm_regions", type="system") == 0


SAFETY_SCRIPT = COMMON + textwrap.dedent("""
    key = f"/fs_safe_{tag}"
    h = shm.create_shared_memory_region("safe", key, 4096)
    r = report
    r["missing_key"] = error_of(lambda: http.register_system_shared_memory("x", f"/fs_nope_{tag}", 64))
    r["bad_key"] = error_of(lambda: grpc.register_system_shared_memory("x", "/../etc/passwd", 64))
    r["bad_name"] = error_of(lambda: http.register_system_shared_memory("a b", key, 64))
    r["beyond_object"] = error_of(lambda: grpc.register_system_shared_memory("x", key, 64, offset=4090))
    r["overflow"] = error_of(lambda: http.register_system_shared_memory("x", key, 16, offset=2**64 - 8))
    r["too_big"] = error_of(lambda: http.register_system_shared_memory("x", key, 2**64 - 8, offset=16))
    r["zero"] = error_of(lambda: http.register_system_shared_memory("x", key, 0))
    http.register_system_shared_memory("safe", key, 4096)
    r["duplicate"] = error_of(lambda: grpc.register_system_shared_memory("safe", key, 16))
    r["unknown_unregister"] = error_of(lambda: http.unregister_system_shared_memory("nope"))
    r["unknown_status"] = error_of(lambda: grpc.get_system_shared_memory_status("nope"))
    r["cuda_on_cpu"] = error_of(lambda: http.register_cuda_shared_memory("c", "AAAA", 0, 64))
    for i in range(5):  # the limit is 6 regions: "safe" and these five
        http.register_system_shared_memory(f"fill{i}", key, 16)
    r["limit"] = error_of(lambda: grpc.register_system_shared_memory("one-too-many", key, 16))
    for i in range(5):
        http.unregister_system_shared_memory(f"fill{i}")

    def infer(mod, client, q_offset, q_bytes, region="safe", shape=(1, 4, 2, 8)):
        inputs = []
        for n in ("Q", "K", "V"):
            i = mod.InferInput(n, list(shape), "FP32")
            i.set_shared_memory(region, q_bytes if n == "Q" else 4 * int(np.prod(shape)),
                                offset=q_offset if n == "Q" else 0)
            inputs.append(i)
        return client.infer("attention", inputs)
    nbytes = 4 * 1 * 4 * 2 * 8
    r["ok_infer"] = error_of(lambda: infer(httpclient, http, 0, nbytes))
    r["offset_beyond"] = error_of(lambda: infer(httpclient, http, 4096 - nbytes + 4, nbytes))
    r["offset_huge"] = error_of(lambda: infer(grpcclient, grpc, 2**63 - 1, nbytes))
    r["wrong_size"] = error_of(lambda: infer(grpcclient, grpc, 0, nbytes - 4))
    r["unknown_region"] = error_of(lambda: infer(httpclient, http, 0, nbytes, region="nope"))

    # A long request reading the region: unregister fails while it runs, works after its answer.
    big = (1, 4096, 8, 128)  # ~1 s on two cores: long enough to unregister under it
    bytes_big = 4 * int(np.prod(big))
    hb = shm.create_shared_memory_region("big", f"/fs_big_{tag}", 3 * bytes_big)
    shm.set_shared_memory_region(hb, [np.random.default_rng(0).standard_normal(3 * int(np.prod(big))).astype(np.float32)])
    http.register_system_shared_memory("big", f"/fs_big_{tag}", 3 * bytes_big)
    inputs = []
    for n, off in zip(("Q", "K", "V"), (0, bytes_big, 2 * bytes_big)):
        i = httpclient.InferInput(n, list(big), "FP32")
        i.set_shared_memory("big", bytes_big, offset=off)
        inputs.append(i)
    # The request runs on a thread of its own (a real one: gevent's async_infer may not send before
    # get_result); the unregister waits until the server counts it in flight (from its headers on),
    # then 50 ms more for its regions to be leased (as its body ends: no body here) -- it computes ~1 s.
    metrics_url = open(f"{work}/metrics_url").read().strip()

    def inflight():
        import urllib.request
        text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
        return sum(float(l.split()[-1]) for l in text.splitlines() if l.startswith("flashserve_inflight_requests"))

    attempts = []
    for _ in range(3):  # the request may still finish before an attempt lands: try a few
        done = threading.Event()

        def run_infer(done=done):  # done even when the inference fails (an unregister that landed early)
            try:
                httpclient.InferenceServerClient(http_url).infer("attention", inputs)
            finally:
                done.set()
        threading.Thread(target=run_infer, daemon=True).start()
        deadline = time.monotonic() + 30
        while inflight() < 1 and not done.is_set() and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(0.05)
        attempts.append(error_of(lambda: grpc.unregister_system_shared_memory("big")))
        done.wait(120)
        if attempts[-1] is not None:
            break
        http.register_system_shared_memory("big", f"/fs_big_{tag}", 3 * bytes_big)
    r["in_use"] = attempts
    r["after"] = error_of(lambda: http.unregister_system_shared_memory("big"))
    r["unregister_all"] = error_of(lambda: grpc.unregister_system_shared_memory())
    r["left"] = len(http.get_system_shared_memory_status())
    shm.destroy_shared_memory_region(h)
    shm.destroy_shared_memory_region(hb)
    json.dump(report, open(f"{work}/report.json", "w"))
""")


def test_system_shm_safety(shm_server, tmp_path):
    (tmp_path / "metrics_url").write_text(f"http://127.0.0.1:{shm_server.metrics_port}/metrics")
    r = run_client(SAFETY_SCRIPT, shm_server, tmp_path, timeout=300)
    assert "does not exist" in r["missing_key"]
    assert "key: must be" in r["bad_key"]
    assert "region name" in r["bad_name"]
    for case in ("beyond_object", "overflow"):
        assert "beyond its" in r[case], (case, r[case])
    assert "--shm_max_bytes" in r["too_big"]
    assert "byte_size: must be > 0" in r["zero"]
    assert "already registered" in r["duplicate"]
    assert r["unknown_unregister"] is None  # as Triton answers: nothing to do (cleanup code calls it blindly)
    assert "no shared-memory region \"nope\"" in r["unknown_status"]
    assert "CUDA backend" in r["cuda_on_cpu"]
    assert "--shm_max_regions" in r["limit"]
    assert r["ok_infer"] is None
    for case in ("offset_beyond", "offset_huge"):
        assert "Q: shared-memory region \"safe\"" in r[case] and "beyond its" in r[case], (case, r[case])
    assert "q" in r["wrong_size"].lower() and "bytes" in r["wrong_size"], r["wrong_size"]
    assert "Q: no shared-memory region \"nope\"" in r["unknown_region"]
    assert r["in_use"][-1] is not None and "is in use by requests in flight" in r["in_use"][-1], r["in_use"]
    assert r["after"] is None and r["unregister_all"] is None and r["left"] == 0
    # The server is unharmed: it still answers.
    assert shm_server.proc.poll() is None


def test_rest_shm_bodies_are_read_as_sent(shm_server):
    """The REST shared-memory calls, by hand (tritonclient never sends these): a key given twice was read as its last
    value (a proxy reading the first saw another region), and an infer offset past int64 came back in the error as
    9223372036854775807, a number the client never sent. Now both are 400 saying what was sent."""
    import requests
    from multiprocessing import shared_memory

    base = f"{shm_server.http}/v2"
    obj = shared_memory.SharedMemory(create=True, size=4096)
    try:
        key = "/" + obj.name

        def post(path, body):
            return requests.post(f"{base}/{path}", data=body.encode(), timeout=30)

        def refused(response, fragment):
            assert response.status_code == 400, (response.status_code, response.text)
            assert fragment in response.json()["error"], (fragment, response.text)

        register = "systemsharedmemory/region/dup/register"
        refused(post(register, '{"key": "%s", "offset": 4090, "offset": 0, "byte_size": 16}' % key),
                'duplicate key "offset" in a JSON object')
        refused(post("cudasharedmemory/region/c/register",
                     '{"raw_handle": {"b64": "AAAA", "b64": "BBBB"}, "device_id": 0, "byte_size": 16}'),
                'duplicate key "b64" in a JSON object')
        refused(post("cudasharedmemory/region/c/register",
                     '{"raw_handle": {"b64": "AAAA"}, "device_id": 18446744073709551615, "byte_size": 16}'),
                "device_id: 18446744073709551615 is not a device")
        refused(post(register, '{"key": 5, "byte_size": 16}'), "key: must be a string")  # was "key: missing"
        refused(post(register, '{"byte_size": 16}'), "key: missing")
        assert post(register, json.dumps({"key": key, "offset": 0, "byte_size": 4096})).status_code == 200

        def tensor(name, offset):
            return {"name": name, "datatype": "FP32", "shape": [1, 4, 2, 8],
                    "parameters": {"shared_memory_region": "dup", "shared_memory_byte_size": 256,
                                   "shared_memory_offset": offset}}
        for offset in (2**64 - 1, 2**63):
            body = json.dumps({"inputs": [tensor("Q", offset), tensor("K", 0), tensor("V", 0)]})
            response = post("models/attention/infer", body)
            refused(response, f'Q: shared-memory region "dup": offset {offset} + byte_size 256 is beyond its 4096')
        body = json.dumps({"inputs": [tensor("Q", 0), tensor("K", 0), tensor("V", 0)]})
        assert post("models/attention/infer", body).status_code == 200
        assert post("systemsharedmemory/region/dup/unregister", "").status_code == 200
    finally:
        obj.close()
        obj.unlink()


OFF_SCRIPT = COMMON + textwrap.dedent("""
    h = shm.create_shared_memory_region("r", f"/fs_off_{tag}", 4096)
    report["http"] = error_of(lambda: http.register_system_shared_memory("r", f"/fs_off_{tag}", 4096))
    report["grpc"] = error_of(lambda: grpc.register_system_shared_memory("r", f"/fs_off_{tag}", 4096))
    report["status"] = error_of(lambda: http.get_system_shared_memory_status())
    i = httpclient.InferInput("Q", [1, 1, 1, 8], "FP32")
    i.set_shared_memory("r", 32)
    k = httpclient.InferInput("K", [1, 1, 1, 8], "FP32")
    k.set_data_from_numpy(np.zeros((1, 1, 1, 8), np.float32))
    v = httpclient.InferInput("V", [1, 1, 1, 8], "FP32")
    v.set_data_from_numpy(np.zeros((1, 1, 1, 8), np.float32))
    report["infer"] = error_of(lambda: http.infer("attention", [i, k, v]))
    shm.destroy_shared_memory_region(h)
    json.dump(report, open(f"{work}/report.json", "w"))
""")


def test_shm_is_off_by_default(server, tmp_path):
    r = run_client(OFF_SCRIPT, server, tmp_path)
    for case in ("http", "grpc", "status", "infer"):
        assert r[case] is not None and "--allow_client_shm" in r[case], (case, r[case])


CUT_SHORT_SCRIPT = COMMON + textwrap.dedent("""
    import random
    rounds = json.load(open(f"{work}/rounds.json"))
    data = np.load(f"{work}/cut.npz")
    qkv = [data[n].astype(np.float16) for n in ("Q", "K", "V")]
    in_bytes = sum(x.nbytes for x in qkv)
    o_bytes = qkv[0].nbytes
    rng = random.Random(7)
    outcomes = []
    for i, cut in enumerate(rounds):
        mod, client = client_of("grpc" if i % 2 else "http")
        in_key, out_key = f"/fs_cut_in_{tag}_{i}", f"/fs_cut_out_{tag}_{i}"
        h_in = shm.create_shared_memory_region(f"cin{i}", in_key, in_bytes)
        h_out = shm.create_shared_memory_region(f"cout{i}", out_key, o_bytes)
        at = 0
        for x in qkv:
            shm.set_shared_memory_region(h_in, [x], offset=at)
            at += x.nbytes
        client.register_system_shared_memory(f"cin{i}", in_key, in_bytes)
        client.register_system_shared_memory(f"cout{i}", out_key, o_bytes)
        inputs, at = [], 0
        for n, x in zip(("Q", "K", "V"), qkv):
            t = mod.InferInput(n, list(x.shape), "FP16")
            t.set_shared_memory(f"cin{i}", x.nbytes, offset=at)
            inputs.append(t)
            at += x.nbytes
        o = mod.InferRequestedOutput("O")
        o.set_shared_memory(f"cout{i}", o_bytes)
        def cut_short(key=in_key if cut == "in" else out_key):
            # The client cuts its object short while the server may be reading (or writing) it.
            fd = os.open("/dev/shm/" + key[1:], os.O_RDWR)
            os.ftruncate(fd, 0)
            os.close(fd)
        cutter = threading.Timer(rng.uniform(0, 0.15), cut_short)  # tritonclient's http: one thread
        cutter.start()
        error = error_of(lambda: client.infer("attention", inputs, outputs=[o]))
        cutter.join()
        outcome = {"cut": cut, "error": error}
        if error is None and cut == "in":  # O is in the untouched region: check it
            out = shm.get_contents_as_numpy(h_out, np.float16, qkv[0].shape)
            np.save(f"{work}/cut_out_{i}.npy", out.astype(np.float32))
        outcomes.append(outcome)
        for name in (f"cin{i}", f"cout{i}"):
            client.unregister_system_shared_memory(name)
        shm.destroy_shared_memory_region(h_in)
        shm.destroy_shared_memory_region(h_out)
    report["outcomes"] = outcomes
    report["alive"] = http.is_server_live()
    report["left"] = len(http.get_system_shared_memory_status())
    json.dump(report, open(f"{work}/report.json", "w"))
""")


def test_an_object_cut_short_during_a_request_fails_it_and_the_server_lives(shm_server, rng, make_qkv,
                                                                              check_answer, tmp_path):
    """A client that ftruncates its region's object while the server reads or writes it used to
    kill the server (SIGBUS, every client's requests with it). Now that request fails
    (FAILED_PRECONDITION naming the region), an answer that did come back OK is right, and the
    server keeps serving. The cut lands at a random moment: before the request, during it or after."""
    q, k, v = make_qkv(rng, 1, 1536, 1536, 8, 8, 64, "float16")
    np.savez(tmp_path / "cut.npz", Q=q.astype(np.float32), K=k.astype(np.float32), V=v.astype(np.float32))
    rounds = ["in", "out"] * 12
    (tmp_path / "rounds.json").write_text(json.dumps(rounds))
    report = run_client(CUT_SHORT_SCRIPT, shm_server, tmp_path, timeout=300)

    assert report["alive"] and shm_server.proc.poll() is None, shm_server.logs()
    assert report["left"] == 0
    failed = 0
    for i, outcome in enumerate(report["outcomes"]):
        error = outcome["error"]
        if error is not None:
            failed += 1
            assert "faulted" in error or "shrank" in error, (i, error)
        elif outcome["cut"] == "in":
            got = np.load(tmp_path / f"cut_out_{i}.npy").astype(q.dtype)
            check_answer(got, None, q, k, v, causal=False)
    # Some cuts must land before or during a request, or the test shows nothing.
    assert failed > 0, report["outcomes"]


@pytest.fixture
def leased_object(tmp_path):
    """A 4 KiB shm object this process holds a read lease on (fcntl F_SETLEASE): yields its key."""
    key = f"fs_lease_{os.getpid()}_{threading.get_ident()}"
    path = f"/dev/shm/{key}"
    with open(path, "wb") as f:
        f.write(bytes(4096))
    fd = os.open(path, os.O_RDONLY)
    previous = signal.signal(signal.SIGIO, signal.SIG_IGN)  # a lease break notifies the holder
    try:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
    except OSError as e:
        os.close(fd)
        os.unlink(path)
        signal.signal(signal.SIGIO, previous)
        pytest.skip(f"cannot take a lease here: {e}")
    yield "/" + key
    fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
    os.close(fd)
    os.unlink(path)
    signal.signal(signal.SIGIO, previous)


def test_a_leased_object_is_refused_at_once_and_grpc_keeps_serving(shm_server, oip, leased_object):
    """Opening an object another process holds a lease on waits until the kernel breaks the lease (45 s by default):
    a registration of one held its gRPC thread that long, and 8 of them (one leased object, 8 names) left the server
    answering nothing on gRPC, ServerLive included, for 45 s. Now each is refused at once, naming the lease."""
    pb2 = oip[0]
    channel, stub = stub_for(oip, shm_server.address)
    results = [None] * 6  # shm_server's --shm_max_regions

    def register(i):
        try:
            stub.SystemSharedMemoryRegister(pb2.SystemSharedMemoryRegisterRequest(
                name=f"leased{i}", key=leased_object, byte_size=64), timeout=10)
            results[i] = ("OK", "")
        except grpc.RpcError as e:
            results[i] = (e.code(), e.details())

    started = time.monotonic()
    threads = [threading.Thread(target=register, args=(i,)) for i in range(len(results))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert stub.ServerLive(pb2.ServerLiveRequest(), timeout=5).live
    for code, details in results:
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "lease" in details, results
    assert time.monotonic() - started < 8, results
    request = urllib.request.Request(f"http://127.0.0.1:{shm_server.http_port}/v2/systemsharedmemory/region/leased/register",
                                     data=json.dumps({"key": leased_object, "byte_size": 64}).encode(), method="POST")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=10)
    assert e.value.code == 400 and "lease" in e.value.read().decode()
    assert stub.SystemSharedMemoryStatus(pb2.SystemSharedMemoryStatusRequest()).regions == {}
    channel.close()


def test_an_output_in_a_region_is_not_sent_again_in_the_answer(shm_server, oip, rng, make_qkv, check_answer):
    """O in a region at an offset the kernels cannot store to (not 16-byte aligned) is computed beside it and copied
    there; that copy was sent in raw_output_contents as well: an answer twice the size asked for, which a client with
    gRPC's default 4 MiB receive limit could not take (8 MiB of O here) although its output was in the region."""
    pb2 = oip[0]
    q, k, v = make_qkv(rng, 1, 1024, 3, 32, 32, 128, "float16")  # O: 8 MiB, cheap to compute
    o_offset = q.nbytes + 2
    key = f"fs_unaligned_out_{os.getpid()}"
    size = o_offset + q.nbytes
    fd = os.open(f"/dev/shm/{key}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, size)
    region = mmap.mmap(fd, size)
    os.close(fd)
    region[:q.nbytes] = q.tobytes()
    channel, stub = stub_for(oip, shm_server.address)
    plain = grpc.insecure_channel(shm_server.address)  # gRPC's default limits: 4 MiB received
    try:
        stub.SystemSharedMemoryRegister(pb2.SystemSharedMemoryRegisterRequest(name="unaligned", key="/" + key,
                                                                              byte_size=size))
        request = pb2.ModelInferRequest(model_name="attention")

        def in_region(tensor, offset, nbytes):
            tensor.parameters["shared_memory_region"].string_param = "unaligned"
            tensor.parameters["shared_memory_offset"].int64_param = offset
            tensor.parameters["shared_memory_byte_size"].int64_param = nbytes

        in_region(request.inputs.add(name="Q", datatype="FP16", shape=list(q.shape)), 0, q.nbytes)
        for name, x in (("K", k), ("V", v)):
            request.inputs.add(name=name, datatype="FP16", shape=list(x.shape))
            request.raw_input_contents.append(x.tobytes())
        in_region(request.outputs.add(name="O"), o_offset, q.nbytes)
        response = oip[1].GRPCInferenceServiceStub(plain).ModelInfer(request, timeout=60)
        assert [o.name for o in response.outputs] == ["O"] and list(response.outputs[0].shape) == list(q.shape)
        assert list(response.raw_output_contents) == [b""]
        out = np.frombuffer(region[o_offset:o_offset + q.nbytes], np.float16).reshape(q.shape)
        check_answer(out, None, q, k, v)
        stub.SystemSharedMemoryUnregister(pb2.SystemSharedMemoryUnregisterRequest(name="unaligned"))
    finally:
        plain.close()
        channel.close()
        region.close()
        os.unlink(f"/dev/shm/{key}")
