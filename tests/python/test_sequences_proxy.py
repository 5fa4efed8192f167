"""deploy/proxy/nginx-sequences.conf: validated by nginx itself, then run in front of three Sequences servers
(in-process fakes): each routing key reaches one server; when that server leaves, its keys move and the client
re-creates their sequences through the proxy. Skips without an nginx binary (Debian: apt-get install nginx)."""

from __future__ import annotations

import collections
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import grpc
import pytest

import flashserve

pytest.importorskip("flashserve.sequence_client", reason="no sequences.proto in this checkout")

import conftest  # noqa: E402
from conftest import REPO_ROOT, free_port  # noqa: E402
from sequences_fake import FakeSequencesServer  # noqa: E402
from sequences_truth import Truth  # noqa: E402

CONFIG = REPO_ROOT / "deploy" / "proxy" / "nginx-sequences.conf"
NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").is_file() else None)
SHAPE = dict(num_layers=1, heads_q=4, heads_kv=1, head_dim=32, dtype="bfloat16")

pytestmark = pytest.mark.skipif(NGINX is None, reason="nginx is not installed (apt-get install nginx)")


def _nginx_test(prefix: Path) -> subprocess.CompletedProcess:
    return subprocess.run([NGINX, "-t", "-p", str(prefix), "-c", "nginx.conf"], capture_output=True, text=True,
                          timeout=30)


def test_shipped_config_passes_nginx_t(tmp_path):
    shutil.copy(CONFIG, tmp_path / "nginx.conf")
    result = _nginx_test(tmp_path)
    assert result.returncode == 0, result.stderr
    assert "test is successful" in result.stderr


def _local_config(backends, port: int, fail_timeout: str = "10s") -> str:
    """The shipped file with its example servers replaced by ``backends`` and its port by ``port``."""
    text = CONFIG.read_text()
    lines = "\n".join(f"    server {b} max_fails=1 fail_timeout={fail_timeout};" for b in backends)
    text, n = re.subn(r"(    server 10\.0\.0\.\d:8001 max_fails=1 fail_timeout=10s;\n)+", lines + "\n", text)
    assert n == 1, "the shipped config's Sequences upstream changed shape; update this test"
    text, n = re.subn(r"(    server 10\.0\.0\.\d:8001;\n)+", "".join(f"    server {b};\n" for b in backends), text)
    assert n == 1
    return text.replace("listen 8001 http2;", f"listen 127.0.0.1:{port} http2;")


def _start_nginx(directory: Path, backends, fail_timeout: str = "10s"):
    """nginx with the shipped config in front of ``backends``; returns (process, address)."""
    port = free_port()
    (directory / "nginx.conf").write_text(_local_config(backends, port, fail_timeout))
    checked = _nginx_test(directory)
    assert checked.returncode == 0, checked.stderr
    with open(directory / "nginx.log", "wb") as log:
        proc = subprocess.Popen([NGINX, "-p", str(directory), "-c", "nginx.conf", "-g", "daemon off;"],
                                stdout=log, stderr=log)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, f"127.0.0.1:{port}"
        except OSError:
            assert proc.poll() is None, (directory / "nginx.log").read_text()
            time.sleep(0.05)
    proc.kill()
    pytest.fail("nginx did not listen within 10 s")


@pytest.fixture
def proxied_fakes(tmp_path):
    fakes = [FakeSequencesServer() for _ in range(3)]
    proc, address = _start_nginx(tmp_path, [f.address for f in fakes])
    yield fakes, address
    proc.terminate()
    proc.wait(timeout=10)
    for f in fakes:
        f.stop()


def _owners(fakes):
    """{routing key: set of fake indices that saw a call with that key}."""
    seen = collections.defaultdict(set)
    for index, fake in enumerate(fakes):
        for md in fake.servicer.metadata_seen:
            seen[md.get(flashserve.ROUTE_HEADER)].add(index)
    return seen


def _round(client, seqs, truth):
    for seq in seqs:
        q, (k, v) = truth.query(), truth.rows(1)
        out = seq.step(0, q, k, v)
        truth.add(seq.key, 0, k, v)
        truth.check(out, q, seq.key, 0)


def test_proxy_keeps_each_key_on_one_server_and_recovers_when_it_leaves(proxied_fakes, rng):
    fakes, proxy = proxied_fakes
    truth = Truth(rng, SHAPE["heads_q"], SHAPE["heads_kv"], SHAPE["head_dim"], SHAPE["dtype"])
    with flashserve.SequenceClient(proxy, timeout=10) as client:
        seqs = []
        # nginx hashes the fakes' random ports: 18 keys left one of them none in 0.2% of port draws, 48 in none of
        # 200,000 (simulated with nginx's chash: crc32 points, 160 a server).
        for i in range(48):
            k, v = truth.rows(3)
            seqs.append(client.create(**SHAPE, prefix={0: (k, v)}, key=f"conversation-{i}"))
            truth.add(seqs[-1].key, 0, k, v)
        for _ in range(3):
            _round(client, seqs, truth)
        owners = _owners(fakes)
        assert all(len(owners[s.key]) == 1 for s in seqs), owners
        assert len({next(iter(owners[s.key])) for s in seqs}) == 3, "nginx used fewer than 3 servers"
        victim = 1
        fakes[victim].stop()
        for fake in fakes:
            fake.servicer.metadata_seen.clear()
        for _ in range(3):
            _round(client, seqs, truth)
        after = _owners(fakes)
        lost = [s for s in seqs if owners[s.key] == {victim}]
        assert lost and all(s.reprefills == 1 for s in lost)
        assert all(s.reprefills == 0 and after[s.key] == owners[s.key] for s in seqs if s not in lost)
        assert all(len(after[s.key]) == 1 and victim not in after[s.key] for s in lost)


def _holder(servers, seq):
    """Index of the real server that holds seq's id (asked directly, not through the proxy)."""
    holders = []
    for index, server in enumerate(servers):
        if server.proc.poll() is not None:
            continue
        with flashserve.SequenceClient(server.address, timeout=10, reprefill=False) as direct:
            try:
                direct.stub(server.address).GetSequenceInfo(  # wait_for_ready: a restarted server may still
                    flashserve.sequences_pb2.GetSequenceInfoRequest(sequence_id=seq.id), timeout=10,  # connect
                    wait_for_ready=True)
                holders.append(index)
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.NOT_FOUND, e
    assert len(holders) == 1, holders
    return holders[0]


@pytest.mark.e2e
def test_proxy_in_front_of_real_servers_one_killed_then_back(start_server, tmp_path, rng, monkeypatch):
    """A server killed: its keys move to the next server (re-prefill once). It restarts on the same port (empty):
    after nginx's fail_timeout its keys come back to it, and are re-created there (re-prefill twice)."""
    servers = [start_server("--kv_cache_bytes=67108864", "--kv_page_tokens=16", name=f"px{i}") for i in range(3)]
    proc, proxy = _start_nginx(tmp_path, [s.address for s in servers], fail_timeout="1s")
    truth = Truth(rng, SHAPE["heads_q"], SHAPE["heads_kv"], SHAPE["head_dim"], SHAPE["dtype"])
    try:
        with flashserve.SequenceClient(proxy, timeout=20) as client:
            seqs = []
            for i in range(12):
                k, v = truth.rows(10 + i)
                seqs.append(client.create(**SHAPE, prefix={0: (k, v)}, key=f"conversation-{i}"))
                truth.add(seqs[-1].key, 0, k, v)
            _round(client, seqs, truth)
            where = {s.key: (_holder(servers, s), s.id) for s in seqs}
            assert len({w for w, _ in where.values()}) >= 2, where
            victim = where[seqs[0].key][0]
            servers[victim].proc.kill()
            servers[victim].proc.wait()
            for _ in range(3):
                _round(client, seqs, truth)
            for seq in seqs:
                lost = where[seq.key][0] == victim
                assert seq.reprefills == int(lost)
                assert (seq.id == where[seq.key][1]) != lost
                assert _holder(servers, seq) != victim
            back = servers[victim]
            ports = [back.grpc_port, back.http_port] + ([back.metrics_port] if back.metrics_port else [])
            monkeypatch.setattr(conftest, "free_port", iter(ports).__next__)
            back.start(attempts=1)
            monkeypatch.undo()
            # Past fail_timeout (nginx compares whole seconds: "now - checked <= 1" holds for up to 2.99 s).
            time.sleep(3.0)
            for _ in range(2):
                _round(client, seqs, truth)
            for seq in seqs:
                lost = where[seq.key][0] == victim
                assert seq.reprefills == 2 * int(lost), (seq.key, seq.reprefills, lost)
                assert (_holder(servers, seq) == victim) == lost
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_calls_without_the_routing_key_are_refused_not_scattered(proxied_fakes):
    """A Sequences call without x-sequence-key (a raw stub, grpcurl, another language's client) was hashed on an empty
    key, which nginx answers by round robin: the create on one server, the steps on others. The proxy refuses it."""
    from flashserve import sequences_pb2 as spb
    from flashserve import sequences_pb2_grpc as spb_grpc

    fakes, proxy = proxied_fakes
    with grpc.insecure_channel(proxy) as channel:
        stub = spb_grpc.SequencesStub(channel)
        for call in (lambda: stub.GetKvPoolInfo(spb.GetKvPoolInfoRequest(), timeout=10),
                     lambda: stub.Release(spb.ReleaseRequest(sequence_ids=["x"]), timeout=10)):
            with pytest.raises(grpc.RpcError) as refused:
                call()
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value
            assert "x-sequence-key" in refused.value.details(), refused.value.details()
        # With the key the same call goes through (to the one server its key hashes to).
        stub.Release(spb.ReleaseRequest(sequence_ids=["x"]), timeout=10,
                     metadata=[(flashserve.ROUTE_HEADER, "conversation-1")])
    assert sum(len(f.servicer.metadata_seen) for f in fakes) == 1
