"""The bad-input matrix: one table of hostile or malformed inputs, each sent to the real server, each with the
status code and message fragment it must get. After EVERY case the server must still answer a good request
correctly and report /v2/health/ready = 200. The same file runs under ASan/UBSan (tests/sanitize/run_asan_matrix.sh).

The ~2 GB message, bounded: a gRPC client cannot send more than 2^31-1 bytes in one message, and building a 1-2 GB
request here would need several GB on a 2-core CI machine for one case. What matters is what the server does with
the size it is *told*, so the matrix checks:
  * a real message just over a small --max_request_bytes (1 MiB) -> RESOURCE_EXHAUSTED;
  * raw HTTP/2: a gRPC length prefix claiming 2^31-1 bytes (the most gRPC allows), 60 KB of it sent, then the
    stream reset -> CANCELLED or no answer, with the server's RSS growing < 32 MiB (nothing sized from the claim),
    both on the default server and on one started at --max_request_bytes=2147483647 (the flag's maximum);
  * a prefix claiming 2^32-1 bytes followed by the end of the stream -> a truncated message, refused;
  * (known limit, xfail) a 64 MiB request to a 1 MiB-limit server is received whole before it is refused; with
    --grpc_memory_quota_bytes=16MiB it is cut off (RESOURCE_EXHAUSTED) while the server's RSS grows < 40 MiB.

Bytes that do not parse as an AttentionRequest (garbage, truncated, invalid UTF-8 in a string, nested groups) get
INVALID_ARGUMENT "flashserve.v1.AttentionRequest: ..." from the server's own zero-copy parser (server/api/request_wire.h); every
other method parses its own request too (INVALID_ARGUMENT "flashserve.v1.GetServerInfoRequest: malformed protobuf
bytes"; gRPC 1.51's typed methods answered UNIMPLEMENTED with an empty message). Observed with gRPC 1.51 (Debian 12)
and recorded in the table: initial metadata over 8 KiB gets RESOURCE_EXHAUSTED or, racing with gRPC closing the
connection, UNAVAILABLE "Stream removed".

Run alone: .venv/bin/python -m pytest -q tests/python/test_bad_input_matrix.py  (about 3 s; -s prints what each case
got).
"""

from __future__ import annotations

import dataclasses
import json
import math
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Callable, Dict, Optional

import grpc
import numpy as np
import pytest

import flashserve
from flashserve import attention_pb2 as pb
from flashserve import reference, tensors

from conftest import LIMITS_MAX_REQUEST_BYTES, LIMITS_MAX_TENSOR_ELEMENTS, ServerProcess, http_get

pytestmark = pytest.mark.e2e

OK = grpc.StatusCode.OK
INVALID = grpc.StatusCode.INVALID_ARGUMENT
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
UNIMPLEMENTED = grpc.StatusCode.UNIMPLEMENTED
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
CANCELLED = grpc.StatusCode.CANCELLED
ITEMSIZE = {pb.FLOAT16: 2, pb.BFLOAT16: 2, pb.FLOAT32: 4}
ATTENTION = "/flashserve.v1.AttentionService/Attention"
# Every method parses its own request (server/edge/grpc/grpc_call.h; test_unparsable_requests.py covers them all).
PARSE_FAILURE = {INVALID: "flashserve.v1.GetServerInfoRequest: malformed protobuf bytes"}
BAD_BYTES = {INVALID: "flashserve.v1.AttentionRequest: malformed protobuf bytes"}  # Attention: the server's own parser
CALL_TIMEOUT_S = 20
NO_ANSWER = grpc.StatusCode.DEADLINE_EXCEEDED  # raw HTTP/2 calls: nothing came back on the stream in time
RESET_STREAM = {CANCELLED: "", NO_ANSWER: ""}  # what a client that reset its stream may see


# --- building requests -----------------------------------------------------------------------------------------------


def tensor(shape, dtype=pb.FLOAT32, data_bytes=None) -> pb.Tensor:
    """A Tensor whose data has the right length for shape/dtype unless data_bytes says otherwise."""
    if data_bytes is None:
        data_bytes = int(np.prod(shape)) * ITEMSIZE.get(dtype, 4)
    return pb.Tensor(dtype=dtype, shape=list(shape), data=b"\x00" * data_bytes)


def request(seqlen_q=4, seqlen_k=5, heads_q=2, heads_kv=2, head_dim=8, batch=1, dtype=pb.FLOAT32, **fields):
    r = pb.AttentionRequest(
        q=tensor([batch, seqlen_q, heads_q, head_dim], dtype),
        k=tensor([batch, seqlen_k, heads_kv, head_dim], dtype),
        v=tensor([batch, seqlen_k, heads_kv, head_dim], dtype),
    )
    for name, value in fields.items():
        if isinstance(value, pb.Tensor):
            getattr(r, name).CopyFrom(value)
        else:
            setattr(r, name, value)
    return r


def mutated(mutate: Callable[[pb.AttentionRequest], None], **kwargs) -> Callable[[], pb.AttentionRequest]:
    def make():
        r = request(**kwargs)
        mutate(r)
        return r

    return make


# --- what a case sends and what came back -----------------------------------------------------------------------


@dataclasses.dataclass
class Outcome:
    code: grpc.StatusCode
    details: str = ""
    response: object = None
    note: str = ""  # anything else worth printing


def send_request(make: Callable[[], pb.AttentionRequest], metadata=()) -> Callable[[ServerProcess], Outcome]:
    def send(target: ServerProcess) -> Outcome:
        with grpc.insecure_channel(target.address, options=CHANNEL_OPTIONS) as channel:
            stub = flashserve.attention_pb2_grpc.AttentionServiceStub(channel)
            try:
                response = stub.Attention(make(), metadata=list(metadata), timeout=CALL_TIMEOUT_S)
            except grpc.RpcError as e:
                return Outcome(e.code(), e.details() or "")
            return Outcome(OK, response=response)

    return send


def send_bytes(payload: bytes, method: str = ATTENTION) -> Callable[[ServerProcess], Outcome]:
    """Raw bytes on a method through a generic channel (no serializer): what a broken client sends."""

    def send(target: ServerProcess) -> Outcome:
        with grpc.insecure_channel(target.address, options=CHANNEL_OPTIONS) as channel:
            call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
            try:
                call(payload, timeout=CALL_TIMEOUT_S)
            except grpc.RpcError as e:
                return Outcome(e.code(), e.details() or "")
            return Outcome(OK)

    return send


CHANNEL_OPTIONS = [("grpc.max_send_message_length", 2**31 - 1), ("grpc.max_receive_message_length", 2**31 - 1)]


# --- raw HTTP/2 (for length prefixes a gRPC client will not send) ---------------------------------------------------
# Just enough of RFC 7540/7541 for one unary call on a fresh connection: gRPC's HPACK encoder writes literal strings
# (no Huffman), so decoding the response headers needs the static table and the dynamic table of this connection.

_HPACK_STATIC = [None, (":authority", ""), (":method", "GET"), (":method", "POST"), (":path", "/"),
                 (":path", "/index.html"), (":scheme", "http"), (":scheme", "https"), (":status", "200"),
                 (":status", "204"), (":status", "206"), (":status", "304"), (":status", "400"), (":status", "404"),
                 (":status", "500")] + [("", "")] * 16 + [("content-type", "")] + [("", "")] * 30


def _hpack_int(value: int, prefix_bits: int, first: int) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out, value = bytearray([first | limit]), value - limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    return bytes(out + bytes([value]))


def _hpack_str(text: str) -> bytes:
    raw = text.encode()
    return _hpack_int(len(raw), 7, 0) + raw


def _decode_int(data: bytes, pos: int, prefix_bits: int):
    limit = (1 << prefix_bits) - 1
    value, pos, shift = data[pos] & limit, pos + 1, 0
    if value < limit:
        return value, pos
    while True:
        byte, pos = data[pos], pos + 1
        value += (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos


def _decode_str(data: bytes, pos: int):
    huffman = data[pos] & 0x80
    length, pos = _decode_int(data, pos, 7)
    raw = data[pos:pos + length]
    return ("<huffman>" if huffman else raw.decode("latin-1")), pos + length


def _hpack_decode(block: bytes, table: list) -> Dict[str, str]:
    headers, pos = {}, 0

    def entry(index):
        return _HPACK_STATIC[index] if index < len(_HPACK_STATIC) else table[index - len(_HPACK_STATIC)]

    while pos < len(block):
        byte = block[pos]
        if byte & 0x80:  # indexed
            index, pos = _decode_int(block, pos, 7)
            name, value = entry(index)
            headers[name] = value
            continue
        if byte & 0xE0 == 0x20:  # dynamic table size update
            _, pos = _decode_int(block, pos, 5)
            continue
        indexing = bool(byte & 0x40)
        index, pos = _decode_int(block, pos, 6 if indexing else 4)
        if index:
            name = entry(index)[0]
        else:
            name, pos = _decode_str(block, pos)
        value, pos = _decode_str(block, pos)
        headers[name] = value
        if indexing:
            table.insert(0, (name, value))
    return headers


def _frame(frame_type: int, flags: int, stream: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([frame_type, flags]) + struct.pack(">I", stream) + payload


def raw_grpc_call(port: int, prefix: bytes, body: bytes, end_stream: bool, reset: bool,
                  timeout: float = 10.0) -> Outcome:
    """One call on stream 1 of a new connection: HEADERS, then `prefix + body` as DATA (at most 64 KiB: the initial
    flow-control window), then END_STREAM or RST_STREAM(CANCEL). Returns grpc-status/grpc-message, or UNAVAILABLE
    with a note when the server reset the stream or closed the connection without a status."""
    assert len(prefix) + len(body) <= 65535
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(4, 0, 0, b""))
        block = (b"\x83\x86" + b"\x04" + _hpack_str(ATTENTION) + b"\x01" + _hpack_str(f"127.0.0.1:{port}")
                 + b"\x0f\x10" + _hpack_str("application/grpc") + b"\x00" + _hpack_str("te") + _hpack_str("trailers"))
        s.sendall(_frame(1, 0x4, 1, block))  # END_HEADERS
        data = prefix + body
        for start in range(0, len(data), 16384):
            last = start + 16384 >= len(data)
            s.sendall(_frame(0, 0x1 if last and end_stream else 0, 1, data[start:start + 16384]))
        if reset:
            s.sendall(_frame(3, 0, 1, struct.pack(">I", 0x8)))  # RST_STREAM CANCEL
        headers, table, buffer = {}, [], b""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                chunk = s.recv(65536)
            except socket.timeout:
                return Outcome(NO_ANSWER, note="no answer")
            if not chunk:
                return Outcome(UNAVAILABLE, note="connection closed")
            buffer += chunk
            while len(buffer) >= 9:
                length = int.from_bytes(buffer[:3], "big")
                if len(buffer) < 9 + length:
                    break
                frame_type, flags = buffer[3], buffer[4]
                stream = int.from_bytes(buffer[5:9], "big") & 0x7FFFFFFF
                payload, buffer = buffer[9:9 + length], buffer[9 + length:]
                if frame_type == 4 and not flags & 1:
                    s.sendall(_frame(4, 1, 0, b""))  # SETTINGS ack
                elif frame_type == 6 and not flags & 1:
                    s.sendall(_frame(6, 1, 0, payload))  # PING ack
                elif frame_type == 1 and stream == 1:
                    headers.update(_hpack_decode(payload, table))
                    if flags & 1 and "grpc-status" in headers:
                        return Outcome(grpc.StatusCode(_status_by_number(int(headers["grpc-status"]))),
                                       headers.get("grpc-message", ""))
                elif frame_type == 3 and stream == 1:
                    return Outcome(UNAVAILABLE, note=f"RST_STREAM {int.from_bytes(payload, 'big')}")
                elif frame_type == 7:
                    return Outcome(UNAVAILABLE, note="GOAWAY")
        return Outcome(NO_ANSWER, note="no answer")


def _status_by_number(number: int):
    return next(code.value for code in grpc.StatusCode if code.value[0] == number)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class PeakRss:
    """Samples a process's RSS every 2 ms while in use; .growth is the peak over the RSS at entry, MiB."""

    def __init__(self, pid: int):
        self.pid, self.growth, self._stop = pid, 0.0, threading.Event()

    def __enter__(self):
        self.start = rss_mib(self.pid)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(0.002):
            self.growth = max(self.growth, rss_mib(self.pid) - self.start)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.growth = max(self.growth, rss_mib(self.pid) - self.start)


def claimed_size(claim: int, end_stream: bool, reset: bool, sent: int = 60000) -> Callable[[ServerProcess], Outcome]:
    """A gRPC message whose 5-byte prefix claims `claim` bytes, of which `sent` are sent; the server's RSS may not
    grow by more than 32 MiB (nothing may be sized from the claim). After the client resets the stream the server
    owes it nothing: it answers CANCELLED or stays silent (NO_ANSWER after 2 s)."""

    def send(target: ServerProcess) -> Outcome:
        with PeakRss(target.proc.pid) as rss:
            outcome = raw_grpc_call(target.grpc_port, b"\x00" + struct.pack(">I", claim), b"\x00" * sent,
                                    end_stream=end_stream, reset=reset, timeout=2.0 if reset else 10.0)
        outcome.note += f" peak rss +{rss.growth:.1f} MiB"
        assert rss.growth < 32, f"server RSS grew {rss.growth:.1f} MiB for a {sent}-byte part of a {claim}-byte claim"
        return outcome

    return send


def over_limit_not_buffered(target: ServerProcess) -> Outcome:
    """64 MiB to a 1 MiB-limit server: refused without the server holding the message."""
    with PeakRss(target.proc.pid) as rss:
        outcome = send_request(lambda: pb.AttentionRequest(request_id="x" * (64 << 20)))(target)
    outcome.note = f"peak rss +{rss.growth:.1f} MiB"
    # 40 MiB: well under the 64 MiB a buffered message costs, above what a 16 MiB gRPC quota plus ASan's
    # quarantine of freed slices reach (+29 MiB seen under tests/sanitize/run_asan_matrix.sh).
    assert rss.growth < 40, (
        f"a 64 MiB request over --max_request_bytes=1MiB was buffered: server RSS peaked +{rss.growth:.1f} MiB")
    return outcome


def log_bytes(target: ServerProcess) -> int:
    return sum(p.stat().st_size for p in target.log_dir.glob(f"{target.name}.std*"))


def bounded_log(make: Callable[[], pb.AttentionRequest]) -> Callable[[ServerProcess], Outcome]:
    """Sends the request and checks the server logged at most 4 KiB for it."""

    def send(target: ServerProcess) -> Outcome:
        before = log_bytes(target)
        outcome = send_request(make)(target)
        time.sleep(0.2)  # let the log line reach the file
        logged = log_bytes(target) - before
        outcome.note = f"logged {logged} bytes"
        assert logged < 4096, f"the server logged {logged} bytes for one bad request"
        return outcome

    return send


def one_log_line(make: Callable[[], pb.AttentionRequest]) -> Callable[[ServerProcess], Outcome]:
    """Sends the request and checks that what the server logged for it has no line a client forged with a newline
    in request_id."""

    def send(target: ServerProcess) -> Outcome:
        files = sorted(target.log_dir.glob(f"{target.name}.std*"))
        sizes = {f: f.stat().st_size for f in files}
        outcome = send_request(make)(target)
        time.sleep(0.2)  # let the log line reach the file
        text = b"".join(f.read_bytes()[sizes[f]:] for f in files).decode(errors="replace")
        outcome.note = f"logged {text.strip()!r}"[:300]
        forged = [line for line in text.splitlines() if line.startswith("FAKE")]
        assert not forged, f"a client-forged log line: {forged} in {text!r}"
        return outcome

    return send


# --- NaN / Inf inputs: documented behaviour ---------------------------------------------------------------------
# NaN in a q/k/v element propagates NaN to the outputs that depend on it and nowhere else; the server never crashes.
# Which outputs depend on an element is what the fp64 reference computes on the same inputs (a NaN in V column d
# reaches only column d of the rows that see that key; a masked key reaches no row). Every other output must be finite
# and match the reference of the clean inputs.


def nonfinite_case(dtype: str, shapes, poison, causal=False, is_nan=True) -> Callable[[ServerProcess], Outcome]:
    """shapes: (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim); poison: (tensor name, index, value)."""

    def send(target: ServerProcess) -> Outcome:
        rng = np.random.default_rng(7)
        batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim = shapes
        dt = tensors.numpy_dtype(dtype)
        clean = {
            "q": rng.standard_normal((batch, seqlen_q, heads_q, head_dim)).astype(dt),
            "k": rng.standard_normal((batch, seqlen_k, heads_kv, head_dim)).astype(dt),
            "v": rng.standard_normal((batch, seqlen_k, heads_kv, head_dim)).astype(dt),
        }
        bad = {name: x.copy() for name, x in clean.items()}
        name, index, value = poison
        bad[name][index] = value
        outcome = send_request(lambda: pb.AttentionRequest(
            q=tensors.to_proto(bad["q"], "q"), k=tensors.to_proto(bad["k"], "k"), v=tensors.to_proto(bad["v"], "v"),
            causal=causal))(target)
        if outcome.code != OK:
            return outcome
        out = tensors.from_proto(outcome.response.out).astype(np.float64)
        with np.errstate(invalid="ignore", over="ignore"):  # NaN/inf in the reference's matmul are the point
            ref = reference.attention(bad["q"], bad["k"], bad["v"], causal=causal)  # exact, for these very inputs
        depends = ~np.isfinite(ref)
        assert (~depends).any(), "the case must leave some outputs independent of the bad element"
        if is_nan:
            assert depends.any(), "the case must have outputs that depend on the NaN"
        tol = reference.output_tolerance(ref[~depends], dtype, float(np.abs(clean["v"].astype(np.float64)).max()),
                                         reference.max_abs_logit(clean["q"], clean["k"]))
        assert np.isfinite(out[~depends]).all(), (
            f"non-finite outputs that do not depend on the {value} in {name}{index}: "
            f"{np.argwhere(~np.isfinite(out) & ~depends)[:5].tolist()}")
        err = float(np.abs(out[~depends] - ref[~depends]).max())
        assert err <= tol, f"independent outputs off by {err:.3e} > {tol:.3e}"
        if is_nan:
            assert np.isnan(out[depends]).all(), (
                f"{int((~np.isnan(out[depends])).sum())} outputs that depend on the NaN are not NaN")
        outcome.note = f"{int(depends.sum())} dependent outputs non-finite, {int((~depends).sum())} correct"
        return outcome

    return send


def scaled(scale: float) -> Callable[[ServerProcess], Outcome]:
    """A finite problem with a huge softmax_scale: refused, or answered with finite outputs (one-hot softmax rows)."""

    def send(target: ServerProcess) -> Outcome:
        rng = np.random.default_rng(3)
        q = rng.standard_normal((1, 4, 2, 8)).astype(np.float32)
        k = rng.standard_normal((1, 5, 2, 8)).astype(np.float32)
        outcome = send_request(lambda: pb.AttentionRequest(q=tensors.to_proto(q, "q"), k=tensors.to_proto(k, "k"),
                                                           v=tensors.to_proto(k, "v"), softmax_scale=scale))(target)
        if outcome.code == OK:
            out = tensors.from_proto(outcome.response.out)
            assert np.isfinite(out).all(), f"{int((~np.isfinite(out)).sum())} of {out.size} outputs non-finite"
        return outcome

    return send


huge_scale = scaled(3.0e38)  # over FLT_MAX / log2(e): refused since b183d1b (every output was NaN before)


# --- the table -------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
    id: str
    send: Callable[[ServerProcess], Outcome]
    expect: Dict[grpc.StatusCode, str]  # acceptable codes -> message fragment each must contain
    target: str = "server"  # fixture: server (default limits), limits_server (1 MiB, 65536 elements), max_server,
    #                         quota_server, shm_matrix_server (--allow_client_shm)
    xfail: Optional[str] = None  # a known server bug: the case is reported xfail, and fails once the bug is fixed


def exactly(code, fragment=""):
    return {code: fragment}


def _shape(name: str, shape, data_bytes=None):
    def mutate(r):
        getattr(r, name).CopyFrom(tensor(shape, getattr(r, name).dtype, data_bytes))

    return mutate


def _set(path: str, value):
    def mutate(r):
        obj = r
        *parents, last = path.split(".")
        for p in parents:
            obj = getattr(obj, p)
        setattr(obj, last, value)

    return mutate


def _data(name: str, edit: Callable[[bytes], bytes]):
    def mutate(r):
        t = getattr(r, name)
        t.data = edit(t.data)

    return mutate


def _dtype_kv(dtype):
    def mutate(r):
        for t in (r.k, r.v):
            t.dtype = dtype
            t.data = b"\x00" * (int(np.prod(t.shape)) * ITEMSIZE[dtype])

    return mutate


def _clear(name):
    return lambda r: r.ClearField(name)


GOOD_BYTES = request(request_id="ok").SerializeToString()


# --- shared memory (Triton's extension, memory/shm_regions.h) ------------------------------------------------------

KSERVE = "/inference.GRPCInferenceService/"
HTTP_CODES = {400: INVALID, 403: grpc.StatusCode.PERMISSION_DENIED, 404: grpc.StatusCode.NOT_FOUND,
              413: EXHAUSTED, 503: EXHAUSTED}


def _pb_field(number: int, value) -> bytes:
    """One protobuf field, hand-encoded (the KServe stubs are not built in this process): str/bytes or an int."""
    def varint(n: int) -> bytes:
        out = b""
        while True:
            out += bytes([(n & 0x7F) | (0x80 if n > 0x7F else 0)])
            n >>= 7
            if not n:
                return out
    if isinstance(value, int):
        return varint(number << 3) + varint(value)
    data = value.encode() if isinstance(value, str) else value
    return varint(number << 3 | 2) + varint(len(data)) + data


def send_http(path: str, body: str) -> Callable[[ServerProcess], Outcome]:
    """A POST on the HTTP edge; its status is mapped to the gRPC code the same error has there."""
    import urllib.error
    import urllib.request

    def send(target: ServerProcess) -> Outcome:
        req = urllib.request.Request(f"{target.http}{path}", data=body.encode(), method="POST")
        try:
            with urllib.request.urlopen(req, timeout=CALL_TIMEOUT_S) as r:
                return Outcome(OK, r.read().decode())
        except urllib.error.HTTPError as e:
            return Outcome(HTTP_CODES.get(e.code, grpc.StatusCode.UNKNOWN), e.read().decode(), note=str(e.code))

    return send


def with_shm_object(size: int, send_for: Callable[[str], Callable[[ServerProcess], Outcome]]):
    """Creates a POSIX shared-memory object of `size` bytes for the case (its key is passed on), then removes it."""
    from multiprocessing import shared_memory

    def send(target: ServerProcess) -> Outcome:
        obj = shared_memory.SharedMemory(create=True, size=size)
        try:
            return send_for("/" + obj.name)(target)
        finally:
            obj.close()
            obj.unlink()

    return send


def _shm_infer(region: str, offset: int, byte_size: int) -> str:
    inputs = [{"name": n, "datatype": "FP32", "shape": [1, 2, 1, 8],
               "parameters": {"shared_memory_region": region, "shared_memory_offset": offset,
                              "shared_memory_byte_size": byte_size}} for n in ("Q", "K", "V")]
    return json.dumps({"inputs": inputs})


def _register_then(key: str, then: Callable[[ServerProcess], Outcome]) -> Callable[[ServerProcess], Outcome]:
    def send(target: ServerProcess) -> Outcome:
        registered = send_http("/v2/systemsharedmemory/region/m/register",
                               json.dumps({"key": key, "byte_size": 4096}))(target)
        assert registered.code == OK, registered
        try:
            return then(target)
        finally:
            send_http("/v2/systemsharedmemory/region/m/unregister", "")(target)

    return send


SHM_REGISTER = KSERVE + "SystemSharedMemoryRegister"
SHM_CASES = [
    Case("shm off by default: register", send_bytes(_pb_field(1, "r") + _pb_field(2, "/k") + _pb_field(4, 64),
                                                    SHM_REGISTER),
         exactly(grpc.StatusCode.PERMISSION_DENIED, "--allow_client_shm")),
    Case("shm off by default: infer naming a region", send_http("/v2/models/attention/infer", _shm_infer("r", 0, 64)),
         exactly(grpc.StatusCode.PERMISSION_DENIED, "--allow_client_shm")),
    Case("shm register: key that does not exist",
         send_bytes(_pb_field(1, "r") + _pb_field(2, "/flashserve_no_such_key") + _pb_field(4, 64), SHM_REGISTER),
         exactly(grpc.StatusCode.NOT_FOUND, "does not exist"), target="shm_matrix_server"),
    Case("shm register: key leaving /dev/shm",
         send_bytes(_pb_field(1, "r") + _pb_field(2, "/../../etc/passwd") + _pb_field(4, 64), SHM_REGISTER),
         exactly(INVALID, "key: must be"), target="shm_matrix_server"),
    Case("shm register: offset + byte_size overflows uint64", with_shm_object(4096, lambda key: send_bytes(
        _pb_field(1, "r") + _pb_field(2, key) + _pb_field(3, 2**64 - 8) + _pb_field(4, 16), SHM_REGISTER)),
         exactly(INVALID, "beyond its 4096 bytes"), target="shm_matrix_server"),
    Case("shm register: cuda region on the CPU backend", send_bytes(
        _pb_field(1, "c") + _pb_field(2, b"\0" * 64) + _pb_field(4, 64), KSERVE + "CudaSharedMemoryRegister"),
         exactly(grpc.StatusCode.FAILED_PRECONDITION, "CUDA backend"), target="shm_matrix_server"),
    Case("shm register: raw_handle not base64", send_http(
        "/v2/cudasharedmemory/region/c/register", '{"raw_handle": {"b64": "%%%"}, "device_id": 0, "byte_size": 8}'),
         exactly(INVALID, "not base64"), target="shm_matrix_server"),
    Case("shm register: body not JSON", send_http("/v2/systemsharedmemory/region/r/register", "{key"),
         exactly(INVALID, "JSON object"), target="shm_matrix_server"),
    Case("shm infer: offset past the region", with_shm_object(4096, lambda key: _register_then(
        key, send_http("/v2/models/attention/infer", _shm_infer("m", 4090, 64)))),
         exactly(INVALID, "beyond its 4096 bytes"), target="shm_matrix_server"),
    Case("shm infer: offset 2^64-1", with_shm_object(4096, lambda key: _register_then(
        key, send_http("/v2/models/attention/infer", _shm_infer("m", 2**64 - 1, 64)))),
         exactly(INVALID, "offset 18446744073709551615 + byte_size 64 is beyond its 4096 bytes"),
         target="shm_matrix_server"),
    Case("shm infer: byte_size not the tensor's", with_shm_object(4096, lambda key: _register_then(
        key, send_http("/v2/models/attention/infer", _shm_infer("m", 0, 60)))),
         exactly(INVALID, "bytes"), target="shm_matrix_server"),
    Case("shm infer: unknown region", send_http("/v2/models/attention/infer", _shm_infer("nope", 0, 64)),
         exactly(grpc.StatusCode.NOT_FOUND, "no shared-memory region"), target="shm_matrix_server"),
]

CASES = [
    # dtype
    Case("dtype unspecified", send_request(mutated(_set("q.dtype", pb.DTYPE_UNSPECIFIED))), exactly(INVALID, "q.dtype")),
    Case("dtype unknown enum 9 on k", send_request(mutated(_set("k.dtype", 9))), exactly(INVALID, "k.dtype")),
    Case("mixed dtypes q fp32 k/v fp16", send_request(mutated(_dtype_kv(pb.FLOAT16))), exactly(INVALID, "k.dtype")),
    Case("v dtype bf16 alone", send_request(mutated(_set("v.dtype", pb.BFLOAT16))), exactly(INVALID, "v.dtype")),
    # rank and dims
    Case("q rank 3", send_request(mutated(_shape("q", [1, 4, 16]))), exactly(INVALID, "q.shape: expected rank 4")),
    Case("k rank 5", send_request(mutated(_shape("k", [1, 5, 2, 8, 1]))), exactly(INVALID, "k.shape: expected rank 4")),
    Case("v rank 0", send_request(mutated(_shape("v", [], data_bytes=4))), exactly(INVALID, "v.shape")),
    Case("q rank 100000 (error message size)", send_request(mutated(_shape("q", [1] * 100000, data_bytes=4))),
         exactly(INVALID, "q.shape: expected rank 4")),
    Case("batch 0", send_request(mutated(_shape("q", [0, 4, 2, 8]))), exactly(INVALID, "q.shape[0] (batch) must be > 0")),
    Case("heads_kv negative", send_request(mutated(_shape("k", [1, 5, -2, 8], data_bytes=0))),
         exactly(INVALID, "k.shape[2] (heads_kv) must be > 0")),
    Case("dim over int32", send_request(mutated(_shape("q", [1, 2**31, 2, 8], data_bytes=0))),
         exactly(INVALID, "exceeds 2147483647")),
    Case("shape product overflows int64", send_request(mutated(_shape("q", [2**31 - 1] * 3 + [8], data_bytes=0))),
         exactly(INVALID, "overflows int64")),
    Case("shape product 4.6e18 fits int64, over max_tensor_elements",
         send_request(mutated(_shape("q", [2**31 - 1, 2**31 - 1, 1, 1], data_bytes=0))),
         exactly(EXHAUSTED, "max_tensor_elements")),
    Case("huge shape (2^34 elements, 64 GiB claimed) with no data",
         send_request(mutated(_shape("k", [16, 2**20, 16, 64], data_bytes=0))), exactly(EXHAUSTED, "max_tensor_elements")),
    Case("just over max_tensor_elements with its data", send_request(
        lambda: request(seqlen_q=LIMITS_MAX_TENSOR_ELEMENTS // 8 + 1, heads_q=1, heads_kv=1)),
        exactly(EXHAUSTED, "--max_tensor_elements=65536"), target="limits_server"),
    Case("batch differs", send_request(mutated(_shape("k", [2, 5, 2, 8]))), exactly(INVALID, "batch")),
    Case("head_dim differs", send_request(mutated(_shape("q", [1, 4, 2, 16]))), exactly(INVALID, "head_dim")),
    Case("v shape differs from k", send_request(mutated(_shape("v", [1, 6, 2, 8]))), exactly(INVALID, "v.shape")),
    Case("heads_q 6 not a multiple of heads_kv 4", send_request(lambda: request(heads_q=6, heads_kv=4)),
         exactly(INVALID, "must be a multiple of k.shape[2] (heads_kv)")),
    Case("head_dim 257 unsupported", send_request(lambda: request(head_dim=257)), exactly(INVALID, "head_dim: 257")),
    # data length
    Case("q.data one byte short", send_request(mutated(_data("q", lambda d: d[:-1]))), exactly(INVALID, "q.data")),
    Case("v.data one element long", send_request(mutated(_data("v", lambda d: d + b"\0" * 4))), exactly(INVALID, "v.data")),
    Case("k.data empty", send_request(mutated(_data("k", lambda d: b""))), exactly(INVALID, "k.data: expected 320 bytes")),
    # softmax_scale
    Case("softmax_scale 0", send_request(lambda: request(softmax_scale=0.0)), exactly(INVALID, "softmax_scale")),
    Case("softmax_scale -0.5", send_request(lambda: request(softmax_scale=-0.5)), exactly(INVALID, "softmax_scale")),
    Case("softmax_scale NaN", send_request(lambda: request(softmax_scale=math.nan)), exactly(INVALID, "softmax_scale")),
    Case("softmax_scale -inf", send_request(lambda: request(softmax_scale=-math.inf)), exactly(INVALID, "softmax_scale")),
    Case("softmax_scale 3e38 (finite) on finite inputs", huge_scale,
         exactly(INVALID, "softmax_scale: must be finite, > 0 and <= 10000")),
    # Above 1e4 fp32 logits overflow for ordinary inputs (NaN rows), so such scales are refused;
    # 1e4 itself is computed like any other.
    Case("softmax_scale 2.3e38 (finite, past the maximum)", scaled(2.3e38),
         exactly(INVALID, "softmax_scale: must be finite, > 0 and <= 10000, got 2.3e+38")),
    Case("softmax_scale 1e4 (the maximum) is computed", scaled(1e4), exactly(OK)),
    # NaN / Inf inputs: answered, NaN only where it belongs
    Case("NaN in one q element", nonfinite_case("float32", (2, 5, 7, 3, 3, 16), ("q", (0, 2, 1, 4), np.nan)),
         exactly(OK)),
    Case("NaN in one v element, GQA fp16", nonfinite_case("float16", (2, 5, 6, 4, 2, 16), ("v", (0, 3, 1, 5), np.nan)),
         exactly(OK)),
    Case("NaN in a key only the last row sees (causal, Sq > Sk)",
         nonfinite_case("bfloat16", (1, 7, 5, 2, 1, 8), ("k", (0, 4, 0, 2), np.nan), causal=True), exactly(OK)),
    Case("+Inf in one k element (causal; a -inf logit)",
         nonfinite_case("float32", (2, 5, 7, 2, 2, 8), ("k", (1, 6, 0, 3), np.inf), causal=True, is_nan=False),
         exactly(OK)),
    Case("-Inf in one q element fp16", nonfinite_case("float16", (1, 4, 4, 2, 1, 8), ("q", (0, 1, 1, 0), -np.inf),
                                                      is_nan=False), exactly(OK)),
    # not a request at all
    Case("empty request", send_request(pb.AttentionRequest), exactly(INVALID, "q: missing")),
    Case("q missing", send_request(mutated(_clear("q"))), exactly(INVALID, "q: missing")),
    Case("garbage bytes", send_bytes(b"\xff\x00garbage"), BAD_BYTES),
    Case("truncated request", send_bytes(GOOD_BYTES[:len(GOOD_BYTES) // 2]), BAD_BYTES),
    Case("invalid UTF-8 in request_id", send_bytes(GOOD_BYTES + b"\x3a\x02\xff\xfe"), BAD_BYTES),
    Case("100000 nested groups (past protobuf's recursion limit)", send_bytes(b"\x7b" * 100000), BAD_BYTES),
    Case("unknown field 99 is ignored", send_bytes(GOOD_BYTES + b"\x9a\x06\x03abc"), exactly(OK)),
    Case("garbage on GetServerInfo", send_bytes(b"\xff\xff\xff", "/flashserve.v1.AttentionService/GetServerInfo"),
         PARSE_FAILURE),
    # the transport
    Case("unknown method", send_bytes(b"", "/flashserve.v1.AttentionService/Nope"), exactly(UNIMPLEMENTED)),
    Case("unknown service", send_bytes(b"", "/flashserve.v9.Nope/Attention"), exactly(UNIMPLEMENTED)),
    Case("7 KiB of metadata is accepted", send_request(lambda: request(), metadata=[("x-pad", "a" * 7000)]),
         exactly(OK)),
    Case("20 KiB of metadata", send_request(lambda: request(), metadata=[("x-pad", "a" * 20000)]),
         {EXHAUSTED: "metadata size exceeds", UNAVAILABLE: "Stream removed"}),
    Case("request just over --max_request_bytes", send_request(
        lambda: request(seqlen_q=(LIMITS_MAX_REQUEST_BYTES + 65536) // (4 * 8 * 2), heads_q=2, head_dim=8)),
        exactly(EXHAUSTED, "larger than max"), target="limits_server"),
    Case("1 MiB request at --max_request_bytes=2147483647", send_request(
        lambda: request(seqlen_q=(1 << 20) // (4 * 8 * 2), heads_q=2, head_dim=8)), exactly(OK), target="max_server"),
    Case("prefix claims 2^31-1 bytes, 60 KB sent, stream reset",
         claimed_size(2**31 - 1, end_stream=False, reset=True), RESET_STREAM),
    Case("prefix claims 2^31-1 bytes at --max_request_bytes=2147483647, stream reset",
         claimed_size(2**31 - 1, end_stream=False, reset=True), RESET_STREAM, target="max_server"),
    Case("prefix claims 2^32-1 bytes, stream ends after 60 KB", claimed_size(2**32 - 1, end_stream=True, reset=False),
         {INVALID: "flashserve.v1.AttentionRequest: no complete message", EXHAUSTED: "larger than max"}, target="max_server"),
    Case("compressed flag without grpc-encoding", lambda t: raw_grpc_call(
        t.grpc_port, b"\x01" + struct.pack(">I", len(GOOD_BYTES)), GOOD_BYTES, end_stream=True, reset=False),
        {OK: "", INVALID: "", grpc.StatusCode.INTERNAL: "", UNIMPLEMENTED: ""}),
    Case("64 MiB over --max_request_bytes=1MiB is refused unread", over_limit_not_buffered,
         exactly(EXHAUSTED, "larger than max"), target="limits_server",
         xfail="gRPC 1.51 receives the whole message before refusing it over its size limit (README says so; bound "
               "it with --grpc_memory_quota_bytes)"),
    Case("64 MiB over the limit with --grpc_memory_quota_bytes=16MiB is not buffered", over_limit_not_buffered,
         exactly(EXHAUSTED, ""), target="quota_server"),
    Case("1 MiB request_id on a bad request: bounded log", bounded_log(
        lambda: pb.AttentionRequest(request_id="r" * (1 << 20))), exactly(INVALID, "q: missing")),
    Case("control characters in request_id: one log line", one_log_line(
        lambda: pb.AttentionRequest(request_id="a\nFAKE [error] forged line\r\x1b[31m\"b")),
        exactly(INVALID, "q: missing")),
] + SHM_CASES


# --- the test --------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def max_server(flashserve_bin, tmp_path_factory):
    """A server at the largest --max_request_bytes the flag takes."""
    s = ServerProcess(flashserve_bin, tmp_path_factory.mktemp("max_server"), ["--max_request_bytes=2147483647"],
                      name="max_server").start()
    yield s
    code = s.stop()
    assert code == 0, f"max_server exited with {code}\n{s.logs()}"


@pytest.fixture(scope="module")
def quota_server(flashserve_bin, tmp_path_factory):
    """1 MiB requests, and gRPC's buffers capped at 16 MiB: README's answer to over-limit messages being received
    whole before they are refused."""
    s = ServerProcess(flashserve_bin, tmp_path_factory.mktemp("quota_server"),
                      [f"--max_request_bytes={LIMITS_MAX_REQUEST_BYTES}", "--grpc_memory_quota_bytes=16777216"],
                      name="quota_server").start()
    yield s
    code = s.stop()
    assert code == 0, f"quota_server exited with {code}\n{s.logs()}"


@pytest.fixture(scope="module")
def shm_matrix_server(flashserve_bin, tmp_path_factory):
    """Shared memory allowed (--allow_client_shm)."""
    s = ServerProcess(flashserve_bin, tmp_path_factory.mktemp("shm_matrix_server"), ["--allow_client_shm"],
                      name="shm_matrix_server").start()
    yield s
    code = s.stop()
    assert code == 0, f"shm_matrix_server exited with {code}\n{s.logs()}"


def answers_a_good_request(target: ServerProcess) -> None:
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 9, 2, 16)).astype(np.float32)
    k = rng.standard_normal((1, 11, 1, 16)).astype(np.float32)
    # A protocol violation (e.g. oversized metadata) may make gRPC close that HTTP/2 connection; grpc-python shares
    # subchannels, so the next call can race the close and see UNAVAILABLE once. A healthy server answers the retry.
    for attempt in range(2):
        try:
            with flashserve.Client(target.address, timeout=30) as c:
                out = c.attention(q, k, k, causal=True)
            break
        except flashserve.UnavailableError:
            if attempt == 1:
                raise
            time.sleep(0.2)
    np.testing.assert_allclose(out, reference.attention(q, k, k, causal=True), atol=1e-5)
    status, body = http_get(f"{target.http}/v2/health/ready", timeout=5)
    assert status == 200, f"/v2/health/ready = {status} {body!r}"


def test_case_count():
    assert len(CASES) >= 25 and len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
def test_bad_input(request, case: Case):
    target: ServerProcess = request.getfixturevalue(case.target)
    failure = None
    try:
        outcome = case.send(target)
        print(f"\n[{case.id}] -> {outcome.code.name}: {outcome.details[:160]!r} {outcome.note}")
        assert outcome.code in case.expect, (
            f"got {outcome.code.name} {outcome.details[:300]!r} {outcome.note}, expected one of "
            f"{[c.name for c in case.expect]}")
        fragment = case.expect[outcome.code]
        assert fragment in outcome.details, f"{fragment!r} not in {outcome.details[:300]!r}"
    except AssertionError as e:
        failure = e
    # Whatever the case did, the server must be alive and serving (never excused by a known bug).
    assert target.proc.poll() is None, f"{target.name} died (exit {target.proc.returncode})\n{target.logs()}"
    answers_a_good_request(target)
    if case.xfail is not None:
        if failure is None:
            pytest.fail(f"known bug no longer reproduces ({case.xfail}): remove its xfail note from CASES")
        pytest.xfail(f"server bug: {case.xfail} [{failure}]")
    if failure is not None:
        raise failure
