"""`python -m flashserve info|check` against the in-process fake server."""

import subprocess
import sys

import grpc
import numpy as np
import pytest

from flashserve import check, cli, client


def test_check_passes_on_a_correct_server(fake, capsys):
    assert cli.main(["check", "--address", fake.address, "--quick", "--seed", "3"]) == 0
    text = capsys.readouterr().out
    assert "max_abs_err" in text and "rel_err" in text and "tol" in text
    assert "FAIL" not in text
    lines = [line for line in text.splitlines() if line.rstrip().endswith("PASS")]
    assert len(lines) == len(check.problems_for(client._server_info_from_proto(fake.servicer.info), quick=True))
    for dtype in ("float16", "bfloat16", "float32"):
        assert dtype in text


def test_check_fails_on_a_wrong_server(fake, capsys):
    fake.servicer.out_offset = 0.01
    assert cli.main(["check", "--address", fake.address, "--quick"]) == 1
    assert "FAIL" in capsys.readouterr().out


@pytest.mark.parametrize("offset", [1, -1])
def test_check_catches_an_off_by_one_causal_mask(fake, capsys, offset):
    fake.servicer.mask_offset = offset
    assert cli.main(["check", "--address", fake.address, "--quick"]) == 1
    rows = capsys.readouterr().out.splitlines()
    for dtype in ("float16", "bfloat16", "float32"):
        causal_rows = [r for r in rows if f" {dtype} " in r and " yes " in r]
        assert causal_rows and any("FAIL" in r for r in causal_rows), (dtype, causal_rows)


def test_check_fails_on_a_wrong_lse(fake, capsys):
    def shift_lse(response):
        lse = np.frombuffer(response.lse.data, "<f4") + np.float32(0.01)
        response.lse.data = lse.astype("<f4").tobytes()
        return response

    fake.servicer.after = shift_lse
    assert cli.main(["check", "--address", fake.address, "--quick"]) == 1
    text = capsys.readouterr().out
    assert "LSE mismatch" in text and "PASS" not in text.split("------")[-1]


def test_check_fails_on_an_out_of_another_dtype(fake, capsys):
    """O must be Q's dtype: a server answering float16 / bfloat16 problems with a float32 O (right by value, garbage to
    a client that reads it as Q's dtype) passed every problem before."""
    from flashserve import attention_pb2 as pb
    from flashserve import tensors

    def as_float32(response):
        out = tensors.from_proto(response.out).astype("<f4")
        response.out.CopyFrom(pb.Tensor(dtype=pb.FLOAT32, shape=list(out.shape), data=out.tobytes()))
        return response

    fake.servicer.after = as_float32
    assert cli.main(["check", "--address", fake.address, "--quick"]) == 1
    rows = capsys.readouterr().out.splitlines()
    of = {dtype: [r for r in rows if r.split()[3:4] == [dtype]] for dtype in ("float16", "bfloat16", "float32")}
    for dtype in ("float16", "bfloat16"):
        assert of[dtype] and all(f"FAIL (out float32 for q {dtype}" in r for r in of[dtype]), of[dtype]
    assert of["float32"] and all(r.rstrip().endswith("PASS") for r in of["float32"])


@pytest.mark.parametrize("command", ["info", "check"])
@pytest.mark.parametrize("option", ["--token-file", "--tls-ca", "--token-file not utf-8"])
def test_an_unreadable_connection_file_exits_2(fake, capsys, tmp_path, command, option):
    """A --token-file or --tls-ca that cannot be read is an error (exit 2, one line), not a mismatch: it ended in a
    traceback and exit 1, the status that says the server's answers are wrong."""
    path = tmp_path / "missing"
    if option.endswith("utf-8"):
        path = tmp_path / "token"
        path.write_bytes(b"\xff\xfe")
    assert cli.main([command, "--address", fake.address, option.split()[0], str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {option.split()[0]} {path}: ") and err.count("\n") == 1, err


def test_check_reports_server_errors(fake, capsys):
    fake.servicer.info.head_dims[:] = [64]
    fake.servicer.info.dtypes[:] = [3]
    calls = []

    def fail_second(request, context):
        calls.append(1)
        if len(calls) == 2:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "q.shape: simulated")

    fake.servicer.before = fail_second
    assert cli.main(["check", "--address", fake.address, "--quick"]) == 1
    text = capsys.readouterr().out
    assert "q.shape: simulated" in text and "3/4 passed" in text


def test_grid_covers_required_cases():
    info = client.ServerInfo("v", "cpu", [], ["float16", "bfloat16", "float32"], [], 256,
                             client.Limits(1, 1, 1), 2, "")
    problems = check.problems_for(info)
    assert {p.head_dim for p in problems} == {64, 128, 40}
    assert {p.dtype for p in problems} == {"float16", "bfloat16", "float32"}
    seqlens = {p.seqlen_q for p in problems} | {p.seqlen_k for p in problems}
    assert {1, 17, 97, 300} <= seqlens
    assert any(p.heads_q == 8 and p.heads_kv == 2 for p in problems)
    assert any(p.heads_q == 6 and p.heads_kv == 1 for p in problems)
    assert any(p.causal and p.seqlen_q < p.seqlen_k for p in problems)
    assert any(p.causal and p.seqlen_q > p.seqlen_k for p in problems)
    assert any(p.softmax_scale is not None for p in problems)
    gpu = client.ServerInfo("v", "cuda", [], ["float16", "bfloat16"], [64, 128], 0, client.Limits(1, 1, 1), 2, "")
    assert {p.head_dim for p in check.problems_for(gpu)} == {64, 128}


def test_info_command(fake, capsys):
    assert cli.main(["info", "--address", fake.address]) == 0
    text = capsys.readouterr().out
    assert "backend:        cpu" in text and "0.0.0-fake" in text and "max_tensor_elements=268435456" in text
    assert cli.main(["info", "--address", fake.address, "--json"]) == 0
    assert '"backend": "cpu"' in capsys.readouterr().out


def test_module_entry_point(fake):
    result = subprocess.run([sys.executable, "-m", "flashserve", "info", "--address", fake.address],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "backend:" in result.stdout


def test_unreachable_server_exits_2(capsys):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert cli.main(["info", "--address", f"127.0.0.1:{port}", "--timeout", "3"]) == 2
    assert "UNAVAILABLE" in capsys.readouterr().err


def test_usage_errors_exit_2():
    with pytest.raises(SystemExit) as e:
        cli.main([])
    assert e.value.code == 2
