"""One side of an A/B of the Python client's CreateSequence with an 8k-token prefix (32 MiB: one Llama-3-8B-like layer,
8 KV heads, d128, fp16): `python create_prefix_ab.py <client/python dir of one side> <grpc port>` prints the median
client time in ms of 10 creates (after 2 warm-up), each followed by a release. Run the two sides alternately against
one server (bench/results/client-create-cpu-2026-11-29.md)."""
import sys, time, statistics, numpy as np
sys.path.insert(0, sys.argv[1])
import flashserve
port = sys.argv[2]
rng = np.random.default_rng(0)
k = rng.standard_normal((8192, 8, 128)).astype(np.float16); v = -k
out = []
with flashserve.SequenceClient(f"127.0.0.1:{port}", timeout=60) as c:
    for i in range(12):
        t = time.perf_counter()
        s = c.create(num_layers=1, heads_q=32, heads_kv=8, head_dim=128, dtype="float16", prefix={0: (k, v)})
        out.append(time.perf_counter() - t)
        s.release()
print(round(statistics.median(out[2:]) * 1e3, 1))
