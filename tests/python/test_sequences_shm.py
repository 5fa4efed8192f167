"""DecodeStep with shared memory (CPU backend, the real binary): q/k/v read from and O/LSE written to a client's
system region (Tensor.shm, DecodeItem.out_shm / lse_shm), mixed with items sent in the message, against the fp64
reference over many steps; the refusals (shm off, data and shm together, wrong sizes, an output overlapping an input,
outside the region) change nothing; DecodeStep counts against --max_inflight_bytes."""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.request
from multiprocessing import shared_memory

import grpc
import numpy as np
import pytest

import flashserve
from flashserve import attention_pb2 as pb
from flashserve import sequences_pb2 as spb
from flashserve import sequences_pb2_grpc
from flashserve import tensors
from conftest import ServerProcess, _stop_and_check
from metrics_helpers import scrape
from sequences_truth import Truth

pytestmark = pytest.mark.e2e
KV_FLAGS = ["--kv_cache_bytes=33554432", "--kv_page_tokens=16"]
SHAPE = dict(heads_q=4, heads_kv=2, head_dim=64)

if spb is None or "out_shm" not in spb.DecodeItem.DESCRIPTOR.fields_by_name:
    pytest.skip("the imported flashserve client predates DecodeItem.out_shm (PYTHONPATH=client/python of this tree)",
                allow_module_level=True)


@pytest.fixture(scope="module")
def shm_server(flashserve_bin, tmp_path_factory):
    s = ServerProcess(flashserve_bin, tmp_path_factory.mktemp("kv_shm"), KV_FLAGS + ["--allow_client_shm"],
                      name="kv_shm").start()
    yield s
    _stop_and_check(s)


def _post(server, path: str, body: dict) -> None:
    req = urllib.request.Request(f"{server.http}{path}", data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200


class Region:
    """A poisoned system region registered with the server; put() lays arrays out one after another."""

    def __init__(self, server, name: str, size: int):
        self.server, self.name = server, name
        self.shm = shared_memory.SharedMemory(create=True, size=size)
        self.buf = np.frombuffer(self.shm.buf, np.uint8)
        self.buf[:] = 0xFF  # NaN in every float type
        self.at = 0
        _post(server, f"/v2/systemsharedmemory/region/{name}/register", {"key": "/" + self.shm.name, "byte_size": size})

    def reset(self) -> None:
        """Everything poisoned again, the next put() at offset 0."""
        self.at = 0
        self.buf[:] = 0xFF

    def put(self, x) -> pb.SharedMemoryRef:
        raw = np.frombuffer(np.ascontiguousarray(x).tobytes(), np.uint8)
        ref = self.reserve(raw.size)
        self.buf[ref.offset:ref.offset + raw.size] = raw
        return ref

    def reserve(self, nbytes: int, align: int = 4) -> pb.SharedMemoryRef:
        self.at = (self.at + align - 1) // align * align
        ref = pb.SharedMemoryRef(region=self.name, offset=self.at, byte_size=nbytes)
        self.at += nbytes
        return ref

    def read(self, ref: pb.SharedMemoryRef, dtype, shape) -> np.ndarray:
        return np.frombuffer(self.buf[ref.offset:ref.offset + ref.byte_size].tobytes(), dtype).reshape(shape).copy()

    def close(self) -> None:
        del self.buf
        _post(self.server, f"/v2/systemsharedmemory/region/{self.name}/unregister", {})
        self.shm.close()
        self.shm.unlink()


def _shm_tensor(x, ref) -> pb.Tensor:
    t = pb.Tensor(dtype=tensors.to_proto_rows(x, "x").dtype, shape=list(x.shape))
    t.shm.CopyFrom(ref)
    return t


def _step_request(region, seqs, qs, kvs, in_shm, return_lse, inputs_in_region=True):
    """Items 0..n-1; item i's outputs in the region when in_shm[i], and its tensors too unless inputs_in_region is
    False (then they travel in the message)."""
    request = spb.DecodeStepRequest(return_lse=return_lse)
    outs = []
    for seq, q, (k, v), shm in zip(seqs, qs, kvs, in_shm):
        item = request.items.add(sequence_id=seq.id, layer=0)
        if not shm or not inputs_in_region:
            for field, x in (("q", q), ("k", k), ("v", v)):
                getattr(item, field).CopyFrom(tensors.to_proto_rows(x, field))
        if not shm:
            outs.append(None)
            continue
        for field, x in (("q", q), ("k", k), ("v", v)):
            if inputs_in_region:
                getattr(item, field).CopyFrom(_shm_tensor(x, region.put(x)))
        item.out_shm.CopyFrom(region.reserve(q.nbytes))
        if return_lse:
            item.lse_shm.CopyFrom(region.reserve(4 * q.shape[0] * q.shape[1]))
        outs.append((item.out_shm, item.lse_shm if return_lse else None))
    return request, outs


@pytest.mark.parametrize("dtype,rows_q", [("float16", 1), ("bfloat16", 3)])
def test_decode_step_through_shm_matches_reference(shm_server, rng, dtype, rows_q):
    run_shm_steps(shm_server, rng, dtype, rows_q, SHAPE)


def run_shm_steps(server, rng, dtype, rows_q, shape, prefixes=(1, 17, 40), steps=6):
    """DecodeSteps over sequences with these prefix lengths, items in the region and in the message mixed; every O
    (and LSE on odd steps) against the fp64 reference. Also used by test_sequences_gpu.py (CUDA backend)."""
    truth = Truth(rng, **shape, dtype=dtype)
    ndt = tensors.numpy_dtype(dtype)
    region = Region(server, f"seq-{dtype}-{rows_q}", 4 << 20)
    try:
        with flashserve.SequenceClient(server.address, timeout=30, reprefill=False) as client:
            seqs = truth.create(client, prefixes)
            stub = client.stub(client.endpoints[0])
            for step in range(steps):
                region.reset()
                qs = [truth.query(rows_q) for _ in seqs]
                kvs = [truth.rows(rows_q) for _ in seqs]
                in_shm = [step % 2 == 0, True, step % 3 != 0]  # mixed with items in the message
                return_lse = step % 2 == 1
                request, outs = _step_request(region, seqs, qs, kvs, in_shm, return_lse)
                response = stub.DecodeStep(request, timeout=30)
                t = response.timing  # disjoint parts of the server's total
                assert t.prepare_us + t.queue_us + t.stage_us + t.compute_us <= t.total_us, t
                for seq, q, (k, v), where, result in zip(seqs, qs, kvs, outs, response.results):
                    truth.add(seq.key, 0, k, v)
                    assert result.length == truth.length(seq.key, 0)
                    assert result.HasField("lse") == return_lse  # no empty LSE when none was asked for
                    if where is None:
                        out = np.frombuffer(result.out.data, ndt).reshape(q.shape)
                        lse = np.frombuffer(result.lse.data, np.float32).reshape(q.shape[1], rows_q) \
                            if return_lse else None
                    else:
                        assert result.out.data == b"" and list(result.out.shape) == list(q.shape)
                        out = region.read(where[0], ndt, q.shape)
                        lse = region.read(where[1], np.float32, (q.shape[1], rows_q)) if return_lse else None
                    assert not np.isnan(out.astype(np.float32)).any()
                    truth.check(out, q, seq.key, 0, lse=lse)
    finally:
        region.close()


def _refused(stub, request, code, *words):
    with pytest.raises(grpc.RpcError) as info:
        stub.DecodeStep(request, timeout=30)
    assert info.value.code() == code, (info.value.code(), info.value.details())
    for word in words:
        assert word.lower() in info.value.details().lower(), info.value.details()


def test_bad_shm_references_are_refused_and_change_nothing(shm_server, rng):
    truth = Truth(rng, **SHAPE, dtype="float16")
    region = Region(shm_server, "seq-bad", 1 << 16)
    try:
        with flashserve.SequenceClient(shm_server.address, timeout=30, reprefill=False) as client:
            k, v = truth.rows(5)
            seq = client.create(num_layers=1, **SHAPE, dtype="float16", prefix={0: (k, v)})
            truth.add(seq.key, 0, k, v)
            stub = client.stub(client.endpoints[0])
            q, (k1, v1) = truth.query(), truth.rows(1)

            def request():
                region.at = 0
                r, _ = _step_request(region, [seq], [q], [(k1, v1)], [True], False)
                return r

            r = request()
            r.items[0].q.data = tensors.to_proto_rows(q, "q").data
            _refused(stub, r, grpc.StatusCode.INVALID_ARGUMENT, "not both")
            r = request()
            r.items[0].out_shm.byte_size += 2
            _refused(stub, r, grpc.StatusCode.INVALID_ARGUMENT, "out_shm", "byte_size")
            r = request()
            r.items[0].k.shm.byte_size -= 2
            _refused(stub, r, grpc.StatusCode.INVALID_ARGUMENT, "k:")
            r = request()
            r.items[0].out_shm.offset = r.items[0].q.shm.offset + 2  # O over q
            _refused(stub, r, grpc.StatusCode.INVALID_ARGUMENT, "overlaps")
            r = request()
            r.items[0].out_shm.offset = (1 << 16) - 8  # past the region's end
            _refused(stub, r, grpc.StatusCode.INVALID_ARGUMENT)
            r = request()
            r.items[0].v.shm.region = "no-such-region"
            _refused(stub, r, grpc.StatusCode.NOT_FOUND, "v:")
            assert list(seq.info().layer_lengths) == [truth.length(seq.key, 0)]  # nothing appended
            q2 = truth.query()
            truth.check(seq.attend(0, q2), q2, seq.key, 0)
    finally:
        region.close()


def test_shm_refused_when_disabled(flashserve_bin, tmp_path, rng):
    s = ServerProcess(flashserve_bin, tmp_path, KV_FLAGS, name="kv_noshm").start()
    try:
        truth = Truth(rng, **SHAPE, dtype="float16")
        with flashserve.SequenceClient(s.address, timeout=30, reprefill=False) as client:
            seq = client.create(num_layers=1, **SHAPE, dtype="float16")
            request = spb.DecodeStepRequest()
            item = request.items.add(sequence_id=seq.id, layer=0)
            q = truth.query()
            item.q.CopyFrom(_shm_tensor(q, pb.SharedMemoryRef(region="r", offset=0, byte_size=q.nbytes)))
            _refused(client.stub(client.endpoints[0]), request, grpc.StatusCode.PERMISSION_DENIED,
                     "--allow_client_shm")
    finally:
        _stop_and_check(s)


def test_decode_steps_count_against_max_inflight_bytes(flashserve_bin, tmp_path, rng):
    """A step waiting in a 1 s batch window holds its bytes: a second one past the limit is refused meanwhile."""
    s = ServerProcess(flashserve_bin, tmp_path, KV_FLAGS + ["--batch_window_us=1000000", "--max_inflight_bytes=4096"],
                      name="kv_inflight").start()
    try:
        truth = Truth(rng, **SHAPE, dtype="float16")
        with flashserve.SequenceClient(s.address, timeout=30, reprefill=False) as client:
            a = client.create(num_layers=1, **SHAPE, dtype="float16")
            b = client.create(num_layers=1, **SHAPE, dtype="float16")
            stub = client.stub(client.endpoints[0])

            def step(seq):
                request = spb.DecodeStepRequest()
                item = request.items.add(sequence_id=seq.id, layer=0)
                k, v = truth.rows(8)  # 4 KiB of K/V: past the limit together with another call
                for field, x in (("q", truth.query()), ("k", k), ("v", v)):
                    getattr(item, field).CopyFrom(tensors.to_proto_rows(x, field))
                return request

            first = stub.DecodeStep.future(step(a), timeout=30)
            # The first waits out its window with its bytes counted: the second goes once the server holds it.
            metrics, deadline = f"http://127.0.0.1:{s.metrics_port}/metrics", time.monotonic() + 10
            while scrape(metrics).value("flashserve_inflight_requests") < 1:
                assert time.monotonic() < deadline and not first.done(), "the first step never waited in the server"
                time.sleep(0.005)
            _refused(stub, step(b), grpc.StatusCode.RESOURCE_EXHAUSTED, "--max_inflight_bytes")
            assert first.result().results[0].length == 8
            # Given back once gRPC reports the first answer written, which may come a moment after the client has
            # read it (a sanitized server showed it: the next call refused once).
            deadline = time.monotonic() + 5
            while True:
                try:
                    assert stub.DecodeStep(step(b), timeout=30).results[0].length == 8
                    break
                except grpc.RpcError as e:
                    if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                        raise
                    time.sleep(0.01)
    finally:
        _stop_and_check(s)


@pytest.mark.parametrize("inputs_in_region", [True, False], ids=["qkv-and-O-in-region", "only-O-in-region"])
def test_a_region_cut_short_during_steps_never_leaves_wrong_rows(shm_server, rng, inputs_in_region):
    """A client that ftruncates the region its DecodeStep reads k/v from (or only writes O to), at a random moment:
    the server must not die (SIGBUS), and no later answer may be wrong. A step whose region faulted fails
    (FAILED_PRECONDITION) and releases the sequences it appended to (their new rows may be zeros, not the client's;
    and a failed call must not keep rows a retry would append again -- until session 42 a step whose q/k/v came in
    the message kept them when only its O region faulted), so they answer NOT_FOUND and are created again; a step
    refused before it read anything ("shrank") changes nothing."""
    truth = Truth(rng, **SHAPE, dtype="float16")
    outcomes = []
    with flashserve.SequenceClient(shm_server.address, timeout=30, reprefill=False) as client:
        seqs = truth.create(client, [1200] * 8)
        stub = client.stub(client.endpoints[0])
        # A cut before the step: refused at the lease, nothing read (random cuts land there in ~5% of rounds only).
        region = Region(shm_server, "cut-first", 1 << 20)
        request, _ = _step_request(region, seqs, [truth.query() for _ in seqs], [truth.rows(1) for _ in seqs],
                                   [True] * len(seqs), False, inputs_in_region)
        os.ftruncate(region.shm._fd, 0)
        with pytest.raises(grpc.RpcError) as refused:
            stub.DecodeStep(request, timeout=30)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION, refused.value.details()
        assert "shrank" in refused.value.details() and "were released" not in refused.value.details()
        outcomes.append("refused")
        region.close()
        round_ = 0
        # At least 40 random cuts, and on until one landed while a step used the region (a fault: it released its
        # sequences); 400 at most.
        while round_ < 40 or ("released" not in outcomes or not faults_seen(shm_server.logs())) and round_ < 400:
            round_ += 1
            region = Region(shm_server, f"cut{round_}", 1 << 20)
            qs = [truth.query() for _ in seqs]
            kvs = [truth.rows(1) for _ in seqs]
            request, _ = _step_request(region, seqs, qs, kvs, [True] * len(seqs), False, inputs_in_region)
            cutter = threading.Timer(rng.uniform(0, 0.003), os.ftruncate, (region.shm._fd, 0))
            cutter.start()
            try:
                stub.DecodeStep(request, timeout=30)
                outcomes.append("ok")
                for seq, (k, v) in zip(seqs, kvs):
                    truth.add(seq.key, 0, k, v)
            except grpc.RpcError as e:
                # Refused at the lease ("shrank": nothing read), or found after the call used the region
                # (a fault, or a shrink seen at the end): its sequences released.
                assert e.code() == grpc.StatusCode.FAILED_PRECONDITION, (e.code(), e.details())
                assert "shrank" in e.details() or "faulted" in e.details(), e.details()
                outcomes.append("released" if "were released" in e.details() else "refused")
            cutter.join()
            region.close()
            for i, seq in enumerate(seqs):  # every sequence answers right, or is gone after a fault
                q = truth.query()
                try:
                    truth.check(seq.attend(0, q), q, seq.key, 0)
                except flashserve.NotFoundError:
                    assert outcomes[-1] == "released", outcomes
                    seqs[i] = truth.create(client, [300])[0]
    assert server_alive(shm_server)
    # Cuts must land during steps, or the test shows nothing.
    assert "released" in outcomes, outcomes
    assert faults_seen(shm_server.logs()), "no cut landed while a step read or wrote the region"


@pytest.mark.parametrize("failure", ["aborted", "not_found", "deadline"])
def test_a_step_that_appended_nothing_keeps_its_sequences_when_its_region_faults(flashserve_bin, tmp_path, rng,
                                                                                   failure):
    """A DecodeStep that fails before its launch (ABORTED on its last item, NOT_FOUND for an unknown id, its deadline
    passed in the batch window) appended nothing, so a region it named that was cut short meanwhile must not cost its
    sequences (until session 42 every sequence of the call with rows was released: NOT_FOUND, their pages freed,
    and the answer said nothing of it). A step that did append releases them and says so (the control)."""
    s = ServerProcess(flashserve_bin, tmp_path, KV_FLAGS + ["--allow_client_shm", "--batch_window_us=1000000"],
                      name="kv_shm_window").start()
    try:
        truth = Truth(rng, **SHAPE, dtype="float16")
        with flashserve.SequenceClient(s.address, timeout=30, reprefill=False) as client:
            stub = client.stub(client.endpoints[0])
            for case in (failure, "control"):
                seqs = truth.create(client, [10] * 3)
                region = Region(s, f"cut-{case}", 1 << 16)
                request, _ = _step_request(region, seqs, [truth.query() for _ in seqs],
                                           [truth.rows(1) for _ in seqs], [True] * 3, False, inputs_in_region=False)
                if case == "aborted":
                    request.items[2].expected_length = 999
                elif case == "not_found":
                    request.items[2].sequence_id = "0" * 32
                cutter = threading.Timer(0.3, os.ftruncate, (region.shm._fd, 0))  # while it waits in the window
                cutter.start()
                with pytest.raises(grpc.RpcError) as failed:
                    stub.DecodeStep(request, timeout=0.6 if case == "deadline" else 30)
                cutter.join()
                time.sleep(0.8 if case == "deadline" else 0)  # the call leaves the window (and its lease)
                region.close()
                if case == "control":
                    assert failed.value.code() == grpc.StatusCode.FAILED_PRECONDITION, failed.value.details()
                    assert "were released" in failed.value.details(), failed.value.details()
                    for seq in seqs:
                        with pytest.raises(flashserve.NotFoundError):
                            seq.attend(0, truth.query())
                    continue
                assert "were released" not in failed.value.details(), failed.value.details()
                for seq in seqs[:2] if case == "not_found" else seqs:  # unchanged: no row appended, not released
                    q = truth.query()
                    truth.check(seq.attend(0, q), q, seq.key, 0)
    finally:
        _stop_and_check(s)


def faults_seen(logs: str) -> bool:
    return "an access to it faulted" in logs


def server_alive(server) -> bool:
    with urllib.request.urlopen(f"{server.http}/v2/health/live", timeout=10) as r:
        return r.status == 200 and server.proc.poll() is None


def _vm_hwm_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


@pytest.mark.parametrize("case", ["heads", "answer"])
def test_a_q_in_a_region_is_bounded_before_its_outputs_are_sized(shm_server, case):
    """O is q's size, and a q in a region is bounded by the region, not the message: a q claiming [16, 8192, 24576]
    had 6 GiB of O allocated (and zero-filled) before its sequence was looked up, and 'one call alone is always
    admitted' under --max_inflight_bytes (audit). Now heads and head_dim are bounded (1024, 256) where q is read, and
    a step whose inline O and LSE could not fit a gRPC message is refused before anything is sized."""
    size = 256 << 20
    key = f"/fs_qbound_{os.getpid()}_{case}"
    fd = os.open("/dev/shm" + key, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)  # sparse: costs this test nothing
        _post(shm_server, f"/v2/systemsharedmemory/region/qbound_{case}/register", {"key": key, "byte_size": size})
        shape, items = ([16, 2048, 4096], 1) if case == "heads" else ([16, 1024, 256], 260)  # 260 x 8 MiB of O
        q = pb.Tensor(dtype=pb.FLOAT16, shape=shape)
        q.shm.CopyFrom(pb.SharedMemoryRef(region=f"qbound_{case}", offset=0, byte_size=2 * int(np.prod(shape))))
        request = spb.DecodeStepRequest()
        for i in range(items):
            request.items.add(sequence_id=f"{i:032x}", layer=0).q.CopyFrom(q)
        before = _vm_hwm_mib(shm_server.proc.pid)
        with grpc.insecure_channel(shm_server.address) as channel:
            stub = sequences_pb2_grpc.SequencesStub(channel)
            with pytest.raises(grpc.RpcError) as e:
                stub.DecodeStep(request, timeout=60)
        grown = _vm_hwm_mib(shm_server.proc.pid) - before
        wanted = grpc.StatusCode.INVALID_ARGUMENT if case == "heads" else grpc.StatusCode.RESOURCE_EXHAUSTED
        assert e.value.code() == wanted, e.value.details()
        assert ("heads at most 1024" if case == "heads" else "out_shm") in e.value.details(), e.value.details()
        assert grown < 128, f"the server's peak RSS grew {grown:.0f} MiB for a refused step"
        _post(shm_server, f"/v2/systemsharedmemory/region/qbound_{case}/unregister", {})
    finally:
        os.close(fd)
        os.unlink("/dev/shm" + key)
