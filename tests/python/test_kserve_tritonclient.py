"""Interoperability with an independent Open Inference Protocol client: NVIDIA's tritonclient (PyPI
`tritonclient[http,grpc]`), HTTP (JSON and binary tensors) and gRPC, for each dtype, against the fp64 reference.

tritonclient.grpc registers its own `inference.*` protobuf messages, which would collide in this process with the
stubs test_kserve_grpc.py generates from our .proto; so the client runs in a child process and hands back .npy files.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

pytestmark = pytest.mark.e2e

CLIENT_SCRIPT = textwrap.dedent("""
    import json, sys
    import ml_dtypes
    import numpy as np
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    http_url, grpc_url, work = sys.argv[1:4]
    problems = json.load(open(f"{work}/problems.json"))
    NUMPY = {"FP16": np.float16, "BF16": ml_dtypes.bfloat16, "FP32": np.float32}
    report = {}

    http = httpclient.InferenceServerClient(http_url)
    grpc = grpcclient.InferenceServerClient(grpc_url)
    assert http.is_server_live() and http.is_server_ready() and http.is_model_ready("attention")
    assert grpc.is_server_live() and grpc.is_server_ready() and grpc.is_model_ready("attention")
    report["http_metadata"] = http.get_model_metadata("attention")
    report["http_server"] = http.get_server_metadata()
    report["grpc_metadata"] = [i.name for i in grpc.get_model_metadata("attention").inputs]

    for p in problems:
        dtype = NUMPY[p["datatype"]]
        data = np.load(f"{work}/{p['name']}.npz")
        qkv = {n: data[n].astype(dtype) for n in ("Q", "K", "V")}
        params = {"causal": p["causal"], "return_lse": True}
        mod = httpclient if p["client"].startswith("http") else grpcclient
        inputs = []
        for n, x in qkv.items():
            i = mod.InferInput(n, list(x.shape), p["datatype"])
            if p["client"] == "http-json":
                i.set_data_from_numpy(x, binary_data=False)
            else:
                i.set_data_from_numpy(x)
            inputs.append(i)
        if p["client"] == "http-json":
            outputs = [httpclient.InferRequestedOutput("O", binary_data=False),
                       httpclient.InferRequestedOutput("LSE", binary_data=False)]
            result = http.infer("attention", inputs, outputs=outputs, request_id=p["name"], parameters=params)
        elif p["client"] == "http":
            result = http.infer("attention", inputs, request_id=p["name"], parameters=params)
        else:
            outputs = [grpcclient.InferRequestedOutput("O"), grpcclient.InferRequestedOutput("LSE")]
            result = grpc.infer("attention", inputs, outputs=outputs, request_id=p["name"], parameters=params)
        response = result.get_response()
        rid = response["id"] if isinstance(response, dict) else response.id
        assert rid == p["name"], (rid, p["name"])
        out, lse = result.as_numpy("O"), result.as_numpy("LSE")
        np.savez(f"{work}/{p['name']}.out.npz", O=out.astype(np.float32), LSE=lse.astype(np.float32),
                 O_dtype=str(out.dtype))
    json.dump(report, open(f"{work}/report.json", "w"))
    print("ok")
""")


def interop_python() -> str:
    """tritonclient pins older protobuf/ml_dtypes than the client's venv: scripts/setup gives it a venv of its own
    (.venv-interop); $FLASHSERVE_INTEROP_PYTHON overrides; else this interpreter."""
    import os
    from pathlib import Path

    if os.environ.get("FLASHSERVE_INTEROP_PYTHON"):
        return os.environ["FLASHSERVE_INTEROP_PYTHON"]
    own = Path(__file__).resolve().parents[2] / ".venv-interop" / "bin" / "python"
    return str(own) if own.exists() else sys.executable


def test_tritonclient_http_and_grpc(server, rng, make_qkv, check_answer, tmp_path):
    python = interop_python()
    probe = subprocess.run([python, "-c", "import tritonclient.http, tritonclient.grpc, ml_dtypes"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"tritonclient[http,grpc] is not importable by {python} (scripts/setup installs it into "
                    ".venv-interop):\n" + probe.stderr[-500:])
    problems, inputs = [], {}
    for client in ("http", "http-json", "grpc"):
        for dtype, datatype in (("float16", "FP16"), ("bfloat16", "BF16"), ("float32", "FP32")):
            if client == "http-json" and datatype == "BF16":
                continue  # tritonclient sends BF16 over HTTP only as binary data
            name = f"{client}-{datatype}"
            causal = datatype != "FP32"
            q, k, v = make_qkv(rng, 2, 19, 31, 4, 2, 64, dtype)
            inputs[name] = (q, k, v, causal)
            np.savez(tmp_path / f"{name}.npz", Q=q.astype(np.float32), K=k.astype(np.float32),
                     V=v.astype(np.float32))
            problems.append({"name": name, "client": client, "datatype": datatype, "causal": causal})
    (tmp_path / "problems.json").write_text(json.dumps(problems))
    (tmp_path / "client.py").write_text(CLIENT_SCRIPT)
    run = subprocess.run([python, str(tmp_path / "client.py"), f"127.0.0.1:{server.http_port}",
                          server.address, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"tritonclient run failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"

    report = json.loads((tmp_path / "report.json").read_text())
    assert [i["name"] for i in report["http_metadata"]["inputs"]] == ["Q", "K", "V"]
    assert "binary_tensor_data" in report["http_server"]["extensions"]
    assert report["grpc_metadata"] == ["Q", "K", "V"]
    for p in problems:
        q, k, v, causal = inputs[p["name"]]
        got = np.load(tmp_path / f"{p['name']}.out.npz")
        out = got["O"].astype(q.dtype)  # exact: the values came in that dtype
        assert str(got["O_dtype"]) == str(q.dtype), (p["name"], got["O_dtype"])
        check_answer(out, got["LSE"], q, k, v, causal=causal)
