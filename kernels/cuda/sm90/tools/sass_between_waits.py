"""Instruction mix between each `WARPGROUP.DEPBAR.LE gsb0, 0x1` and the next `... 0x0` in a
cuobjdump -sass listing of an sm90 kernel: what runs while P V is still on the tensor cores.
  cuobjdump -sass <build>/.../sm90_fwd_bf16_hd128_n128s2.cu.o > k.sass
  python3 kernels/cuda/sm90/tools/sass_between_waits.py k.sass
The intended overlap shows the softmax (MUFU, FFMA, FADD) there; session 8 found only the row
max (64 FMNMX): ptxas had moved the exps below the wait (bench/results/kernels-sm90-h100-2026-11-24-d.md).
"""
import re, sys, collections
lines = open(sys.argv[1]).read().splitlines()
ins = []
for l in lines:
    m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", l)
    if m: ins.append((int(m.group(1), 16), m.group(2).strip()))
idx = [i for i, (a, s) in enumerate(ins) if "WARPGROUP.DEPBAR" in s]
for a, b in zip(idx, idx[1:]):
    if "0x1" in ins[a][1] and "0x0" in ins[b][1]:
        c = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", s).split(" ")[0].split(".")[0] for _, s in ins[a+1:b])
        print(hex(ins[a][0]), "->", hex(ins[b][0]), b - a - 1, "instrs:", dict(c.most_common(10)))
