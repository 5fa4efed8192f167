"""The client against an in-process fake AttentionService (no real server needed)."""

import asyncio
import socket

import grpc
import ml_dtypes
import numpy as np
import pytest

import flashserve
from flashserve import reference
from flashserve.client import _decode_health_response, _encode_health_request


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
def test_attention_round_trip(fake, rng, make_qkv, check_answer, dtype):
    q, k, v = make_qkv(rng, 2, 17, 33, 8, 2, 16, np.dtype(dtype).name)
    with flashserve.Client(fake.address) as client:
        out = client.attention(q, k, v, causal=True)
    assert isinstance(out, np.ndarray) and out.dtype == q.dtype
    check_answer(out, None, q, k, v, causal=True)
    request = fake.servicer.requests[-1]
    assert request.causal and not request.return_lse and not request.HasField("softmax_scale")
    assert list(request.q.shape) == [2, 17, 8, 16] and list(request.k.shape) == [2, 33, 2, 16]


def test_return_lse_and_softmax_scale(fake, rng, make_qkv, check_answer):
    q, k, v = make_qkv(rng, 1, 5, 9, 2, 1, 8, "float32")
    with flashserve.Client(fake.address) as client:
        out, lse = client.attention(q, k, v, softmax_scale=0.5, return_lse=True)
    assert fake.servicer.requests[-1].softmax_scale == 0.5
    assert lse.shape == (1, 2, 5) and lse.dtype == np.float32
    check_answer(out, lse, q, k, v, softmax_scale=0.5)


def test_attention_with_metadata(fake, rng, make_qkv):
    q, k, v = make_qkv(rng, 1, 4, 4, 1, 1, 8, "float16")
    with flashserve.Client(fake.address) as client:
        result = client.attention_with_metadata(q, k, v, request_id="abc-123", return_lse=True)
        auto = client.attention_with_metadata(q, k, v)
    assert isinstance(result, flashserve.AttentionResult)
    assert result.request_id == "abc-123" and result.kernel == "fake_reference"
    assert result.timing == flashserve.Timing(queue_us=1, h2d_us=0, compute_us=2, d2h_us=0, total_us=3)
    assert result.lse is not None and auto.lse is None
    assert len(auto.request_id) == 32  # generated when not given


def test_missing_lse_in_response_is_an_error(fake, rng, make_qkv):
    fake.servicer.drop_lse = True
    q, k, v = make_qkv(rng, 1, 4, 4, 1, 1, 8, "float32")
    with flashserve.Client(fake.address) as client, pytest.raises(flashserve.FlashserveError, match="no lse"):
        client.attention(q, k, v, return_lse=True)


def test_large_message_over_default_4mb_limit(fake, rng, make_qkv):
    q, k, v = make_qkv(rng, 1, 512, 512, 4, 4, 256, "float32")  # 2 MiB each, 6 MiB request
    with flashserve.Client(fake.address) as client:
        out = client.attention(q, k, v)
    assert out.shape == q.shape


ERRORS = [
    (grpc.StatusCode.INVALID_ARGUMENT, "q.shape: expected 4 dims", flashserve.InvalidArgumentError),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full", flashserve.ResourceExhaustedError),
    (grpc.StatusCode.UNAVAILABLE, "shutting down", flashserve.UnavailableError),
    (grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed in queue", flashserve.DeadlineExceededError),
    (grpc.StatusCode.INTERNAL, "cuda error", flashserve.FlashserveError),
    (grpc.StatusCode.UNIMPLEMENTED, "nope", flashserve.FlashserveError),
]


@pytest.mark.parametrize("code,message,error_type", ERRORS)
def test_error_mapping(fake, rng, make_qkv, code, message, error_type):
    fake.servicer.abort_with = (code, message)
    q, k, v = make_qkv(rng, 1, 2, 2, 1, 1, 4, "float32")
    with flashserve.Client(fake.address) as client:
        with pytest.raises(error_type) as e:
            client.attention(q, k, v, request_id="rid-7")
        assert type(e.value) is error_type
        assert e.value.code == code and e.value.message == message and e.value.request_id == "rid-7"
        assert code.name in str(e.value) and message in str(e.value)
        with pytest.raises(error_type):
            client.server_info()


def test_error_subclasses_are_also_builtin_exceptions():
    assert issubclass(flashserve.InvalidArgumentError, ValueError)
    assert issubclass(flashserve.DeadlineExceededError, TimeoutError)
    assert issubclass(flashserve.UnavailableError, ConnectionError)
    for cls in (flashserve.InvalidArgumentError, flashserve.ResourceExhaustedError, flashserve.UnavailableError,
                flashserve.DeadlineExceededError):
        assert issubclass(cls, flashserve.FlashserveError)


def test_client_timeout_raises_deadline_exceeded(fake, rng, make_qkv):
    fake.servicer.delay_s = 1.0
    q, k, v = make_qkv(rng, 1, 2, 2, 1, 1, 4, "float32")
    with flashserve.Client(fake.address) as client:
        with pytest.raises(flashserve.DeadlineExceededError) as e:
            client.attention(q, k, v, timeout=0.1)
    assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_default_timeout_from_constructor(fake, rng, make_qkv):
    fake.servicer.delay_s = 1.0
    q, k, v = make_qkv(rng, 1, 2, 2, 1, 1, 4, "float32")
    with flashserve.Client(fake.address, timeout=0.1) as client, pytest.raises(flashserve.DeadlineExceededError):
        client.attention(q, k, v)


def test_no_server_is_unavailable():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with flashserve.Client(f"127.0.0.1:{port}", timeout=5) as client:
        with pytest.raises(flashserve.UnavailableError):
            client.server_info()


def test_client_side_validation_happens_before_sending(fake):
    with flashserve.Client(fake.address) as client, pytest.raises(flashserve.InvalidArgumentError, match="same dtype"):
        client.attention(np.zeros((1, 1, 1, 4), np.float32), np.zeros((1, 1, 1, 4), np.float16),
                         np.zeros((1, 1, 1, 4), np.float32))
    assert fake.servicer.requests == []


def test_server_info(fake):
    with flashserve.Client(fake.address) as client:
        info = client.server_info()
    assert info.backend == "cpu" and info.version == "0.0.0-fake"
    assert info.dtypes == ["float16", "bfloat16", "float32"]
    assert info.max_head_dim == 256 and info.head_dims == []
    assert info.supports_head_dim(40) and not info.supports_head_dim(257)
    assert info.limits == flashserve.Limits(1 << 30, 1 << 28, 64)


def test_health(fake):
    from grpc_health.v1 import health_pb2

    with flashserve.Client(fake.address) as client:
        assert client.health() is True
        assert client.health_status("flashserve.v1.AttentionService") == "SERVING"
        fake.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert client.health() is False
        assert client.health_status() == "NOT_SERVING"
        with pytest.raises(flashserve.FlashserveError) as e:
            client.health_status("no.such.Service")
        assert e.value.code == grpc.StatusCode.NOT_FOUND


def test_health_codec_matches_generated_messages():
    from grpc_health.v1 import health_pb2

    for service in ("", "flashserve.v1.AttentionService", "x" * 300):
        assert _encode_health_request(service) == health_pb2.HealthCheckRequest(service=service).SerializeToString()
    for status in (0, 1, 2, 3):
        data = health_pb2.HealthCheckResponse(status=status).SerializeToString()
        assert _decode_health_response(data) == status
    # unknown fields of every wire type are skipped
    assert _decode_health_response(b"\x10\x05\x1a\x02ab\x21" + b"\0" * 8 + b"\x2d" + b"\0" * 4 + b"\x08\x01") == 1


def test_async_client(fake, rng, make_qkv, check_answer):
    q, k, v = make_qkv(rng, 1, 9, 17, 6, 1, 8, "bfloat16")

    async def main():
        async with flashserve.AsyncClient(fake.address) as client:
            results = await asyncio.gather(*(client.attention(q, k, v, causal=True, return_lse=True)
                                             for _ in range(4)))
            meta = await client.attention_with_metadata(q, k, v, request_id="async-1")
            info = await client.server_info()
            healthy = await client.health()
            return results, meta, info, healthy

    results, meta, info, healthy = asyncio.run(main())
    for out, lse in results:
        check_answer(out, lse, q, k, v, causal=True)
    assert meta.request_id == "async-1" and info.backend == "cpu" and healthy


def test_async_client_errors(fake, rng, make_qkv):
    fake.servicer.abort_with = (grpc.StatusCode.INVALID_ARGUMENT, "k.dtype: differs from q.dtype")
    q, k, v = make_qkv(rng, 1, 2, 2, 1, 1, 4, "float32")

    async def main():
        async with flashserve.AsyncClient(fake.address) as client:
            await client.attention(q, k, v)

    with pytest.raises(flashserve.InvalidArgumentError, match="k.dtype"):
        asyncio.run(main())


def test_fake_out_offset_is_caught(fake, rng, make_qkv, check_answer):
    """The comparison used everywhere must notice a wrong answer (else the e2e checks could not fail)."""
    fake.servicer.out_offset = 0.01
    q, k, v = make_qkv(rng, 1, 17, 17, 2, 2, 16, "float16")
    with flashserve.Client(fake.address) as client:
        out = client.attention(q, k, v)
    with pytest.raises(AssertionError, match="max abs err"):
        check_answer(out, None, q, k, v)


def test_torch_in_torch_out_if_available(fake, rng, make_qkv, check_answer):
    torch = pytest.importorskip("torch")
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        q, k, v = (torch.randn(1, 7, 4, 16, dtype=dtype) for _ in range(3))
        with flashserve.Client(fake.address) as client:
            out, lse = client.attention(q, k, v, causal=True, return_lse=True)
        assert isinstance(out, torch.Tensor) and out.dtype == dtype and out.device == q.device
        assert isinstance(lse, torch.Tensor) and lse.dtype == torch.float32
        ref = reference.attention(q, k, v, causal=True)
        assert np.abs(out.float().numpy() - ref).max() < 0.05
