#!/usr/bin/env python3
"""Writes the seed corpora of the libFuzzer targets into tests/fuzz/corpus/<target>/.

    .venv/bin/python tests/fuzz/make_corpus.py          # rewrites the corpus (deterministic output)

Seeds are small on purpose (libFuzzer's default -max_len is 4096 bytes): valid requests of every dtype, causal,
GQA, LSE and scale variant, and one of each kind of malformed request; tune cache files that match the header the
fuzz_tune_cache target uses, and the ways a cache file goes wrong (foreign, truncated, wrong types).
"""

from __future__ import annotations

import json
import random
import shutil
import struct
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "client" / "python"))

from flashserve import attention_pb2 as pb  # noqa: E402

ITEMSIZE = {pb.FLOAT16: 2, pb.BFLOAT16: 2, pb.FLOAT32: 4}
# Must equal the header in fuzz_tune_cache.cc.
CACHE_HEADER = {
    "device": {"name": "NVIDIA H100 80GB HBM3", "cc_major": 9, "cc_minor": 0, "driver_version": 12040,
               "runtime_version": 12040},
    "build_id": "0123456789abcdef",
}


def values(rng: random.Random, n: int, dtype: int) -> bytes:
    """n small random values in dtype's little-endian encoding."""
    xs = [rng.uniform(-2.0, 2.0) for _ in range(n)]
    if dtype == pb.FLOAT32:
        return struct.pack(f"<{n}f", *xs)
    if dtype == pb.FLOAT16:
        return struct.pack(f"<{n}e", *xs)
    return b"".join(struct.pack("<f", x)[2:] for x in xs)  # bfloat16: the high half of the float


def tensor(rng, shape, dtype=pb.FLOAT32, data=None) -> pb.Tensor:
    n = 1
    for d in shape:
        n *= d
    if data is None:
        data = values(rng, max(n, 0), dtype) if 0 < n < 4096 else b""
    return pb.Tensor(dtype=dtype, shape=list(shape), data=data)


def request(rng, batch=1, seqlen_q=3, seqlen_k=4, heads_q=2, heads_kv=1, head_dim=8, dtype=pb.FLOAT32, **fields):
    r = pb.AttentionRequest(
        q=tensor(rng, [batch, seqlen_q, heads_q, head_dim], dtype),
        k=tensor(rng, [batch, seqlen_k, heads_kv, head_dim], dtype),
        v=tensor(rng, [batch, seqlen_k, heads_kv, head_dim], dtype),
    )
    for name, value in fields.items():
        if isinstance(value, pb.Tensor):
            getattr(r, name).CopyFrom(value)
        else:
            setattr(r, name, value)
    return r


def request_seeds(rng):
    seeds = {
        "valid_fp32": request(rng),
        "valid_fp16_causal_lse": request(rng, dtype=pb.FLOAT16, causal=True, return_lse=True),
        "valid_bf16_gqa4": request(rng, dtype=pb.BFLOAT16, heads_q=4, heads_kv=1, head_dim=16),
        "valid_causal_sq_gt_sk": request(rng, seqlen_q=6, seqlen_k=2, causal=True, return_lse=True),
        "valid_scale": request(rng, softmax_scale=0.25, request_id="seed"),
        "valid_batch2_hd1": request(rng, batch=2, head_dim=1, seqlen_q=5, seqlen_k=7),
        "valid_hd64": request(rng, dtype=pb.FLOAT16, seqlen_q=2, seqlen_k=3, heads_q=1, head_dim=64),
        "empty": pb.AttentionRequest(),
    }
    r = request(rng)
    r.ClearField("q")
    seeds["q_missing"] = r
    seeds["rank3"] = request(rng, q=tensor(rng, [1, 3, 16]))
    r = request(rng)
    r.k.shape.append(1)
    seeds["rank5"] = r
    r = request(rng)
    r.q.shape[1] = 0
    seeds["zero_dim"] = r
    r = request(rng)
    r.k.shape[1] = -4
    seeds["negative_dim"] = r
    r = request(rng)
    r.q.shape[:] = [2**40, 2**40, 1, 8]
    seeds["overflow"] = r
    r = request(rng)
    r.q.shape[:] = [1, 2**31, 1, 8]
    seeds["dim_over_int32"] = r
    r = request(rng)
    r.v.data = r.v.data[:-1]
    seeds["v_short"] = r
    r = request(rng)
    r.q.data = r.q.data + b"\0\0\0\0"
    seeds["q_long"] = r
    r = request(rng)
    r.k.dtype = pb.FLOAT16
    seeds["mixed_dtype"] = r
    r = request(rng)
    r.q.dtype = 7
    seeds["unknown_dtype"] = r
    r = request(rng)
    r.q.dtype = pb.DTYPE_UNSPECIFIED
    seeds["unspecified_dtype"] = r
    seeds["heads_3_vs_2"] = request(rng, heads_q=3, heads_kv=2)
    seeds["head_dim_300"] = request(rng, head_dim=300, seqlen_q=1, seqlen_k=1, heads_q=1, dtype=pb.FLOAT16)
    seeds["scale_nan"] = request(rng, softmax_scale=float("nan"))
    seeds["scale_negative"] = request(rng, softmax_scale=-1.0)
    seeds["scale_huge"] = request(rng, softmax_scale=3.0e38)
    r = request(rng)
    r.q.data = struct.pack("<f", -2.5e38) + r.q.data[4:]
    r.k.data = struct.pack("<f", -23.0) + r.k.data[4:]
    r.softmax_scale = 1e-19
    r.causal = True
    seeds["fp32_dot_overflows_small_scale"] = r  # q.k overflows fp32 though the scaled logit does not
    out = {name: r.SerializeToString(deterministic=True) for name, r in seeds.items()}
    out["garbage"] = b"\xff\x00garbage"
    out["truncated"] = seeds["valid_fp32"].SerializeToString()[:37]
    return out


def request_wire_seeds(rng):
    """fuzz_request_wire input: a split header (byte 0: cut count in bits 0-3, 0x40 empty slices between, 0x80 one
    slice per byte; then a little-endian uint16 per cut), then the serialized request (see the target)."""

    def split(message: bytes, *cuts: int, flags: int = 0) -> bytes:
        return bytes([len(cuts) | flags]) + b"".join(struct.pack("<H", c) for c in cuts) + message

    small = dict(batch=1, seqlen_q=2, seqlen_k=3, heads_q=2, heads_kv=1, head_dim=4)
    fp32 = request(rng, **small).SerializeToString()
    fp16 = request(rng, dtype=pb.FLOAT16, causal=True, return_lse=True, **small).SerializeToString()
    scaled = request(rng, softmax_scale=0.25, request_id="seed-\u20ac", **small).SerializeToString()
    second_q = pb.AttentionRequest(q=tensor(rng, [1, 1, 1, 4])).SerializeToString()
    shape_only = pb.AttentionRequest(k=pb.Tensor(shape=[7])).SerializeToString()
    unknown = b"\x48\x05" + b"\x51" + bytes(8) + b"\x5a\x03abc" + b"\x65" + bytes(4)  # fields 9-12, each wire type
    return {
        "one_slice_fp32": split(fp32),
        "cuts_fp16_causal_lse": split(fp16, 1, 40, 40, 100),
        "empty_slices_between": split(fp16, 3, 17, 64, flags=0x40),
        "bytewise_scale_id": split(scaled, flags=0x80),
        "merged_q_twice": split(fp32 + second_q, 60),
        "merged_shape_only": split(fp32 + shape_only, 5),
        "unknown_fields": split(unknown + fp32 + unknown, 2, 30),
        "unknown_in_tensor": split(b"\x0a\x0a\x08\x01\x12\x01\x02\x68\x07\x1a\x01x" + fp32),
        "group_unknown": split(fp32 + b"\x4b\x48\x01\x4c"),
        "padded_varints": split(b"\xa0\x80\x00\x01\x3a\x81\x80\x80\x80\x00a" + fp32),
        # Encodings protobuf and the parser read differently (the target's FirstDeviation), one each.
        "deviation_tag_6_bytes": split(fp32 + b"\xa0\x80\x80\x80\x80\x00\x01"),
        "deviation_length_6_bytes": split(fp32 + b"\x3a\x81\x80\x80\x80\x80\x00a"),
        "deviation_tag_over_32_bits": split(fp32 + b"\xa0\x80\x80\x80\x10\x01"),
        "deviation_varint_over_64_bits": split(fp32 + b"\x20" + b"\xff" * 9 + b"\x7f"),
        "truncated": split(fp16[:45], 20),
        "bad_utf8_id": split(fp32 + b"\x3a\x02\xc3\x28"),
        "empty_request": split(b""),
        "empty_input": b"",
    }


def cpu_attention_seeds(rng):
    # fuzz_cpu_attention reads a few bytes of sizes and options, then tensor bytes: any bytes are a problem.
    return {f"random_{n}": bytes(rng.getrandbits(8) for _ in range(n)) for n in (16, 64, 300, 1500, 4000)}


def cache(entries, **overrides):
    j = {"format": "flashserve-tune-cache/1", **json.loads(json.dumps(CACHE_HEADER)), "entries": entries}
    j.update(overrides)
    return j


def tune_cache_seeds(rng):
    record = {"config": "m128n64w4s2", "tflops": 412.5, "runner_up": "m128n128w8s2", "runner_up_tflops": 401.0,
              "default": "m128n64w4s2", "default_tflops": 412.5, "candidates_timed": 9}
    valid = cache({"sm90|bf16|d128|causal|gqa1|q4096|k4096": record,
                   "sm90|fp16|d64|full|gqa4|q16|k512": {"config": "m64n64w4s2", "tflops": 88.0}})
    foreign = cache({}, device={**CACHE_HEADER["device"], "name": "NVIDIA A100-SXM4-80GB", "cc_major": 8})
    seeds = {
        "valid.json": json.dumps(valid, indent=2),
        "valid_empty.json": json.dumps(cache({})),
        "foreign_device.json": json.dumps(foreign),
        "other_build.json": json.dumps(cache({}, build_id="fedcba9876543210")),
        "wrong_format.json": json.dumps(cache({}, format="flashserve-tune-cache/0")),
        "format_number.json": json.dumps(cache({}, format=1)),
        "entries_array.json": json.dumps(cache([record])),
        "entry_missing_config.json": json.dumps(cache({"k": {"tflops": 1.0}})),
        "entry_wrong_types.json": json.dumps(cache({"k": {"config": 5, "tflops": "fast"}})),
        "cc_as_float.json": json.dumps(cache({}, device={**CACHE_HEADER["device"], "cc_major": 9.5})),
        "truncated.json": json.dumps(valid)[:150],
        "not_object.json": "[1, 2, 3]",
        "empty.json": "",
        # Known bug (tests/fuzz/RESULTS.md): a float where an int belongs is cast with UB.
        "regression_cc_major_1e20.json": json.dumps(cache({}, device={**CACHE_HEADER["device"], "cc_major": 1e20})),
        "regression_candidates_1e19.json": json.dumps(cache({"k": {**record, "candidates_timed": 1e19}})),
    }
    return {name: text.encode() for name, text in seeds.items()}


def kserve_rest_seeds(rng):
    """fuzz_kserve_rest input: JSON header, then NUL and the binary inputs (see the target)."""

    def rest_input(name, shape, dtype="FP32", binary=False):
        n = 1
        for d in shape:
            n *= d
        entry = {"name": name, "datatype": dtype, "shape": shape}
        if binary:
            entry["parameters"] = {"binary_data_size": n * (4 if dtype == "FP32" else 2)}
        else:
            entry["data"] = [round(rng.uniform(-2, 2), 3) for _ in range(n)]
        return entry

    def body(inputs, binary=b"", **top):
        header = json.dumps({"inputs": inputs, **top}).encode()
        return header + (b"\0" + binary if binary else b"")

    q, kv = [1, 3, 2, 4], [1, 5, 1, 4]
    json_inputs = [rest_input("Q", q), rest_input("K", kv), rest_input("V", kv)]
    pb_dtype = {"FP32": pb.FLOAT32, "FP16": pb.FLOAT16, "BF16": pb.BFLOAT16}
    binary_inputs = [rest_input(n, s, "FP16", binary=True) for n, s in (("Q", q), ("K", kv), ("V", kv))]
    binary_bytes = b"".join(values(rng, 24 if n == "Q" else 20, pb_dtype["FP16"]) for n in "QKV")
    return {
        "json_fp32": body(json_inputs),
        "json_causal_lse": body(json_inputs, parameters={"causal": True, "return_lse": True, "softmax_scale": 0.5},
                                outputs=[{"name": "O"}, {"name": "LSE", "parameters": {"binary_data": True}}],
                                id="seed"),
        "binary_fp16": body(binary_inputs, binary_bytes, parameters={"binary_data_output": True}),
        "binary_chunked": json.dumps({"inputs": binary_inputs}).encode() + b"\0\0" + binary_bytes,
        "nested_data": body([{**json_inputs[0], "data": [[1.0, 2.0], [3.0, [4.0]]]}] + json_inputs[1:]),
        "missing_v": body(json_inputs[:2]),
        "unknown_input": body(json_inputs + [rest_input("W", kv)]),
        "bad_datatype": body([{**json_inputs[0], "datatype": "INT8"}] + json_inputs[1:]),
        "binary_size_mismatch": body(binary_inputs, binary_bytes[:-3]),
        "binary_too_big": body([{**binary_inputs[0], "parameters": {"binary_data_size": 2**62}}] + binary_inputs[1:],
                               b"x"),
        "unknown_output": body(json_inputs, outputs=[{"name": "P"}]),
        "bad_param_types": body(json_inputs, parameters={"causal": 1, "timeout": -5}),
        "not_json": b"{\"inputs\": [",
        "not_object": b"[]",
        # Triton's shared-memory extension: references instead of data, good and bad.
        "shm_refs": body([{**{k: v for k, v in json_inputs[0].items() if k != "data"}, "parameters": {
            "shared_memory_region": "r", "shared_memory_offset": 16, "shared_memory_byte_size": 96}}]
            + json_inputs[1:], outputs=[{"name": "O", "parameters": {
                "shared_memory_region": "o", "shared_memory_byte_size": 96}}]),
        "shm_overflow": body([{**json_inputs[0], "parameters": {
            "shared_memory_region": "r", "shared_memory_offset": 2**64 - 1, "shared_memory_byte_size": 2**63}}]
            + json_inputs[1:]),
    }


def kserve_grpc_seeds(rng):
    """Serialized inference.ModelInferRequest messages (the proto compiled on the fly with grpc_tools)."""
    import importlib
    import tempfile

    from grpc_tools import protoc

    proto_root = HERE.parents[1] / "proto"
    with tempfile.TemporaryDirectory() as out:
        if protoc.main(["protoc", f"-I{proto_root}", f"--python_out={out}",
                        str(proto_root / "inference" / "open_inference_grpc.proto")]) != 0:
            raise RuntimeError("protoc failed on inference/open_inference_grpc.proto")
        sys.path.insert(0, out)
        try:
            ip = importlib.import_module("inference.open_inference_grpc_pb2")
        finally:
            sys.path.remove(out)

    def request(dtype="FP16", shapes=((1, 3, 2, 8), (1, 4, 1, 8), (1, 4, 1, 8)), names="QKV", raw=True, **params):
        r = ip.ModelInferRequest(model_name="attention", id="seed")
        for name, shape in zip(names, shapes):
            t = r.inputs.add(name=name, datatype=dtype, shape=list(shape))
            n = 1
            for d in shape:
                n *= d
            if raw:
                r.raw_input_contents.append(values(rng, n, {"FP16": pb.FLOAT16, "BF16": pb.BFLOAT16}.get(dtype,
                                                                                                       pb.FLOAT32)))
            else:
                t.contents.fp32_contents.extend(rng.uniform(-2, 2) for _ in range(n))
        for key, value in params.items():
            p = r.parameters[key]
            if isinstance(value, bool):
                p.bool_param = value
            elif isinstance(value, int):
                p.int64_param = value
            elif isinstance(value, float):
                p.double_param = value
            else:
                p.string_param = value
        return r

    seeds = {
        "raw_fp16": request(),
        "raw_bf16_causal_lse": request("BF16", causal=True, return_lse=True, softmax_scale=0.3, timeout=1000000),
        "contents_fp32": request("FP32", raw=False),
        "missing_k": request(shapes=((1, 3, 2, 8), (1, 4, 1, 8)), names="QV"),
        "bad_datatype": request("INT8"),
        "bad_param": request(causal="yes"),
    }
    r = request()
    r.outputs.add(name="LSE")
    seeds["outputs_lse"] = r
    r = request()
    del r.raw_input_contents[-1]
    seeds["raw_count_mismatch"] = r
    return {name: m.SerializeToString(deterministic=True) for name, m in seeds.items()}  # map order


def local_frame_seeds(rng):
    """Whole frames of the local transport (proto/flashserve/v1/local_frame.h): each method, and each way a header
    is refused."""
    from flashserve import sequences_pb2 as spb

    def frame(method, payload=b"", flags=0, magic=0x314C5346, size=None):
        return struct.pack("<IHHII", magic, method, flags, len(payload) if size is None else size, 0) + payload

    attention = request(rng, return_lse=True).SerializeToString()
    step = spb.DecodeStepRequest(return_lse=True)
    item = step.items.add(sequence_id="0" * 32, layer=1)
    for field in ("q", "k", "v"):
        getattr(item, field).CopyFrom(pb.Tensor(dtype=pb.FLOAT16, shape=[1, 2, 4], data=bytes(16)))
    attend = spb.AttendRequest(sequence_id="1" * 32, layer=0,
                               q=pb.Tensor(dtype=pb.FLOAT16, shape=[1, 2, 4], data=bytes(16)))
    return {
        "hello": frame(1, b"a-token-of-some-length"),
        "echo": frame(2, b"echo me"),
        "echo_empty": frame(2),
        "attention": frame(3, attention),
        "decode_step": frame(4, step.SerializeToString()),
        "attend": frame(5, attend.SerializeToString()),
        "bad_magic": frame(2, b"x", magic=0x12345678),
        "unknown_method": frame(9, b"x"),
        "flags": frame(2, b"x", flags=1),
        "huge_claim": frame(3, b"", size=0xFFFFFFFF),
        "short_payload": frame(3, attention[:10], size=len(attention)),
        "short_header": frame(2, b"x")[:9],
    }


def with_answer_buffer(request: bytes) -> bytes:
    """fuzz_decode_step gives an input an answer buffer (and checks the encoded answer) when its size is a multiple of
    3: pad with an unknown varint field (15 = 0) until it is."""
    while len(request) % 3:
        request += b"\x78\x00"
    return request


def decode_step_seeds(rng):
    """DecodeStepRequests for fuzz_decode_step, whose ids s0, s1, s2 name its three sequences (s0: FLOAT16 2 layers
    heads 4:2 d8, 5 and 0 rows; s1: BFLOAT16 heads 2:1 d4, 3 rows; s2: like s0 with one layer, 4 rows): valid steps
    per item and packed, attend-only, causal with more query rows than keys, and each kind of refusal."""
    from flashserve import sequences_pb2 as spb
    shapes = {"s0": (4, 2, 8, pb.FLOAT16), "s1": (2, 1, 4, pb.BFLOAT16), "s2": (4, 2, 8, pb.FLOAT16)}

    def rows(n, heads, dim, dtype):
        return tensor(rng, [n, heads, dim], dtype)

    def step(items, **fields):
        r = spb.DecodeStepRequest(**fields)
        for sid, layer, rows_q, rows_kv in items:
            hq, hkv, d, dtype = shapes.get(sid, shapes["s0"])
            item = r.items.add(sequence_id=sid, layer=layer)
            item.q.CopyFrom(rows(rows_q, hq, d, dtype))
            if rows_kv is not None:
                item.k.CopyFrom(rows(rows_kv, hkv, d, dtype))
                item.v.CopyFrom(rows(rows_kv, hkv, d, dtype))
        return r.SerializeToString()

    def packed(items, rows_q, rows_kv, with_kv=True, answer_packed=False, **fields):
        r = spb.DecodeStepRequest(**fields)
        r.packed.answer_packed = answer_packed
        for sid, layer in items:
            r.items.add(sequence_id=sid, layer=layer)
        r.packed.q.CopyFrom(rows(sum(rows_q), 4, 8, pb.FLOAT16))
        if with_kv:
            r.packed.k.CopyFrom(rows(sum(rows_kv), 2, 8, pb.FLOAT16))
            r.packed.v.CopyFrom(rows(sum(rows_kv), 2, 8, pb.FLOAT16))
        r.packed.rows_q.extend(rows_q)
        r.packed.rows_kv.extend(rows_kv)
        return r.SerializeToString()

    return {
        "one_item": step([("s0", 0, 1, 1)], return_lse=True),
        "three_items_gqa": step([("s0", 0, 1, 1), ("s0", 1, 1, 1), ("s2", 0, 1, 1)], return_lse=True),
        "bf16_causal_q_gt_k": step([("s1", 0, 8, 2)], causal=True, return_lse=True),
        "attend_only": step([("s2", 0, 2, None)], return_lse=True),
        "empty_layer": step([("s0", 1, 1, 0)], return_lse=True),
        "cross_pages": step([("s0", 0, 4, 7)], causal=True, return_lse=True, softmax_scale=0.3),
        "past_limit": step([("s0", 0, 1, 20)]),
        "unknown_id": step([("zz", 0, 1, 1)]),
        "same_layer_twice": step([("s2", 0, 1, 1), ("s2", 0, 1, 1)]),
        "mixed_shapes": step([("s0", 0, 1, 1), ("s1", 0, 1, 1)]),
        "layer_out_of_range": step([("s2", 1, 1, 1)]),
        "packed": packed([("s0", 0), ("s2", 0)], [1, 2], [1, 3], return_lse=True),
        "packed_attend_only": packed([("s0", 0), ("s2", 0)], [1, 1], [], with_kv=False, causal=True),
        "packed_uneven": packed([("s0", 0), ("s2", 0)], [2, 1], [1, 3], return_lse=True),
        "packed_counts_wrong": packed([("s0", 0), ("s2", 0)], [1, 1], [1, 5]),
        "packed_answer": with_answer_buffer(
            packed([("s0", 0), ("s2", 0)], [2, 1], [1, 3], answer_packed=True, return_lse=True)),
        "packed_answer_no_lse": with_answer_buffer(packed([("s2", 0), ("s0", 0)], [1, 3], [2, 0], answer_packed=True)),
    }


def main():
    rng = random.Random(20261122)
    targets = {
        "fuzz_attention_request": request_seeds(rng),
        "fuzz_cpu_attention": cpu_attention_seeds(rng),
        "fuzz_tune_cache": tune_cache_seeds(rng),
        "fuzz_kserve_rest": kserve_rest_seeds(rng),
        "fuzz_kserve_grpc": kserve_grpc_seeds(rng),
        "fuzz_request_wire": request_wire_seeds(rng),
        "fuzz_local_frame": local_frame_seeds(rng),  # after the others: their seeds do not change
        "fuzz_decode_step": decode_step_seeds(rng),
    }
    targets["fuzz_infer_body"] = dict(targets["fuzz_kserve_rest"])  # the same input format
    for target, seeds in targets.items():
        directory = HERE / "corpus" / target
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
        for name, data in seeds.items():
            (directory / name).write_bytes(data)
        print(f"{directory.relative_to(HERE.parents[1])}: {len(seeds)} seeds")


if __name__ == "__main__":
    main()
