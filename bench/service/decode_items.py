#!/usr/bin/env python3
"""Where a DecodeStep's q / k / v / O live, side by side (issue 20, CUDA-region items): one Llama-3-8B-like layer
(32 q heads, 8 kv heads, d128, bf16), --sequences sequences per --contexts length, one client, three item paths:

  inline  q, k, v in the message, O in the response (gRPC bytes; rows staged through pinned memory)
  system  q, k, v read from and O written to a system shared-memory region (page-locked by the server at
          registration: read / written by the device where they are)
  cuda    the same in a CUDA region (a torch CUDA tensor shared by CUDA IPC) on the server's GPU: nothing
          crosses PCIe but the launch's tables

The paths take turns step by step over the same sequences (each step appends one token per sequence), so they see
the same context lengths. Reported: the server's Timing medians (queue/stage/h2d/kernel/d2h/compute/total) and the
Python client's wall time per call (its own cost included). The server needs --allow_client_shm.

    python3 bench/service/decode_items.py --target 127.0.0.1:8001 --contexts 1024,8192 --md items.md
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_bench import (  # noqa: E402
    HEAD_DIM, HEADS_KV, HEADS_Q, SERVER_TIMING, _record, _row, bf16_rows, create_sequences, release)

import flashserve  # noqa: E402
from flashserve import attention_pb2 as pb, sequences_pb2 as spb, sequences_pb2_grpc as spb_grpc  # noqa: E402
from flashserve import tensors  # noqa: E402

Q_BYTES, KV_BYTES = HEADS_Q * HEAD_DIM * 2, HEADS_KV * HEAD_DIM * 2
FIELDS = (("q", HEADS_Q, Q_BYTES), ("k", HEADS_KV, KV_BYTES), ("v", HEADS_KV, KV_BYTES))


def layout(n: int) -> dict:
    """[q of every item][k][v][O]: one block per tensor."""
    return {"q": 0, "k": n * Q_BYTES, "v": n * (Q_BYTES + KV_BYTES), "o": n * (Q_BYTES + 2 * KV_BYTES),
            "end": n * (2 * Q_BYTES + 2 * KV_BYTES)}


def shm_request(ids, at, ref) -> "spb.DecodeStepRequest":
    request = spb.DecodeStepRequest()
    for j, sid in enumerate(ids):
        item = request.items.add(sequence_id=sid, layer=0)
        item.out_shm.CopyFrom(ref(at["o"] + j * Q_BYTES, Q_BYTES))
        for field, heads, size in FIELDS:
            t = getattr(item, field)
            t.dtype = pb.BFLOAT16
            t.shape[:] = [1, heads, HEAD_DIM]
            t.shm.CopyFrom(ref(at[field] + j * size, size))
    return request


class InlinePath:
    def __init__(self, client, ids, rng):
        q = tensors.to_proto_rows(bf16_rows(rng, 1, HEADS_Q, HEAD_DIM), "q")
        k = tensors.to_proto_rows(bf16_rows(rng, 1, HEADS_KV, HEAD_DIM), "k")
        v = tensors.to_proto_rows(bf16_rows(rng, 1, HEADS_KV, HEAD_DIM), "v")
        self.request = spb.DecodeStepRequest(items=[spb.DecodeItem(sequence_id=i, layer=0, q=q, k=k, v=v)
                                                    for i in ids])

    def call(self, stub):
        response = stub.DecodeStep(self.request, timeout=60)
        assert len(response.results[0].out.data) == Q_BYTES
        return response

    def close(self):
        pass


class SystemPath:
    def __init__(self, client, ids, rng):
        from flashserve.shm import SystemRegion

        self.at = layout(len(ids))
        self.region = SystemRegion(client, "decode-items-system", self.at["end"])
        self.request = shm_request(ids, self.at, self.region.ref)
        self.inputs = bf16_rows(rng, self.at["o"] // 2).view(np.uint8).reshape(-1)

    def call(self, stub):
        buf = self.region._buffer
        buf[:self.inputs.size] = self.inputs  # this step's q, k, v
        response = stub.DecodeStep(self.request, timeout=60)
        out = buf[self.at["o"]:self.at["end"]].copy()  # O, as the caller would take it
        assert out.size == self.at["end"] - self.at["o"]
        return response

    def close(self):
        self.region.close()


class CudaPath:
    def __init__(self, client, ids, rng):
        import torch
        from flashserve.shm import TorchCudaIpc

        self.torch = torch
        self.at = layout(len(ids))
        self.buf = torch.empty(self.at["end"], dtype=torch.uint8, device="cuda")
        self.ipc = TorchCudaIpc(client)
        name, base = self.ipc._region(self.buf)
        self.request = shm_request(
            ids, self.at, lambda off, size: pb.SharedMemoryRef(region=name, offset=base + off, byte_size=size))
        raw = bf16_rows(rng, self.at["o"] // 2).view(np.uint8).reshape(-1)
        self.inputs = torch.from_numpy(raw.copy()).cuda()

    def call(self, stub):
        self.buf[:self.inputs.numel()].copy_(self.inputs)  # this step's q, k, v (as a model would write them)
        self.torch.cuda.synchronize()
        response = stub.DecodeStep(self.request, timeout=60)
        return response  # O is in self.buf on the GPU: nothing to copy

    def close(self):
        self.ipc.close()


PATHS = {"inline": InlinePath, "system": SystemPath, "cuda": CudaPath}


def bench_context(args, context: int, rng) -> list:
    ids = create_sequences(args.target, None, context, args.sequences, rng)
    client = flashserve.Client(args.target)
    paths = {}
    try:
        paths = {name: PATHS[name](client, ids, rng) for name in args.paths}
        stub = spb_grpc.SequencesStub(client.channel)
        server = {name: {k: [] for k in SERVER_TIMING + ("batched_calls",)} for name in paths}
        latencies = {name: [] for name in paths}
        start = time.perf_counter()
        for step in range(args.warmup + args.steps):
            for name, path in paths.items():  # turns: the same context lengths for every path
                t0 = time.perf_counter()
                response = path.call(stub)
                if step >= args.warmup:
                    latencies[name].append(time.perf_counter() - t0)
                    _record(server[name], response)
        wall = time.perf_counter() - start
        rows = []
        for name in paths:
            row = _row(latencies[name], wall / len(paths), len(ids), args.steps, server[name])
            row.update(context=context, path=name, context_end=context + args.warmup + args.steps)
            rows.append(row)
        return rows
    finally:
        for path in paths.values():
            path.close()
        client.close()
        release(args.target, None, ids)


def markdown(rows) -> str:
    head = ("| context (start..end) | path | client p50 ms | server total us | server compute us | "
            "queue/stage/h2d/kernel/d2h us |\n|---|---|---|---|---|---|\n")
    lines = []
    for r in rows:
        stages = "/".join(f"{r[f'server_{k}_us']:.0f}" for k in ("queue", "stage", "h2d", "kernel", "d2h"))
        lines.append(f"| {r['context']}..{r['context_end']} | {r['path']} | {r['p50_ms']:.3f} | "
                     f"{r['server_total_us']:.0f} | {r['server_compute_us']:.0f} | {stages} |")
    return head + "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--contexts", default="1024,8192")
    p.add_argument("--sequences", type=int, default=64)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--paths", default="inline,system,cuda")
    p.add_argument("--md")
    p.add_argument("--json")
    args = p.parse_args(argv)
    args.paths = args.paths.split(",")
    rng = np.random.default_rng(0)
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        rows += bench_context(args, context, rng)
        print(markdown(rows[-len(args.paths):]), flush=True)
    if args.md:
        Path(args.md).write_text(markdown(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
