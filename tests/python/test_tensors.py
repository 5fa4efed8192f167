"""numpy / torch <-> wire Tensor conversions and client-side validation."""

import ml_dtypes
import numpy as np
import pytest

import flashserve
from flashserve import attention_pb2 as pb
from flashserve import tensors


@pytest.mark.parametrize(
    "dtype,wire,itemsize",
    [(np.float16, pb.FLOAT16, 2), (ml_dtypes.bfloat16, pb.BFLOAT16, 2), (np.float32, pb.FLOAT32, 4)],
)
def test_numpy_round_trip(rng, dtype, wire, itemsize):
    x = rng.standard_normal((2, 3, 4, 5)).astype(dtype)
    t = tensors.to_proto(x, "q")
    assert t.dtype == wire
    assert list(t.shape) == [2, 3, 4, 5]
    assert len(t.data) == x.size * itemsize
    back = tensors.from_proto(t)
    assert back.dtype == x.dtype and back.shape == x.shape
    assert back.flags.writeable
    np.testing.assert_array_equal(back.view(np.uint8), x.view(np.uint8))


def test_wire_bytes_are_little_endian_row_major():
    x = np.arange(24, dtype=np.float32).reshape(1, 2, 3, 4)
    t = tensors.to_proto(x, "q")
    assert t.data[:8] == np.array([0.0, 1.0], dtype="<f4").tobytes()
    assert t.data == np.arange(24, dtype="<f4").tobytes()


def test_bfloat16_bits_are_the_top_half_of_float32():
    x = np.array([1.0, -2.5, 3.140625], dtype=ml_dtypes.bfloat16).reshape(1, 1, 1, 3)
    t = tensors.to_proto(x, "q")
    f32_bits = np.array([1.0, -2.5, 3.140625], dtype="<f4").view("<u4") >> 16
    assert t.data == f32_bits.astype("<u2").tobytes()


def test_big_endian_and_non_contiguous_inputs_are_normalised(rng):
    x = rng.standard_normal((1, 4, 2, 6)).astype(">f4")
    assert tensors.to_proto(x, "q").data == x.astype("<f4").tobytes()
    y = rng.standard_normal((1, 6, 2, 4)).astype(np.float16).transpose(0, 3, 2, 1)  # not contiguous
    assert not y.flags.c_contiguous
    assert tensors.to_proto(y, "q").data == np.ascontiguousarray(y).tobytes()


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32])
def test_big_endian_arrays_of_every_dtype_go_little_endian_on_every_path(rng, dtype):
    """bfloat16 arrays in big-endian byte order went out unswapped (a silent wrong answer on the server)."""
    from flashserve import striped
    little = rng.standard_normal((1, 3, 2, 4)).astype(dtype)
    big = little.astype(np.dtype(dtype).newbyteorder(">"))
    assert big.tobytes() != little.tobytes()
    want = little.tobytes()
    assert tensors.to_proto(big, "q").data == want
    assert bytes(tensors.to_host_rows(big[0], "k").data) == want
    assert bytes(tensors.to_host_rows(big[0], "q", copy=False).data) == want
    assert bytes(striped._as_bytes(big)[0]) == want
    back = tensors.from_proto(tensors.to_proto(big, "q"))
    np.testing.assert_array_equal(back.astype(np.float32), little.astype(np.float32))


def test_from_proto_rejects_wrong_byte_count():
    with pytest.raises(flashserve.InvalidArgumentError):
        tensors.from_proto(pb.Tensor(dtype=pb.FLOAT32, shape=[1, 1, 1, 2], data=b"\0" * 7))


@pytest.mark.parametrize(
    "q,k,v,fragment",
    [
        (np.zeros((1, 2, 3), np.float32), np.zeros((1, 2, 3, 4), np.float32), np.zeros((1, 2, 3, 4), np.float32),
         "q: expected 4 dimensions"),
        (np.zeros((1, 2, 3, 4), np.float32), np.zeros((1, 2, 3, 4), np.float16), np.zeros((1, 2, 3, 4), np.float32),
         "same dtype"),
        (np.zeros((1, 2, 3, 4), np.float64),) * 3 + ("unsupported numpy dtype float64",),
        (np.zeros((1, 2, 3, 4), np.int8),) * 3 + ("unsupported numpy dtype",),
        ([[[[1.0]]]], np.zeros((1, 1, 1, 1), np.float32), np.zeros((1, 1, 1, 1), np.float32), "numpy array"),
    ],
)
def test_check_inputs_rejects(q, k, v, fragment):
    with pytest.raises(flashserve.InvalidArgumentError) as e:
        tensors.check_inputs(q, k, v)
    assert fragment in e.value.message
    assert isinstance(e.value, ValueError)


def test_torch_round_trip_if_available(rng):
    torch = pytest.importorskip("torch")
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        x = torch.randn(1, 3, 2, 4, dtype=dtype).transpose(1, 2)  # non-contiguous
        t = tensors.to_proto(x, "q")
        back = tensors.from_proto(t, "torch", x.device)
        assert back.dtype == dtype and torch.equal(back, x.contiguous())
