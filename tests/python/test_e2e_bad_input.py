"""Every malformed request gets its status code and a message naming the field, and the server keeps answering."""

import math

import grpc
import numpy as np
import pytest

import flashserve
from flashserve import attention_pb2 as pb

from conftest import LIMITS_MAX_REQUEST_BYTES, LIMITS_MAX_TENSOR_ELEMENTS

pytestmark = pytest.mark.e2e

INVALID = grpc.StatusCode.INVALID_ARGUMENT
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
ITEMSIZE = {pb.FLOAT16: 2, pb.BFLOAT16: 2, pb.FLOAT32: 4}


def tensor(shape, dtype=pb.FLOAT32, data_bytes=None):
    """A Tensor whose data has the right length for shape/dtype unless data_bytes says otherwise."""
    if data_bytes is None:
        data_bytes = int(np.prod(shape)) * ITEMSIZE.get(dtype, 4)
    return pb.Tensor(dtype=dtype, shape=list(shape), data=b"\x00" * data_bytes)


def good_request(seqlen_q=4, seqlen_k=5, heads_q=2, heads_kv=2, head_dim=8, batch=1):
    return pb.AttentionRequest(
        q=tensor([batch, seqlen_q, heads_q, head_dim]),
        k=tensor([batch, seqlen_k, heads_kv, head_dim]),
        v=tensor([batch, seqlen_k, heads_kv, head_dim]),
    )


def with_(request=None, **fields):
    r = request or good_request()
    for name, value in fields.items():
        if isinstance(value, pb.Tensor):
            getattr(r, name).CopyFrom(value)
        else:
            setattr(r, name, value)
    return r


def q_missing():
    r = good_request()
    r.ClearField("q")
    return r


def unknown_dtype():
    r = good_request()
    r.q.dtype = 7  # proto3 enums are open: the value travels as is
    return r


def q_short():
    r = good_request()
    r.q.data = r.q.data[:-1]
    return r


def v_long():
    r = good_request()
    r.v.data = r.v.data + b"\x00\x00\x00\x00"
    return r


# (id, request factory, expected code, fragment of the message, which server)
CASES = [
    ("q missing", q_missing, INVALID, "q", "server"),
    ("q.dtype unspecified", lambda: with_(q=tensor([1, 4, 2, 8], pb.DTYPE_UNSPECIFIED, 4 * 64)), INVALID, "q.dtype",
     "server"),
    ("q.dtype unknown 7", unknown_dtype, INVALID, "q.dtype", "server"),
    ("k dtype differs", lambda: with_(k=tensor([1, 5, 2, 8], pb.FLOAT16), v=tensor([1, 5, 2, 8], pb.FLOAT16)),
     INVALID, "k.dtype", "server"),
    ("q rank 3", lambda: with_(q=tensor([1, 4, 16])), INVALID, "q.shape", "server"),
    ("k rank 5", lambda: with_(k=tensor([1, 5, 2, 8, 1])), INVALID, "k.shape", "server"),
    ("q seqlen 0", lambda: with_(q=tensor([1, 0, 2, 8])), INVALID, "q.shape", "server"),
    ("k negative dim", lambda: with_(k=tensor([1, -5, 2, 8], data_bytes=0)), INVALID, "k.shape", "server"),
    ("batch differs", lambda: with_(q=tensor([2, 4, 2, 8])), INVALID, "batch", "server"),
    ("head_dim differs", lambda: with_(q=tensor([1, 4, 2, 16])), INVALID, "head_dim", "server"),
    ("v shape differs", lambda: with_(v=tensor([1, 6, 2, 8])), INVALID, "v.shape", "server"),
    ("heads 6 vs 4", lambda: good_request(heads_q=6, heads_kv=4), INVALID, "heads_kv", "server"),
    ("head_dim 300", lambda: good_request(head_dim=300), INVALID, "head_dim", "server"),
    ("q.data one byte short", q_short, INVALID, "q.data", "server"),
    ("v.data too long", v_long, INVALID, "v.data", "server"),
    ("shape overflows int64", lambda: with_(q=tensor([2**40, 2**40, 1, 64], data_bytes=0)), INVALID, "q.shape",
     "server"),
    ("q over max_tensor_elements", lambda: good_request(seqlen_q=LIMITS_MAX_TENSOR_ELEMENTS // 8 + 1, heads_q=1,
                                                        heads_kv=1),
     EXHAUSTED, "max_tensor_elements", "limits_server"),
    ("q over default max_tensor_elements, no data",
     lambda: with_(q=tensor([1, 2**28 // 64 + 1, 1, 64], data_bytes=0)), EXHAUSTED, "max_tensor_elements", "server"),
    ("softmax_scale 0", lambda: with_(softmax_scale=0.0), INVALID, "softmax_scale", "server"),
    ("softmax_scale -1", lambda: with_(softmax_scale=-1.0), INVALID, "softmax_scale", "server"),
    ("softmax_scale NaN", lambda: with_(softmax_scale=math.nan), INVALID, "softmax_scale", "server"),
    ("softmax_scale inf", lambda: with_(softmax_scale=math.inf), INVALID, "softmax_scale", "server"),
    ("request over max_request_bytes", lambda: good_request(seqlen_q=2 * LIMITS_MAX_REQUEST_BYTES // (4 * 8 * 2),
                                                            head_dim=8),
     EXHAUSTED, "", "limits_server"),
    ("empty request", pb.AttentionRequest, INVALID, "q", "server"),
]


def answers_a_good_request(address):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 9, 2, 16)).astype(np.float32)
    k = rng.standard_normal((1, 11, 1, 16)).astype(np.float32)
    with flashserve.Client(address, timeout=30) as c:
        out = c.attention(q, k, k, causal=True)
    np.testing.assert_allclose(out, flashserve.reference.attention(q, k, k, causal=True), atol=1e-5)


@pytest.mark.parametrize("make_request,code,fragment,which", [pytest.param(*c[1:], id=c[0]) for c in CASES])
def test_bad_input(request, make_request, code, fragment, which):
    target = request.getfixturevalue(which)
    bad = make_request()
    with flashserve.Client(target.address, timeout=30) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.stub.Attention(bad, timeout=30)
    assert e.value.code() == code, f"got {e.value.code()}: {e.value.details()}"
    assert fragment in (e.value.details() or ""), f"{fragment!r} not in {e.value.details()!r}"
    assert target.proc.poll() is None, f"server died\n{target.logs()}"
    answers_a_good_request(target.address)


def test_bad_input_through_the_client_raises_typed_errors(client):
    q = np.zeros((1, 4, 6, 8), np.float32)
    k = np.zeros((1, 4, 4, 8), np.float32)
    with pytest.raises(flashserve.InvalidArgumentError) as e:
        client.attention(q, k, k)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "heads_kv" in e.value.message
    with pytest.raises(flashserve.InvalidArgumentError, match="softmax_scale"):
        client.attention(q[:, :, :4], k, k, softmax_scale=-1.0)


def test_over_max_request_bytes_through_the_client(limits_server):
    q = np.zeros((1, 2 * LIMITS_MAX_REQUEST_BYTES // (4 * 64), 1, 64), np.float32)
    k = np.zeros((1, 8, 1, 64), np.float32)
    with flashserve.Client(limits_server.address, timeout=30) as c:
        with pytest.raises(flashserve.ResourceExhaustedError):
            c.attention(q, k, k)
    answers_a_good_request(limits_server.address)
